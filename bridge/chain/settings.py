"""What a chain is asked for, and the contract with the command.

:class:`ChainSettings` is what ``hpc-bridge chain`` was asked for; it is recorded in
``chain.json`` and read back by every link. The parsers here turn the command line's options
into it (time limits, ``-v`` variables, the scheduler and its site options, the command made
absolute), and refuse what cannot work with :class:`ChainError`. The contract's constants live
here too: ``EX_TEMPFAIL`` (exit 75: continue in the next link) and ``CONTRACT_ENV`` (the
variables the supervisor sets for the command, which a ``-v`` may not override).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bridge.errors import BridgeError
from bridge.schedulers import DEFAULT_SCHEDULER, backend_name, choices_text, scheduler_class
from bridge.schedulers.base import ENV_NAME

EX_TEMPFAIL = 75  # sysexits.h: "temporary failure, try again" -> continue in the next link
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
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


class ChainError(BridgeError):
    """A chain cannot be submitted as asked (bad option, unusable run directory)."""


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
        if not ENV_NAME.match(name):
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
    """``--scheduler``, else ``$HPC_SCHEDULER``, else the default backend (a name or an alias:
    ``sge`` is Grid Engine)."""
    raw = requested or environ.get("HPC_SCHEDULER") or DEFAULT_SCHEDULER
    name = backend_name(raw)
    if not name:
        raise ChainError(f"unknown scheduler {raw!r}: use {choices_text()}")
    return name


def scheduler_options(name: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The constructor options of backend ``name`` from its site settings in the environment
    (Grid Engine: HPC_SGE_PE, ...; see ``Scheduler.site_options``)."""
    return scheduler_class(name).constructor_options(environ)


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
