"""Inside a link's batch job: the supervisor that runs the command (``python -m bridge.chain``).

:func:`run_link` waits until the chain is fully submitted, skips the link if the chain has
already ended, and otherwise runs the command with the contract's environment. It forwards
the time-limit warning as ``SIGUSR1`` (from the scheduler's signal or its own timer), and
reads the exit status: 0 writes ``DONE`` and cancels the links still waiting, 75 leaves the
rest to the next link, anything else writes ``FAILED`` and cancels the rest. It needs only
the settings and the run directory, never the follow or command-line code.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import structlog

from bridge.chain.rundir import ChainLog, ChainRunDir
from bridge.chain.settings import EX_TEMPFAIL, ChainError, ChainSettings
from bridge.errors import BridgeError
from bridge.schedulers import Scheduler, get_scheduler
from bridge.shell import CommandError, CommandTimeout, supervise

log = structlog.get_logger(__name__)

# Set to 0 in a link's environment (-v HPC_CHAIN_WARN_TIMER=0) to rely on the scheduler's signal alone.
TIMER_SWITCH = "HPC_CHAIN_WARN_TIMER"
# How long a link waits for the submitting command to finish writing chain.json.
SUBMIT_WAIT_S = 300.0
# How long after its time limit a link's command may run before the supervisor stops it itself.
LIMIT_SLACK_S = 120.0


class _Signals:
    """Flags set by the signal handlers (which do nothing else), acted on by :meth:`poll`."""

    def __init__(self, events: ChainLog, warn_at: float | None) -> None:
        self.events = events
        self.warn_at = warn_at  # epoch seconds of the supervisor's own warning, None: no timer
        self.scheduler_warning = 0  # the signal number of the scheduler's warning, once it came
        self.terminate = 0  # SIGTERM/SIGINT received: the scheduler is ending this job
        self.warned = False
        self.terminated = False

    def handler(self, signum: int, _frame: FrameType | None) -> None:
        if signum in (signal.SIGUSR1, signal.SIGUSR2):
            self.scheduler_warning = self.scheduler_warning or signum
        else:
            self.terminate = self.terminate or signum

    def poll(self, child: Any) -> None:
        """Called by :func:`supervise` between waits: forward what the handlers recorded."""
        if self.terminate and not self.terminated:
            self.terminated = True
            _send(child, self.terminate)
            self.events.emit("link_terminating", level="warning", signal=signal.Signals(self.terminate).name)
        if self.warned:
            return
        if self.scheduler_warning:
            source = f"scheduler ({signal.Signals(self.scheduler_warning).name})"
        elif self.warn_at is not None and time.time() >= self.warn_at:
            source = "timer"
        else:
            return
        self.warned = True
        _send(child, signal.SIGUSR1)
        self.events.emit("warning_forwarded", source=source, pid=child.pid)


def _send(child: Any, signum: int) -> None:
    try:
        child.send_signal(signum)
    except ProcessLookupError:
        pass


def _wait_for_submission(run: ChainRunDir, timeout_s: float) -> dict[str, Any]:
    """chain.json once the submitting command has recorded every job id (or given up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        record = run.read()
        if record.get("state") != "submitting" or time.monotonic() >= deadline:
            return record
        time.sleep(0.5)


def _number_env(environ: Mapping[str, str], name: str, default: float) -> float:
    try:
        return float(environ[name])
    except (KeyError, ValueError):
        return default


def run_link(
    run_path: Path,
    link: int,
    *,
    scheduler: Scheduler | None = None,
    environ: Mapping[str, str] | None = None,
    submit_wait_s: float = SUBMIT_WAIT_S,
) -> int:
    """Run link ``link`` of the chain in ``run_path``: the command, supervised. Returns the exit status.

    0 when the command finished (or the link was skipped) or when the next link continues;
    75 when the last link ended with more to do; on failure, the command's status (1 instead of
    99, 100 or a signal). Raises :class:`ChainError`, running nothing, when the run directory or
    ``chain.json`` could have been changed by someone else (:meth:`ChainRunDir.verify`, :meth:`ChainRunDir.read`).
    """
    env = dict(os.environ if environ is None else environ)
    run = ChainRunDir(run_path)
    run.verify()  # nobody else can have changed what it runs (ChainError: run nothing, write nothing)
    record = _wait_for_submission(run, submit_wait_s)
    settings = ChainSettings.from_json(record)
    job_ids = [str(j) for j in record.get("job_ids") or []]
    job_id = env.get("HPC_JOB_ID", "")
    events = ChainLog(run.log_file, chain=settings.name, link=link, links=settings.links, job_id=job_id)
    try:
        if scheduler is None:
            scheduler = get_scheduler(settings.scheduler, options=settings.scheduler_options)
        later = job_ids[link:]
        marker = run.marker()
        if record.get("state") == "submit_failed" or marker is not None:
            reason, by = ("submit_failed", {}) if marker is None else marker
            cancelled = _cancel(scheduler, later, events)
            events.emit("link_skipped", reason=reason, by_link=by.get("link"), cancelled=cancelled)
            return 0
        if record.get("state") == "submitting":
            events.emit("submission_unfinished", level="warning", known_job_ids=job_ids)
        return _run_command(_Link(settings, run, link, job_id, scheduler, later, events), env)
    finally:
        events.close()


@dataclass(frozen=True)
class _Link:
    """The link a supervisor runs: its chain, run directory, number, job, and the links after it."""

    settings: ChainSettings
    run: ChainRunDir
    number: int
    job_id: str
    scheduler: Scheduler
    later: list[str]  # the job ids of the links after this one
    events: ChainLog

    @property
    def last(self) -> bool:
        return self.number == self.settings.links

    def cancel_later(self) -> list[str]:
        return _cancel(self.scheduler, self.later, self.events)


@dataclass(frozen=True)
class _Timing:
    """This job's time limit, its warning and when it started: the scheduler's (from the batch
    script's environment), else the chain's settings; ``timer``: the supervisor warns by its own
    timer as well as on the scheduler's signal."""

    limit_s: float
    warn_s: float
    started: float
    timer: bool

    @classmethod
    def read(cls, env: Mapping[str, str], settings: ChainSettings) -> _Timing:
        warn_s = _number_env(env, "HPC_JOB_WARN_S", settings.warn_s)
        return cls(
            limit_s=_number_env(env, "HPC_JOB_TIME_LIMIT_S", settings.time_limit_s),
            warn_s=warn_s,
            started=_number_env(env, "HPC_JOB_STARTED", time.time()),
            timer=warn_s > 0 and env.get(TIMER_SWITCH, "1") != "0",
        )

    @property
    def warn_at(self) -> float | None:
        """Epoch seconds of the supervisor's own warning; None: no timer."""
        return self.started + self.limit_s - self.warn_s if self.timer else None

    def timeout_s(self) -> float:
        """How long from now the command may run before the supervisor stops it itself."""
        return max(60.0, self.started + self.limit_s + LIMIT_SLACK_S - time.time())


@dataclass(frozen=True)
class _Ended:
    """How the command ended: its status (negative: the signal that killed it), its run time,
    the signal with which the scheduler (or the supervisor at its own limit) ended the job (0:
    none), and why it could not start (empty: it started)."""

    code: int
    seconds: float
    terminated: int = 0
    error: str = ""

    def fields(self) -> dict[str, Any]:
        """The ``command_exit`` event's fields."""
        fields: dict[str, Any] = {"code": self.code, "seconds": round(self.seconds, 3)}
        if self.code < 0:
            fields["signal"] = signal.Signals(-self.code).name
        if self.error:
            fields["error"] = self.error
        return fields


def _run_command(link: _Link, env: dict[str, str]) -> int:
    """Run the link's command with the contract's environment, supervised; returns the link's exit status."""
    restarts = sum(1 for e in link.run.events() if e.get("event") == "link_start")
    timing = _Timing.read(env, link.settings)
    link.events.emit(
        "link_start",
        host=socket.gethostname(),
        restart_count=restarts,
        time_limit_s=int(timing.limit_s),
        warn_s=int(timing.warn_s),
        warning_timer=timing.timer,
        command=list(link.settings.command),
    )
    ended = _supervise(link.settings, _child_environment(env, link, restarts, timing), timing, link.events)
    return _exit_policy(link, ended)


def _child_environment(env: Mapping[str, str], link: _Link, restarts: int, timing: _Timing) -> dict[str, str]:
    """The command's environment: the job's, with the contract's variables."""
    return {
        **env,
        "HPC_CHECKPOINT_DIR": str(link.run.checkpoints),
        "HPC_RESTART_COUNT": str(restarts),
        "HPC_CHAIN_LINK": str(link.number),
        "HPC_CHAIN_LINKS": str(link.settings.links),
        "HPC_RUN_DIR": str(link.run.path),
        "HPC_JOB_TIME_LIMIT_S": str(int(timing.limit_s)),
        "HPC_JOB_WARN_S": str(int(timing.warn_s)),
        "HPC_JOB_STARTED": str(int(timing.started)),
    }


def _supervise(settings: ChainSettings, child_env: dict[str, str], timing: _Timing, events: ChainLog) -> _Ended:
    """Run the command (through :func:`bridge.shell.supervise`) until it ends, forwarding the
    warning and the scheduler's SIGTERM/SIGINT to it; this process's handlers only for that long."""
    flags = _Signals(events, timing.warn_at)
    watched = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, flags.handler) for sig in watched}
    error = ""
    try:
        result = supervise(
            settings.command,
            timeout=timing.timeout_s(),
            poll=flags.poll,
            env=child_env,
            cwd=Path(settings.workdir),
            ignore_signals=(signal.SIGUSR1, signal.SIGUSR2),
        )
        code, seconds = result.returncode, result.seconds
    except CommandTimeout as exc:  # the scheduler did not end the job at its limit
        code, seconds, flags.terminate = -signal.SIGTERM, exc.result.seconds, flags.terminate or signal.SIGTERM
    except CommandError as exc:  # could not start: not found (127) or not executable (126)
        code, seconds, error = (127 if exc.reason == "not found" else 126), exc.result.seconds, str(exc)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return _Ended(code, seconds, flags.terminate, error)  # a signal until the handlers were restored counts


def _exit_policy(link: _Link, ended: _Ended) -> int:
    """What the command's exit means for the chain: write the marker, cancel the links still
    waiting, report; returns the link's exit status.

    0: finished (DONE, the rest cancelled). 75: the next link continues (75 from the last link).
    Ended by the scheduler: the next link resumes (128 + the signal). Anything else: FAILED, the
    rest cancelled, the command's status (1 instead of 99, 100 or a signal).
    """
    events, code, fields = link.events, ended.code, ended.fields()
    if code == 0:
        events.emit("command_exit", outcome="finished", **fields)
        link.run.write_marker(link.run.done_marker, {"link": link.number, "job_id": link.job_id, "at": time.time()})
        events.emit("chain_done", cancelled=link.cancel_later())
        return 0
    if code == EX_TEMPFAIL:
        events.emit("command_exit", outcome="continue", **fields)
        if link.last:
            events.emit("chain_incomplete", level="warning", reason="the command exited 75 in the last link")
            return EX_TEMPFAIL
        return 0
    if ended.terminated:  # the scheduler ended this job (time limit, or a cancel): the next link resumes
        events.emit("command_exit", level="warning", outcome="terminated", **fields)
        if link.last:
            events.emit("chain_incomplete", level="warning", reason="the last link was ended by the scheduler")
        return 128 + int(ended.terminated)
    events.emit("command_exit", level="error", outcome="failed", **fields)
    failed = {"link": link.number, "job_id": link.job_id, "code": code, "at": time.time()}
    link.run.write_marker(link.run.failed_marker, failed)
    events.emit("chain_failed", level="error", code=code, cancelled=link.cancel_later())
    # Never 99 or 100: Grid Engine would requeue the job, or park it in an error state.
    return code if 0 < code < 256 and code not in (99, 100) else 1


def _cancel(scheduler: Scheduler, job_ids: Sequence[str], events: ChainLog) -> list[str]:
    """Cancel the links among ``job_ids`` that have not ended, last first (so that cancelling
    one never releases the next). Returns the ids cancelled; failures are logged, not raised:
    a link that starts anyway sees the marker and skips."""
    if not job_ids:
        return []
    try:
        states = scheduler.query(list(job_ids))
    except BridgeError as exc:
        events.emit("cancel_failed", level="warning", job_ids=list(job_ids), error=str(exc))
        return []
    cancelled = []
    for job_id in reversed(job_ids):
        info = states.get(job_id)
        if info is not None and info.state.is_terminal:
            continue
        try:
            scheduler.cancel(job_id)
            cancelled.append(job_id)
        except (BridgeError, ValueError) as exc:
            events.emit("cancel_failed", level="warning", job_ids=[job_id], error=str(exc))
    return sorted(cancelled, key=lambda j: (len(j), j))


def link_main(argv: Sequence[str] | None = None) -> int:
    """``python -m bridge.chain RUN_DIR LINK``: what each link's batch script runs."""
    from bridge.logs import configure_logging

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or not args[1].isdigit():
        print(
            "usage: python -m bridge.chain RUN_DIR LINK  (run by the batch jobs of 'hpc-bridge chain')", file=sys.stderr
        )
        return 2
    configure_logging(level=os.environ.get("HPC_LOG_LEVEL", "INFO"), stream=sys.stderr, component="chain")
    try:
        return run_link(Path(args[0]), int(args[1]))
    except ChainError as exc:  # an untrusted run directory: nothing ran, nothing was written there
        log.error("link_refused", run_dir=args[0], link=int(args[1]), error=str(exc))
        return 1
