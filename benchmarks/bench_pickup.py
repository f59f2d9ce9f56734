"""Pickup latency: a request published -> its job accepted by Slurm (the ledger's submitted_at,
written when sbatch has returned a job id), for the daemon (`hpc-bridge run`) and for cron
(`hpc-bridge check` started every minute on the minute, as cron does, whether or not the last
pass has finished; the spool lock makes an overlapping pass a no-op).

Requests are published at uniformly random instants over the window, so the wait for cron's next
tick is sampled fairly. Jobs are submitted held (`sbatch --hold`, accepted but never run) and
cancelled afterwards; every mode gets its own queues and spool.

    .venv/bin/python benchmarks/bench_pickup.py                 # full: 200 requests per mode, ~9 min
    .venv/bin/python benchmarks/bench_pickup.py --quick         # smoke test, ~15 s
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import threading
import time

from benchlib import Deployment, Publisher, deployment, load, percentile
from tables import print_table


def daemon_mode(requests: int, window: float, rng: random.Random) -> tuple[list[float], str]:
    with deployment() as dep:
        publisher = Publisher(dep)
        daemon = dep.bridge("run", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_for(lambda: any(e["event"] == "broker_connected" for e in dep.log_events()), 30)
            loads = [load()]
            publisher.publish_at(sorted(rng.uniform(0, window) for _ in range(requests)))
            loads.append(load())
            _wait_for(lambda: len(dep.submitted()) >= requests, 60)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(30)
            publisher.close()
        return _latencies(dep, requests), "/".join(loads)


def cron_mode(requests: int, window: float, period: float, rng: random.Random) -> tuple[list[float], str]:
    with deployment() as dep:
        publisher = Publisher(dep)
        stop = threading.Event()
        passes: list[subprocess.Popen[bytes]] = []

        def cron() -> None:
            # Ticks on multiples of `period` of the wall clock (cron: second 0 of every minute).
            while not stop.is_set():
                now = time.time()
                if stop.wait(period - now % period):
                    return
                passes.append(dep.bridge("check", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        ticker = threading.Thread(target=cron, daemon=True)
        ticker.start()
        try:
            loads = [load()]
            publisher.publish_at(sorted(rng.uniform(0, window) for _ in range(requests)))
            loads.append(load())
            _wait_for(lambda: len(dep.submitted()) >= requests, 2 * period + 60)
        finally:
            stop.set()
            ticker.join()
            for proc in passes:
                proc.wait(120)
            publisher.close()
        return _latencies(dep, requests), "/".join(loads)


def _latencies(dep: Deployment, requests: int) -> list[float]:
    submitted = dep.submitted()
    if len(submitted) != requests:
        raise SystemExit(f"only {len(submitted)} of {requests} requests were submitted")
    return [submitted[corr]["submitted_at"] - at for corr, at in dep.published.items()]


def _wait_for(condition: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s")
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="requests per mode (default 200)")
    parser.add_argument("--daemon-window", type=float, default=120.0, help="seconds to spread them over (daemon)")
    parser.add_argument("--cron-window", type=float, default=300.0, help="seconds to spread them over (cron)")
    parser.add_argument("--cron-period", type=float, default=60.0, help="seconds between cron passes (default 60)")
    parser.add_argument("--modes", default="daemon,cron", help="comma-separated: daemon, cron")
    parser.add_argument("--seed", type=int, default=6)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 10 requests over 3 s per mode, cron every 3 s",
    )
    args = parser.parse_args()
    if args.quick:
        args.requests, args.daemon_window, args.cron_window, args.cron_period = 10, 3.0, 3.0, 3.0
    rng = random.Random(args.seed)
    rows = []
    for mode in args.modes.split(","):
        if mode == "daemon":
            lat, loads = daemon_mode(args.requests, args.daemon_window, rng)
            how = f"`hpc-bridge run`, {args.requests} over {args.daemon_window:.0f} s"
        elif mode == "cron":
            lat, loads = cron_mode(args.requests, args.cron_window, args.cron_period, rng)
            how = f"`check` every {args.cron_period:.0f} s, {args.requests} over {args.cron_window:.0f} s"
        else:
            parser.error(f"unknown mode {mode!r}")
        ms = [x * 1000 for x in lat]
        rows.append(
            [
                mode,
                how,
                str(len(ms)),
                f"{percentile(ms, 0.50):.0f}",
                f"{percentile(ms, 0.95):.0f}",
                f"{percentile(ms, 0.99):.0f}",
                f"{max(ms):.0f}",
                loads,
            ]
        )
    print("Pickup latency: request published -> sbatch accepted (ledger submitted_at), ms\n")
    print_table(["mode", "how", "requests", "p50 ms", "p95 ms", "p99 ms", "max ms", "load before/after"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
