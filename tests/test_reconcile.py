"""Reconciliation decisions, with a scripted scheduler (the real one is covered in test_e2e_slurm)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from bridge.config import load_config
from bridge.continuation_record import Continuation, write_continuation
from bridge.errors import SchedulerUnavailable
from bridge.ledger import Ledger, RequestRecord, RequestState
from bridge.reconcile import Reconciler
from bridge.replies import ReplyBox
from bridge.schedulers import JobInfo, JobSpec, JobState, Scheduler
from bridge.spool import Spool, atomic_write_json


class ScriptedScheduler(Scheduler):
    name = "slurm"
    display_name = "Slurm"
    template_name = "slurm.sh"
    directive_prefix = "#SBATCH"

    def __init__(self) -> None:
        super().__init__()
        self.infos: dict[str, JobInfo] = {}
        self.names: dict[str, list[str]] = {}
        self.cancelled: list[str] = []
        self.down = False

    def directives(self, spec: JobSpec) -> list[str]:
        return []

    def submit(self, script: Path, spec: JobSpec) -> str:
        raise AssertionError("reconciliation never submits")

    def query(self, job_ids: Sequence[str]) -> Mapping[str, JobInfo]:
        if self.down:
            raise SchedulerUnavailable("slurmctld down")
        return {j: self.infos[j] for j in job_ids if j in self.infos}

    def find_by_name(self, name: str) -> list[str]:
        return self.names.get(name, [])

    def cancel(self, job_id: str) -> None:
        self.cancelled.append(job_id)


@pytest.fixture
def world(tmp_path: Path):
    config = load_config(
        environ={
            "RABBITMQ_URL": "amqp://g:g@127.0.0.1/%2F",
            "RODAN_HOST": "r",
            "RODAN_USER": "u@x.org",
            "RODAN_PASSWORD": "p",
            "HPC_SPOOL_DIR": str(tmp_path),
            "HPC_MISSING_TIMEOUT": "60",
        }
    )
    spool = Spool(tmp_path).ensure()
    ledger = Ledger(spool)
    scheduler = ScriptedScheduler()
    replies = ReplyBox(spool)
    return Reconciler(config, spool, ledger, scheduler, replies), ledger, scheduler, replies


def submitted(ledger: Ledger, corr: str, job_id: str) -> RequestRecord:
    record = RequestRecord(
        correlation_id=corr,
        key=corr,
        reply_to="hpc-results",
        state=RequestState.SUBMITTED,
        job_id=job_id,
        job_name=f"rodan-{corr}",
        time_limit="0-06:00",
        memory_mb=8000,
    )
    ledger.save(record)
    return record


def staged_errors(replies: ReplyBox) -> dict[str, str]:
    return {e.correlation_id: json.loads(e.body_path.read_bytes())["error"] for e in replies.staged()}


@pytest.mark.parametrize(
    ("native", "state", "fragment"),
    [
        ("TIMEOUT", JobState.TIMEOUT, "TIMEOUT after 0-06:00"),
        ("OUT_OF_MEMORY", JobState.OUT_OF_MEMORY, "OUT_OF_MEMORY with 8000 MB"),
        ("CANCELLED by 1000", JobState.CANCELLED, "CANCELLED"),
        ("FAILED", JobState.FAILED, "FAILED, exit code 1:0"),
        ("NODE_FAIL", JobState.NODE_FAIL, "compute node failed"),
        ("PREEMPTED", JobState.PREEMPTED, "preempted"),
        ("BOOT_FAIL", JobState.BOOT_FAIL, "failed to boot"),
        ("DEADLINE", JobState.DEADLINE, "deadline"),
        ("COMPLETED", JobState.COMPLETED, "finished without sending its models"),
    ],
)
def test_every_terminal_state_gets_one_explained_error(world, native, state, fragment):
    reconciler, ledger, scheduler, replies = world
    submitted(ledger, "c1", "7")
    scheduler.infos["7"] = JobInfo("7", state, native, exit_code="1:0", source="accounting")
    assert reconciler.reconcile() == 1
    error = staged_errors(replies)["c1"]
    assert fragment in error and "Slurm job 7" in error
    # staged once: a second pass before the outbox is flushed stages nothing new
    assert reconciler.reconcile() == 0 and len(replies.staged()) == 1


@pytest.mark.parametrize("state", [JobState.PENDING, JobState.RUNNING, JobState.REQUEUED, JobState.SUSPENDED])
def test_live_jobs_are_left_alone(world, state):
    reconciler, ledger, scheduler, replies = world
    submitted(ledger, "c1", "7")
    scheduler.infos["7"] = JobInfo("7", state, state.value)
    assert reconciler.reconcile() == 0 and replies.staged() == []
    assert ledger.get("c1").job_state == state.value


def test_the_ledger_keeps_the_job_state_not_the_schedulers_own_word(world):
    reconciler, ledger, scheduler, replies = world
    submitted(ledger, "c1", "7")
    for native, state in [("hqw", JobState.PENDING), ("Rr", JobState.RUNNING), ("COMPLETING", JobState.RUNNING)]:
        scheduler.infos["7"] = JobInfo("7", state, native, source="queue")
        assert reconciler.reconcile() == 0
        assert ledger.get("c1").job_state == state.value


def test_a_vanished_job_is_judged_only_after_the_timeout(world):
    reconciler, ledger, scheduler, replies = world
    record = submitted(ledger, "c1", "7")
    assert reconciler.reconcile() == 0 and replies.staged() == []
    assert ledger.get("c1").missing_since > 0
    record = ledger.get("c1")
    record.missing_since -= 61
    ledger.save(record)
    assert reconciler.reconcile() == 1
    assert "vanished" in staged_errors(replies)["c1"]


def test_reappearing_job_resets_the_missing_clock(world):
    reconciler, ledger, scheduler, replies = world
    submitted(ledger, "c1", "7")
    reconciler.reconcile()
    scheduler.infos["7"] = JobInfo("7", JobState.RUNNING, "RUNNING")
    reconciler.reconcile()
    assert ledger.get("c1").missing_since == 0.0


def test_replied_requests_are_settled_and_not_judged(world):
    reconciler, ledger, scheduler, replies = world
    submitted(ledger, "c1", "7")
    scheduler.infos["7"] = JobInfo("7", JobState.COMPLETED, "COMPLETED")
    atomic_write_json(replies.spool.reply_marker("c1"), {"outcome": "ok", "published_at": 1.0})
    assert reconciler.reconcile() == 0 and replies.staged() == []
    assert ledger.get("c1").state is RequestState.REPLIED and ledger.get("c1").outcome == "ok"


def test_a_reply_waiting_in_the_outbox_is_not_replaced_by_an_error(world):
    reconciler, ledger, scheduler, replies = world
    submitted(ledger, "c1", "7")
    scheduler.infos["7"] = JobInfo("7", JobState.COMPLETED, "COMPLETED")
    replies.stage("c1", "hpc-results", b'{"Model 0": "AAAA"}', origin="worker")
    assert reconciler.reconcile() == 0
    assert [e.origin for e in replies.staged()] == ["worker"]


def test_scheduler_down_judges_nothing(world):
    reconciler, ledger, scheduler, replies = world
    submitted(ledger, "c1", "7")
    scheduler.down = True
    assert reconciler.reconcile() == 0 and replies.staged() == []
    assert ledger.get("c1").missing_since == 0.0, "an unreachable scheduler is not a missing job"


def test_a_worker_staged_reply_is_the_workers_until_its_job_ends(world):
    """The worker may be publishing its staged reply right now: the bridge must not race it."""
    reconciler, ledger, scheduler, replies = world
    submitted(ledger, "c1", "7")
    entry = replies.stage("c1", "hpc-results", b'{"Model 0": "AAAA"}', origin="worker")
    assert not reconciler.may_publish(entry), "job state unknown yet"
    scheduler.infos["7"] = JobInfo("7", JobState.RUNNING, "RUNNING")
    reconciler.reconcile()
    assert not reconciler.may_publish(entry)
    scheduler.infos["7"] = JobInfo("7", JobState.COMPLETED, "COMPLETED")
    reconciler.reconcile()
    assert reconciler.may_publish(entry)
    assert [e.origin for e in replies.staged()] == ["worker"], "no error reply staged beside the models"


def test_bridge_staged_replies_and_orphans_are_always_publishable(world):
    reconciler, ledger, scheduler, replies = world
    assert reconciler.may_publish(replies.stage("c9", "q", b'{"error": "x"}', origin="bridge"))
    assert reconciler.may_publish(replies.stage("c8", "q", b'{"error": "x"}', origin="worker")), "no ledger record"


# --- continuation past the time limit ----------------------------------------------------


def test_a_requeued_job_is_the_same_request_and_its_continuations_are_counted(world):
    reconciler, ledger, scheduler, replies = world
    submitted(ledger, "c1", "7")
    write_continuation(reconciler.spool, "c1", Continuation(count=1, previous_job_id="7", job_id="7"))
    for state in (JobState.REQUEUED, JobState.PENDING, JobState.RUNNING):
        scheduler.infos["7"] = JobInfo("7", state, state.value)
        assert reconciler.reconcile() == 0
    record = ledger.get("c1")
    assert replies.staged() == [] and record.continuations == 1 and record.job_id == "7"
    # the last run then ends without replying: exactly one error reply, for job 7
    scheduler.infos["7"] = JobInfo("7", JobState.FAILED, "FAILED", exit_code="1:0", source="accounting")
    assert reconciler.reconcile() == 1 and "Slurm job 7" in staged_errors(replies)["c1"]


def test_a_grid_engine_successor_from_the_continuation_record_is_followed(world):
    reconciler, ledger, scheduler, replies = world
    submitted(ledger, "c1", "10")
    scheduler.infos["10"] = JobInfo("10", JobState.COMPLETED, "exit 0", source="accounting")
    scheduler.infos["11"] = JobInfo("11", JobState.PENDING, "hqw")
    write_continuation(reconciler.spool, "c1", Continuation(count=1, previous_job_id="10", job_id="11"))
    assert reconciler.reconcile() == 0 and replies.staged() == []
    record = ledger.get("c1")
    assert (record.job_id, record.job_ids, record.continuations) == ("11", ["10", "11"], 1)
    assert not record.job_ended
    # a second link: its record arrives while 11 is still being watched
    scheduler.infos["11"] = JobInfo("11", JobState.TIMEOUT, "failed 37", source="accounting")
    scheduler.infos["12"] = JobInfo("12", JobState.RUNNING, "r")
    write_continuation(reconciler.spool, "c1", Continuation(count=2, previous_job_id="11", job_id="12"))
    assert reconciler.reconcile() == 0 and replies.staged() == []
    assert ledger.get("c1").job_ids == ["10", "11", "12"]
    # the last job replies itself: the worker's staged reply may go out once it has ended
    scheduler.infos["12"] = JobInfo("12", JobState.COMPLETED, "exit 0", source="accounting")
    entry = replies.stage("c1", "hpc-results", b'{"ok": 1}', origin="worker")
    assert not reconciler.may_publish(entry)
    assert reconciler.reconcile() == 0
    assert reconciler.may_publish(entry) and [e.origin for e in replies.staged()] == ["worker"]


def test_an_unrecorded_successor_is_found_by_job_name(world):
    """The job died between submitting its successor and writing the record."""
    reconciler, ledger, scheduler, replies = world
    submitted(ledger, "c1", "10")
    scheduler.infos["10"] = JobInfo("10", JobState.TIMEOUT, "failed 37", source="accounting")
    scheduler.infos["13"] = JobInfo("13", JobState.PENDING, "hqw")
    scheduler.names["rodan-c1"] = ["9", "10", "13"]  # 9: an older job of that name is not a successor
    assert reconciler.reconcile() == 0 and replies.staged() == []
    record = ledger.get("c1")
    assert record.job_id == "13" and record.job_ids == ["10", "13"] and record.continuations == 1


def test_no_successor_means_one_error_reply(world):
    reconciler, ledger, scheduler, replies = world
    submitted(ledger, "c1", "10")
    scheduler.infos["10"] = JobInfo("10", JobState.TIMEOUT, "TIMEOUT", source="accounting")
    scheduler.names["rodan-c1"] = ["10"]
    assert reconciler.reconcile() == 1
    assert "could checkpoint and continue" in staged_errors(replies)["c1"]


def test_a_job_in_an_error_state_is_deleted_and_answered(world):
    reconciler, ledger, scheduler, replies = world
    submitted(ledger, "c1", "21")
    scheduler.infos["21"] = JobInfo("21", JobState.ERROR, "Eqw", source="queue")
    assert reconciler.reconcile() == 1
    assert scheduler.cancelled == ["21"]
    assert "error state" in staged_errors(replies)["c1"]


def test_marking_a_reply_deletes_the_parameter_file(world):
    reconciler, ledger, scheduler, replies = world
    submitted(ledger, "c1", "7")
    params = reconciler.spool.params_path("c1")
    atomic_write_json(params, {"broker": {"url": "amqp://u:secret@h/%2F"}})
    entry = replies.stage("c1", "hpc-results", b"{}", origin="bridge")
    replies.publish_staged(_NullChannel(), entry)
    assert reconciler.mark_replied() == 1
    assert not params.exists() and ledger.get("c1").state is RequestState.REPLIED


class _NullChannel:
    """A channel whose publishes are confirmed at once."""

    def basic_publish(self, *args: object, **kwargs: object) -> None:
        return None


# --- requests whose message the broker lost --------------------------------------------------------


def waiting(ledger: Ledger, corr: str, state: RequestState, updated_s_ago: float, spool: Spool) -> RequestRecord:
    """A request taken but not submitted (deferred), last seen ``updated_s_ago`` seconds ago."""
    record = RequestRecord(
        correlation_id=corr, key=corr, reply_to="hpc-results", state=state, job_name=f"rodan-{corr}", attempts=2
    )
    ledger.save(record)
    record.updated_at -= updated_s_ago
    atomic_write_json(spool.root / "ledger" / f"{corr}.json", record.to_json())
    return record


def test_a_request_whose_message_is_gone_gets_one_error_reply(world):
    rec, ledger, scheduler, replies = world
    spool = rec.spool
    waiting(ledger, "lost", RequestState.RECEIVED, 120, spool)
    waiting(ledger, "recent", RequestState.RECEIVED, 10, spool)  # came back 10 s ago: still in the queue
    waiting(ledger, "in-queue", RequestState.RECEIVED, 120, spool)  # stale, but the drain just saw it
    waiting(ledger, "submitted-then-lost", RequestState.SUBMITTING, 120, spool)
    scheduler.names["rodan-submitted-then-lost"] = ["77"]  # its job exists: adopted, not answered
    spool.params_path("lost").write_text('{"rodan": {"token": "t"}}')
    assert rec.judge_lost(seen={"in-queue"}) == 1
    errors = staged_errors(replies)
    assert list(errors) == ["lost"]
    assert errors["lost"].startswith("the request was lost from the broker's queue before it could be submitted")
    assert "run the job again" in errors["lost"]
    assert ledger.get("lost").state is RequestState.REJECTED and not spool.params_path("lost").exists()
    assert ledger.get("recent").state is RequestState.RECEIVED and ledger.get("in-queue").state is RequestState.RECEIVED
    adopted = ledger.get("submitted-then-lost")
    assert adopted.state is RequestState.SUBMITTED and adopted.job_id == "77"
    assert rec.judge_lost(seen={"in-queue"}) == 0  # "lost" was answered once: never again


def test_lost_requests_are_not_judged_while_the_scheduler_cannot_say_whether_a_job_exists(world):
    rec, ledger, scheduler, replies = world
    waiting(ledger, "maybe", RequestState.SUBMITTING, 120, rec.spool)
    scheduler.find_by_name = lambda name: (_ for _ in ()).throw(SchedulerUnavailable("slurmctld down"))
    assert rec.judge_lost(seen=set()) == 0 and not replies.staged()
    assert ledger.get("maybe").state is RequestState.SUBMITTING
