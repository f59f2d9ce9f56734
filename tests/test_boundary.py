"""The pass's boundary: no message, and no defect met while handling one, stops the bridge.

Each test drives the real pass (``hpc-bridge check`` / ``run`` as cron and systemd run them, or
``Bridge.check()`` in-process where a defect has to be injected) against the real broker, the
Rodan stand-in and the dev Slurm / Grid Engine, and asserts on what Rodan would see: the replies,
the dead letters, the queue's depth, the jobs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pika
import pytest
import structlog

from bridge.config import load_config
from bridge.intake import Intake, text_property
from bridge.ledger import Ledger, RequestRecord, RequestState
from bridge.ops.prune import prune
from bridge.protocol import MAX_REASON_CHARS
from bridge.replies import ReplyBox
from bridge.runner import Bridge
from bridge.spool import Spool
from tests.support.bridge import FAST_SETTINGS, bridge_environ, job_parameters_json, run_bridge
from tests.support.cluster import Cluster, cancel_ledger_jobs, cancel_spool_jobs, jobs_named
from tests.support.daemon import Daemon
from tests.support.wait import wait_until


def events(log: Path, name: str) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [e for e in lines if e["event"] == name]


def ledger(spool: Path, corr: str) -> dict[str, Any]:
    return json.loads((spool / "ledger" / f"{corr}.json").read_text())


@pytest.fixture
def env(broker_url, standin, queues, tmp_path):
    spool = tmp_path / "spool"
    environ = bridge_environ(
        broker_url,
        standin,
        queues,
        spool,
        HPC_LOG_FILE=str(tmp_path / "bridge.log"),
        HPC_SCHEDULER_ARGS="--hold",  # a job that is submitted never runs: these tests are about intake
        HPC_WORKER_PYTHON="/bin/true",
    )
    yield environ
    cancel_spool_jobs(spool)


def test_a_defect_met_for_one_message_is_one_error_reply_and_the_next_message_is_served(
    env, rodan, queues, sample_inputs, slurm, monkeypatch
):
    page = sample_inputs("new", n_layers=1)
    first = rodan.publish_request(page, FAST_SETTINGS)
    second = rodan.publish_request(page, FAST_SETTINGS)
    original = Intake.job_spec
    calls: list[str] = []

    def job_spec_with_a_defect(self: Intake, request: Any, key: str) -> Any:
        calls.append(key)
        if len(calls) == 1:
            raise KeyError("a defect that nobody expected")
        return original(self, request, key)

    monkeypatch.setattr(Intake, "job_spec", job_spec_with_a_defect)
    bridge = Bridge(load_config(environ=env))
    with structlog.testing.capture_logs() as logs:
        assert bridge.check() == 0
    crashed = [e for e in logs if e["event"] == "request_crashed"]
    assert len(crashed) == 1 and crashed[0]["exc_info"] is True and "KeyError" in crashed[0]["error"]
    replies = rodan.drain()
    assert [c for c, _b, _h in replies] == [first]
    error = json.loads(replies[0][1])["error"]
    assert error.startswith("internal error in the HPC bridge while handling this request (KeyError)")
    assert [c for c, _b, _h in rodan.drain(queues.dead)] == [first]
    assert rodan.depth(queues.request) == 0
    spool = Path(env["HPC_SPOOL_DIR"])
    assert ledger(spool, second)["state"] == "submitted" and jobs_named(f"rodan-{second}")
    assert ledger(spool, first)["state"] == "rejected" and ledger(spool, first)["deliveries"] == 0


def test_a_message_that_kills_the_bridge_is_quarantined_after_the_poison_limit(
    env, rodan, queues, sample_inputs, slurm
):
    """A request whose handling kills the process (an OOM, a segfault: here the test's kill switch
    at ``before_submit``) comes back at the head of the queue after every restart. After
    HPC_POISON_LIMIT such deliveries it is answered and set aside without being handled again."""
    corr = rodan.publish_request(sample_inputs("new", n_layers=1), FAST_SETTINGS)
    behind = rodan.publish_request(sample_inputs("new", n_layers=1, seed=3), FAST_SETTINGS)
    spool = Path(env["HPC_SPOOL_DIR"])
    for n in (1, 2, 3):
        killed = run_bridge({**env, "HPC_POISON_LIMIT": "3", "HPC_FAULT_KILL": f"before_submit:{1}"}, "check")
        assert killed.returncode == -9, killed.stderr[-2000:]
        assert ledger(spool, corr)["deliveries"] == n
    done = run_bridge({**env, "HPC_POISON_LIMIT": "3"}, "check")
    assert done.returncode == 0, done.stderr[-2000:]
    replies = {c: json.loads(b) for c, b, _h in rodan.drain()}
    assert list(replies) == [corr]
    assert "stopped 3 times while handling this request" in replies[corr]["error"]
    assert [c for c, _b, _h in rodan.drain(queues.dead)] == [corr]
    assert jobs_named(f"rodan-{corr}") == [], "quarantined before its submit: no job"
    assert ledger(spool, behind)["state"] == "submitted", "the request behind it is served"
    assert events(Path(env["HPC_LOG_FILE"]), "request_quarantined")


def test_replies_go_only_to_the_configured_reply_queue(env, rodan, queues, broker_url, sample_inputs):
    other = f"{queues.reply}-someone-else"
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    connection.channel().queue_declare(other)
    page = sample_inputs("new", n_layers=1)
    try:
        targets = [other, queues.request, queues.dead, "a-queue-nobody-declared"]
        sent = [rodan.publish_request(page, FAST_SETTINGS, reply_to=target) for target in targets]
        result = run_bridge(env, "check")
        assert result.returncode == 0, result.stderr[-2000:]
        assert rodan.drain() == [] and rodan.drain(other) == []
        dead = rodan.drain(queues.dead)
        assert sorted(c for c, _b, _h in dead) == sorted(sent), "each is dead-lettered, once, without a reply"
        assert all("is not Rodan's reply queue (HPC_REPLY_QUEUE)" in h["x-hpc-bridge-reason"] for _c, _b, h in dead)
        assert rodan.depth(queues.request) == 0
        assert not list((Path(env["HPC_SPOOL_DIR"]) / "jobs").iterdir()), "nothing was submitted"
    finally:
        connection.channel().queue_delete(other)
        connection.close()


def test_reply_queue_patterns(make_config):
    config = make_config(HPC_REPLY_QUEUE="hpc-results, rodan-*-results")
    assert config.reply_queue == "hpc-results"
    assert config.accepts_reply_to("rodan-lab2-results") and config.accepts_reply_to("hpc-results")
    assert not config.accepts_reply_to("hpc-jobs") and not config.accepts_reply_to("hpc-results2")


def test_a_reply_whose_queue_never_appears_expires_and_is_counted(env, queues, tmp_path):
    """Rodan's reply queue is declared by its waiting task: one that does not exist after
    HPC_REPLY_WAIT has nobody waiting on it. The reply leaves the outbox instead of being tried on
    every pass for ever."""
    metrics = tmp_path / "metrics.prom"
    # An hour: the first pass comes long before it, however slow the machine; then an hour passes
    # (the staging time is moved back, rather than a wait).
    environ = {**env, "HPC_REPLY_WAIT": "3600", "HPC_METRICS_FILE": str(metrics)}
    spool = Spool(Path(env["HPC_SPOOL_DIR"])).ensure()
    Ledger(spool).save(RequestRecord("lonely", "lonely", queues.reply, state=RequestState.SUBMITTED, job_id="1"))
    staged = ReplyBox(spool).stage("lonely", queues.reply, b'{"error": "x"}', origin="bridge")
    first = run_bridge(environ, "check")
    assert first.returncode == 0, first.stderr[-2000:]
    assert (spool.outbox_dir / "lonely.json").exists(), "kept while it may still be wanted"
    meta = json.loads(staged.meta_path.read_text())
    staged.meta_path.write_text(json.dumps({**meta, "staged_at": meta["staged_at"] - 3601}))
    second = run_bridge(environ, "check")
    assert second.returncode == 0, second.stderr[-2000:]
    assert not list(spool.outbox_dir.iterdir())
    assert json.loads(spool.reply_marker("lonely").read_text())["outcome"] == "expired"
    log = Path(env["HPC_LOG_FILE"])
    assert [e["correlation_id"] for e in events(log, "reply_expired")] == ["lonely"]
    third = run_bridge(environ, "check")  # marks the record replied, and the metric counts it
    assert third.returncode == 0
    assert ledger(spool.root, "lonely")["outcome"] == "expired"
    assert 'hpc_bridge_requests_total{outcome="reply_expired"} 1' in metrics.read_text()


def test_rejected_messages_publish_their_own_reply_not_the_whole_outbox(env, rodan, queues):
    """Each rejected message used to flush the whole outbox: a staged reply whose queue is gone was
    tried once per rejected message (N junk messages: ~N^2/2 publishes)."""
    spool = Spool(Path(env["HPC_SPOOL_DIR"])).ensure()
    ReplyBox(spool).stage("stuck", queues.reply + "-gone", b'{"error": "x"}', origin="bridge")
    for _ in range(6):
        rodan.publish(b"not json")
    result = run_bridge(env, "check")
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(rodan.drain()) == 6
    tries = events(Path(env["HPC_LOG_FILE"]), "reply_left_in_outbox")
    assert len(tries) == 2, "tried at the start and at the end of the pass, not once per message"


def test_a_pass_takes_at_most_the_drain_batch_then_reconciles(env, rodan, queues):
    for _ in range(5):
        rodan.publish(b"{}")
    result = run_bridge({**env, "HPC_DRAIN_BATCH": "2"}, "check")
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(rodan.drain()) == 2 and rodan.depth(queues.request) == 3
    done = events(Path(env["HPC_LOG_FILE"]), "check_done")
    assert done[-1]["received"] == 2


def test_error_reasons_are_bounded_everywhere(env, rodan, queues):
    body = json.dumps({"inputs": {"x" * 900_000: "/a"}, "settings": {"CPUs": "y" * 50_000}}).encode()
    corr = rodan.publish(body)
    result = run_bridge(env, "check")
    assert result.returncode == 0, result.stderr[-2000:]
    (reply,) = rodan.drain()
    error = json.loads(reply[1])["error"]
    assert error.startswith("invalid request: ") and len(error) <= MAX_REASON_CHARS
    ((_c, _b, headers),) = rodan.drain(queues.dead)
    assert len(headers["x-hpc-bridge-reason"]) <= MAX_REASON_CHARS
    assert len(ledger(Path(env["HPC_SPOOL_DIR"]), corr)["reason"]) <= MAX_REASON_CHARS
    log = Path(env["HPC_LOG_FILE"])
    assert max(len(line) for line in log.read_text().splitlines()) < 4 * MAX_REASON_CHARS


def test_deferral_is_bounded_by_time_not_by_attempts(env, rodan, queues, standin, sample_inputs):
    """A Rodan outage longer than five passes (the old HPC_MAX_ATTEMPTS) is waited out."""
    standin.fail_next(1000, status=503, paths="/api/auth/token/")
    corr = rodan.publish_request(sample_inputs("new", n_layers=1), FAST_SETTINGS)
    for _ in range(7):
        assert run_bridge({**env, "HPC_RODAN_RETRIES": "0"}, "check").returncode == 0
    record = ledger(Path(env["HPC_SPOOL_DIR"]), corr)
    assert record["attempts"] == 7 and record["state"] == "received"
    assert rodan.drain() == [] and rodan.depth(queues.request) == 1


@pytest.mark.parametrize(
    "hold",
    [
        pytest.param(("slurm", "--hold"), marks=pytest.mark.slurm, id="slurm"),
        pytest.param(("gridengine", "-h"), marks=pytest.mark.gridengine, id="gridengine"),
    ],
)
def test_a_job_pending_longer_than_the_limit_is_cancelled_and_answered_with_the_reason(
    hold, env, rodan, sample_inputs, request
):
    name, flag = hold
    request.getfixturevalue(name)
    # 10 s: two passes (a few seconds each on 2 busy cores) fit well inside it.
    environ = {**env, "HPC_SCHEDULER": name, "HPC_SCHEDULER_ARGS": flag, "HPC_MAX_PENDING": "10"}
    spool = Path(env["HPC_SPOOL_DIR"])
    try:
        corr = rodan.publish_request(sample_inputs("new", n_layers=1), FAST_SETTINGS)
        assert run_bridge(environ, "check").returncode == 0
        record = ledger(spool, corr)
        assert record["state"] == "submitted"
        assert run_bridge(environ, "check").returncode == 0  # has seen it PENDING: the clock runs
        pending_since = ledger(spool, corr)["pending_since"]
        assert pending_since > 0 and rodan.drain() == []
        time.sleep(max(0.0, pending_since + 10.1 - time.time()))
        wait_until(lambda: run_bridge(environ, "check").returncode == 0 and rodan.drain(), 60, 1, "the reply")
    finally:
        cancel_ledger_jobs(spool, Cluster(name))
    record = ledger(spool, corr)
    assert record["state"] == "replied" and record["outcome"] == "error"
    assert "waited" in record["reason"] and "without starting" in record["reason"]
    assert "HPC_MAX_PENDING" in record["reason"]
    if name == "slurm":
        assert "JobHeldUser" in record["reason"], record["reason"]
    assert events(Path(env["HPC_LOG_FILE"]), "job_pending_too_long")


def test_the_daemon_outlives_a_pass_that_fails_and_keeps_answering(env, rodan, queues, tmp_path, slurm):
    spool = Path(env["HPC_SPOOL_DIR"])
    (spool / "ledger").mkdir(parents=True)
    # A record no version of the bridge writes (job ids must be strings): reconciliation trips on it.
    (spool / "ledger" / "odd.json").write_text(
        json.dumps({"correlation_id": "odd", "key": "odd", "reply_to": "r", "state": "submitted", "job_id": 7})
    )
    daemon = Daemon(env, Path(env["HPC_LOG_FILE"]), spool)
    try:
        wait_until(lambda: daemon.events("pass_failed"), 60, 0.2, "a failed pass")
        corr = rodan.publish(b"[]")
        wait_until(lambda: rodan.drain(), 60, 0.5, "the reply after failed passes")
        assert daemon.proc.poll() is None, "the daemon is still running"
        assert daemon.state(corr) == "rejected"
    finally:
        assert daemon.stop() == 0
    failed = daemon.events("pass_failed")
    assert failed and "exception" in failed[0] and "Traceback" in failed[0]["exception"]


def test_message_properties_are_taken_apart_defensively():
    assert text_property(b"\xff\xfe") is None
    assert text_property(b"abc") == "abc"
    assert text_property("") is None and text_property(None) is None and text_property(12) is None
    assert text_property("x" * 256) is None and text_property("x" * 255) == "x" * 255


def test_error_replies_do_not_show_the_installation(make_config, tmp_path):
    config = make_config(HPC_SLURM_ACCOUNT="def-secretlab", HPC_SLURM_PARTITION="gpu-a100")
    text = (
        f"Invalid account def-secretlab on partition gpu-a100: see {config.spool_dir}/jobs/x/job.sh "
        f"and {Path.home()}/notes (gpu-a100x stays)"
    )
    public = config.public(text)
    assert "def-secretlab" not in public and str(config.spool_dir) not in public and str(Path.home()) not in public
    assert "<account>" in public and "<partition>" in public and "<spool>/jobs/x/job.sh" in public
    assert "gpu-a100x stays" in public


def test_prune_forgets_long_settled_requests_only(make_config, tmp_path):
    config = make_config(HPC_RETENTION_DAYS="30")
    spool = Spool(config.spool_dir).ensure()
    book = Ledger(spool)
    now = time.time()
    old = now - 31 * 86400
    records = {
        "old-replied": RequestRecord("old-replied", "old-replied", "q", state=RequestState.REPLIED, replied_at=old),
        "old-rejected": RequestRecord(
            "old-rejected", "old-rejected", "q", state=RequestState.REJECTED, dead_lettered=True
        ),
        "new-replied": RequestRecord("new-replied", "new-replied", "q", state=RequestState.REPLIED, replied_at=now),
        "old-open": RequestRecord("old-open", "old-open", "q", state=RequestState.SUBMITTED, created_at=old),
    }
    runs = spool.root / "runs"
    for key, record in records.items():
        book.save(record)
        spool.job_dir(key).mkdir(parents=True)
        (spool.job_dir(key) / "job.sh").write_text("#!/bin/bash\n")
        (runs / f"20261001-120000-{key}").mkdir(parents=True)
        spool.reply_marker(key).write_text("{}")
    # A rejected record's age is its last update: make it old on disk.
    path = book.path("old-rejected")
    data = json.loads(path.read_text())
    data["updated_at"] = old
    path.write_text(json.dumps(data))

    dry = prune(config, spool, book, dry_run=True, now=now)
    assert sorted(dry.requests) == ["old-rejected", "old-replied"]
    assert book.path("old-replied").exists(), "a dry run deletes nothing"
    report = prune(config, spool, book, now=now)
    assert sorted(report.requests) == ["old-rejected", "old-replied"]
    for key in ("old-rejected", "old-replied"):
        assert not book.path(key).exists() and not spool.job_dir(key).exists()
        assert not (runs / f"20261001-120000-{key}").exists() and not spool.reply_marker(key).exists()
    for key in ("new-replied", "old-open"):
        assert book.path(key).exists() and spool.job_dir(key).exists() and (runs / f"20261001-120000-{key}").exists()


def test_prune_command(env, tmp_path):
    spool = Spool(Path(env["HPC_SPOOL_DIR"])).ensure()
    Ledger(spool).save(
        RequestRecord("gone", "gone", "q", state=RequestState.REPLIED, replied_at=time.time() - 9 * 86400)
    )
    dry = run_bridge(env, "prune", "--dry-run", "--older-than", "7")
    assert dry.returncode == 0 and "would delete" in dry.stdout and (spool.ledger_dir / "gone.json").exists()
    done = run_bridge(env, "prune", "--older-than", "7")
    assert done.returncode == 0 and "1 settled request(s)" in done.stdout
    assert not (spool.ledger_dir / "gone.json").exists()


def test_the_workers_error_replies_do_not_show_the_installation(tmp_path):
    from bridge.handoff import JobParameters
    from worker.job import _describe

    spool = tmp_path / "spool"
    params = JobParameters.from_json(job_parameters_json(spool=str(spool)))
    text = _describe(FileNotFoundError(2, "No such file", str(spool / "runs" / "x" / "inputs" / "Image")), params)
    assert str(spool) not in text and "<runs>/x/inputs/Image" in text, text
