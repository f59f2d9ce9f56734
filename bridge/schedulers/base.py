"""What every scheduler backend offers, and the one job-state vocabulary.

A backend is a short module: its batch-script template (a file in
``templates/``), how to render resource requests as directives, how to submit,
query and cancel, and a translation table from its own state names to
:class:`JobState`. It knows nothing of RabbitMQ, Rodan or the trainer.
"""

from __future__ import annotations

import os
import re
import shlex
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from importlib import resources
from pathlib import Path
from string import Template

from bridge.errors import SchedulerUnavailable
from bridge.shell import CommandError, CommandResult, run_command


class JobState(str, Enum):
    """The internal job state. Each backend maps its own names onto these.

    ``MISSING`` means the scheduler no longer (or not yet) knows the job: it is
    never read as finished. Reconciliation waits, and only gives up after a
    configured time.
    """

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    REQUEUED = "REQUEUED"  # going round again (same request, not an outcome)
    COMPLETED = "COMPLETED"  # exit status 0
    FAILED = "FAILED"  # non-zero exit status
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    MISSING = "MISSING"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset(
    {
        JobState.COMPLETED,
        JobState.FAILED,
        JobState.CANCELLED,
        JobState.TIMEOUT,
        JobState.OUT_OF_MEMORY,
        JobState.NODE_FAIL,
        JobState.PREEMPTED,
        JobState.BOOT_FAIL,
        JobState.DEADLINE,
    }
)


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    state: JobState
    native_state: str = ""  # the scheduler's own word, for messages
    exit_code: str = ""
    elapsed: str = ""
    source: str = ""  # "queue" (live) or "accounting"


@dataclass(frozen=True)
class JobSpec:
    """A batch job to submit. Every value here is validated before it reaches a script."""

    name: str
    comment: str
    time_minutes: int
    memory_mb: int
    cpus: int
    command: Sequence[str]
    output_path: Path
    workdir: Path
    gres: str | None = None
    email: str = ""
    account: str = ""
    partition: str = ""
    extra_args: Sequence[str] = field(default_factory=tuple)


# A directive value may hold no white space, quote, backslash or shell metacharacter:
# it is written verbatim after '#SBATCH ' and read back by the scheduler.
_DIRECTIVE_VALUE = re.compile(r"^[A-Za-z0-9@%+=:,./_-]+$")
# Environment variables a batch job must not inherit from the submitting process.
_SECRET_ENV_PREFIXES = ("RABBITMQ_", "RODAN_", "HPC_BRIDGE_CREDENTIALS")


def directive_value(name: str, value: object) -> str:
    text = str(value)
    if not _DIRECTIVE_VALUE.match(text):
        raise ValueError(f"refusing unsafe value for {name}: {text!r}")
    return text


def scrubbed_environment() -> dict[str, str]:
    """The environment for scheduler commands, without any credential variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_SECRET_ENV_PREFIXES)}


class Scheduler(ABC):
    """One batch scheduler. Subclasses are ~100 lines each."""

    name: str
    template_name: str
    directive_prefix: str

    def __init__(self, *, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s

    # --- rendering -----------------------------------------------------------
    def template(self) -> Template:
        text = resources.files("bridge.schedulers").joinpath(f"templates/{self.template_name}").read_text()
        return Template(text)

    @abstractmethod
    def directives(self, spec: JobSpec) -> list[str]:
        """The resource requests as directive arguments (without the prefix)."""

    def render(self, spec: JobSpec) -> str:
        lines = [f"{self.directive_prefix} {d}" for d in self.directives(spec)]
        return self.template().substitute(
            directives="\n".join(lines),
            command=shlex.join(spec.command),
            workdir=shlex.quote(str(spec.workdir)),
            job_name=directive_value("job name", spec.name),
        )

    # --- operations ----------------------------------------------------------
    @abstractmethod
    def submit(self, script: Path, spec: JobSpec) -> str:
        """Submit the rendered script; return the job id. Raises SchedulerRejected/Unavailable."""

    @abstractmethod
    def query(self, job_ids: Sequence[str]) -> Mapping[str, JobInfo]:
        """States of the given jobs; a job the scheduler does not know is absent from the result."""

    @abstractmethod
    def find_by_name(self, name: str) -> list[str]:
        """Ids of jobs with this name (live or in accounting): dedupe after a crash."""

    @abstractmethod
    def cancel(self, job_id: str) -> None: ...

    def ping(self) -> str:
        """A one-line description of the cluster; raises SchedulerUnavailable."""
        raise NotImplementedError

    # --- the one way to run a scheduler command ------------------------------
    def _run(self, argv: Sequence[str], *, check: bool = True) -> CommandResult:
        try:
            return run_command(argv, timeout=self.timeout_s, env=scrubbed_environment(), check=check)
        except CommandError as exc:
            if check and exc.result.returncode > 0:
                raise
            raise SchedulerUnavailable(f"{self.name}: {exc}") from exc
