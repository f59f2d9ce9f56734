"""The worker's side of continuing past the time limit: the warning flag, the continuation state, the hand-over.

The real schedulers are exercised end to end in test_e2e.py; here a recording scheduler
stands in so that every file the hand-over writes can be checked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import bridge.schedulers as schedulers
import worker.continuation as continuation
from bridge.continuation_record import read_continuation
from bridge.errors import SchedulerUnavailable
from bridge.handoff import JobParameters
from bridge.schedulers import JobInfo, JobSpec, Scheduler, SlurmScheduler
from bridge.spool import Spool, atomic_write_json, read_json
from tests.support.bridge import fake_command, job_parameters_json
from tests.support.wait import wait_until
from worker.continuation import TimeLimitWarning, continue_job
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


def parameters_json(spool: Path, *, scheduler: str = "recording", **continuation_settings: Any) -> dict[str, Any]:
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
    return job_parameters_json(
        correlation_id="c1",
        spool=str(spool),
        rodan={"base_url": "http://rodan", "token": "tok-123"},
        broker={"url": "amqp://u:p@h/%2F"},
        job={
            "scheduler": scheduler,
            "options": {},
            "timeout_s": 5,
            "script": str(spool / "jobs" / "c1" / "job.sh"),
            "spec": spec.to_json(),
        },
        continuation={"count": 0, "max": 2, "node_local_dir": None, "sync_s": 30, **continuation_settings},
    )


def parameters(spool: Path, *, scheduler: str = "recording", **continuation_settings: Any) -> JobParameters:
    return JobParameters.from_json(parameters_json(spool, scheduler=scheduler, **continuation_settings))


def test_the_parameters_read_back_the_job_spec_and_counts() -> None:
    raw = parameters_json(Path("/spool"))
    read = JobParameters.from_json(json.loads(json.dumps(raw)))
    assert read.job.spec == JobSpec.from_json(raw["job"]["spec"])
    assert read.job.spec.command[-1] == "/spool/params/c1.json" and read.job.spec.warn_seconds == 300
    state = read.continuation
    assert (state.count, state.max, state.exhausted, state.sync_s) == (0, 2, False, 30.0)
    assert parameters(Path("/spool"), count=2, max=2).continuation.exhausted
    without = {k: v for k, v in raw.items() if k != "continuation"}
    with pytest.raises(ValueError, match="missing field 'continuation'"):
        JobParameters.from_json(without)  # no default: every file says how its job continues


def test_the_token_leaves_the_disk_once_read(tmp_path: Path) -> None:
    path = tmp_path / "c1.json"
    params = parameters(tmp_path)
    atomic_write_json(path, params.to_json())
    kept = forget_token(path, params, keep_file=True)
    assert kept.rodan.token == "" and params.rodan.token == "tok-123" and "tok-123" not in path.read_text()
    assert JobParameters.from_json(read_json(path)) == kept  # the next job reads the rest
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    forget_token(path, params, keep_file=False)
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
    params = parameters(spool.root)  # as the job holds them: the token in memory
    stored = forget_token(params_path, params, keep_file=True)
    run_dir = tmp_path / "runs" / "20261126-000000-c1"
    successor = continue_job(params, params_path=params_path, run_dir=run_dir, stopped_at="layer 'A'")
    assert successor == "4242"
    # the next job reads: one more continuation, the same run directory, still no token
    updated = read_json(params_path)
    assert updated["continuation"]["count"] == 1 and updated["run_dir"] == str(run_dir)
    assert updated["rodan"]["token"] == "" and "tok-123" not in params_path.read_text()
    following = JobParameters.from_json(updated)
    assert following == replace(stored, continuation=replace(stored.continuation, count=1), run_dir=run_dir)
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
    stored = forget_token(params_path, parameters(spool.root, scheduler="busy"), keep_file=True)
    assert stored.job.scheduler == "busy"
    kwargs = {"params_path": params_path, "run_dir": tmp_path}
    if continued:
        assert continue_job(stored, stopped_at="here", **kwargs) == "4100"  # type: ignore[arg-type]
        record = read_continuation(spool, "c1")
        assert record is not None and record.job_id == "4100"
    else:
        with pytest.raises(SchedulerUnavailable, match="Unexpected message"):
            continue_job(stored, stopped_at="here", **kwargs)  # type: ignore[arg-type]
    assert BusyScheduler.busy == 0


def test_outside_a_batch_job_there_is_nothing_to_continue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPC_JOB_ID", raising=False)
    params = parameters(tmp_path)
    with pytest.raises(RuntimeError, match="HPC_JOB_ID"):
        continue_job(params, params_path=tmp_path / "p.json", run_dir=tmp_path, stopped_at="")


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
    params = parameters(tmp_path, count=count, max=maximum)
    body = stopped(
        Stopped("layer 'A' epoch 2"), params, tmp_path / "p.json",
        None,  # type: ignore[arg-type]  # not reached: nothing continues
        TimeLimitWarning(time.time() - 1),
    )  # fmt: skip
    assert body is not None and fragment in json.loads(body)["error"]


def test_the_bridges_rodan_timeout_and_retries_reach_the_worker(tmp_path: Path) -> None:
    """The worker's downloads use HPC_RODAN_TIMEOUT / HPC_RODAN_RETRIES from the parameter file
    (it used fixed 30 s and 4 retries, so a hanging Rodan cost every job ~165 s); a file without
    them is refused, not read with defaults of the worker's own."""
    base = parameters_json(tmp_path)
    given = JobParameters.from_json({**base, "rodan": {**base["rodan"], "timeout_s": 7.5, "retries": 1}})
    assert (given.rodan.timeout_s, given.rodan.retries) == (7.5, 1)
    with pytest.raises(ValueError, match=re.escape("missing fields 'rodan.timeout_s', 'rodan.retries'")):
        JobParameters.from_json({**base, "rodan": {"base_url": "http://rodan", "token": "tok-123"}})


# --- Slurm: requeue, or a successor for sites that forbid requeue (HPC_SLURM_CONTINUE) -----------


def slurm_spec(workdir: Path, **kw: Any) -> JobSpec:
    values: dict[str, Any] = dict(
        name=f"rodan-hpcbt-{uuid.uuid4().hex[:12]}",
        comment="continuation-test",
        time_minutes=5,
        memory_mb=200,
        cpus=1,
        command=(sys.executable, "-c", "pass"),
        log_dir=workdir,
        workdir=workdir,
        warn_seconds=30,
    )
    values.update(kw)
    return JobSpec(**values)


@pytest.mark.parametrize("mode", ["requeue", "successor"])
def test_slurm_continues_by_requeue_or_by_a_held_successor_without_requeue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    calls = tmp_path / "calls.txt"
    fake_command(
        tmp_path, monkeypatch, "sbatch", f'echo "sbatch $*" >> "{calls}"\nenv > "{tmp_path}/env.txt"\necho 4242\n'
    )
    fake_command(tmp_path, monkeypatch, "scontrol", f'echo "scontrol $*" >> "{calls}"\n')
    # What a running job's environment holds: its own variables, and sbatch's input (configless node).
    monkeypatch.setenv("SLURM_JOB_ID", "4100")
    monkeypatch.setenv("SLURM_TMPDIR", "/localscratch/hpcbt.4100.0")
    monkeypatch.setenv("SLURM_CONF", "/run/slurm/conf/slurm.conf")
    scheduler = SlurmScheduler(timeout_s=10)
    job = slurm_spec(tmp_path, continue_by=mode)
    script = tmp_path / "job.sh"
    script.write_text(scheduler.render(job))
    first = script.read_text()
    assert ("#SBATCH --requeue\n" in first) is (mode == "requeue") and "#SBATCH --signal=B:USR1@30\n" in first
    assert scheduler.continues_by(job) == mode
    next_id = scheduler.continue_job("4100", script, job)
    lines = calls.read_text().splitlines()
    successor = tmp_path / "job-after-4100.sh"
    if mode == "requeue":
        assert (next_id, lines, successor.exists()) == ("4100", ["scontrol requeue 4100"], False)
        return
    assert next_id == "4242" and lines == [f"sbatch --parsable {successor}"]  # scontrol: never
    text = successor.read_text()
    assert "#SBATCH --dependency=afterany:4100\n" in text and "--requeue" not in text
    assert text.replace("#SBATCH --dependency=afterany:4100\n", "") == first  # otherwise the same job
    env = dict(line.split("=", 1) for line in (tmp_path / "env.txt").read_text().splitlines() if "=" in line)
    assert "SLURM_JOB_ID" not in env and "SLURM_TMPDIR" not in env  # the successor sets its own
    assert env["SLURM_CONF"] == "/run/slurm/conf/slurm.conf"


def test_an_unknown_way_to_continue_never_reaches_a_script(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unsafe value for continue_by"):
        SlurmScheduler().render(slurm_spec(tmp_path, continue_by="restart"))
    assert "--requeue" not in SlurmScheduler().render(slurm_spec(tmp_path, continue_by="successor", warn_seconds=0))


def test_the_way_to_continue_travels_in_the_parameter_file(tmp_path: Path) -> None:
    raw = parameters_json(tmp_path)
    raw["job"]["spec"] = slurm_spec(tmp_path, continue_by="successor").to_json()
    assert JobParameters.from_json(json.loads(json.dumps(raw))).job.spec.continue_by == "successor"
    # a parameter file written before the setting existed: the job goes on as it was submitted
    older = {k: v for k, v in raw["job"]["spec"].items() if k != "continue_by"}
    assert JobSpec.from_json(older).continue_by == "requeue"


class TimingOutScheduler(RecordingScheduler):
    """Submits the successor, then fails the way sbatch does when slurmctld answers too late."""

    name = "timingout"

    def continue_job(self, job_id: str, script: Path, spec: JobSpec) -> str:
        RecordingScheduler.submitted.append((script, spec))
        raise SchedulerUnavailable("sbatch: timed out after 60 s")

    def find_by_name(self, name: str) -> list[str]:
        return ["4000", "4100", *(["4242"] if RecordingScheduler.submitted else [])]  # 4000: an older one


def test_a_successor_submitted_despite_an_error_is_taken_not_submitted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(schedulers.BACKENDS, "timingout", TimingOutScheduler)
    monkeypatch.setattr("worker.continuation.CONTINUE_RETRY_S", 0.01)
    monkeypatch.setenv("HPC_JOB_ID", "4100")
    RecordingScheduler.submitted.clear()
    spool = Spool(tmp_path / "spool").ensure()
    spool.job_dir("c1").mkdir(parents=True)
    params_path = spool.params_path("c1")
    stored = forget_token(params_path, parameters(spool.root, scheduler="timingout"), keep_file=True)
    successor = continue_job(stored, params_path=params_path, run_dir=tmp_path, stopped_at="here")
    assert successor == "4242" and len(RecordingScheduler.submitted) == 1  # one successor, not three
    record = read_continuation(spool, "c1")
    assert record is not None and (record.previous_job_id, record.job_id) == ("4100", "4242")


#: Run inside the real Slurm job: record the environment; the first job continues in a successor.
IN_JOB = """
import json, os, pathlib, sys, time
from bridge.schedulers import JobSpec, SlurmScheduler
here = pathlib.Path(sys.argv[1])
job_id = os.environ["SLURM_JOB_ID"]
(here / f"env-{job_id}.json").write_text(json.dumps(dict(os.environ)))
if not (here / "successor.txt").exists():
    spec = JobSpec.from_json(json.loads((here / "spec.json").read_text()))
    os.environ["SLURM_TMPDIR"] = "/nonexistent/from-the-first-job"  # as a site's plugin sets it
    (here / "successor.txt").write_text(SlurmScheduler(timeout_s=30).continue_job(job_id, here / "job.sh", spec))
    time.sleep(3)
(here / f"end-{job_id}.txt").write_text(repr(time.time()))
"""


@pytest.mark.slurm
def test_a_real_slurm_job_submits_its_successor_held_on_itself(slurm: None, tmp_path: Path) -> None:
    (tmp_path / "in_job.py").write_text(IN_JOB)
    job = slurm_spec(
        tmp_path, continue_by="successor", command=(sys.executable, str(tmp_path / "in_job.py"), str(tmp_path))
    )
    (tmp_path / "spec.json").write_text(json.dumps(job.to_json()))
    scheduler = SlurmScheduler(timeout_s=30)
    (tmp_path / "job.sh").write_text(scheduler.render(job))
    first = scheduler.submit(tmp_path / "job.sh", job)
    try:
        second = wait_until(
            lambda: (tmp_path / f"end-{first}.txt").exists() and (tmp_path / "successor.txt").read_text(),
            300,
            what="the first job",
        )
        assert second != first and second.isdigit()
        wait_until(lambda: (tmp_path / f"end-{second}.txt").exists(), 300, what="the successor")
    finally:
        recorded = tmp_path / "successor.txt"
        for job_id in (first, recorded.read_text() if recorded.exists() else ""):
            if job_id:
                scheduler.cancel(job_id)  # only a job still queued or running: a failed test's
    assert "--requeue" not in (tmp_path / "job.sh").read_text()
    assert f"#SBATCH --dependency=afterany:{first}\n" in (tmp_path / f"job-after-{first}.sh").read_text()
    started = json.loads((tmp_path / f"env-{second}.json").read_text())
    assert started["SLURM_JOB_ID"] == started["HPC_JOB_ID"] == second
    assert "SLURM_TMPDIR" not in started and "SLURM_RESTART_COUNT" not in started
    assert started["SLURM_JOB_NAME"] == job.name  # the same name: reconciliation finds it by name too
    # held on the first: it started only once the first had ended (after its 3 s sleep)
    first_end = float((tmp_path / f"end-{first}.txt").read_text())
    assert float(started["HPC_JOB_STARTED"]) >= int(first_end)
    assert scheduler.find_by_name(job.name) == [first, second]


WAIT_FOR_WARNING = """
import sys, time
from worker.continuation import TimeLimitWarning
warning = TimeLimitWarning(None).install()  # no deadline of its own: only the scheduler's signal
while not warning():
    time.sleep(0.2)
open(sys.argv[1], "w").write(warning.reason)
"""


@pytest.mark.slurm
@pytest.mark.slow  # waits for Slurm's warning signal
@pytest.mark.waits
def test_slurms_warning_signal_reaches_the_workers_flag(slurm: None, tmp_path: Path) -> None:
    """The real ``--signal=B:USR1@30`` of a two-minute job: the worker's flag rises (the time-limit
    path the end-to-end continuation test cuts short with a fixed amount of work). Slurm may send
    the signal up to 60 s early: here 30 to 90 s into the job, well after the worker's handler."""
    (tmp_path / "wait.py").write_text(WAIT_FOR_WARNING)
    job = slurm_spec(
        tmp_path,
        time_minutes=2,
        warn_seconds=30,
        command=(sys.executable, str(tmp_path / "wait.py"), str(tmp_path / "reason.txt")),
    )
    scheduler = SlurmScheduler(timeout_s=30)
    (tmp_path / "job.sh").write_text(scheduler.render(job))
    job_id = scheduler.submit(tmp_path / "job.sh", job)
    try:
        reason = wait_until(lambda: (tmp_path / "reason.txt").exists() and (tmp_path / "reason.txt").read_text(), 240)
    finally:
        scheduler.cancel(job_id)
    assert reason == "the scheduler's warning (SIGUSR1)"


def test_a_test_can_cut_the_training_after_a_fixed_amount_of_work() -> None:
    warning = TimeLimitWarning.from_environment({continuation.TEST_WARN_AFTER_POLLS: "3"})
    assert [warning(), warning(), warning(), warning()] == [False, False, True, True]
    assert "HPC_TEST_WARN_AFTER_POLLS=3" in warning.reason
    assert not TimeLimitWarning.from_environment({continuation.TEST_WARN_AFTER_POLLS: "x"})()
