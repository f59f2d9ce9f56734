"""The one gate every subprocess goes through.

Argument lists only (never a shell), always a timeout, and a typed error that
carries what the command printed, so callers can classify failures (e.g. quote
the scheduler's rejection message in an error reply).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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


def run_command(
    argv: Sequence[str],
    *,
    timeout: float,
    input_text: str | None = None,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> CommandResult:
    """Run ``argv`` without a shell and return its output.

    Raises :class:`CommandTimeout`, :class:`CommandNotFound`, or (with
    ``check``) :class:`CommandError` for a non-zero exit.
    """
    args = tuple(str(a) for a in argv)
    started = time.monotonic()
    try:
        proc = subprocess.run(
            args,
            input=input_text,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(env) if env is not None else None,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        result = CommandResult(args, -1, _text(exc.stdout), _text(exc.stderr), time.monotonic() - started)
        log.warning("command_timeout", command=args[0], timeout_s=timeout)
        raise CommandTimeout(result, f"timed out after {timeout:g} s") from None
    except FileNotFoundError:
        result = CommandResult(args, -1, "", f"{args[0]}: command not found", time.monotonic() - started)
        raise CommandNotFound(result, "not found") from None
    result = CommandResult(args, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)
    log.debug("command_ran", command=args[0], rc=proc.returncode, seconds=round(result.seconds, 3))
    if check and proc.returncode != 0:
        raise CommandError(result, f"exit status {proc.returncode}")
    return result


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value
