"""The worker's side of continuing past the time limit: the warning flag, the plan, the hand-over.

The real schedulers are exercised end to end in test_e2e.py; here a recording scheduler
stands in so that every file the hand-over writes can be checked.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

import bridge.schedulers as schedulers
import worker.continuation as continuation
from bridge.continuation import read_continuation
from bridge.errors import SchedulerUnavailable
from bridge.schedulers import JobInfo, JobSpec, Scheduler
from bridge.spool import Spool, atomic_write_json, read_json
from worker.continuation import ContinuationPlan, TimeLimitWarning, continue_job
from worker.job import forget_token


@pytest.fixture
def restore_signals() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in continuation.WARNING_SIGNALS}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_the_deadline_comes_from_the_batch_scripts_environment() -> None:
    env = {"HPC_JOB_STARTED": "1000", "HPC_JOB_TIME_LIMIT_S": "3600", "HPC_JOB_WARN_S": "300"}
    assert TimeLimitWarning.from_environment(env).deadline == 1000 + 3600 - 300
    assert TimeLimitWarning.from_environment({**env, "HPC_JOB_WARN_S": "0"}).deadline is None
    assert TimeLimitWarning.from_environment({}).deadline is None
    assert TimeLimitWarning.from_environment({**env, "HPC_JOB_STARTED": "soon"}).deadline is None


def test_a_passed_deadline_asks_to_stop() -> None:
    assert TimeLimitWarning(time.time() - 1)()
    assert not TimeLimitWarning(time.time() + 3600)()
    assert not TimeLimitWarning(None)()
    assert "deadline" in TimeLimitWarning(time.time() - 1).reason


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGUSR2])
def test_a_warning_signal_only_sets_the_flag(restore_signals: None, signum: signal.Signals) -> None:
    warning = TimeLimitWarning(None).install()
    assert not warning()
    os.kill(os.getpid(), signum)
    deadline = time.monotonic() + 5
    while not warning() and time.monotonic() < deadline:
        time.sleep(0.01)  # Python runs the handler at the next bytecode boundary of the main thread
    assert warning() and warning.signal_name == signum.name and signum.name in warning.reason
    os.kill(os.getpid(), signal.SIGUSR1)  # a second warning changes nothing and kills nothing
    assert warning.signal_name == signum.name


class RecordingScheduler(Scheduler):
    """Submits nothing: records what a Grid Engine-like backend would have been asked."""

    name = "recording"
    display_name = "Recording"
    template_name = "slurm.sh"
    directive_prefix = "#REC"
    job_id_variable = "REC_JOB_ID"
    log_name = "job-%j.out"
    log_name_id = "%j"
    submitted: list[tuple[Path, JobSpec]] = []

    def __init__(self, *, timeout_s: float = 60.0) -> None:
        super().__init__(timeout_s=timeout_s)

    def directives(self, spec: JobSpec) -> list[str]:
        return [f"--name={spec.name}"] + ([f"--after={spec.hold_after}"] if spec.hold_after else [])

    def submit(self, script: Path, spec: JobSpec) -> str:
        RecordingScheduler.submitted.append((script, spec))
        return "4242"

    def query(self, job_ids: Sequence[str]) -> Mapping[str, JobInfo]:
        return {}

    def find_by_name(self, name: str) -> list[str]:
        return []

    def cancel(self, job_id: str) -> None:
        raise AssertionError("not used")


def parameters(spool: Path, **continuation_settings: Any) -> dict[str, Any]:
    spec = JobSpec(
        name="rodan-c1",
        comment="c1",
        time_minutes=60,
        memory_mb=4000,
        cpus=1,
        command=("/usr/bin/python3", "-m", "worker", "run", str(spool / "params" / "c1.json")),
        log_dir=spool / "jobs" / "c1",
        workdir=spool / "jobs" / "c1",
        warn_seconds=300,
    )
    return {
        "correlation_id": "c1",
        "rodan": {"base_url": "http://rodan", "token": "tok-123"},
        "broker": {"url": "amqp://u:p@h/%2F"},
        "job": {
            "scheduler": "recording",
            "options": {},
            "timeout_s": 5,
            "script": str(spool / "jobs" / "c1" / "job.sh"),
            "spec": spec.to_json(),
        },
        "continuation": {"count": 0, "max": 2, "node_local_dir": None, "sync_s": 30, **continuation_settings},
    }


def test_the_plan_reads_back_the_job_spec_and_counts() -> None:
    raw = parameters(Path("/spool"))
    plan = ContinuationPlan.from_parameters(raw)
    assert plan is not None
    assert plan.spec == JobSpec.from_json(json.loads(json.dumps(raw["job"]["spec"])))
    assert plan.spec.command[-1] == "/spool/params/c1.json" and plan.spec.warn_seconds == 300
    assert (plan.count, plan.maximum, plan.exhausted, plan.sync_s) == (0, 2, False, 30.0)
    assert ContinuationPlan.from_parameters({**raw, "continuation": {"count": 2, "max": 2}}).exhausted  # type: ignore[union-attr]
    assert ContinuationPlan.from_parameters({"correlation_id": "c1"}) is None  # a bridge without continuation


def test_the_token_leaves_the_disk_once_read(tmp_path: Path) -> None:
    path = tmp_path / "c1.json"
    raw = parameters(tmp_path)
    atomic_write_json(path, raw)
    kept = forget_token(path, raw, keep_file=True)
    assert "token" not in kept["rodan"] and "tok-123" not in path.read_text()
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    forget_token(path, raw, keep_file=False)
    assert not path.exists()


def test_the_hand_over_records_the_continuation_and_submits_a_held_successor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(schedulers.BACKENDS, "recording", RecordingScheduler)
    monkeypatch.setenv("HPC_JOB_ID", "4100")
    RecordingScheduler.submitted.clear()
    spool = Spool(tmp_path / "spool").ensure()
    (spool.job_dir("c1")).mkdir(parents=True)
    params_path = spool.params_path("c1")
    raw = forget_token(params_path, parameters(spool.root), keep_file=True)
    plan = ContinuationPlan.from_parameters(raw)
    assert plan is not None
    run_dir = tmp_path / "runs" / "20261126-000000-c1"
    successor = continue_job(
        plan, params_path=params_path, raw_params=raw, spool=spool, key="c1", run_dir=run_dir, stopped_at="layer 'A'"
    )
    assert successor == "4242"
    # the next job reads: one more continuation, the same run directory, still no token
    updated = read_json(params_path)
    assert updated["continuation"]["count"] == 1 and updated["run_dir"] == str(run_dir)
    assert "token" not in updated["rodan"]
    # the record the bridge's reconciliation follows
    record = read_continuation(spool, "c1")
    assert record is not None
    assert (record.count, record.previous_job_id, record.job_id, record.stopped_at) == (1, "4100", "4242", "layer 'A'")
    # the successor: the same job, rendered again with a hold on this one
    ((script, spec),) = RecordingScheduler.submitted
    assert spec.hold_after == "4100" and script.name == "job-after-4100.sh"
    assert "#REC --after=4100" in script.read_text() and oct(script.stat().st_mode & 0o777) == "0o700"


class BusyScheduler(RecordingScheduler):
    """Refuses the first ``busy`` continuations the way a busy slurmctld does, then accepts."""

    name = "busy"
    busy = 0

    def continue_job(self, job_id: str, script: Path, spec: JobSpec) -> str:
        if BusyScheduler.busy > 0:
            BusyScheduler.busy -= 1
            raise SchedulerUnavailable(f"scontrol requeue {job_id} failed: Unexpected message received for job")
        return job_id


@pytest.mark.parametrize(("busy", "continued"), [(2, True), (3, False)])
def test_a_busy_scheduler_is_asked_again_at_most_three_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, busy: int, continued: bool
) -> None:
    monkeypatch.setitem(schedulers.BACKENDS, "busy", BusyScheduler)
    monkeypatch.setattr("worker.continuation.CONTINUE_RETRY_S", 0.01)
    monkeypatch.setenv("HPC_JOB_ID", "4100")
    BusyScheduler.busy = busy
    spool = Spool(tmp_path / "spool").ensure()
    spool.job_dir("c1").mkdir(parents=True)
    params_path = spool.params_path("c1")
    raw = forget_token(params_path, {**parameters(spool.root)}, keep_file=True)
    raw["job"]["scheduler"] = "busy"
    plan = ContinuationPlan.from_parameters(raw)
    assert plan is not None and plan.scheduler == "busy"
    kwargs = {"params_path": params_path, "raw_params": raw, "spool": spool, "key": "c1", "run_dir": tmp_path}
    if continued:
        assert continue_job(plan, stopped_at="here", **kwargs) == "4100"  # type: ignore[arg-type]
        record = read_continuation(spool, "c1")
        assert record is not None and record.job_id == "4100"
    else:
        with pytest.raises(SchedulerUnavailable, match="Unexpected message"):
            continue_job(plan, stopped_at="here", **kwargs)  # type: ignore[arg-type]
    assert BusyScheduler.busy == 0


def test_outside_a_batch_job_there_is_nothing_to_continue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPC_JOB_ID", raising=False)
    raw = parameters(tmp_path)
    plan = ContinuationPlan.from_parameters(raw)
    assert plan is not None
    with pytest.raises(RuntimeError, match="HPC_JOB_ID"):
        continue_job(
            plan, params_path=tmp_path / "p.json", raw_params=raw, spool=Spool(tmp_path), key="c1",
            run_dir=tmp_path, stopped_at="",
        )  # fmt: skip


def _job_parameters(spool: Path) -> Any:
    from worker.job import JobParameters

    raw = parameters(spool)
    return JobParameters.from_json(
        {**raw, "reply_to": "q", "inputs": {}, "layers": [], "settings": {}, "spool": str(spool)}
    )


@pytest.mark.parametrize(
    ("count", "maximum", "fragment"),
    [
        (2, 2, "needs more time than 3 jobs of 60 s each: it stopped at layer 'A' epoch 2 after 2 continuations"),
        (0, 0, "this bridge does not continue jobs"),
    ],
)
def test_no_continuation_left_is_one_error_reply_saying_where_training_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int, maximum: int, fragment: str
) -> None:
    from worker.job import Stopped, stopped

    monkeypatch.setenv("HPC_JOB_TIME_LIMIT_S", "60")
    raw = parameters(tmp_path, count=count, max=maximum)
    plan = ContinuationPlan.from_parameters(raw)
    body = stopped(
        Stopped("layer 'A' epoch 2"), _job_parameters(tmp_path), plan, tmp_path / "p.json", raw,
        None,  # type: ignore[arg-type]  # not reached: nothing continues
        TimeLimitWarning(time.time() - 1),
    )  # fmt: skip
    assert body is not None and fragment in json.loads(body)["error"]


def test_the_bridges_rodan_timeout_and_retries_reach_the_worker(tmp_path: Path) -> None:
    """The worker's downloads use HPC_RODAN_TIMEOUT / HPC_RODAN_RETRIES from the parameter file
    (it used fixed 30 s and 4 retries, so a hanging Rodan cost every job ~165 s); an older file
    without them gets the old defaults."""
    from worker.job import JobParameters

    base = {**parameters(tmp_path), "reply_to": "q", "inputs": {}, "layers": [], "settings": {}, "spool": str(tmp_path)}
    given = JobParameters.from_json({**base, "rodan": {**base["rodan"], "timeout_s": 7.5, "retries": 1}})
    assert (given.rodan_timeout_s, given.rodan_retries) == (7.5, 1)
    older = JobParameters.from_json(base)
    assert (older.rodan_timeout_s, older.rodan_retries) == (30.0, 4)
