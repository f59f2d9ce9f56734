"""The one gate every subprocess goes through.

Argument lists only (never a shell), always a timeout, and a typed error that
carries what the command printed, so callers can classify failures (e.g. quote
the scheduler's rejection message in an error reply). This is the only module of
the project that imports :mod:`subprocess` (an import contract in pyproject.toml
and tests/test_import_contracts.py enforce it): :func:`run_command` for a short
command (``stop`` makes it interruptible from another thread, as the GPU monitor
needs), :func:`supervise` for a long-lived one inside a batch job.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    seconds: float


class CommandError(Exception):
    """A command exited non-zero, timed out, or could not be started."""

    def __init__(self, result: CommandResult, reason: str) -> None:
        self.result = result
        self.reason = reason
        super().__init__(f"{result.argv[0]}: {reason}: {result.stderr.strip() or result.stdout.strip()}")

    @property
    def output(self) -> str:
        """stderr and stdout together, for matching known messages."""
        return f"{self.result.stderr}\n{self.result.stdout}".strip()


class CommandTimeout(CommandError):
    """The command did not finish within its timeout and was killed."""


class CommandNotFound(CommandError):
    """The executable does not exist on this machine."""


class CommandInterrupted(CommandError):
    """The caller's ``stop`` said so while the command ran; the command's process group was killed."""


def run_command(
    argv: Sequence[str],
    *,
    timeout: float,
    input_text: str | None = None,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    cwd: Path | None = None,
    stop: Callable[[], bool] | None = None,
    poll_interval: float = 0.05,
) -> CommandResult:
    """Run ``argv`` without a shell and return its output (bytes that do not decode become U+FFFD).

    Raises :class:`CommandTimeout`, :class:`CommandNotFound`, or (with
    ``check``) :class:`CommandError` for a non-zero exit. ``cwd``: the directory it runs in.

    With ``stop``, the command runs in a session (process group) of its own and ``stop()`` is
    asked every ``poll_interval`` seconds, from the calling thread, while it runs: once it
    returns true the whole group is killed (SIGKILL) and :class:`CommandInterrupted` is raised
    with what the command had printed. Another thread stops the command by setting what
    ``stop`` reads (e.g. ``threading.Event().is_set``). A command is not started when ``stop()``
    is already true. On a timeout the whole group is killed too.
    """
    args = tuple(str(a) for a in argv)
    if stop is not None:
        return _run_interruptible(
            args,
            timeout=timeout,
            input_text=input_text,
            env=env,
            check=check,
            cwd=cwd,
            stop=stop,
            poll_interval=poll_interval,
        )
    started = time.monotonic()
    try:
        proc = subprocess.run(
            args,
            input=input_text,
            capture_output=True,
            text=True,
            errors="replace",  # output that is not valid in the locale's encoding never raises
            timeout=timeout,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        result = CommandResult(args, -1, _text(exc.stdout), _text(exc.stderr), time.monotonic() - started)
        log.warning("command_timeout", command=args[0], timeout_s=timeout)
        raise CommandTimeout(result, f"timed out after {timeout:g} s") from None
    except OSError as exc:
        raise _not_started(args, exc, started) from None
    result = CommandResult(args, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)
    log.debug("command_ran", command=args[0], rc=proc.returncode, seconds=round(result.seconds, 3))
    if check and proc.returncode != 0:
        raise CommandError(result, f"exit status {proc.returncode}")
    return result


def _not_started(args: tuple[str, ...], exc: OSError, started: float) -> CommandError:
    """The typed error for a command that could not start: not found, or not executable."""
    seconds = time.monotonic() - started
    if isinstance(exc, FileNotFoundError):
        return CommandNotFound(CommandResult(args, -1, "", f"{args[0]}: command not found", seconds), "not found")
    return CommandError(CommandResult(args, -1, "", f"{args[0]}: {exc.strerror or exc}", seconds), "could not start")


def _start(args: tuple[str, ...], started: float, **popen: Any) -> subprocess.Popen[Any]:
    """``Popen(args, **popen)``; a command that cannot start raises :func:`_not_started`'s error."""
    try:
        return subprocess.Popen(args, **popen)
    except OSError as exc:
        raise _not_started(args, exc, started) from None


def _run_interruptible(
    args: tuple[str, ...],
    *,
    timeout: float,
    input_text: str | None,
    env: Mapping[str, str] | None,
    check: bool,
    cwd: Path | None,
    stop: Callable[[], bool],
    poll_interval: float,
) -> CommandResult:
    """:func:`run_command` with ``stop``: a polling loop around one ``Popen``."""
    started = time.monotonic()
    if stop():
        raise CommandInterrupted(CommandResult(args, -1, "", "", 0.0), "stopped before it started")
    proc = _start(
        args,
        started,
        stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        env=dict(env) if env is not None else None,
        cwd=cwd,
        start_new_session=True,  # its own process group: killing it reaches what it started
    )
    deadline = started + timeout
    pending_input = input_text  # communicate() takes the input on its first call only
    while True:
        remaining = deadline - time.monotonic()
        interrupted = stop()
        if interrupted or remaining <= 0:
            out, err = _kill_group(proc)
            result = CommandResult(args, -1, out, err, time.monotonic() - started)
            if interrupted:
                raise CommandInterrupted(result, "stopped")
            log.warning("command_timeout", command=args[0], timeout_s=timeout)
            raise CommandTimeout(result, f"timed out after {timeout:g} s")
        try:
            out, err = proc.communicate(pending_input, timeout=min(poll_interval, remaining))
        except subprocess.TimeoutExpired:
            pending_input = None
            continue
        break
    result = CommandResult(args, proc.returncode, out, err, time.monotonic() - started)
    log.debug("command_ran", command=args[0], rc=proc.returncode, seconds=round(result.seconds, 3))
    if check and proc.returncode != 0:
        raise CommandError(result, f"exit status {proc.returncode}")
    return result


def _kill_group(proc: subprocess.Popen[str], grace: float = 5.0) -> tuple[str, str]:
    """SIGKILL ``proc``'s process group, reap it and return what it printed.

    A descendant that left the group and holds the pipes open is not waited for longer than
    ``grace`` seconds: the output read by then is returned.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        out, err = proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired as exc:
        out, err = _text(exc.stdout), _text(exc.stderr)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    proc.wait()
    return out or "", err or ""


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def supervise(
    argv: Sequence[str],
    *,
    timeout: float,
    poll: Callable[[subprocess.Popen[bytes]], None] | None = None,
    poll_interval: float = 0.2,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    ignore_signals: Sequence[int] = (),
    kill_grace: float = 10.0,
) -> CommandResult:
    """Run ``argv`` (no shell) as a long-lived child that shares this process's stdout and stderr.

    For a command that runs for hours inside a batch job. ``poll`` is called with the child
    every ``poll_interval`` seconds while it runs, from this (the main) thread: that is where a
    caller acts on flags its signal handlers set, e.g. forwards a warning with
    ``child.send_signal``. ``ignore_signals`` start ignored in the child (a signal this process
    handles would otherwise reset to its default action, which kills). The returned result has
    the child's exit status (negative: killed by that signal) and no output, even when it is
    non-zero: the caller classifies it. Raises :class:`CommandNotFound` or :class:`CommandError`
    when the command cannot start, and :class:`CommandTimeout` after ``timeout`` seconds (the
    child then gets SIGTERM, and SIGKILL ``kill_grace`` seconds later).
    """
    args = tuple(str(a) for a in argv)
    started = time.monotonic()
    ignored = tuple(ignore_signals)

    def in_child() -> None:  # runs in the child between fork and exec
        for sig in ignored:
            signal.signal(sig, signal.SIG_IGN)

    child = _start(
        args,
        started,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        preexec_fn=in_child if ignored else None,  # a supervisor runs no threads
    )
    log.debug("command_started", command=args[0], pid=child.pid)
    deadline = started + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _stop(child, kill_grace)
            result = CommandResult(args, -1, "", "", time.monotonic() - started)
            log.warning("command_timeout", command=args[0], timeout_s=timeout)
            raise CommandTimeout(result, f"timed out after {timeout:g} s")
        try:
            returncode = child.wait(timeout=min(poll_interval, remaining))
        except subprocess.TimeoutExpired:
            if poll is not None:
                poll(child)
            continue
        break
    result = CommandResult(args, returncode, "", "", time.monotonic() - started)
    log.debug("command_ran", command=args[0], rc=returncode, seconds=round(result.seconds, 3))
    return result


def _stop(child: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; reaps the child."""
    with contextlib.suppress(ProcessLookupError):
        child.terminate()
    try:
        child.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        child.wait()
