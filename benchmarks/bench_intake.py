"""Intake throughput: N Rodan requests in the queue -> one `hpc-bridge check` pass -> N real Slurm jobs.

Measures the whole pass (one fresh process, as cron runs it), checks that nothing was lost or done
twice (every request has exactly one job in `sacct`, by the job name the bridge gave it; the request
and dead-letter queues are empty), and, from the bridge's own JSON log, where the time of each
request goes: validation, the Rodan token (cached for 10 minutes), writing the parameter file and
batch script, sbatch, the ledger, and the ack. With --profile, a second batch goes through a pass
run under cProfile (both threads: the one that owns the pika connection and the work thread that
talks to Rodan and Slurm) and the top functions by cumulative time are printed.

Jobs are submitted held (`sbatch --hold`: accepted, given an id, in sacct, but never started, so
the node's CPUs stay free for other work; --run-jobs lets them run /bin/true) and cancelled afterwards.

    .venv/bin/python benchmarks/bench_intake.py                      # 500 requests + a profiled pass of 100
    .venv/bin/python benchmarks/bench_intake.py --quick              # smoke test: 20 requests, ~10 s
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pika
from benchlib import BROKER, REPO, Deployment, Publisher, deployment, load, percentile, sacct_names
from tables import print_table


def run_pass(dep: Deployment, profile_dir: Path | None = None) -> tuple[float, int]:
    cmd = [sys.executable, "-m", "bridge", "check"]
    if profile_dir is not None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--profile-child", str(profile_dir)]
    started = time.monotonic()
    result = subprocess.run(cmd, env=dep.env, cwd=Path(__file__).resolve().parents[1], capture_output=True)
    return time.monotonic() - started, result.returncode


def profile_child(out_dir: Path) -> int:
    """Run one `check` pass in this process under cProfile: one profile per thread."""
    from bridge import runner
    from bridge.cli import main as cli_main

    work = cProfile.Profile()
    original = runner.Bridge._off_connection_thread

    def profiled_off_connection_thread(self: runner.Bridge, fn: Callable[..., Any], *args: object) -> Any:
        return original(self, lambda *a: work.runcall(fn, *a), *args)

    runner.Bridge._off_connection_thread = profiled_off_connection_thread
    owner = cProfile.Profile()
    started = time.monotonic()
    status: int = owner.runcall(cli_main, ["check"])
    wall = time.monotonic() - started
    owner.dump_stats(out_dir / "owner.prof")
    work.dump_stats(out_dir / "work.prof")
    (out_dir / "wall").write_text(f"{wall}")
    return status


def top(path: Path, n: int) -> list[list[str]]:
    stats = pstats.Stats(str(path))
    entries = stats.stats  # type: ignore[attr-defined]
    ranked = sorted(entries.items(), key=lambda kv: kv[1][3], reverse=True)
    rows = []
    for (filename, line, name), (_cc, ncalls, tottime, cumtime, _callers) in ranked[:n]:
        where = filename
        for marker in ("/site-packages/", f"{REPO}/", "/lib/python3"):
            if marker in filename:
                where = filename.split(marker, 1)[1]
                where = where.split("/", 1)[1] if marker == "/lib/python3" else where
                break
        rows.append([f"`{where}:{line}({name})`", str(ncalls), f"{tottime:.3f}", f"{cumtime:.3f}"])
    return rows


def verify(dep: Deployment) -> tuple[int, int, int, int]:
    """(requests with a submitted ledger entry, with exactly one sacct job, queue depth, dead-lettered)."""
    submitted = dep.submitted()
    names = {r["job_name"] for r in submitted.values()}
    counts: dict[str, int] = {}
    for _ in range(30):  # slurmdbd records submissions asynchronously
        counts = sacct_names([r["job_id"] for r in submitted.values()], names)
        if all(v >= 1 for v in counts.values()):
            break
        time.sleep(1)
    once = sum(1 for corr in dep.published if corr in submitted and counts.get(submitted[corr]["job_name"]) == 1)
    connection = pika.BlockingConnection(pika.URLParameters(BROKER))
    channel = connection.channel()
    depth = channel.queue_declare(dep.request_q, passive=True).method.message_count
    try:
        dead = channel.queue_declare(dep.dead_q, passive=True).method.message_count
    except pika.exceptions.ChannelClosedByBroker:
        dead = 0
    connection.close()
    return len([c for c in dep.published if c in submitted]), once, depth, dead


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--profile-requests", type=int, default=100, help="0: no profiled pass")
    parser.add_argument("--top", type=int, default=14, help="functions shown per thread in the profile")
    parser.add_argument("--run-jobs", action="store_true", help="let the jobs run /bin/true instead of holding them")
    parser.add_argument("--quick", action="store_true", help="smoke test: 20 requests, profiled pass of 10")
    parser.add_argument("--profile-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.profile_child:
        return profile_child(args.profile_child)
    if args.quick:
        args.requests, args.profile_requests, args.top = 20, 10, 8

    with deployment(hold=not args.run_jobs) as dep:
        publisher = Publisher(dep)
        for _ in range(args.requests):
            publisher.publish()
        load_before = load()
        pass_s, status = run_pass(dep)
        load_after = load()
        found, once, depth, dead = verify(dep)
        events = dep.log_events()
        per_request: dict[str, dict[str, float]] = {}
        for event in events:
            corr = event.get("correlation_id")
            if corr:
                ts = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
                per_request.setdefault(corr, {}).setdefault(event["event"], ts)
        done = [e for e in per_request.values() if "request_acked" in e and "request_received" in e]
        total = [(e["request_acked"] - e["request_received"]) * 1000 for e in done]
        submit = [(e["request_submitted"] - e["request_valid"]) * 1000 for e in done if "request_valid" in e]

        profile_rows: tuple[list[list[str]], list[list[str]], float, float] | None = None
        if args.profile_requests:
            for _ in range(args.profile_requests):
                publisher.publish()
            prof_dir = dep.tmp / "profile"
            prof_dir.mkdir()
            prof_wall, _ = run_pass(dep, prof_dir)
            inner = float((prof_dir / "wall").read_text())
            work_top, owner_top = top(prof_dir / "work.prof", args.top), top(prof_dir / "owner.prof", args.top)
            profile_rows = (work_top, owner_top, prof_wall, inner)
        publisher.close()

    print(
        f"hpc-bridge check: {args.requests} requests into real Slurm (exit status {status}), "
        f"load {load_before}/{load_after}\n"
    )
    rows = [
        ["requests published", str(args.requests)],
        ["submitted (ledger), exactly one job each in sacct", f"{found} / {once}"],
        ["left in the request queue / dead-lettered", f"{depth} / {dead}"],
        ["whole pass, incl. process start (s)", f"{pass_s:.2f}"],
        ["throughput (requests/s)", f"{found / pass_s:.1f}"],
        ["per request, received -> acked, p50 (ms)", f"{statistics.median(total):.1f}"],
        ["per request, received -> acked, p95 (ms)", f"{percentile(total, 0.95):.1f}"],
        ["per request, token+files+sbatch+ledger p50 (ms)", f"{statistics.median(submit):.1f}"],
    ]
    print_table(["metric", "value"], rows)
    if profile_rows is not None:
        work_rows, owner_rows, prof_wall, inner = profile_rows
        print(
            f"\nProfiled pass: {args.profile_requests} requests, {prof_wall:.2f} s with process start "
            f"({inner:.2f} s inside main), load {load()}\n"
        )
        print("Work thread (Intake.process per request), by cumulative time:\n")
        print_table(["function", "calls", "own s", "cumulative s"], work_rows)
        print("\nConnection-owner thread (the whole `check`), by cumulative time:\n")
        print_table(["function", "calls", "own s", "cumulative s"], owner_rows)
    lost = args.requests - once
    return 0 if lost == 0 and depth == 0 and dead == 0 and status == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
