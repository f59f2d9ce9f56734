"""``hpc-bridge chain``: run any command for longer than one batch job may run.

The chain is N batch jobs ("links"), each held on the one before (it starts once that one
has ended, whatever the outcome: Slurm ``afterany``, Grid Engine ``-hold_jid``). Every link
runs the same command under a small supervisor (:func:`run_link`, ``python -m bridge.chain
RUN_DIR LINK``), which tells the command where to checkpoint and when its time is nearly up,
and reads its exit status:

* ``0``: the work is finished. The supervisor writes the ``DONE`` marker, cancels the links
  still waiting (a link that starts anyway sees ``DONE`` and exits 0 without running it).
* ``75`` (``EX_TEMPFAIL``): more to do; the next link resumes from the checkpoint.
* anything else: failure. The supervisor writes the ``FAILED`` marker and cancels the rest.

Everything lives in one run directory (see :class:`RunDir`); ``chain.log`` has one JSON
event per line from every link and from the submitting command. No broker, no Rodan and no
credentials are involved. The contract for the command is in ``deploy/examples/README.md``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import structlog

from bridge.errors import BridgeError, SchedulerUnavailable
from bridge.schedulers import JobInfo, JobSpec, JobState, Scheduler, get_scheduler
from bridge.shell import CommandError, CommandTimeout, supervise
from bridge.spool import atomic_write, atomic_write_json, read_json

log = structlog.get_logger(__name__)

EX_TEMPFAIL = 75  # sysexits.h: "temporary failure, try again" -> continue in the next link
CHAIN_FILE = "chain.json"
LOG_FILE = "chain.log"
DONE_FILE = "DONE"
FAILED_FILE = "FAILED"
FINAL_EVENTS = {"chain_done": 0, "chain_failed": 1, "chain_incomplete": EX_TEMPFAIL}
# Names the supervisor sets for the command; a -v may not override them.
CONTRACT_ENV = (
    "HPC_CHECKPOINT_DIR",
    "HPC_RESTART_COUNT",
    "HPC_CHAIN_LINK",
    "HPC_CHAIN_LINKS",
    "HPC_RUN_DIR",
    "HPC_JOB_SCHEDULER",
    "HPC_JOB_TIME_LIMIT_S",
    "HPC_JOB_WARN_S",
    "HPC_JOB_ID",
    "HPC_JOB_STARTED",
)
# Set to 0 in a link's environment (-v HPC_CHAIN_WARN_TIMER=0) to rely on the scheduler's signal alone.
TIMER_SWITCH = "HPC_CHAIN_WARN_TIMER"
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
# How long a link waits for the submitting command to finish writing chain.json.
SUBMIT_WAIT_S = 300.0
# How long after its time limit a link's command may run before the supervisor stops it itself.
LIMIT_SLACK_S = 120.0


class ChainError(BridgeError):
    """A chain cannot be submitted as asked (bad option, unusable run directory)."""


# --- settings -----------------------------------------------------------------------------------


def parse_time(text: str) -> int:
    """A Slurm-style time limit -> seconds, rounded up to whole minutes (the schedulers' unit).

    ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``.
    """
    match = _TIME.match(text.strip())
    if not match:
        raise ChainError(f"--time: expected minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]], got {text!r}")
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        seconds = int(days) * 86400 + int(first) * 3600 + int(second or 0) * 60 + int(third or 0)
    elif third is not None:  # HH:MM:SS
        seconds = int(first) * 3600 + int(second) * 60 + int(third)
    elif second is not None:  # MM:SS
        seconds = int(first) * 60 + int(second)
    else:  # MM
        seconds = int(first) * 60
    if seconds <= 0:
        raise ChainError(f"--time must be at least one minute, got {text!r}")
    return math.ceil(seconds / 60) * 60


def parse_environment(items: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """``-v NAME=VALUE`` (or ``-v NAME``: its value here, like ``qsub -v``) -> a dict.

    One variable per ``-v``: a value may hold commas, spaces and quotes (they are shell-quoted
    into the batch script, never given to ``qsub -v``), but no newline or NUL byte.
    """
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not _ENV_NAME.match(name):
            raise ChainError(f"-v: {name!r} is not a valid environment variable name (use NAME=VALUE)")
        if name in CONTRACT_ENV:
            raise ChainError(f"-v: {name} is set by hpc-bridge chain itself")
        if not sep:
            if name not in environ:
                raise ChainError(f"-v {name}: no such variable in this environment (use NAME=VALUE)")
            value = environ[name]
        if "\n" in value or "\0" in value:
            raise ChainError(f"-v {name}: a value may not contain a newline or NUL byte")
        out[name] = value
    return out


def scheduler_choice(requested: str | None, environ: Mapping[str, str]) -> str:
    """``--scheduler``, else ``$HPC_SCHEDULER``, else slurm (``sge`` is Grid Engine)."""
    from bridge.config import SCHEDULER_ALIASES

    raw = requested or environ.get("HPC_SCHEDULER") or "slurm"
    name = SCHEDULER_ALIASES.get(raw.strip().lower())
    if name is None:
        raise ChainError(f"unknown scheduler {raw!r}: use slurm or gridengine")
    return name


def scheduler_options(name: str, environ: Mapping[str, str]) -> dict[str, str]:
    """Site settings of the backend from the environment (Grid Engine: HPC_SGE_PE, ...)."""
    if name != "gridengine":
        return {}
    keys = {"pe": "HPC_SGE_PE", "gpu_resource": "HPC_SGE_GPU_RESOURCE", "memory_resource": "HPC_SGE_MEMORY_RESOURCE"}
    return {option: environ[var] for option, var in keys.items() if environ.get(var)}


def resolve_command(command: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The command with a bare program name made absolute through this ``PATH``.

    A Grid Engine job runs in a login shell whose ``/etc/profile`` resets ``PATH``, so
    ``python`` would not be the interpreter the researcher meant. A name not found here
    is kept as it is (it may exist on the compute nodes only).
    """
    argv = list(command)
    if argv and "/" not in argv[0]:
        found = shutil.which(argv[0], path=environ.get("PATH"))
        if found:
            argv[0] = os.path.abspath(found)
    return argv


@dataclass(frozen=True)
class ChainSettings:
    """What ``hpc-bridge chain`` was asked for: recorded in chain.json, read by every link."""

    name: str
    links: int
    time_limit_s: int
    warn_s: int
    cpus: int
    memory_mb: int
    gpus: int
    command: tuple[str, ...]  # as it runs: argv[0] resolved (see resolve_command)
    workdir: str
    scheduler: str
    scheduler_options: Mapping[str, str] = field(default_factory=dict)
    account: str = ""
    partition: str = ""
    environment: Mapping[str, str] = field(default_factory=dict)
    python: str = sys.executable
    command_given: tuple[str, ...] = ()

    def check(self) -> None:
        if not _NAME.match(self.name):
            raise ChainError(f"--name {self.name!r}: use a letter, then letters, digits, '.', '_' or '-' (at most 64)")
        if not 1 <= self.links <= 1000:
            raise ChainError(f"--jobs must be between 1 and 1000, got {self.links}")
        if not 0 <= self.warn_s < self.time_limit_s:
            raise ChainError(
                f"--warn must be at least 0 and less than --time ({self.time_limit_s} s), got {self.warn_s}"
            )
        if self.cpus < 1 or self.memory_mb < 1 or self.gpus < 0:
            raise ChainError("--cpus and --mem must be at least 1, --gpus at least 0")
        if not self.command:
            raise ChainError("no command: put it after '--', e.g. hpc-bridge chain --jobs 3 -- python train.py")
        if not self.python.startswith("/"):
            raise ChainError(f"the interpreter path must be absolute, got {self.python!r}")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            command=list(self.command),
            command_given=list(self.command_given),
            scheduler_options=dict(self.scheduler_options),
            environment=dict(self.environment),
        )
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ChainSettings:
        return cls(
            name=str(data["name"]),
            links=int(data["links"]),
            time_limit_s=int(data["time_limit_s"]),
            warn_s=int(data["warn_s"]),
            cpus=int(data["cpus"]),
            memory_mb=int(data["memory_mb"]),
            gpus=int(data["gpus"]),
            command=tuple(str(a) for a in data["command"]),
            workdir=str(data["workdir"]),
            scheduler=str(data["scheduler"]),
            scheduler_options={str(k): str(v) for k, v in dict(data.get("scheduler_options") or {}).items()},
            account=str(data.get("account", "")),
            partition=str(data.get("partition", "")),
            environment={str(k): str(v) for k, v in dict(data.get("environment") or {}).items()},
            python=str(data.get("python", sys.executable)),
            command_given=tuple(str(a) for a in data.get("command_given") or ()),
        )


def default_warn(time_limit_s: int) -> int:
    """Five minutes before the limit, but at most a quarter of it."""
    return min(300, time_limit_s // 4)


# --- the run directory ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RunDir:
    """``chain.json``, ``chain.log``, ``checkpoints/``, ``logs/`` (scheduler output), ``scripts/``, markers."""

    path: Path

    @property
    def chain_file(self) -> Path:
        return self.path / CHAIN_FILE

    @property
    def log_file(self) -> Path:
        return self.path / LOG_FILE

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def scripts(self) -> Path:
        return self.path / "scripts"

    @property
    def done_marker(self) -> Path:
        return self.path / DONE_FILE

    @property
    def failed_marker(self) -> Path:
        return self.path / FAILED_FILE

    def create(self) -> None:
        if self.chain_file.exists():
            raise ChainError(f"{self.path} already holds a chain ({CHAIN_FILE}): choose another --run-dir")
        for directory in (self.path, self.checkpoints, self.logs, self.scripts):
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    def read(self) -> dict[str, Any]:
        data = read_json(self.chain_file)
        if not isinstance(data, dict):
            raise ChainError(f"{self.chain_file} is not a JSON object")
        return data

    def write(self, record: Mapping[str, Any]) -> None:
        atomic_write_json(self.chain_file, dict(record))

    def marker(self) -> tuple[str, dict[str, Any]] | None:
        """("done" | "failed", its record) once a link has finished or failed the chain."""
        for kind, path in (("done", self.done_marker), ("failed", self.failed_marker)):
            try:
                data = read_json(path)
            except FileNotFoundError:
                continue
            except (OSError, ValueError):
                data = {}
            return kind, data if isinstance(data, dict) else {}
        return None

    def write_marker(self, path: Path, record: Mapping[str, Any]) -> None:
        atomic_write(path, (json.dumps(dict(record), sort_keys=True) + "\n").encode(), mode=0o600)

    def events(self) -> list[dict[str, Any]]:
        """Every complete event in chain.log, oldest first."""
        try:
            text = self.log_file.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return []
        return [e for e in (_parse_event(line) for line in text.splitlines()) if e is not None]


def default_run_dir(name: str, cwd: Path, now: datetime | None = None) -> Path:
    """``./chain-runs/<name>-<UTC timestamp>`` (a suffix if that exists already)."""
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    base = cwd / "chain-runs" / f"{name}-{stamp}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def _parse_event(line: str) -> dict[str, Any] | None:
    try:
        event = json.loads(line)
    except ValueError:
        return None  # a line still being written, or not ours
    return event if isinstance(event, dict) and "event" in event else None


class ChainLog:
    """Appends JSON events to chain.log (one ``write`` per line, ``O_APPEND``: links, the
    submitting command and a follower may all write). Each event is also logged as usual
    (the job's output inside a link)."""

    def __init__(self, path: Path, **context: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handle: TextIO = path.open("a", encoding="utf-8", buffering=1)
        self._events = structlog.wrap_logger(
            structlog.WriteLogger(self._handle),
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.JSONRenderer(sort_keys=False),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET),  # whatever the log level
        ).bind(**context)
        self._context = context

    def bind(self, **context: Any) -> None:
        self._events = self._events.bind(**context)
        self._context.update(context)

    def emit(self, event: str, *, level: str = "info", **fields: Any) -> None:
        getattr(self._events, level)(event, **fields)
        getattr(log, level)(event, **self._context, **fields)

    def close(self) -> None:
        self._handle.close()


# --- submitting -----------------------------------------------------------------------------------


def link_spec(settings: ChainSettings, run: RunDir, link: int, hold_after: str) -> JobSpec:
    return JobSpec(
        name=f"{settings.name}-{link}",
        comment=f"hpc-bridge-chain-link-{link}-of-{settings.links}",
        time_minutes=settings.time_limit_s // 60,
        memory_mb=settings.memory_mb,
        cpus=settings.cpus,
        command=(settings.python, "-m", "bridge.chain", str(run.path), str(link)),
        log_dir=run.logs,
        workdir=Path(settings.workdir),
        gres=f"gpu:{settings.gpus}" if settings.gpus else None,
        account=settings.account,
        partition=settings.partition,
        warn_seconds=settings.warn_s,
        hold_after=hold_after,
        environment=dict(settings.environment),
    )


def submit_chain(settings: ChainSettings, run: RunDir, scheduler: Scheduler) -> list[str]:
    """Create the run directory and submit every link, each held on the one before.

    chain.json says ``"state": "submitting"`` until every link is in, so a link that starts
    meanwhile waits for the full list of job ids. If a submission fails, the links already
    submitted are cancelled, chain.json says ``submit_failed`` and the error is raised.
    """
    settings.check()
    for link in (1, 2):  # every value a batch script refuses shows here, before anything exists
        scheduler.render(link_spec(settings, run, link, "1" if link > 1 else ""))
    run.create()
    record: dict[str, Any] = {
        "version": 1,
        "state": "submitting",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "run_dir": str(run.path),
        "submit_host": socket.gethostname(),
        **settings.to_json(),
        "job_ids": [],
    }
    run.write(record)
    events = ChainLog(run.log_file, chain=settings.name, links=settings.links)
    job_ids: list[str] = []
    try:
        for link in range(1, settings.links + 1):
            spec = link_spec(settings, run, link, job_ids[-1] if job_ids else "")
            script = run.scripts / f"link-{link}.sh"
            atomic_write(script, scheduler.render(spec).encode(), mode=0o700)
            job_ids.append(scheduler.submit(script, spec))
            record["job_ids"] = list(job_ids)
        record["state"] = "submitted"
        run.write(record)
        events.emit("chain_submitted", scheduler=scheduler.name, job_ids=job_ids, command=list(settings.command))
        return job_ids
    except (BridgeError, ValueError, KeyboardInterrupt) as exc:
        for job_id in reversed(job_ids):
            try:
                scheduler.cancel(job_id)
            except BridgeError as cancel_error:
                log.warning("cancel_failed", job_id=job_id, error=str(cancel_error))
        record.update(state="submit_failed", job_ids=job_ids, error=str(exc) or type(exc).__name__)
        run.write(record)
        events.emit(
            "chain_failed",
            level="error",
            reason=f"submission failed: {str(exc) or type(exc).__name__}",
            cancelled=job_ids,
        )
        raise
    finally:
        events.close()


# --- inside a link: the supervisor -----------------------------------------------------------------


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


def _wait_for_submission(run: RunDir, timeout_s: float) -> dict[str, Any]:
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
    99, 100 or a signal).
    """
    env = dict(os.environ if environ is None else environ)
    run = RunDir(run_path)
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
        return _run_command(settings, run, link, job_id, env, scheduler, later, events)
    finally:
        events.close()


def _run_command(
    settings: ChainSettings,
    run: RunDir,
    link: int,
    job_id: str,
    env: dict[str, str],
    scheduler: Scheduler,
    later: list[str],
    events: ChainLog,
) -> int:
    restarts = sum(1 for e in run.events() if e.get("event") == "link_start")
    limit_s = _number_env(env, "HPC_JOB_TIME_LIMIT_S", settings.time_limit_s)
    warn_s = _number_env(env, "HPC_JOB_WARN_S", settings.warn_s)
    started = _number_env(env, "HPC_JOB_STARTED", time.time())
    timer = warn_s > 0 and env.get(TIMER_SWITCH, "1") != "0"
    child_env = {
        **env,
        "HPC_CHECKPOINT_DIR": str(run.checkpoints),
        "HPC_RESTART_COUNT": str(restarts),
        "HPC_CHAIN_LINK": str(link),
        "HPC_CHAIN_LINKS": str(settings.links),
        "HPC_RUN_DIR": str(run.path),
        "HPC_JOB_TIME_LIMIT_S": str(int(limit_s)),
        "HPC_JOB_WARN_S": str(int(warn_s)),
        "HPC_JOB_STARTED": str(int(started)),
    }
    events.emit(
        "link_start",
        host=socket.gethostname(),
        restart_count=restarts,
        time_limit_s=int(limit_s),
        warn_s=int(warn_s),
        warning_timer=timer,
        command=list(settings.command),
    )
    flags = _Signals(events, started + limit_s - warn_s if timer else None)
    watched = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, flags.handler) for sig in watched}
    failure = ""
    try:
        result = supervise(
            settings.command,
            timeout=max(60.0, started + limit_s + LIMIT_SLACK_S - time.time()),
            poll=flags.poll,
            env=child_env,
            cwd=Path(settings.workdir),
            ignore_signals=(signal.SIGUSR1, signal.SIGUSR2),
        )
        code, seconds = result.returncode, result.seconds
    except CommandTimeout as exc:  # the scheduler did not end the job at its limit
        code, seconds, flags.terminate = -signal.SIGTERM, exc.result.seconds, flags.terminate or signal.SIGTERM
    except CommandError as exc:  # could not start: not found (127) or not executable (126)
        code, seconds, failure = (127 if exc.reason == "not found" else 126), exc.result.seconds, str(exc)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    exit_fields: dict[str, Any] = {"code": code, "seconds": round(seconds, 3)}
    if code < 0:
        exit_fields["signal"] = signal.Signals(-code).name
    if failure:
        exit_fields["error"] = failure
    last = link == settings.links

    if code == 0:
        events.emit("command_exit", outcome="finished", **exit_fields)
        run.write_marker(run.done_marker, {"link": link, "job_id": job_id, "at": time.time()})
        events.emit("chain_done", cancelled=_cancel(scheduler, later, events))
        return 0
    if code == EX_TEMPFAIL:
        events.emit("command_exit", outcome="continue", **exit_fields)
        if last:
            events.emit("chain_incomplete", level="warning", reason="the command exited 75 in the last link")
            return EX_TEMPFAIL
        return 0
    if flags.terminate:  # the scheduler ended this job (time limit, or a cancel): the next link resumes
        events.emit("command_exit", level="warning", outcome="terminated", **exit_fields)
        if last:
            events.emit("chain_incomplete", level="warning", reason="the last link was ended by the scheduler")
        return 128 + int(flags.terminate)
    events.emit("command_exit", level="error", outcome="failed", **exit_fields)
    run.write_marker(run.failed_marker, {"link": link, "job_id": job_id, "code": code, "at": time.time()})
    events.emit("chain_failed", level="error", code=code, cancelled=_cancel(scheduler, later, events))
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
    return run_link(Path(args[0]), int(args[1]))


# --- following a chain from the login node ----------------------------------------------------------


def describe(event: Mapping[str, Any]) -> str | None:
    """One line for a person, or None for events not worth a line."""
    name = event.get("event")
    where = f"link {event.get('link')}/{event.get('links')}"
    job = f" (job {event['job_id']})" if event.get("job_id") else ""
    cancelled = event.get("cancelled") or []
    also = f"; cancelled job(s) {' '.join(cancelled)}" if cancelled else ""
    if name == "link_start":
        return f"{where}{job} started on {event.get('host')}, restart {event.get('restart_count')}"
    if name == "warning_forwarded":
        return f"{where}{job} warned the command (SIGUSR1) that its time is nearly up, from the {event.get('source')}"
    if name == "link_terminating":
        return f"{where}{job} is being ended by the scheduler ({event.get('signal')})"
    if name == "command_exit":
        how = f"signal {event['signal']}" if event.get("signal") else f"exit {event.get('code')}"
        return f"{where}{job} command ended with {how} after {event.get('seconds')} s: {event.get('outcome')}"
    if name == "link_skipped":
        return f"{where}{job} skipped: the chain had already {_why(event.get('reason'))}{also}"
    if name == "chain_done":
        return f"chain done: the command finished in {where}{also}"
    if name == "chain_failed":
        why = f"the command exited {event['code']} in {where}" if "code" in event else str(event.get("reason"))
        return f"chain failed: {why}{also}"
    if name == "chain_incomplete":
        return f"chain incomplete: {event.get('reason')} (resume from the checkpoints with a new chain)"
    if name == "cancel_failed":
        return f"{where}: could not cancel job(s) {' '.join(event.get('job_ids') or [])}: {event.get('error')}"
    return None


def _why(reason: Any) -> str:
    return {"done": "finished", "failed": "failed", "submit_failed": "failed to submit"}.get(str(reason), str(reason))


def follow(
    run_path: Path,
    scheduler: Scheduler,
    *,
    out: Callable[[str], None] = print,
    log_poll_s: float = 0.5,
    query_every_s: float = 5.0,
    settle_s: float = 120.0,
) -> int:
    """Print the chain's events as they come until it has ended; return 0 (done), 1 (failed), 75 (incomplete).

    The chain has ended when a final event is in chain.log and no link is pending or running
    any more (or ``settle_s`` after the final event). Should every link end without a final
    event (a link killed outright, e.g. Grid Engine's SIGKILL at h_rt without a warning), the
    follower decides and records it in chain.log itself.
    """
    run = RunDir(run_path)
    record = run.read()
    job_ids = [str(j) for j in record.get("job_ids") or []]
    links = int(record.get("links", len(job_ids)))
    offset = 0
    final: dict[str, Any] | None = None
    final_seen_at = 0.0
    states: dict[str, str] = {}
    next_query = time.monotonic() + query_every_s
    ended_polls = 0
    swept = False
    seen: list[dict[str, Any]] = []
    while True:
        offset, new = _read_new(run.log_file, offset)
        for event in new:
            seen.append(event)
            line = describe(event)
            if line:
                out(line)
            if final is None and event.get("event") in FINAL_EVENTS:
                final, final_seen_at, next_query = event, time.monotonic(), time.monotonic()
        now = time.monotonic()
        if now >= next_query:
            next_query = now + (1.0 if final is not None else query_every_s)
            try:
                current = scheduler.query(job_ids)
            except BridgeError as exc:
                out(f"(the scheduler did not answer: {exc}; still following)")
                current = None
            if current is not None:
                if final is not None and not swept:
                    swept = True
                    _sweep(run, record, scheduler, current, out)
                _print_states(job_ids, links, current, states, out)
                live = [j for j in job_ids if j in current and not current[j].state.is_terminal]
                ended_polls = ended_polls + 1 if not live else 0
                if final is not None and (ended_polls >= 2 or now - final_seen_at > settle_s):
                    if live:
                        out(f"(job(s) {' '.join(live)} still in the queue; stopped following)")
                    return FINAL_EVENTS[str(final["event"])]
                if final is None and ended_polls >= 3:
                    return _conclude(run, record, seen, current, out)
        time.sleep(log_poll_s)


def _sweep(
    run: RunDir,
    record: Mapping[str, Any],
    scheduler: Scheduler,
    current: Mapping[str, JobInfo],
    out: Callable[[str], None],
) -> None:
    """The chain has ended but links still wait: the link could not cancel them (on Grid Engine,
    an execution host need not be a submit host). Cancel them from here."""
    job_ids = [str(j) for j in record.get("job_ids") or []]
    waiting = [j for j in job_ids if j in current and current[j].state is JobState.PENDING]
    if not waiting:
        return
    events = ChainLog(run.log_file, chain=record.get("name"), links=record.get("links"))
    try:
        cancelled = _cancel(scheduler, waiting, events)
        if cancelled:
            events.emit("links_cancelled", job_ids=cancelled, by="follower")
            out(f"cancelled waiting job(s) {' '.join(cancelled)}")
    finally:
        events.close()


def _read_new(path: Path, offset: int) -> tuple[int, list[dict[str, Any]]]:
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return offset, []
    complete = data[: data.rfind(b"\n") + 1]
    events = [e for e in (_parse_event(line) for line in complete.decode(errors="replace").splitlines()) if e]
    return offset + len(complete), events


def _print_states(
    job_ids: Sequence[str],
    links: int,
    current: Mapping[str, JobInfo],
    states: dict[str, str],
    out: Callable[[str], None],
) -> None:
    for index, job_id in enumerate(job_ids, start=1):
        info = current.get(job_id)
        state = info.state.value if info is not None else JobState.MISSING.value
        if states.get(job_id) != state:
            if job_id in states or state != JobState.PENDING.value:
                said = "gone from the scheduler" if state == JobState.MISSING.value else state
                out(f"link {index}/{links} (job {job_id}): {said}")
            states[job_id] = state


def _conclude(
    run: RunDir,
    record: Mapping[str, Any],
    seen: Sequence[Mapping[str, Any]],
    current: Mapping[str, JobInfo],
    out: Callable[[str], None],
) -> int:
    """Every link ended and none said how the chain ended: say it in chain.log."""
    job_ids = [str(j) for j in record.get("job_ids") or []]
    ended = {j: (current[j].state.value if j in current else "gone") for j in job_ids}
    continued = any(e.get("event") == "command_exit" and e.get("outcome") in ("continue", "terminated") for e in seen)
    events = ChainLog(run.log_file, chain=record.get("name"), links=record.get("links"))
    try:
        if continued:
            event = {"event": "chain_incomplete", "reason": "the links ended without finishing the command"}
        else:
            event = {"event": "chain_failed", "reason": "the links ended without the command ever reporting an end"}
        events.emit(str(event["event"]), level="warning", reason=event["reason"], job_states=ended, by="follower")
    finally:
        events.close()
    out(describe(event) or str(event))
    return FINAL_EVENTS[str(event["event"])]


# --- the command line -------------------------------------------------------------------------------


def chain_command(args: Any, environ: Mapping[str, str] | None = None, out: Callable[[str], None] = print) -> int:
    """``hpc-bridge chain`` (arguments parsed in bridge/cli.py). Needs no credentials.env."""
    from bridge.logs import configure_logging

    env = dict(os.environ if environ is None else environ)
    try:
        command = list(args.cmd)
        if command and command[0] == "--":
            command = command[1:]
        limit_s = parse_time(args.time)
        name = args.name
        scheduler_name = scheduler_choice(args.scheduler, env)
        options = scheduler_options(scheduler_name, env)
        settings = ChainSettings(
            name=name,
            links=args.jobs,
            time_limit_s=limit_s,
            warn_s=default_warn(limit_s) if args.warn is None else args.warn,
            cpus=args.cpus,
            memory_mb=args.mem,
            gpus=args.gpus,
            command=tuple(resolve_command(command, env)),
            command_given=tuple(command),
            workdir=str(Path.cwd()),
            scheduler=scheduler_name,
            scheduler_options=options,
            account=args.account or "",
            partition=args.partition or "",
            environment=parse_environment(args.env, env),
        )
        settings.check()
        run_path = (args.run_dir or default_run_dir(name, Path.cwd())).absolute()
        scheduler = get_scheduler(scheduler_name, options=options)
    except (ChainError, ValueError) as exc:
        print(f"hpc-bridge chain: {exc}", file=sys.stderr)
        return 2
    configure_logging(level=env.get("HPC_LOG_LEVEL", "WARNING"), stream=sys.stderr, component="chain")
    run = RunDir(run_path)
    try:
        job_ids = submit_chain(settings, run, scheduler)
    except (ChainError, ValueError, OSError) as exc:  # e.g. a run directory with a space (no valid directive)
        print(f"hpc-bridge chain: {exc}", file=sys.stderr)
        return 2
    except BridgeError as exc:
        print(f"hpc-bridge chain: submission failed, nothing left queued: {exc}", file=sys.stderr)
        return 1
    out(f"run directory: {run_path}")
    out(f"{scheduler_name} job ids: {' '.join(job_ids)} (each starts after the one before has ended)")
    if settings.command != tuple(command):
        out(f"command: {' '.join(settings.command)}")
    if not args.wait:
        out(f"follow: tail -f {run.log_file}")
        return 0
    try:
        return follow(run_path, scheduler, out=out)
    except KeyboardInterrupt:
        out("stopped following; the chain goes on")
        return 130


def cancel_chain(run_path: Path, scheduler: Scheduler | None = None) -> list[str]:
    """Cancel every link of the chain in ``run_path`` that has not ended (tests, clean-up)."""
    record = RunDir(run_path).read()
    if scheduler is None:
        scheduler = get_scheduler(str(record["scheduler"]), options=record.get("scheduler_options") or {})
    cancelled = []
    for job_id in reversed([str(j) for j in record.get("job_ids") or []]):
        try:
            scheduler.cancel(job_id)
            cancelled.append(job_id)
        except (SchedulerUnavailable, ValueError):
            continue
    return cancelled


if __name__ == "__main__":
    sys.exit(link_main())
