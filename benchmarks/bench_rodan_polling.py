"""What waiting HPC runs cost Rodan's Python3 Celery worker, on a real Rodan 3.1.0 (deploy/dev/rodan.sh).

For each version of the job package (``before``: 0.4.0's, every poll the whole of Rodan's ``run`` at a
fixed HPC_POLL_SECONDS; ``after``: this tree's, a poll that finds its reply queue empty ends after one
database query and one passive queue declaration, and the interval grows with the wait), with
HPC_POLL_SECONDS = ``--poll`` (or ``--poll-before`` / ``--poll-after``):

1. the worker alone: its CPU share over ``--idle`` seconds, and the time a model upload takes
   (``POST /api/resources/`` until Rodan's ``create_resource`` task, on the same worker, has typed it);
2. ``--runs`` workflow runs of the job waiting (their requests go to a queue nobody reads; with
   ``--age-s``, this tree's runs are made to have waited that long already, by moving the publish
   time in their state files back): the worker's CPU share over ``--window`` seconds, the polls in
   that window (the worker log's ``retry:`` lines), CPU seconds per poll (less the idle share), the
   seconds from each poll's due time to its end (p50, p90: the wait for a free pool process plus
   the poll), and the model upload again;
3. Rodan's Cancel of every run: the reply queues and state folders left (0.4.0: after 20 s), and for
   this tree the seconds until none is left.

The worker's CPU is read from /proc: utime + stime of every process of its process group plus the
children they reaped (cutime + cstime), so the pool processes that ``--max-tasks-per-child=1`` starts
and ends for every task are counted. A second table computes the busy share of 50 runs in steady
state from the CPU per poll: 50 x CPU per poll / interval (0.4.0: its fixed 120 s; after: the
interval of a run in its first minutes, after 1 hour and after 5 hours, 'Maximum time' 1-00:00).

    .venv/bin/python benchmarks/bench_rodan_polling.py --runs 20 --poll 10 --window 240    # ~20 min
    .venv/bin/python benchmarks/bench_rodan_polling.py --runs 50 --poll-before 120 --poll-after 30 \
        --age-s 3600 --window 720                                    # steady state, measured; ~45 min
    .venv/bin/python benchmarks/bench_rodan_polling.py --quick       # 2 runs, short windows, ~3 min

Set HPC_TEST_RODAN_REDIS_DB when another Rodan of the tests may run on the machine (rodan.sh picks a
free port by itself).
"""

from __future__ import annotations

import argparse
import calendar
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import pika

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "rodan_job"))

from hpc_paco_trainer import hpc_relay, selftest  # noqa: E402

from bridge.testing.rodan_api import FAILED, FINISHED, Api, Upload  # noqa: E402

RODAN_SH = REPO / "deploy" / "dev" / "rodan.sh"
JOB_NAME = "Training model for Patchwise Analysis of Music Document, HPC"
#: 0.4.0's job package (unchanged from this commit to 0.4.0's release).
BEFORE_REV = "74c219e"
CANCELLED = 9
REQUEST_CANCELLING = 29
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def package_dir(version: str, tmp: Path) -> Path:
    """The job package of ``version``: this tree's, or 0.4.0's from git."""
    if version == "after":
        return REPO / "rodan_job" / "hpc_paco_trainer"
    archive = subprocess.run(
        ["git", "archive", BEFORE_REV, "rodan_job/hpc_paco_trainer"], cwd=REPO, capture_output=True, check=True
    ).stdout
    target = tmp / "before"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(target)
    return target / "rodan_job" / "hpc_paco_trainer"


def rodan_env(state: Path, broker_url: str, request_queue: str, poll_s: int) -> dict[str, str]:
    env = {
        **os.environ,
        "HPC_DEV_RODAN_DIR": str(state),
        "HPC_DEV_RODAN_PORT": "0",
        "HPC_DEV_RODAN_REDIS_DB": os.environ.get("HPC_TEST_RODAN_REDIS_DB", "13"),
        "HPC_RABBITMQ_URL": broker_url,
        "HPC_REQUEST_QUEUE": request_queue,
        "HPC_POLL_SECONDS": str(poll_s),
    }
    env.pop("HPC_DEV_RODAN_JOB_PACKAGES", None)
    return env


def rodan_sh(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(["bash", str(RODAN_SH), *args], env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"rodan.sh {' '.join(args)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def worker_cpu_s(pgid: int) -> float:
    """CPU seconds of the worker's process group, the children it reaped included."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:  # pgrp
            total += sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
    return total / CLOCK_TICKS


_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}): INFO/[^\]]+\] (.*)$")
_ETA = re.compile(r"Received task: .*\[([0-9a-f-]{36})\]\s+ETA:\[([^\]]+)\]")
_RETRY = re.compile(r"\[([0-9a-f-]{36})\] retry: Retry in")


def polls_in_log(log: Path, start: int) -> tuple[int, list[float]]:
    """The polls in the worker log from byte ``start`` (Celery's ``retry:`` lines) and, for each
    poll whose due time (ETA) is in that part, seconds from its due time to its end: the wait for a
    free pool process plus the poll itself. Celery logs the time of Rodan's TIME_ZONE and the ETA in
    UTC: the offset is taken from the log's last line against the file's modification time."""
    with open(log, "rb") as handle:
        handle.seek(start)
        text = handle.read().decode("utf-8", "replace")
    due: dict[str, list[float]] = {}
    walls: list[float] = []
    polls = 0
    stamps = [m for m in map(_LINE.match, text.splitlines()) if m]
    if not stamps:
        return 0, []
    last = calendar.timegm(time.strptime(stamps[-1].group(1), "%Y-%m-%d %H:%M:%S"))
    offset = round((log.stat().st_mtime - last) / 900) * 900
    for match in stamps:
        at = calendar.timegm(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")) + offset + int(match.group(2)) / 1000
        message = match.group(3)
        eta = _ETA.search(message)
        if eta:
            due.setdefault(eta.group(1), []).append(datetime.fromisoformat(eta.group(2)).timestamp())
            continue
        retry = _RETRY.search(message)
        if retry:
            # This poll ran for the latest message of its task that was due (the next message,
            # which this poll published, may be logged just before this line).
            polls += 1
            passed = [t for t in due.get(retry.group(1), []) if t <= at]
            if passed:
                walls.append(at - max(passed))
                due[retry.group(1)] = [t for t in due[retry.group(1)] if t > at]
    return polls, walls


def queue_depth(broker_url: str, queue: str) -> int:
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        return int(connection.channel().queue_declare(queue=queue, passive=True).method.message_count)
    except pika.exceptions.ChannelClosedByBroker:
        return 0
    finally:
        if connection.is_open:
            connection.close()


def reply_queues_left(broker_url: str, runjobs: list[str]) -> int:
    left = 0
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        for runjob in runjobs:
            for attempt in (1, 2):
                name = hpc_relay.reply_queue_name(hpc_relay.correlation_id_for(runjob, attempt))
                try:
                    connection.channel().queue_declare(queue=name, passive=True)
                    left += 1
                except pika.exceptions.ChannelClosedByBroker:
                    pass
    finally:
        connection.close()
    return left


def delete_queues(broker_url: str, names: list[str]) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        for name in names:
            with contextlib.suppress(pika.exceptions.ChannelClosedByBroker):
                connection.channel().queue_delete(queue=name)
    finally:
        connection.close()


def upload_s(api: Api, project: str, megabytes: float, repeat: int) -> float:
    """Median seconds of a model upload until Rodan typed it (its create_resource task ran)."""
    times = []
    for _ in range(repeat):
        data = selftest.HDF5_MAGIC + os.urandom(int(megabytes * 1e6))
        t0 = time.monotonic()
        api.upload(project, Upload(f"model-{uuid.uuid4().hex[:8]}.hdf5", data, "keras/model+hdf5"), timeout_s=900)
        times.append(time.monotonic() - t0)
    return sorted(times)[len(times) // 2]


def start_runs(api: Api, project: str, n: int, tmp: Path) -> list[str]:
    """``n`` workflow runs of the job, each on the same uploaded sample; their URLs."""
    sample = tmp / "sample.zip"
    selftest.write_sample_zip(str(sample), 2, 1)
    resource = api.upload(project, Upload("sample.zip", sample.read_bytes(), "application/zip"))
    job = api.job(JOB_NAME)
    in_types = {p["name"]: p["url"] for p in job["input_port_types"]}
    out_types = {p["name"]: p["url"] for p in job["output_port_types"]}
    urls = []
    for i in range(n):
        workflow = api.created("/api/workflows/", data={"project": project, "name": f"wait {i}"})
        wfjob = api.created("/api/workflowjobs/", json={"workflow": workflow["url"], "job": job["url"]})
        port = api.created(
            "/api/inputports/", data={"workflow_job": wfjob["url"], "input_port_type": in_types["Sample 1"]}
        )
        for name in ("Log File", "Model 1"):
            api.created("/api/outputports/", data={"workflow_job": wfjob["url"], "output_port_type": out_types[name]})
        answer = api.patch(workflow["url"], json={"valid": True})
        answer.raise_for_status()
        run = api.created(
            "/api/workflowruns/",
            json={"workflow": workflow["url"], "resource_assignments": {port["url"]: [resource["url"]]}},
        )
        urls.append(str(run["url"]))
    return urls


def measure(version: str, args: argparse.Namespace, broker_url: str, tmp: Path) -> dict[str, Any]:
    request_queue = "hpc-jobs.bench-polling-" + uuid.uuid4().hex[:8]
    state = tmp / f"rodan-{version}"
    poll = {"before": args.poll_before, "after": args.poll_after}.get(version) or args.poll
    env = rodan_env(state, broker_url, request_queue, poll)
    row: dict[str, Any] = {"version": version, "poll s": poll}
    runjobs: list[str] = []
    try:
        rodan_sh(env, "up", "--job-package", str(package_dir(version, tmp)))
        lines = dict(line.split("=", 1) for line in rodan_sh(env, "env").splitlines() if "=" in line)
        api = Api.login(lines["RODAN_URL"], lines["RODAN_EMAIL"], lines["RODAN_PASSWORD"])
        pgid = int((state / "run" / "worker.pid").read_text().strip())
        log = state / "logs" / "worker.log"
        project = api.create_project()
        row["upload alone s"] = upload_s(api, project, args.upload_mb, args.repeat)
        cpu0, t0 = worker_cpu_s(pgid), time.monotonic()
        time.sleep(args.idle)
        row["idle busy %"] = 100 * (worker_cpu_s(pgid) - cpu0) / (time.monotonic() - t0)

        urls = start_runs(api, project, args.runs, tmp)
        deadline = time.monotonic() + 600 + 30 * args.runs
        while queue_depth(broker_url, request_queue) < args.runs:
            if time.monotonic() > deadline:
                raise SystemExit(f"{version}: only {queue_depth(broker_url, request_queue)} of {args.runs} published")
            time.sleep(2)
        for url in urls:
            runjobs += [r["uuid"] for r in api.run_jobs(api.json(url))]
        if args.age_s and version == "after":
            # Runs that have waited --age-s already (the state file's publish time, which the
            # interval follows); the retries already scheduled come first.
            for runjob in runjobs:
                path = state / "media" / "hpc_paco_trainer" / runjob / "state.json"
                data = json.loads(path.read_text())
                data["published_at"] -= args.age_s
                path.write_text(json.dumps(data))
            time.sleep(poll * 2 + 10)
        start = log.stat().st_size
        cpu0, t0 = worker_cpu_s(pgid), time.monotonic()
        time.sleep(args.window)
        wall = time.monotonic() - t0
        cpu = worker_cpu_s(pgid) - cpu0
        polls, walls = polls_in_log(log, start)
        walls.sort()
        row.update(
            {
                "runs": args.runs,
                "window s": wall,
                "polls": polls,
                "busy %": 100 * cpu / wall,
                "poll wall s p50": walls[len(walls) // 2] if walls else float("nan"),
                "poll wall s p90": walls[int(len(walls) * 0.9)] if walls else float("nan"),
                # The worker's own idle share (its heartbeats, Celery's housekeeping) is not the polls'.
                "CPU s / poll": max(0.0, cpu - row["idle busy %"] / 100 * wall) / polls if polls else float("nan"),
            }
        )
        row["upload with runs s"] = upload_s(api, project, args.upload_mb, args.repeat)
        statuses = [api.json(url)["status"] for url in urls]
        row["runs still waiting"] = sum(1 for s in statuses if s not in (FINISHED, FAILED))
        # Cancel: 0.4.0 leaves every queue and state folder (it is measured once, after 20 s); this
        # tree's job removes them when each run's next poll is due (within its interval, a tenth of
        # the time it waited) or at once: how long until none is left.
        folders = state / "media" / "hpc_paco_trainer"
        t_cancel = time.monotonic()
        for url in urls:
            api.patch(url, json={"status": REQUEST_CANCELLING})
        limit = 20.0 if version == "before" else 120.0 + args.window / 5 + 0.12 * args.age_s
        while True:
            time.sleep(2)
            row["queues left"] = reply_queues_left(broker_url, runjobs)
            row["state folders left"] = sum(1 for r in runjobs if (folders / r).exists())
            waited = time.monotonic() - t_cancel
            if waited > limit or not (row["queues left"] or row["state folders left"]):
                break
        row["cancel to clean s"] = waited if not (row["queues left"] or row["state folders left"]) else float("nan")
        return row
    finally:
        with contextlib.suppress(SystemExit):
            rodan_sh(env, "down")
        replies = [hpc_relay.correlation_id_for(r, n) for r in runjobs for n in (1, 2)]
        delete_queues(broker_url, [request_queue, *(hpc_relay.reply_queue_name(c) for c in replies)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 runs, short windows: that the script runs")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--poll", type=int, default=10, help="HPC_POLL_SECONDS of the worker (both versions)")
    parser.add_argument("--poll-before", type=int, default=0, help="HPC_POLL_SECONDS for 0.4.0 (default --poll)")
    parser.add_argument("--poll-after", type=int, default=0, help="HPC_POLL_SECONDS for this tree (default --poll)")
    parser.add_argument("--age-s", type=float, default=0.0, help="this tree's runs: seconds they have waited already")
    parser.add_argument("--window", type=float, default=240.0, help="seconds measured with the runs waiting")
    parser.add_argument("--idle", type=float, default=30.0)
    parser.add_argument("--upload-mb", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--versions", default="before,after")
    args = parser.parse_args()
    if args.quick:
        # Two polls of each run in the window (--poll 10): enough for every column of the table.
        args.runs, args.window, args.idle, args.upload_mb, args.repeat = 2, 20.0, 3.0, 0.5, 1
    broker_url = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
    tmp = Path(tempfile.mkdtemp(prefix="bench-rodan-polling-"))
    rows = []
    try:
        for version in args.versions.split(","):
            rows.append(measure(version, args, broker_url, tmp))
            print(rows[-1], file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load = os.getloadavg()[0]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    aged = f", this tree's runs aged {args.age_s:.0f} s" if args.age_s else ""
    print(f"\n{args.runs} runs waiting{aged}, {cpu}, load {load:.1f}\n")
    columns = [
        "version", "poll s", "runs", "window s", "polls", "busy %", "CPU s / poll", "poll wall s p50",
        "poll wall s p90", "idle busy %",
        "upload alone s", "upload with runs s", "runs still waiting", "queues left", "state folders left",
        "cancel to clean s",
    ]  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{row[c]:.2f}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in columns]
        print("| " + " | ".join(cells) + " |")
    print("\nSteady state, 50 runs waiting ('Maximum time' 1-00:00), from the CPU per poll above:\n")
    print("| version | interval s | busy % of one worker |")
    print("|---|---|---|")
    for row in rows:
        per_poll = row.get("CPU s / poll") or float("nan")
        if row["version"] == "before":
            intervals = [("fixed", 120)]
        else:
            day = hpc_relay.parse_time_limit("1-00:00")
            intervals = [
                ("first minutes", hpc_relay.poll_interval_s(0, 30, day)),
                ("waited 1 h", hpc_relay.poll_interval_s(3600, 30, day)),
                ("waited 5 h+", hpc_relay.poll_interval_s(5 * 3600, 30, day)),
            ]
        for label, interval in intervals:
            print(f"| {row['version']} ({label}) | {interval} | {100 * 50 * per_poll / interval:.1f} |")


if __name__ == "__main__":
    main()
