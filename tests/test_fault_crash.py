"""Fault suite, crash anywhere (item 1 of docs/reliability.md): SIGKILL the bridge at every durable step.

Many requests go through the real broker and the real scheduler while ``hpc-bridge check``
passes (and, for part of the run, the ``hpc-bridge run`` daemon) are SIGKILLed at the named
fault points of ``bridge/faults.py`` (the reachable one killed least so far) and at random,
and restarted, until every request has its final reply. Then it counts, from the broker (the
reply queue drained: every correlation id exactly once), the ledger, and the scheduler's own
records (squeue/sacct, qstat/qacct: each job name ``rodan-<id>`` submitted at most once):
requests lost, jobs submitted twice, requests with zero or more than one reply. All must be 0.

The jobs run ``tests/stub_worker.py`` (real parameter file, real reply path, no TensorFlow) so
that many requests are affordable. Half of them leave their reply in the outbox, as a
worker that cannot reach the broker does, so the BRIDGE publishes it (the publish fault
points); one request in eight is malformed, so the bridge rejects it (error reply, dead letter).

CI size: 24 requests on Slurm, 8 on Grid Engine. The full count (the figures print with -s):

    HPC_FAULT_REQUESTS=200 HPC_FAULT_REQUESTS_GE=40 .venv/bin/python -m pytest -s -p no:cacheprovider \\
        tests/test_fault_crash.py

``HPC_FAULT_SEED`` fixes the random kills. Every scheduler command the bridge runs goes through a
wrapper that records its argv (``argv.log`` in the test's directory; tests/test_fault_secrets.py
scans it for secrets).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import pytest

from bridge.faults import POINTS
from tests import stub_worker
from tests.support.bridge import REPO, bridge_environ, run_bridge, settled
from tests.support.broker import Queues
from tests.support.cluster import Cluster, cancel_ledger_jobs
from tests.support.wait import wait_until

pytestmark = [pytest.mark.broker, pytest.mark.slow]  # a sweep of crash points

REQUEST_POINTS = [p for p in POINTS if not p.endswith(("_publish", "_marker"))]
PUBLISH_POINTS = [p for p in POINTS if p not in REQUEST_POINTS]

SETTINGS = {"Maximum time (D-HH:MM)": "0-00:05", "Maximum memory (MB)": 1024, "CPUs": 1}


def requested(cluster: Cluster) -> int:
    if cluster.name == "slurm":
        return int(os.environ.get("HPC_FAULT_REQUESTS", "24"))
    return int(os.environ.get("HPC_FAULT_REQUESTS_GE", "8"))


def time_budget(n: int) -> float:
    """Seconds for the kill-and-restart loop to settle ``n`` requests (then the test fails)."""
    return 150 + 8 * n


# The loop's own deadline, plus the waits after it: pytest-timeout's default would cut a full run short.
pytestmark.append(
    pytest.mark.timeout(time_budget(max(requested(Cluster("slurm")), requested(Cluster("gridengine")))) + 400)
)


def record_argv(bindir: Path, names: tuple[str, ...], argv_log: Path) -> None:
    """Wrappers that append each scheduler command line to ``argv_log``, then run the real one."""
    bindir.mkdir(parents=True, exist_ok=True)
    for name in names:
        real = shutil.which(name)
        if real is None:
            continue
        wrapper = bindir / name
        wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "{name} $*" >> {argv_log}\nexec {real} "$@"\n')
        wrapper.chmod(0o755)


@dataclass
class Figures:
    scheduler: str
    requests: int
    malformed: int
    bridge_published: int
    seed: int
    kills: Counter[str] = field(default_factory=Counter)
    passes: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)
    submitted_twice: dict[str, list[str]] = field(default_factory=dict)
    multiple_replies: dict[str, int] = field(default_factory=dict)
    expiring_repeats: dict[str, int] = field(default_factory=dict)
    wrong_replies: list[str] = field(default_factory=list)
    ledger_not_final: list[str] = field(default_factory=list)
    jobs: int = 0
    dead_letters: int = 0
    duration_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler,
            "requests": self.requests,
            "malformed (rejected by the bridge)": self.malformed,
            "replies left for the bridge to publish": self.bridge_published,
            "scheduler jobs": self.jobs,
            "kills per point": dict(sorted(self.kills.items())),
            "kills in all": sum(self.kills.values()),
            "passes": dict(self.passes),
            "lost (zero replies)": len(self.lost),
            "submitted twice": len(self.submitted_twice),
            "more than one reply": len(self.multiple_replies),
            "a second reply that expires (publish outcome unknown at the kill)": len(self.expiring_repeats),
            "wrong reply body": len(self.wrong_replies),
            "ledger not final": len(self.ledger_not_final),
            "dead-letter copies": self.dead_letters,
            "seed": self.seed,
            "duration_s": round(self.duration_s, 1),
        }


class CrashRun:
    def __init__(self, env: dict[str, str], spool: Path, queues: Queues, broker_url: str, tmp: Path) -> None:
        self.env, self.spool, self.queues, self.broker_url, self.tmp = env, spool, queues, broker_url, tmp
        self.fault_log = tmp / "faults.log"
        self.replies: dict[str, list[bytes]] = defaultdict(list)
        self.expiring: Counter[str] = Counter()  # replies published again with an expiry
        self.dead = 0

    def kills_so_far(self) -> list[str]:
        return self.fault_log.read_text().split() if self.fault_log.exists() else []

    def fault_env(self, spec: str, seed: int) -> dict[str, str]:
        return {**self.env, "HPC_FAULT_KILL": spec, "HPC_FAULT_SEED": str(seed), "HPC_FAULT_LOG": str(self.fault_log)}

    def check(self, spec: str | None, seed: int) -> int:
        env = self.fault_env(spec, seed) if spec else self.env
        return run_bridge(env, "check", timeout=180).returncode

    def daemon(self, spec: str, seed: int, seconds: float) -> int:
        """``hpc-bridge run`` with random kills, for at most ``seconds`` (then SIGTERM)."""
        full = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "RODAN_", "HPC_"))}
        full.update(self.fault_env(spec, seed))
        proc = subprocess.Popen(
            [sys.executable, "-m", "bridge", "run"],
            env=full,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            return proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            return proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def collect(self) -> None:
        connection = pika.BlockingConnection(pika.URLParameters(self.broker_url))
        try:
            channel = connection.channel()
            for queue in (self.queues.reply, self.queues.dead):
                while True:
                    try:
                        method, props, body = channel.basic_get(queue, auto_ack=True)
                    except pika.exceptions.ChannelClosedByBroker as exc:
                        if exc.reply_code != 404:
                            raise
                        channel = connection.channel()
                        break
                    if method is None:
                        break
                    if queue == self.queues.reply:
                        self.replies[props.correlation_id or ""].append(body)
                        if props.expiration is not None:
                            self.expiring[props.correlation_id or ""] += 1
                    else:
                        self.dead += 1
        finally:
            if connection.is_open:
                connection.close()

    def ledger(self) -> dict[str, dict[str, Any]]:
        out = {}
        for path in (self.spool / "ledger").glob("*.json"):
            record = json.loads(path.read_text())
            out[record["correlation_id"]] = record
        return out

    def settled(self, corrs: list[str]) -> bool:
        if not all(self.replies.get(c) for c in corrs):
            return False
        records = self.ledger()
        outbox = list((self.spool / "outbox").glob("*.json"))
        return not outbox and all(records.get(c, {}).get("state") in ("replied", "rejected") for c in corrs)


def jobs_by_name(cluster: Cluster, names: list[str]) -> dict[str, list[str]]:
    """Every job (live or accounted) of each name, from the scheduler itself."""
    return cluster.jobs_by_name(names)


def no_live_jobs(cluster: Cluster, names: list[str]) -> bool:
    return not cluster.live_names() & set(names)


@pytest.fixture(
    params=[pytest.param("slurm", marks=pytest.mark.slurm), pytest.param("gridengine", marks=pytest.mark.gridengine)]
)
def crash_cluster(request: pytest.FixtureRequest) -> Cluster:
    request.getfixturevalue(request.param)
    return Cluster(request.param)


def test_crash_anywhere_loses_nothing_and_does_nothing_twice(
    crash_cluster: Cluster,
    broker_url: str,
    standin: Any,
    queues: Queues,
    rodan: Any,
    sample_inputs: Any,
    tmp_path: Path,
) -> None:
    cluster = crash_cluster
    started = time.monotonic()
    n = requested(cluster)
    seed = int(os.environ.get("HPC_FAULT_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    spool = tmp_path / "spool"
    bindir = tmp_path / "bin"
    record_argv(bindir, cluster.commands, tmp_path / "argv.log")
    env = bridge_environ(
        broker_url,
        standin,
        queues,
        spool,
        HPC_LOG_FILE=str(tmp_path / "bridge.log"),
        HPC_SCHEDULER=cluster.name,
        HPC_WORKER_PYTHON=str(stub_worker.install(tmp_path / "stub")),
        HPC_GPU_RULES="99999999=gpu:1",  # no GPU for these jobs: more of them run at once
        HPC_POISON_LIMIT="1000",  # these kills are the test's, not the request's: no quarantine
        PATH=f"{bindir}:{os.environ['PATH']}",
    )
    run = CrashRun(env, spool, queues, broker_url, tmp_path)
    inputs = sample_inputs("new", n_layers=1, height=96, width=96, seed=11)
    corrs: list[str] = []
    malformed: list[str] = []
    outbox_only: list[str] = []

    def publish_next() -> None:
        """One more request, as Rodan publishes it (every 8th malformed, half the rest left in the outbox)."""
        i = len(corrs)
        corr = str(uuid.uuid4())
        if i % 8 == 7:
            malformed.append(rodan.publish(b"{not json", correlation_id=corr))
        else:
            corr = ("0" if i % 2 == 1 else "f") + corr[1:]  # tests/stub_worker.py: "0..." stays in the outbox
            rodan.publish_request(inputs, SETTINGS, correlation_id=corr)
            if corr.startswith("0"):
                outbox_only.append(corr)
        corrs.append(corr)

    # Requests arrive in waves over about 40 passes, so that every kind of pass finds work.
    wave = max(1, n // 40)
    figures = Figures(cluster.name, n, 0, 0, seed)
    deadline = time.monotonic() + time_budget(n)
    step = 0
    try:
        while len(corrs) < n or not run.settled(corrs):
            assert time.monotonic() < deadline, f"not settled in time: {figures.summary()}"
            for _ in range(min(wave, n - len(corrs))):
                publish_next()
            kills_before = len(run.kills_so_far())
            # The points this pass can reach: the request points while requests wait in the queue,
            # the publish points while a reply waits in the outbox or a malformed request is queued.
            reachable = []
            if rodan.depth(queues.request):
                reachable += REQUEST_POINTS
            if list((spool / "outbox").glob("*.json")) or (rodan.depth(queues.request) and malformed):
                reachable += PUBLISH_POINTS
            if step % 7 == 6:
                rc = run.daemon("random:0.03", seed + step, seconds=12)
                figures.passes["daemon, random"] += 1
            elif step % 7 == 5 or not reachable:
                rc = run.check("random:0.05", seed + step)
                figures.passes["check, random"] += 1
            else:  # the reachable point killed least so far
                point = min(reachable, key=lambda p: (figures.kills[p], rng.random()))
                rc = run.check(f"{point}:1", seed + step)
                figures.passes["check, one point"] += 1
            killed = run.kills_so_far()[kills_before:]
            if rc == -signal.SIGKILL:
                assert killed, "killed, but not by a fault point"
            figures.kills.update(killed)
            run.collect()
            step += 1
            if not killed:
                time.sleep(1)  # nothing to kill at: let the jobs run
        # Every request answered: the jobs end, then clean passes until the bridge has settled every
        # request (ledger final, outbox empty: nothing can publish after that), and a last look at the queues.
        names = [f"rodan-{c}" for c in corrs if c not in malformed]
        wait_until(lambda: no_live_jobs(cluster, names), 120, 1, "the jobs to end")
        wait_until(
            lambda: run.check(None, seed) == 0 and settled(spool, corrs), 120, 1, "clean passes to settle every request"
        )
        run.collect()

        def accounted() -> dict[str, list[str]] | None:
            found = jobs_by_name(cluster, names)
            return found if all(found.values()) else None

        jobs = wait_until(accounted, 120, 2, "the scheduler's record of every job")
    finally:
        figures.duration_s = time.monotonic() - started
        cancel_ledger_jobs(spool, cluster)

    records = run.ledger()
    figures.malformed, figures.bridge_published = len(malformed), len(outbox_only)
    figures.jobs = sum(len(ids) for ids in jobs.values())
    figures.dead_letters = run.dead
    for corr in corrs:
        bodies = run.replies.get(corr, [])
        if not bodies:
            figures.lost.append(corr)
        elif len(bodies) - run.expiring[corr] > 1 or (len(bodies) > 1 and len(set(bodies)) > 1):
            figures.multiple_replies[corr] = len(bodies)
        elif len(bodies) > 1:
            # The bridge died between the broker's confirm and the marker: it cannot know the reply
            # arrived, so it sent it again with an expiry (bridge/replies.py, UNCERTAIN_REPLY_TTL_MS).
            figures.expiring_repeats[corr] = len(bodies)
        expected = ["error"] if corr in malformed else ["Background Model", "Model 0"]
        if any(sorted(json.loads(body)) != expected for body in bodies):
            figures.wrong_replies.append(corr)
        if records.get(corr, {}).get("state") not in ("replied", "rejected"):
            figures.ledger_not_final.append(corr)
    for name, ids in jobs.items():
        if len(ids) > 1:
            figures.submitted_twice[name] = ids
        record = records[name.removeprefix("rodan-")]
        assert record["job_ids"] == ids[:1], f"ledger {record['job_ids']} vs scheduler {ids}"
    strangers = set(run.replies) - set(corrs)
    summary = figures.summary()
    print(f"\nfault suite, crash anywhere: {json.dumps(summary, indent=1)}")
    (tmp_path / "figures.json").write_text(json.dumps(summary, indent=1))
    assert not strangers, f"replies for unknown correlation ids: {strangers}"
    assert (figures.lost, figures.submitted_twice, figures.multiple_replies) == ([], {}, {}), summary
    assert figures.wrong_replies == [] and figures.ledger_not_final == [], summary
    assert figures.dead_letters >= len(malformed)
    # Enough kills, at enough different points, that the zeros above mean something.
    assert sum(figures.kills.values()) >= min(n // 2, len(POINTS)), f"too few kills: {summary}"
    assert len(figures.kills) >= (len(POINTS) - 2 if n >= 20 else 3), f"too few points reached: {summary}"
