"""Time-limit warnings, and continuing the training in a new job.

The scheduler warns a job before its time limit: Slurm sends SIGUSR1
(``--signal=B:USR1@N``), Grid Engine SIGUSR2 (``-notify``, at the limit itself). The
worker also keeps its own timer from the batch script's ``HPC_JOB_STARTED``,
``HPC_JOB_TIME_LIMIT_S`` and ``HPC_JOB_WARN_S``, so the warning comes on time even where
the scheduler's is late or lost. The signal handler only sets a flag; the trainer looks
at it between batches, saves a checkpoint and stops (``TrainingInterrupted``).

The worker then asks the scheduler to run the job again (``Scheduler.continue_job``:
Slurm requeues the same job id, or with ``HPC_SLURM_CONTINUE=successor`` submits a
successor held on this job, as Grid Engine always does) after recording it in
``jobs/KEY/continuation.json`` for the bridge's reconciliation. The way is the job
spec's ``continue_by``, fixed when the bridge submitted the first job.

A successor submission that failed as far as the worker can tell (sbatch or qsub timed
out) may still have reached the scheduler: before asking again, the worker looks for a
job of the same name newer than itself and takes it, so a request never has two
successors.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import FrameType

import structlog

from bridge.continuation_record import Continuation, write_continuation
from bridge.errors import SchedulerUnavailable
from bridge.handoff import JobParameters
from bridge.schedulers import BACKENDS, JobSpec, Scheduler, get_scheduler
from bridge.spool import Spool, atomic_write_json

log = structlog.get_logger("worker")

#: Asking the scheduler to continue is tried this often (a busy controller answers with an error
#: now and then); the pauses grow by CONTINUE_RETRY_S and stay well inside the warning time.
CONTINUE_ATTEMPTS = 3
CONTINUE_RETRY_S = 2.0

#: The signals a scheduler warns with (each backend's ``warning_signal``; Slurm: USR1 as we ask;
#: Grid Engine -notify: USR2), once each.
WARNING_SIGNALS = tuple(dict.fromkeys(cls.warning_signal for cls in BACKENDS.values()))


#: Test-only: the job is warned after this many looks at the flag (the trainer looks after every
#: batch and at every epoch end), so that a test's training is cut after a fixed amount of work,
#: into the same number of jobs however fast the machine is. Set through HPC_JOB_PROLOGUE.
TEST_WARN_AFTER_POLLS = "HPC_TEST_WARN_AFTER_POLLS"


class TimeLimitWarning:
    """Set by a warning signal or by the job's own deadline; read between batches."""

    def __init__(self, deadline: float | None = None, *, after_polls: int | None = None) -> None:
        self.deadline = deadline  # epoch seconds at which to stop, or None
        self.signal_name = ""  # the first warning signal received
        self.after_polls = after_polls  # test-only (TEST_WARN_AFTER_POLLS)
        self.polls = 0

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> TimeLimitWarning:
        """The deadline ``HPC_JOB_STARTED + HPC_JOB_TIME_LIMIT_S - HPC_JOB_WARN_S``, when all are set."""
        env = os.environ if environ is None else environ
        polls = env.get(TEST_WARN_AFTER_POLLS, "")
        after_polls = int(polls) if polls.isdigit() and int(polls) > 0 else None
        try:
            started = float(env["HPC_JOB_STARTED"])
            limit = float(env["HPC_JOB_TIME_LIMIT_S"])
            warn = float(env["HPC_JOB_WARN_S"])
        except (KeyError, ValueError):
            return cls(None, after_polls=after_polls)
        return cls(started + limit - warn if warn > 0 else None, after_polls=after_polls)

    def install(self) -> TimeLimitWarning:
        for signum in WARNING_SIGNALS:
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.signal_name:  # only a flag: the trainer acts at its next batch boundary
            self.signal_name = signal.Signals(signum).name

    def __call__(self) -> bool:
        """True once the job should checkpoint and stop."""
        self.polls += 1
        return (
            bool(self.signal_name) or self._polled_out or (self.deadline is not None and time.time() >= self.deadline)
        )

    @property
    def _polled_out(self) -> bool:
        return self.after_polls is not None and self.polls >= self.after_polls

    @property
    def reason(self) -> str:
        if self.signal_name:
            return f"the scheduler's warning ({self.signal_name})"
        if self._polled_out:
            return f"a test's fixed amount of work ({TEST_WARN_AFTER_POLLS}={self.after_polls})"
        return "the job's own deadline (time limit minus HPC_WARN_SECONDS)"


def _submitted_after_all(scheduler: Scheduler, spec: JobSpec, job_id: str) -> str:
    """The successor of job ``job_id`` that a failed-looking submission left at the scheduler, or "".

    Only a job of this request's name with a higher id than this one can be it (a requeue keeps
    the id: nothing is found). A lookup that fails finds nothing: the submission is tried again.
    """
    if scheduler.continues_by(spec) != "successor" or not job_id.isdigit():
        return ""
    try:
        newer = [i for i in scheduler.find_by_name(spec.name) if i.isdigit() and int(i) > int(job_id)]
    except (SchedulerUnavailable, ValueError) as exc:
        log.warning("successor_lookup_failed", error=str(exc))
        return ""
    if newer:
        log.warning("job_continue_found_successor", next_job_id=max(newer, key=int), note="not submitted again")
    return max(newer, key=int) if newer else ""


def continue_job(
    params: JobParameters,
    *,
    params_path: Path,
    run_dir: Path,
    stopped_at: str,
) -> str:
    """Rewrite the parameter file for the next job, record the continuation, ask the scheduler.

    The file is ``params`` with the next count and ``run_dir``, and never the Rodan token: the next
    job resumes from the downloaded inputs (``job.forget_token`` removed it from disk already).

    Returns the id of the job that continues. On Slurm the requeue ends this process
    soon after, so everything else must be done before. Raises SchedulerUnavailable or
    SchedulerRejected when the scheduler refuses.
    """
    job_id = os.environ.get("HPC_JOB_ID", "")
    if not job_id:
        raise RuntimeError("HPC_JOB_ID is not set: not inside a batch job rendered by hpc-bridge")
    job, spool, key = params.job, Spool(params.spool), params.key
    count = params.continuation.count + 1
    updated = replace(
        params,
        rodan=replace(params.rodan, token=""),
        continuation=replace(params.continuation, count=count),
        run_dir=run_dir,
    )
    atomic_write_json(params_path, updated.to_json())
    write_continuation(spool, key, Continuation(count=count, previous_job_id=job_id, stopped_at=stopped_at))
    scheduler = get_scheduler(job.scheduler, timeout_s=job.timeout_s, options=dict(job.options))
    log.info(
        "job_continuing",
        continuation=count,
        of=params.continuation.max,
        scheduler=job.scheduler,
        by=scheduler.continues_by(job.spec),
        stopped_at=stopped_at,
    )
    for attempt in range(1, CONTINUE_ATTEMPTS + 1):
        try:
            successor = scheduler.continue_job(job_id, job.script, job.spec)
            break
        except SchedulerUnavailable as exc:  # e.g. slurmctld busy: "Unexpected message received"
            if attempt < CONTINUE_ATTEMPTS:
                log.warning("job_continue_retry", attempt=attempt, error=str(exc))
                time.sleep(CONTINUE_RETRY_S * attempt)
            successor = _submitted_after_all(scheduler, job.spec, job_id)
            if successor:
                break
            if attempt == CONTINUE_ATTEMPTS:
                raise
    write_continuation(
        spool, key, Continuation(count=count, previous_job_id=job_id, job_id=successor, stopped_at=stopped_at)
    )
    log.info("job_continued", continuation=count, next_job_id=successor)
    return successor
