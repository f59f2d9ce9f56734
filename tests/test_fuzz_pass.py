"""Hostile messages through the REAL pass: no message can stop the bridge.

Generated messages (tests/fuzz_messages.py: any bytes or JSON as body, valid requests of the three
generations (Rodan 2's two, and Rodan 3's sample zips and starting models) with one field mutated,
~1 MiB bodies, JSON nested 100,000 deep, and every AMQP property missing, empty, at its 255-byte
limit, non-UTF-8 or odd) are published with raw ``pika.BasicProperties`` to the real broker; then
the real ``Bridge(config).check()`` runs in-process on real Slurm (``HPC_SCHEDULER_ARGS=--hold``: a
request that is submitted stays held and is cancelled at the end), with the Rodan stand-in serving a
sample page of each generation. Every message must end in exactly one outcome (see
tests/fuzz_messages.py): submitted; or one error reply with its correlation id plus a dead-letter
copy; or, without a usable correlation id / reply_to (``reply_to`` must be ``HPC_REPLY_QUEUE``
itself), a dead-letter copy only. The pass must return 0, and leave the request queue empty.

One hypothesis example = one batch of up to 6 messages = one pass. ``HPC_FUZZ_EXAMPLES`` sets the
number of examples (default 150, about a minute on 2 busy cores; each run draws new ones from a fresh
seed, and the full run is 10,000)::

    HPC_FUZZ_EXAMPLES=10000 .venv/bin/python -m pytest -s -p no:cacheprovider tests/test_fuzz_pass.py

``HPC_FUZZ_SEED`` replays a run (the seed is printed, and attached to a failure);
``HPC_FUZZ_SHRINK=1`` lets hypothesis shrink a failing batch (slow: each try is a pass).

The daemon test feeds ``hpc-bridge run`` a fixed burst of ~200 hostile messages covering every kind,
then 3 valid requests: the valid ones are submitted, each hostile one gets its outcome, and the
daemon is still running, and exits 0 on SIGTERM.
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
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
import structlog
from hypothesis import HealthCheck, Phase, given, seed, settings

from bridge.config import load_config
from bridge.logs import configure_logging
from bridge.runner import Bridge
from bridge.testing.rodan import RodanStandin
from bridge.testing.samples import make_sample_page
from tests.fuzz_messages import (
    Context,
    Corr,
    Delivery,
    FuzzQueues,
    MessageSpec,
    Prop,
    Published,
    Verdict,
    batches,
    contract_violations,
    drain,
    hostile_burst,
    observe,
    publish_batch,
    write_odd_files,
    write_rodan3_page,
)
from tests.support.bridge import REPO, bridge_environ
from tests.support.broker import Queues
from tests.support.wait import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.broker]

FUZZ_EXAMPLES = int(os.environ.get("HPC_FUZZ_EXAMPLES", "150"))
FUZZ_SEED = int(os.environ.get("HPC_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
SHRINK = os.environ.get("HPC_FUZZ_SHRINK", "") not in ("", "0")
BATCH = 6


# --- helpers --------------------------------------------------------------------------------------------


def ledger_records(spool: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted((spool / "ledger").glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out.append(data)
    return out


def recorded_job_ids(records: list[dict[str, Any]]) -> list[str]:
    ids: set[str] = set()
    for record in records:
        ids.update(str(j) for j in [record.get("job_id"), *(record.get("job_ids") or [])] if j)
    return sorted(ids)


def live_jobs(job_ids: list[str]) -> set[str]:
    """The ids among ``job_ids`` that Slurm has (held, here)."""
    if not job_ids:
        return set()
    out = subprocess.run(
        ["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", "%i"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return {line.strip() for line in out.stdout.splitlines() if line.strip()}


def cancel_jobs(spool: Path) -> None:
    """scancel every job the spool's ledger records."""
    ids = recorded_job_ids(ledger_records(spool))
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, timeout=60)


def new_queues() -> FuzzQueues:
    tag = uuid.uuid4().hex[:10]
    return FuzzQueues(f"test-{tag}-hpc-jobs", f"test-{tag}-hpc-results", f"test-{tag}-dead", f"test-{tag}-foreign")


def declare_as_rodan(connection: pika.BlockingConnection, queues: FuzzQueues) -> None:
    """The request and reply queues as Rodan declares them, and a foreign queue that must stay empty."""
    channel = connection.channel()
    for name in (queues.request, queues.reply, queues.foreign):
        channel.queue_declare(name)
    channel.close()


def close_quietly(connection: pika.BlockingConnection) -> None:
    """Close a connection a failed test may have left broken (the queues are deleted next, regardless)."""
    try:
        if connection.is_open:
            connection.close()
    except pika.exceptions.AMQPError:
        pass


def delete_queues(broker_url: str, queues: FuzzQueues) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    channel = connection.channel()
    for name in queues.all():
        channel.queue_delete(name)
    connection.close()


def describe_batch(published: Published) -> str:
    lines = [f"  {i}: {s.describe()}" for i, s in enumerate(published.sent)]
    lines += [f"  refused ({why}): [{spec.kind}]" for spec, why in published.refused]
    return "\n".join(lines)


def fail_on(verdict: Verdict, published: Published, where: str) -> None:
    if verdict.violations:
        shown = "\n".join(f"- {v}" for v in verdict.violations[:12])
        more = len(verdict.violations) - 12
        raise AssertionError(
            f"{len(verdict.violations)} contract violation(s) after {where}"
            f"{f' ({more} more)' if more > 0 else ''}:\n{shown}\nthe batch:\n{describe_batch(published)}"
        )


@pytest.fixture
def context(standin: RodanStandin, slurm: None) -> Context:
    """A sample page of each generation, served by the stand-in (its requests are submittable), and
    files that are no PNG or JPEG (an input naming one is refused, or fails in the job); generation
    3's page is a sample zip, a multi-sample zip and a starting model."""
    pages = {
        "old": make_sample_page(standin.uploads_dir, generation="old", height=96, width=96, seed=11),
        "new": make_sample_page(standin.uploads_dir, generation="new", n_layers=2, height=96, width=96, seed=12),
    }
    pages["rodan3"] = write_rodan3_page(standin.uploads_dir, pages["new"])
    return Context(standin.host_port, pages, write_odd_files(standin.uploads_dir))


@pytest.fixture
def quiet_logs() -> Iterator[None]:
    """The in-process bridge logs to a file per pass; the logging set-up is restored afterwards."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


class PassRig:
    """One pass per batch: fresh queues, a fresh spool, the real ``Bridge.check()``."""

    def __init__(self, broker_url: str, standin: RodanStandin, root: Path) -> None:
        self.broker_url = broker_url
        self.standin = standin
        self.root = root
        self.spools: list[Path] = []
        self.stats: Counter[str] = Counter()

    def run(self, specs: list[MessageSpec]) -> None:
        queues = new_queues()
        work = self.root / queues.request
        spool = work / "spool"
        self.spools.append(spool)
        connection = pika.BlockingConnection(pika.URLParameters(self.broker_url))
        published = Published([], [])
        passed = False
        try:
            declare_as_rodan(connection, queues)
            published = publish_batch(connection, queues, specs)
            env = bridge_environ(
                self.broker_url,
                self.standin,
                Queues(queues.request, queues.reply, queues.dead),
                spool,
                HPC_SCHEDULER="slurm",
                HPC_SCHEDULER_ARGS="--hold",
            )
            configure_logging(log_file=work / "bridge.log")
            try:
                status = Bridge(load_config(environ=env)).check()
            except BaseException:
                print(f"check() raised; HPC_FUZZ_SEED={FUZZ_SEED}; the batch:\n{describe_batch(published)}")
                raise
            assert status == 0, f"check() returned {status}; the batch:\n{describe_batch(published)}"
            records = ledger_records(spool)
            seen = observe(connection, queues, records, live_jobs(recorded_job_ids(records)))
            verdict = contract_violations(published.sent, seen, queues.reply)
            fail_on(verdict, published, f"one pass (HPC_FUZZ_SEED={FUZZ_SEED})")
            self.stats.update(verdict.outcomes)
            self.stats["messages"] += len(published.sent)
            self.stats["refused by pika or the broker"] += len(published.refused)
            self.stats.update(f"kind {s.spec.kind.split('+')[0].split(':')[0]}" for s in published.sent)
            passed = True
        finally:
            cancel_jobs(spool)
            close_quietly(connection)
            delete_queues(self.broker_url, queues)
            if passed:
                shutil.rmtree(work, ignore_errors=True)


# --- the fuzz -----------------------------------------------------------------------------------------


@pytest.mark.slow  # a sweep of random messages
@pytest.mark.timeout(max(900, 600 + FUZZ_EXAMPLES))  # the full run takes longer than the suite's 900 s
def test_fuzzed_messages_through_the_real_pass(
    broker_url: str, standin: RodanStandin, context: Context, tmp_path: Path, quiet_logs: None
) -> None:
    rig = PassRig(broker_url, standin, tmp_path)
    print(f"\nHPC_FUZZ_SEED={FUZZ_SEED} HPC_FUZZ_EXAMPLES={FUZZ_EXAMPLES}")
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if SHRINK else [])
    started = time.monotonic()

    @seed(FUZZ_SEED)
    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
    )
    @given(batch=batches(context, max_size=BATCH))
    def one_pass(batch: list[MessageSpec]) -> None:
        rig.stats["passes"] += 1
        rig.run(batch)
        if rig.stats["passes"] % 1000 == 0:
            print(f"{rig.stats['passes']} passes, {time.monotonic() - started:.0f} s", flush=True)

    try:
        one_pass()
    finally:
        for spool in rig.spools:
            cancel_jobs(spool)
    elapsed = time.monotonic() - started
    print(f"fuzz through the pass: {dict(sorted(rig.stats.items()))} in {elapsed:.0f} s")
    assert rig.stats["passes"] >= FUZZ_EXAMPLES
    # The generators reach every outcome, not only the validator's refusals.
    if FUZZ_EXAMPLES >= 100:
        for outcome in ("submitted", "error reply", "dead-lettered only"):
            assert rig.stats[outcome] >= 3, (outcome, dict(rig.stats))


def test_a_valid_request_with_a_bad_reply_to_is_dead_lettered_not_submitted(
    broker_url: str, standin: RodanStandin, context: Context, tmp_path: Path, quiet_logs: None
) -> None:
    """The NEW rule, pinned with fixed messages: ``reply_to`` other than ``HPC_REPLY_QUEUE`` (the request
    queue, the dead-letter queue, another queue, one that does not exist, a near-miss spelling) gets
    no reply and no job, only a dead-letter copy; a correlation id that is not UTF-8 likewise."""
    body = json.dumps({"inputs": context.pages["new"], "settings": {"CPUs": 1, "Maximum memory (MB)": 4096}})
    specs = [
        MessageSpec(f"reply_to:{target}", body.encode(), reply_to=Prop(target))
        for target in ("request", "dead", "foreign", "absent", "reply+newline", "reply-fullwidth", "reply-utf16")
    ]
    specs.append(MessageSpec("correlation_id:not-utf8", body.encode(), corr=Corr("literal", b"\xff\xfe")))
    specs.append(MessageSpec("rodan", body.encode()))  # the control: submitted
    PassRig(broker_url, standin, tmp_path).run(specs)


# --- the daemon ---------------------------------------------------------------------------------------


def test_daemon_survives_a_hostile_burst_and_submits_the_valid_requests(
    broker_url: str, standin: RodanStandin, context: Context, tmp_path: Path
) -> None:
    queues = new_queues()
    spool = tmp_path / "spool"
    log = tmp_path / "bridge.log"
    env = bridge_environ(
        broker_url,
        standin,
        Queues(queues.request, queues.reply, queues.dead),
        spool,
        HPC_LOG_FILE=str(log),
        HPC_SCHEDULER="slurm",
        HPC_SCHEDULER_ARGS="--hold",
    )
    full = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "RODAN_", "HPC_"))}
    full.update(env)
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    declare_as_rodan(connection, queues)
    output = (tmp_path / "daemon.out").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bridge", "run"], env=full, cwd=REPO, stdout=output, stderr=subprocess.STDOUT
    )

    def tail() -> str:
        text = (tmp_path / "daemon.out").read_text(errors="replace")
        return text[-4000:]

    def events(name: str) -> list[dict[str, Any]]:
        if not log.exists():
            return []
        lines = [json.loads(line) for line in log.read_text(errors="replace").splitlines() if line.startswith("{")]
        return [e for e in lines if e.get("event") == name]

    def alive(what: str) -> Callable[[], Any]:
        def check() -> Any:
            if proc.poll() is not None:
                raise AssertionError(f"the daemon exited ({proc.returncode}) while waiting for {what}:\n{tail()}")
            return True

        return check

    replies: list[Delivery] = []
    try:
        wait_until(lambda: alive("connect")() and events("broker_connected"), 60, 0.2, "the daemon to connect")
        burst = hostile_burst(context)
        small = {"CPUs": 1, "Maximum memory (MB)": 4096, "Maximum time (D-HH:MM)": "0-00:15"}
        valid = [
            MessageSpec("valid", json.dumps({"inputs": context.pages[g], "settings": small}).encode())
            for g in ("new", "old", "new")
        ]
        sentinel = MessageSpec(
            "sentinel", b"the last message: not JSON", corr=Corr("literal", f"sentinel-{uuid.uuid4()}")
        )
        published = publish_batch(connection, queues, [*burst, *valid, sentinel])
        assert len(published.sent) >= 190, describe_batch(published)
        sentinel_id = published.sent[-1].correlation_id
        assert published.sent[-1].spec.kind == "sentinel"

        def sentinel_answered() -> bool:
            alive("the sentinel's reply")()
            replies.extend(drain(connection, queues.reply))
            return any(r.correlation_id == sentinel_id for r in replies)

        # The queue is read in order and nothing is deferred: once the last message is answered,
        # every message before it has had its outcome.
        wait_until(sentinel_answered, 600, 1, "the reply to the last message")
        records = ledger_records(spool)
        seen = observe(connection, queues, records, live_jobs(recorded_job_ids(records)), replies)
        verdict = contract_violations(published.sent, seen, queues.reply)
        fail_on(verdict, published, "the daemon's burst")
        by_id = {r["correlation_id"]: r for r in records}
        for sent in published.sent[-4:-1]:
            record = by_id.get(sent.correlation_id) or {}
            assert record.get("state") == "submitted", (sent.describe(), record)
            assert str(record.get("job_id")) in seen.jobs, record
        assert proc.poll() is None, f"the daemon exited on its own:\n{tail()}"
        print(f"\ndaemon burst: {len(published.sent)} messages, {dict(verdict.outcomes)}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            status = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            status = proc.wait(timeout=10)
        output.close()
        cancel_jobs(spool)
        close_quietly(connection)
        delete_queues(broker_url, queues)
    assert status == 0, f"the daemon's exit status on SIGTERM: {status}\n{tail()}"
