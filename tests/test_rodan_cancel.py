"""The bridge's side of a Rodan 3 Cancel or Retry (bridge/rodan_cancel.py), decided with a scripted
scheduler and a scripted Rodan. The real Rodan 3.1.0, Slurm and broker: tests/test_rodan3_cancel.py."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from bridge.config import load_config
from bridge.errors import TransientError
from bridge.ledger import Ledger, RequestRecord, RequestState
from bridge.reconcile import Reconciler
from bridge.replies import ReplyBox
from bridge.rodan_cancel import RodanCancels, attempt_of, runjob_of
from bridge.schedulers import JobInfo, JobState
from bridge.spool import Spool, atomic_write_json
from tests.test_reconcile import ScriptedScheduler

RUNJOB = str(uuid.UUID(int=0x1234))


class ScriptedRodan:
    """``runjob_status`` answers from a table (None: 404); ``down`` raises as an unreachable Rodan."""

    def __init__(self) -> None:
        self.status: dict[str, int | None] = {}
        self.asked: list[str] = []
        self.down = False

    def runjob_status(self, runjob: str) -> int | None:
        self.asked.append(runjob)
        if self.down:
            raise TransientError("Rodan at http://r unreachable: ConnectionError")
        return self.status.get(runjob)


@pytest.fixture
def world(tmp_path: Path):
    config = load_config(
        environ={
            "RABBITMQ_URL": "amqp://g:g@127.0.0.1/%2F",
            "RODAN_HOST": "r",
            "RODAN_USER": "u@x.org",
            "RODAN_PASSWORD": "p",
            "HPC_SPOOL_DIR": str(tmp_path / "spool"),
            "HPC_RODAN_CHECK_INTERVAL": "60",
        }
    )
    spool = Spool(tmp_path / "spool").ensure()
    ledger = Ledger(spool)
    scheduler = ScriptedScheduler()
    replies = ReplyBox(spool)
    rodan = ScriptedRodan()
    cancels = RodanCancels(config, spool, ledger, scheduler, replies, rodan)  # type: ignore[arg-type]
    reconciler = Reconciler(config, spool, ledger, scheduler, replies, cancels)
    return reconciler, cancels, ledger, scheduler, rodan, spool


def waiting(ledger: Ledger, spool: Spool, corr: str, job_id: str, run_dir: Path) -> RequestRecord:
    """A generation-3 request whose job runs, with its parameter file and run directory."""
    record = RequestRecord(
        correlation_id=corr,
        key=corr,
        reply_to=f"hpc-results.{corr}",
        state=RequestState.SUBMITTED,
        generation="rodan3",
        job_id=job_id,
        job_ids=[job_id],
        job_name=f"rodan-{corr}",
        rodan_runjob=runjob_of(corr),
    )
    ledger.save(record)
    for name in ("inputs", "checkpoints", "logs"):
        (run_dir / name).mkdir(parents=True, exist_ok=True)
    atomic_write_json(spool.params_path(corr), {"run_dir": str(run_dir)})
    return record


def test_the_runjob_and_attempt_come_from_the_correlation_id_or_the_header() -> None:
    """Mutation caught: taking the whole ``<uuid>.<n>`` as the RunJob (no RunJob ever matches)."""
    assert runjob_of(RUNJOB) == RUNJOB and attempt_of(RUNJOB) == 1
    assert runjob_of(f"{RUNJOB}.3") == RUNJOB and attempt_of(f"{RUNJOB}.3") == 3
    assert runjob_of("corr-7", RUNJOB) == RUNJOB
    assert runjob_of("corr-7") == "" and attempt_of("corr-7") == 0 and attempt_of(f"{RUNJOB}.x") == 0


def test_a_run_cancelled_in_rodan_ends_its_jobs_and_gets_no_reply(world, tmp_path: Path) -> None:
    """CANCELLED in Rodan: every job of the request (a successor found by name too) is cancelled,
    the ledger says cancelled_by_rodan, the staged reply is dropped, and once the jobs have ended the
    run's inputs/ and checkpoints/ and the parameter file go (logs/ stays). Mutations caught: not
    cancelling the successor; publishing the staged reply; cleaning before the job ended."""
    reconciler, cancels, ledger, scheduler, rodan, spool = world
    run_dir = tmp_path / "runs" / "r1"
    record = waiting(ledger, spool, RUNJOB, "101", run_dir)
    scheduler.names[record.job_name] = ["101", "102"]
    scheduler.infos = {"101": JobInfo("101", JobState.RUNNING), "102": JobInfo("102", JobState.PENDING)}
    reconciler.replies.stage(RUNJOB, record.reply_to, b'{"error": "stopped"}', origin="worker")
    rodan.status[RUNJOB] = 1
    assert cancels.check([ledger.get(RUNJOB)], now=1000.0) == 0
    rodan.status[RUNJOB] = 9
    assert cancels.check([ledger.get(RUNJOB)], now=1030.0) == 0, "asked again before HPC_RODAN_CHECK_INTERVAL"
    assert cancels.check([ledger.get(RUNJOB)], now=1061.0) == 1
    after = ledger.get(RUNJOB)
    assert after.state is RequestState.CANCELLED_BY_RODAN and after.reason == "the run was cancelled in Rodan"
    assert sorted(scheduler.cancelled) == ["101", "102"]
    assert reconciler.replies.staged_entry(RUNJOB) is None
    assert (run_dir / "inputs").exists(), "the job still ran: its files stay until it has ended"
    scheduler.infos = {"101": JobInfo("101", JobState.CANCELLED), "102": JobInfo("102", JobState.CANCELLED)}
    assert cancels.settle(ledger.in_state(RequestState.CANCELLED_BY_RODAN)) == 1
    assert not (run_dir / "inputs").exists() and not (run_dir / "checkpoints").exists()
    assert (run_dir / "logs").exists() and not spool.params_path(RUNJOB).exists()
    assert ledger.get(RUNJOB).job_ended


def test_a_404_cancels_only_a_runjob_seen_before(world, tmp_path: Path) -> None:
    """Rodan answers 404 both for a deleted RunJob and to an account that may not view it: a RunJob
    never seen is left alone (its job runs on), one seen before is deleted. Mutation caught: reading
    every 404 as deleted (an account without view rights would cancel every training)."""
    reconciler, cancels, ledger, scheduler, rodan, spool = world
    waiting(ledger, spool, RUNJOB, "101", tmp_path / "runs" / "r1")
    scheduler.infos = {"101": JobInfo("101", JobState.RUNNING)}
    assert cancels.check([ledger.get(RUNJOB)], now=1000.0) == 0
    assert scheduler.cancelled == [] and ledger.get(RUNJOB).state is RequestState.SUBMITTED
    rodan.status[RUNJOB] = 1
    assert cancels.check([ledger.get(RUNJOB)], now=2000.0) == 0 and ledger.get(RUNJOB).rodan_seen
    del rodan.status[RUNJOB]
    assert cancels.check([ledger.get(RUNJOB)], now=3000.0) == 1
    assert ledger.get(RUNJOB).reason == "the run was deleted in Rodan" and scheduler.cancelled == ["101"]


def test_rodan_down_changes_nothing_and_older_generations_are_never_asked(world, tmp_path: Path) -> None:
    """Mutations caught: cancelling on an unreachable Rodan; asking Rodan about a request without a
    RunJob (the older generations)."""
    reconciler, cancels, ledger, scheduler, rodan, spool = world
    waiting(ledger, spool, RUNJOB, "101", tmp_path / "runs" / "r1")
    old = RequestRecord(correlation_id="old-1", key="old-1", reply_to="hpc-results", state=RequestState.SUBMITTED)
    old.job_id = "200"
    ledger.save(old)
    rodan.down = True
    assert cancels.check(ledger.in_state(RequestState.SUBMITTED), now=1000.0) == 0
    assert ledger.get(RUNJOB).state is RequestState.SUBMITTED and scheduler.cancelled == []
    rodan.down = False
    cancels.check(ledger.in_state(RequestState.SUBMITTED), now=2000.0)
    assert rodan.asked == [RUNJOB, RUNJOB]


def test_a_retry_supersedes_the_earlier_attempts_of_its_runjob(world, tmp_path: Path) -> None:
    """Attempt 3 of a RunJob cancels attempts 1 and 2 still open, not another RunJob's request.
    Mutation caught: looking up earlier attempts under the wrong key (the first attempt is the bare
    uuid)."""
    reconciler, cancels, ledger, scheduler, rodan, spool = world
    other = str(uuid.UUID(int=0x9999))
    waiting(ledger, spool, RUNJOB, "101", tmp_path / "runs" / "a1")
    waiting(ledger, spool, f"{RUNJOB}.2", "102", tmp_path / "runs" / "a2")
    waiting(ledger, spool, other, "103", tmp_path / "runs" / "b1")
    third = RequestRecord(correlation_id=f"{RUNJOB}.3", key=f"{RUNJOB}.3", reply_to="x", rodan_runjob=RUNJOB)
    assert cancels.supersede(third) == 2
    assert sorted(scheduler.cancelled) == ["101", "102"]
    assert ledger.get(RUNJOB).state is RequestState.CANCELLED_BY_RODAN
    assert "attempt 3" in ledger.get(f"{RUNJOB}.2").reason
    assert ledger.get(other).state is RequestState.SUBMITTED


def test_the_run_directory_is_found_by_name_before_any_continuation(world, tmp_path: Path) -> None:
    """The parameter file names the run directory only once a job continued; before, the first job's
    ``RUNS/<UTC time>-<key>`` is found by name (the real Rodan test's first run left its inputs/ with
    only the parameter file's lookup). Mutation caught: cleaning only a run_dir from the parameter
    file; matching another request's directory whose key starts with this one's."""
    reconciler, cancels, ledger, scheduler, rodan, spool = world
    runs = spool.root / "runs"
    mine = runs / f"20261129-001312-{RUNJOB}"
    retry = runs / f"20261129-001312-{RUNJOB}.2"
    for folder in (mine, retry):
        (folder / "inputs").mkdir(parents=True)
        (folder / "checkpoints").mkdir()
    record = waiting(ledger, spool, RUNJOB, "101", mine)
    atomic_write_json(spool.params_path(RUNJOB), {"runs_dir": str(runs), "run_dir": None})
    scheduler.infos = {"101": JobInfo("101", JobState.CANCELLED)}
    assert cancels.cancel(record, "the run was cancelled in Rodan", rodan_status="cancelled") == 1
    assert not (mine / "inputs").exists() and not (mine / "checkpoints").exists()
    assert (retry / "inputs").exists() and (retry / "checkpoints").exists(), "attempt 2's directory is not this one's"
