"""What every scheduler backend offers, and the one job-state vocabulary.

A backend is a short module: its batch-script template (a file in
``templates/``), how to render resource requests as directives, how to submit,
query and cancel, and a translation table from its own state names to
:class:`JobState`. It knows nothing of RabbitMQ, Rodan or the trainer.

Everything the rest of the bridge needs to know about a backend is on its class (names, aliases,
commands, site settings, what its jobs are given, advice for ``doctor``), and the class is listed
once in ``bridge/schedulers/__init__.py``: a new backend is a new module here and one line there.
"""

from __future__ import annotations

import os
import pwd
import re
import shlex
import signal
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

from bridge.errors import SchedulerRejected, SchedulerUnavailable, SubmitLimitReached
from bridge.shell import CommandError, CommandResult, run_command
from bridge.spool import atomic_write


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
    ERROR = "ERROR"  # held by the scheduler in an error state (Grid Engine Eqw): it will never run on its own
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
        JobState.ERROR,
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
    reason: str = ""  # why a PENDING job waits, in the scheduler's words (one line, <= REASON_CHARS); else ""


#: The longest pending reason kept in a :class:`JobInfo`.
REASON_CHARS = 300


def one_line(text: str, limit: int = REASON_CHARS) -> str:
    """``text`` as one line of at most ``limit`` characters (white space runs squeezed to one space)."""
    return " ".join(text.split())[:limit]


def format_duration(minutes: int) -> str:
    """Minutes -> ``D-HH:MM`` (Slurm's ``--time`` and a request's 'Maximum time (D-HH:MM)')."""
    days, rest = divmod(minutes, 1440)
    return f"{days}-{rest // 60:02d}:{rest % 60:02d}"


@dataclass(frozen=True)
class SiteOption:
    """One site setting of a backend (``HPC_SGE_PE``): read by ``load_config`` from the credentials,
    and by ``hpc-bridge chain`` from the environment.

    ``keyword`` is the backend's constructor keyword the value is given as ("": none, the setting
    reaches the job through :class:`JobSpec` instead, see :attr:`Scheduler.account_setting`);
    ``choices`` the values allowed (none: any text); ``private_as`` what error replies say instead
    of the value (``<account>``; "": nothing to hide).
    """

    setting: str
    default: str = ""
    keyword: str = ""
    choices: tuple[str, ...] = ()
    private_as: str = ""


@dataclass(frozen=True)
class JobSpec:
    """A batch job to submit. Every value here is validated before it reaches a script.

    ``log_dir`` receives the job's output, in a file the backend names after the job id
    (:meth:`Scheduler.log_file`). ``gres`` is a Slurm-style GPU request (``gpu:1``,
    ``gpu:v100l:2``); backends without GPU types use its count (:func:`gpu_count`).
    ``account`` is Slurm's account or Grid Engine's project, ``partition`` Slurm's
    partition or Grid Engine's queue. With ``warn_seconds`` the job is signalled that
    long before its time limit and may continue itself: ``continue_by`` ``"requeue"`` (Slurm:
    the same job id runs again) or ``"successor"`` (a new job held on it; the only way on Grid
    Engine, for which the value does not matter). ``hold_after`` starts the job only after
    that job has ended, whatever its outcome. ``environment`` is exported to the job (like ``qsub -v``);
    its values are shell-quoted, never secrets.

    The site's own additions (``HPC_JOB_DIRECTIVES``, ``HPC_JOB_PROLOGUE``): ``directives`` are
    written as extra directive lines after the bridge's own (each one option and its value, e.g.
    ``--constraint=v100`` or ``-l h_vmem=4G``; never one the bridge sets itself, see
    :meth:`Scheduler.reserved_option`), and ``prologue`` is shell lines run in the job just before
    the command (``module load``, ``source``, proxies); a failing line ends the job there.
    """

    name: str
    comment: str
    time_minutes: int
    memory_mb: int
    cpus: int
    command: Sequence[str]
    log_dir: Path
    workdir: Path
    gres: str | None = None
    email: str = ""
    account: str = ""
    partition: str = ""
    warn_seconds: int = 0
    continue_by: str = "requeue"  # one of CONTINUE_BY
    hold_after: str = ""
    environment: Mapping[str, str] = field(default_factory=dict)
    extra_args: Sequence[str] = field(default_factory=tuple)
    directives: Sequence[str] = field(default_factory=tuple)
    prologue: str = ""

    @property
    def gpus(self) -> int:
        return gpu_count(self.gres)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values (a job that continues itself re-renders its successor from them)."""
        data = asdict(self)
        data.update(
            command=list(self.command),
            log_dir=str(self.log_dir),
            workdir=str(self.workdir),
            environment=dict(self.environment),
            extra_args=list(self.extra_args),
            directives=list(self.directives),
        )
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobSpec:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values.update(
            command=tuple(values["command"]),
            log_dir=Path(values["log_dir"]),
            workdir=Path(values["workdir"]),
            environment=dict(values.get("environment") or {}),
            extra_args=tuple(values.get("extra_args") or ()),
            directives=tuple(values.get("directives") or ()),
        )
        return cls(**values)


# An exported variable's name (its value is shell-quoted instead); `hpc-bridge chain -v` checks it too.
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A directive value may hold no white space, quote, backslash or shell metacharacter:
# it is written verbatim after '#SBATCH ' and read back by the scheduler.
# Matched with fullmatch: '$' would let a trailing newline through.
_DIRECTIVE_VALUE = re.compile(r"[A-Za-z0-9@%+=:,./_-]+")
# Environment variables a batch job must not inherit from the submitting process.
_SECRET_ENV_PREFIXES = ("RABBITMQ_", "RODAN_", "HPC_BRIDGE_CREDENTIALS")


#: How a job warned before its time limit continues (``JobSpec.continue_by``).
CONTINUE_BY = ("requeue", "successor")


def directive_value(name: str, value: object) -> str:
    text = str(value)
    if not _DIRECTIVE_VALUE.fullmatch(text):
        raise ValueError(f"refusing unsafe value for {name}: {text!r}")
    return text


# What a site directive (HPC_JOB_DIRECTIVES entry) may not hold: control characters (a newline would
# start a new script line), a comment sign, quotes, a backslash or anything a shell reads specially.
_SITE_DIRECTIVE_UNSAFE = re.compile(r"[\x00-\x1f\x7f#'\"\\$`;&|<>()]")


def site_directive(text: str) -> str:
    """One ``HPC_JOB_DIRECTIVES`` entry, checked: an option (``-...``), single spaces, nothing unsafe."""
    if not text.startswith("-") or text.strip("-") == "" or text != " ".join(text.split()):
        raise ValueError(f"refusing unsafe value for HPC_JOB_DIRECTIVES entry: {text!r} (one option, e.g. --nice=10)")
    if _SITE_DIRECTIVE_UNSAFE.search(text):
        raise ValueError(f"refusing unsafe value for HPC_JOB_DIRECTIVES entry: {text!r}")
    return text


def parse_omit(text: str) -> tuple[str, ...]:
    """A backend's omit setting (``HPC_SLURM_OMIT=--mem, --mail-type``, ``HPC_SGE_OMIT=-l mem_free, -m``):
    the options, comma-separated, each with single spaces, in order, without repeats."""
    return tuple(dict.fromkeys(" ".join(entry.split()) for entry in text.split(",") if entry.strip()))


#: The start of why one of the bridge's own options cannot be left out (``Scheduler.own_options``).
NEEDED = "the bridge cannot work without it: "


def render_prologue(spec: JobSpec, directive_prefix: str) -> str:
    """``spec.prologue`` as the block that runs just before the command ("" without one).

    It runs under ``set -eo pipefail`` (not ``-u``: environment-module and conda scripts read unset
    variables), so a failing line ends the job there, with a line in the job's log saying so; then
    ``set -u`` again and back to the working directory. A line that the scheduler would read as a
    directive (``#SBATCH``, ``#$``; Grid Engine reads them anywhere in the script) is refused.
    """
    text = spec.prologue.strip("\n")
    if not text.strip():
        return ""
    if "\0" in text:
        raise ValueError("refusing unsafe value for HPC_JOB_PROLOGUE: it holds a NUL character")
    for line in text.splitlines():
        if line.lstrip().startswith(directive_prefix):
            raise ValueError(
                f"refusing unsafe value for HPC_JOB_PROLOGUE: the line {line.strip()!r} would be read as a "
                "scheduler directive; put directives in HPC_JOB_DIRECTIVES"
            )
    return (
        "# The site's set-up (HPC_JOB_PROLOGUE): a failing line ends the job here.\n"
        "set +u\n"
        "trap 'echo \"hpc-bridge: HPC_JOB_PROLOGUE failed (exit $?, line $LINENO of this script)\" >&2' ERR\n"
        f"{text}\n"
        "trap - ERR\n"
        "set -u\n"
        f"cd {shlex.quote(str(spec.workdir))}\n"
    )


def gpu_count(gres: str | None) -> int:
    """``gpu:v100l:2`` -> 2, ``gpu`` -> 1, ``None`` -> 0."""
    if not gres:
        return 0
    last = gres.rsplit(":", 1)[-1]
    return int(last) if last.isdigit() else 1


def render_environment(spec: JobSpec, scheduler: str) -> str:
    """``export NAME=value`` lines: what every job is told about itself, then ``spec.environment``.

    Names are checked and values shell-quoted. Every job gets ``HPC_JOB_SCHEDULER``,
    ``HPC_JOB_TIME_LIMIT_S`` and ``HPC_JOB_WARN_S`` (0: no warning before the limit);
    the template adds ``HPC_JOB_ID`` and ``HPC_JOB_STARTED`` (epoch seconds) at run time.
    """
    standard = {
        "HPC_JOB_SCHEDULER": scheduler,
        "HPC_JOB_TIME_LIMIT_S": str(int(spec.time_minutes) * 60),
        "HPC_JOB_WARN_S": str(int(spec.warn_seconds)),
    }
    lines = []
    for name, value in {**standard, **spec.environment}.items():
        if not ENV_NAME.fullmatch(name):
            raise ValueError(f"refusing unsafe value for environment variable name: {name!r}")
        if "\n" in value or "\0" in value:
            raise ValueError(f"refusing unsafe value for {name}: {value!r}")
        lines.append(f"export {name}={shlex.quote(value)}")
    return "\n".join(lines)


# A user name as it goes on a scheduler command line (--user=NAME, -u NAME, -o NAME): never an option.
_USER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]*")


def current_user() -> str:
    """The effective user's name (its uid as digits where the password database has no entry)."""
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def plain_job_id(text: str) -> str:
    """``text`` stripped when it is a plain job id (ASCII digits only), else "".

    Array tasks (Slurm ``123_1``, ``123_[0-1]``; Grid Engine ``123.1``), heterogeneous job parts
    (``123+0``), job steps (``123.batch``) and garbage are never one of the bridge's jobs.
    """
    word = text.strip()
    return word if word.isascii() and word.isdigit() else ""


def scrubbed_environment() -> dict[str, str]:
    """The environment for scheduler commands, without any credential variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_SECRET_ENV_PREFIXES)}


def _option_problem(what: str, text: str, why: str) -> str:
    """One problem of a site's scheduler options: ``HPC_JOB_DIRECTIVES entry '--time=5': why``."""
    return f"{what} {text!r}: {why}"


class Scheduler(ABC):
    """One batch scheduler. Subclasses are ~100-200 lines each.

    ``job_id_variable`` is the environment variable in which a running job finds its own
    id; ``log_name`` is the job's output file inside ``JobSpec.log_dir`` in the
    scheduler's own pattern, with ``log_name_id`` standing for the job id.

    Only our jobs: every lookup (query, find_by_name) and every cancel is restricted to the jobs
    of ``user``, the effective user of this process unless given (tests). Job names are public,
    so another user's job named like one of ours must never be adopted, read or cancelled.
    """

    # --- what the rest of the bridge knows of a backend (nothing else names it) ----------
    name: str  # HPC_SCHEDULER's value, and the ledger's record of which backend ran a job
    #: Other accepted spellings of HPC_SCHEDULER and ``hpc-bridge chain --scheduler`` (lower case).
    aliases: tuple[str, ...] = ()
    display_name: str  # for people: "Slurm", "Grid Engine"
    short_name: str  # in tables and progress lines ("sge 12"): ``hpc-bridge status``, ``enqueue --wait``
    #: The commands the backend runs; the first one submits (``doctor`` and ``install`` look for them on PATH).
    commands: tuple[str, ...] = ()
    #: Environment variables its commands need from the shell that runs the bridge (cron, systemd):
    #: ``install`` writes them into the units it makes.
    command_environment: tuple[str, ...] = ()
    #: The site settings it reads (its own names start with ``setting_prefix``).
    site_options: tuple[SiteOption, ...] = ()
    setting_prefix: str = ""
    #: The site options that are ``JobSpec.account``, ``JobSpec.partition`` and ``JobSpec.continue_by``
    #: (""; none: no account/partition, and jobs always continue by a successor).
    account_setting: str = ""
    partition_setting: str = ""
    continue_setting: str = ""
    #: The signal a job is warned with before its time limit (the worker catches every backend's).
    warning_signal: signal.Signals = signal.SIGUSR1
    #: Variables naming a job's node-local scratch directory, tried before ``$TMPDIR``.
    scratch_variables: tuple[str, ...] = ()
    #: Variables saying a job runs again (a count, or a flag), as its jobs see them.
    restart_variables: tuple[str, ...] = ()
    #: For ``doctor``'s advice: the daemon its commands talk to, how they find it (a clause that ends
    #: the fix, "" when nothing to add), what else to try when the commands are not on PATH.
    controller: str = ""
    controller_hint: str = ""
    commands_hint: str = ""
    #: The command that reads ended jobs, what to fix when it does not answer, and whether it
    #: needs the controller's settings to answer at all (judged only once the controller answers).
    accounting_command: str = ""
    accounting_fix: str = ""
    accounting_needs_controller: bool = False

    # --- rendering and running ---------------------------------------------------------------
    template_name: str
    directive_prefix: str
    job_id_variable: str
    log_name: str
    log_name_id: str
    #: The site setting that leaves out some of the bridge's own options (``omit`` of the constructor;
    #: "": none can be): :meth:`own_options` says which.
    omit_setting: str = ""
    #: Words in the submit command's output that no retry can fix: the request is refused for good.
    permanent_submit_errors: tuple[str, ...] = ()
    #: Words in the submit command's output that say a submit limit (jobs per user, account or cluster)
    #: is reached: the job is taken once earlier ones have ended. Checked before the permanent ones.
    submit_limit_errors: tuple[str, ...] = ()

    def __init__(self, *, timeout_s: float = 60.0, user: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.user = current_user() if user is None else user
        if not _USER_NAME.fullmatch(self.user):
            raise ValueError(f"refusing unsafe value for the scheduler user: {self.user!r}")
        self.omit: tuple[str, ...] = ()  # the bridge's own options left out (checked_omit)

    @classmethod
    def translate(cls, native: str) -> JobState:
        """The scheduler's own state word -> :class:`JobState`; a word it does not know is MISSING."""
        raise NotImplementedError

    @classmethod
    def site_option(cls, setting: str) -> SiteOption | None:
        """The site option named ``setting`` (None: not one of this backend's)."""
        return next((o for o in cls.site_options if o.setting == setting), None)

    @classmethod
    def constructor_options(cls, values: Mapping[str, str]) -> dict[str, str]:
        """Constructor keywords from site settings ``values`` (setting name -> value); an option
        that is unset or empty there is left out (the constructor's default applies)."""
        return {o.keyword: values[o.setting] for o in cls.site_options if o.keyword and values.get(o.setting)}

    @classmethod
    def lookup_options(cls, scheduler_args: Sequence[str]) -> dict[str, Any]:
        """Constructor keywords derived from ``HPC_SCHEDULER_ARGS`` (the submit command's extra
        arguments) that every other command of this backend needs too; none by default."""
        return {}

    # --- rendering -----------------------------------------------------------
    def template(self) -> Template:
        text = resources.files("bridge.schedulers").joinpath(f"templates/{self.template_name}").read_text()
        return Template(text)

    @abstractmethod
    def directives(self, spec: JobSpec) -> list[str]:
        """The resource requests as directive arguments (without the prefix), all of them: :meth:`render`
        leaves out those the site omits (:attr:`omit`)."""

    def directive_key(self, directive: str) -> str:
        """The option one of the bridge's own directives sets, as :meth:`own_options` and the omit
        setting name it: ``--mem=4000M`` -> ``--mem``, ``-w e`` -> ``-w``."""
        return directive.split("=", 1)[0].split()[0]

    def own_options(self) -> dict[str, str]:
        """Every option the bridge's own directives set (:meth:`directive_key`) -> why the site cannot
        leave it out with :attr:`omit_setting` ("" when it can)."""
        return {}

    def omittable(self) -> list[str]:
        """The bridge's own options that :attr:`omit_setting` may leave out."""
        return [option for option, why in self.own_options().items() if not why]

    def checked_omit(self, text: str) -> tuple[str, ...]:
        """The omit setting's value ``text`` (:func:`parse_omit`), checked: an option the bridge cannot
        work without, or one it never sets, raises ValueError naming the setting and what can be left out."""
        options = parse_omit(text)
        own = self.own_options()
        for option in options:
            if option in own and not own[option]:
                continue
            why = (
                f"{option} cannot be left out: {own[option]}" if option in own else f"{option} is not set by the bridge"
            )
            allowed = ", ".join(self.omittable()) or "none"
            raise ValueError(f"{self.omit_setting or 'omit'}: {why} (what can be left out: {allowed})")
        return options

    def set_by_bridge(self, option: str, why: str, key: str = "") -> str:
        """Why a site may not set ``option`` itself (directive or submit argument): the bridge sets it,
        because ``why``; with how to leave it out when :attr:`omit_setting` can (``key``: its name there)."""
        hint = f" ({self.omit_setting}={key} leaves it out)" if key and key in self.omittable() else ""
        return f"{option} is set by the bridge: {why}{hint}"

    def reserved_in(self, words: Sequence[str], *, command_line: bool = False) -> list[tuple[str, str]]:
        """The options among ``words`` that the bridge sets itself (job name, log file, time, memory,
        continuation...): ``(the option as written, why it may not be used)`` for each, in order.
        ``words`` are one directive's (``--time 5``), or with ``command_line`` the submit command's
        extra arguments (``HPC_SCHEDULER_ARGS``), where what only a script must not do (hold the job,
        choose the cluster) is fine."""
        return []

    def reserved_option(self, directive: str) -> str:
        """Why the site directive ``directive`` may not be used ("" when it may): it sets an option
        the bridge sets itself (:meth:`reserved_in`)."""
        found = self.reserved_in(directive.split())
        return found[0][1] if found else ""

    def directive_problems(self, directives: Sequence[str]) -> list[str]:
        """Why each unusable ``HPC_JOB_DIRECTIVES`` entry cannot be used (none: []), for a check at start."""
        problems = []
        for text in directives:
            try:
                why = self.reserved_option(site_directive(text))
            except ValueError as exc:
                why = str(exc)
            if why:
                problems.append(_option_problem("HPC_JOB_DIRECTIVES entry", text, why))
        return problems

    def argument_problems(self, arguments: Sequence[str]) -> list[str]:
        """Why ``HPC_SCHEDULER_ARGS`` cannot be used (none: []), for a check at start: the same options
        as in :meth:`directive_problems` (the command line overrides the script's directives), but
        for those a command line may give (:meth:`reserved_in`)."""
        return [
            _option_problem("HPC_SCHEDULER_ARGS argument", text, why)
            for text, why in self.reserved_in(arguments, command_line=True)
        ]

    def site_directives(self, spec: JobSpec) -> list[str]:
        """``spec.directives`` checked: safe text, and none that overrides one of the bridge's own."""
        checked = []
        for text in spec.directives:
            why = self.reserved_option(site_directive(text))
            if why:
                raise ValueError(f"refusing HPC_JOB_DIRECTIVES entry {text!r}: {why}")
            checked.append(text)
        return checked

    def own_directives(self, spec: JobSpec) -> list[str]:
        """:meth:`directives` without those the site leaves out (:attr:`omit`)."""
        return [d for d in self.directives(spec) if self.directive_key(d) not in self.omit]

    def render(self, spec: JobSpec) -> str:
        """The batch script of ``spec``: the one renderer (the bridge's submits, continuations,
        ``hpc-bridge chain``, ``doctor`` and ``hpc-bridge script``)."""
        lines = [f"{self.directive_prefix} {d}" for d in [*self.own_directives(spec), *self.site_directives(spec)]]
        return self.template().substitute(
            directives="\n".join(lines),
            environment=render_environment(spec, self.name),
            command=shlex.join(spec.command),
            workdir=shlex.quote(str(spec.workdir)),
            job_name=directive_value("job name", spec.name),
            prologue=render_prologue(spec, self.directive_prefix),
        )

    def log_path(self, spec: JobSpec) -> str:
        """The output-file directive value: the log directory plus the scheduler's pattern."""
        return f"{directive_value('log directory', spec.log_dir)}/{self.log_name}"

    def log_file(self, log_dir: Path, job_id: str) -> Path:
        """Where the output of job ``job_id`` went."""
        return log_dir / self.log_name.replace(self.log_name_id, job_id)

    # --- operations ----------------------------------------------------------
    def submit_command(self, script: Path, spec: JobSpec) -> list[str]:
        """The command that submits ``script``: the submit command (the first of :attr:`commands`), its
        own options, then ``spec.extra_args`` (``HPC_SCHEDULER_ARGS``)."""
        return [self.commands[0], *spec.extra_args, str(script)]

    @abstractmethod
    def submit(self, script: Path, spec: JobSpec) -> str:
        """Submit the rendered script (:meth:`submit_command`); return the job id. Raises
        SchedulerRejected/Unavailable."""

    @abstractmethod
    def query(self, job_ids: Sequence[str]) -> Mapping[str, JobInfo]:
        """States of the given jobs of ours; a job the scheduler does not know, or another user's, is
        absent from the result. A PENDING job's ``reason`` says why it waits, where the scheduler says."""

    @abstractmethod
    def find_by_name(self, name: str) -> list[str]:
        """Ids (plain digits, ascending) of our jobs with this name, live or in accounting: dedupe
        after a crash. Array jobs and other users' jobs are never among them."""

    @abstractmethod
    def cancel(self, job_id: str) -> None:
        """Cancel job ``job_id`` if it is ours and has not ended; another user's job is left alone."""

    def continue_job(self, job_id: str, script: Path, spec: JobSpec) -> str:
        """Run the job ``spec`` (rendered as ``script``) again once job ``job_id`` has ended.

        Returns the id to watch from now on. The default submits a successor held on
        ``job_id`` (:meth:`write_successor`; Grid Engine ``-hold_jid``); Slurm requeues the
        same job instead unless ``spec.continue_by`` is ``"successor"``. Called from inside
        the running job, last of all.
        """
        path, successor = self.write_successor(job_id, script, spec)
        return self.submit(path, successor)

    def continues_by(self, spec: JobSpec) -> str:
        """How :meth:`continue_job` continues the job ``spec``: one of CONTINUE_BY."""
        return "successor"

    def write_successor(self, job_id: str, script: Path, spec: JobSpec) -> tuple[Path, JobSpec]:
        """The job ``spec`` held on job ``job_id``, rendered beside ``script`` (``job-after-ID.sh``)."""
        successor = replace(spec, hold_after=job_id)
        path = script.with_name(f"{script.stem}-after-{directive_value('job id', job_id)}{script.suffix}")
        atomic_write(path, self.render(successor).encode("utf-8"), mode=0o700)
        return path, successor

    def ping(self) -> str:
        """A one-line description of the cluster; raises SchedulerUnavailable."""
        raise NotImplementedError

    def check_accounting(self) -> str:
        """Whether the accounting that :meth:`query` reads for ended jobs answers (a one-line
        description); raises SchedulerUnavailable, with the scheduler's words, when it does not."""
        raise NotImplementedError

    def clean(self, message: str) -> str:
        """A scheduler command's output as one line for logs and error replies."""
        return " ".join(line.strip() for line in message.splitlines() if line.strip())[:500]

    # --- the one way to run a scheduler command ------------------------------
    def _submit_command(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> CommandResult:
        """Run the submit command: a refusal no retry can fix raises SchedulerRejected, any other
        failure (controller down, timeout) SchedulerUnavailable."""
        try:
            return self._run(argv, env=env)
        except CommandError as exc:
            message = exc.output
            if any(p.lower() in message.lower() for p in self.submit_limit_errors):
                raise SubmitLimitReached(f"{argv[0]}: submit limit reached: {self.clean(message)}") from exc
            if any(p.lower() in message.lower() for p in self.permanent_submit_errors):
                raise SchedulerRejected(self.clean(message)) from exc
            raise SchedulerUnavailable(f"{argv[0]} failed: {self.clean(message)}") from exc

    def _run(self, argv: Sequence[str], *, check: bool = True, env: Mapping[str, str] | None = None) -> CommandResult:
        """``argv`` with ``env`` (default: this process's, without credentials: :func:`scrubbed_environment`)."""
        try:
            environ = scrubbed_environment() if env is None else env
            return run_command(argv, timeout=self.timeout_s, env=environ, check=check)
        except CommandError as exc:
            if check and exc.result.returncode > 0:
                raise
            raise SchedulerUnavailable(f"{self.name}: {exc}") from exc
