"""What the bridge costs the login node: the daemon (`hpc-bridge run`, default settings: poll every
0.25 s, reconcile every 30 s) idle and during a burst of requests, read from /proc of the daemon
process (its own CPU, and that of the commands it ran and waited for: sbatch, squeue, sacct); and,
for a cron deployment, one `hpc-bridge check` pass with nothing to do (os.wait4: wall, CPU, max
RSS), with no jobs in flight and with the burst's jobs still queued in Slurm (held).

    .venv/bin/python benchmarks/bench_idle.py                 # 2 min idle, burst of 200, 5 idle passes
    .venv/bin/python benchmarks/bench_idle.py --quick         # smoke test: 3 s idle, burst of 10, 1 pass
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

from benchlib import REPO, Deployment, Publisher, deployment, load, proc_stat
from tables import print_table


def check_pass(dep: Deployment) -> tuple[float, float, int]:
    """(wall s, CPU s incl. its children, max RSS bytes) of one fresh `check` process."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bridge", "check"],
        env=dep.env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"check exited {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


def passes(dep: Deployment, runs: int, label: str) -> list[str]:
    results = [check_pass(dep) for _ in range(runs)]
    return [
        label,
        str(runs),
        f"{statistics.median(r[0] for r in results):.2f}",
        f"{statistics.median(r[1] for r in results):.2f}",
        f"{max(r[2] for r in results) / 2**20:.0f}",
        load(),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idle", type=float, default=120.0, help="seconds of idle daemon measured (default 120)")
    parser.add_argument("--burst", type=int, default=200, help="requests in the burst (default 200)")
    parser.add_argument("--check-runs", type=int, default=5, help="idle check passes per case (default 5)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 s idle, burst of 10, 1 pass per case")
    args = parser.parse_args()
    if args.quick:
        args.idle, args.burst, args.check_runs = 3.0, 10, 1

    daemon_rows = []
    check_rows = []
    with deployment() as empty:
        check_rows.append(passes(empty, args.check_runs, "idle `check`, no jobs in flight"))
    with deployment() as dep:
        publisher = Publisher(dep)
        daemon = dep.bridge("run", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while not any(e["event"] == "broker_connected" for e in dep.log_events()):
                if time.monotonic() > deadline:
                    raise SystemExit("the daemon did not connect")
                time.sleep(0.2)
            time.sleep(1.0)  # past start-up (imports, the first reconcile)

            def phase(label: str, until: object, extra: str) -> None:
                load_before = load()
                own0, kids0, _ = proc_stat(daemon.pid)
                started = time.monotonic()
                peak = 0
                while not until():  # type: ignore[operator]
                    peak = max(peak, proc_stat(daemon.pid)[2])
                    time.sleep(0.1)
                wall = time.monotonic() - started
                own1, kids1, rss = proc_stat(daemon.pid)
                peak = max(peak, rss)
                own, kids = own1 - own0, kids1 - kids0
                daemon_rows.append(
                    [
                        label,
                        f"{wall:.1f}",
                        f"{own:.2f}",
                        f"{100 * own / wall:.1f}",
                        f"{kids:.2f}",
                        f"{rss / 2**20:.0f}",
                        f"{peak / 2**20:.0f}",
                        extra,
                        f"{load_before}/{load()}",
                    ]
                )

            idle_end = time.monotonic() + args.idle
            phase("idle", lambda: time.monotonic() >= idle_end, "")
            for _ in range(args.burst):
                publisher.publish()
            burst_started = time.monotonic()
            phase(f"burst of {args.burst} requests", lambda: len(dep.submitted()) >= args.burst, "")
            rate = args.burst / (time.monotonic() - burst_started)
            daemon_rows[-1][7] = f"{rate:.1f} requests/s"
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(30)
            publisher.close()
        check_rows.append(passes(dep, args.check_runs, f"idle `check`, {args.burst} held jobs in flight"))

    print("Bridge daemon (`hpc-bridge run`), from /proc/PID/stat\n")
    print_table(
        [
            "phase",
            "wall s",
            "CPU s (daemon)",
            "CPU %",
            "CPU s (its commands)",
            "RSS MiB at end",
            "peak RSS MiB",
            "rate",
            "load",
        ],
        daemon_rows,
    )
    print("\nCron: one `hpc-bridge check` pass with nothing to do (fresh process, os.wait4)\n")
    print_table(["case", "passes", "wall s (median)", "CPU s (median)", "max RSS MiB", "load"], check_rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
