"""Batch schedulers behind one small interface (see base.py).

:data:`BACKENDS` is the one place a backend is registered: configuration, ``hpc-bridge chain``,
``doctor``, ``status``, the metrics and the worker ask the functions here (and the classes they
return) instead of naming a scheduler themselves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from bridge.schedulers.base import (
    TERMINAL_STATES,
    JobInfo,
    JobSpec,
    JobState,
    Scheduler,
    SiteOption,
    format_duration,
)
from bridge.schedulers.gridengine import GridEngineScheduler
from bridge.schedulers.slurm import SlurmScheduler, slurm_cluster_args

__all__ = [
    "BACKENDS",
    "DEFAULT_SCHEDULER",
    "TERMINAL_STATES",
    "GridEngineScheduler",
    "JobInfo",
    "JobSpec",
    "JobState",
    "Scheduler",
    "SiteOption",
    "SlurmScheduler",
    "all_site_options",
    "backend_name",
    "choices_text",
    "format_duration",
    "get_scheduler",
    "job_state_value",
    "option_problems",
    "own_job_id",
    "refused_site_options",
    "restart_variables",
    "scheduler_class",
    "scratch_variables",
    "short_name",
    "slurm_cluster_args",
]

#: Backend name (HPC_SCHEDULER after aliases) -> class. A new backend is one more entry here.
BACKENDS: dict[str, type[Scheduler]] = {cls.name: cls for cls in (SlurmScheduler, GridEngineScheduler)}
#: The backend when HPC_SCHEDULER is not set.
DEFAULT_SCHEDULER = SlurmScheduler.name
_JOB_STATE_VALUES = frozenset(state.value for state in JobState)


def backend_name(text: str) -> str:
    """The backend's name for ``text``, a name or an alias in any case (``SGE`` -> ``gridengine``);
    "" when no backend is called so."""
    word = " ".join(text.split()).lower()
    for name, cls in BACKENDS.items():
        if word == name or word in cls.aliases:
            return name
    return ""


def scheduler_class(name: str) -> type[Scheduler]:
    """The class of the backend called ``name`` (or one of its aliases); raises ValueError."""
    found = backend_name(name)
    if not found:
        raise ValueError(f"unknown scheduler {name!r}")
    return BACKENDS[found]


def choices_text(conjunction: str = "or", quote: bool = False) -> str:
    """The backends' names for a message: ``slurm or gridengine`` (``'slurm' or 'gridengine'``)."""
    names = [repr(n) if quote else n for n in BACKENDS]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {conjunction} {names[-1]}"


def all_site_options() -> list[SiteOption]:
    """Every backend's site settings (all are read, whichever backend is chosen)."""
    return [option for cls in BACKENDS.values() for option in cls.site_options]


def short_name(name: str) -> str:
    """``gridengine`` -> ``sge``: the backend's short name for tables; an unknown name stays as it is."""
    found = backend_name(name) if name else ""
    return BACKENDS[found].short_name if found else name


def job_state_value(scheduler: str, word: str) -> str:
    """A job state as a :class:`JobState` value. A value already is one; a scheduler's own word (as
    ledgers written before they kept JobState values hold: Grid Engine's ``r``, Slurm's ``CANCELLED
    by 0``) is translated by the backend ``scheduler``; a word it does not know stays as it is
    (upper case)."""
    text = word.strip()
    if text.upper() in _JOB_STATE_VALUES:
        return text.upper()
    found = backend_name(scheduler) if scheduler else ""
    translated = BACKENDS[found].translate(text) if found and text else JobState.MISSING
    return text.upper() if translated is JobState.MISSING else translated.value


# --- what a job sees (worker/ asks these: it runs inside any backend's job) ----------------------


def scratch_variables() -> tuple[str, ...]:
    """Every backend's node-local scratch variables (``SLURM_TMPDIR``), tried before ``$TMPDIR``."""
    return tuple(dict.fromkeys(v for cls in BACKENDS.values() for v in cls.scratch_variables))


def restart_variables() -> tuple[str, ...]:
    """Every backend's "this job runs again" variables (``SLURM_RESTART_COUNT``, ``RESTARTED``)."""
    return tuple(dict.fromkeys(v for cls in BACKENDS.values() for v in cls.restart_variables))


def own_job_id(environ: Mapping[str, str]) -> str:
    """The job's id from its scheduler's own variable (``SLURM_JOB_ID``, ``JOB_ID``), "" outside a job;
    the batch scripts export it as ``HPC_JOB_ID`` too, which is read first."""
    for variable in ("HPC_JOB_ID", *(cls.job_id_variable for cls in BACKENDS.values())):
        if environ.get(variable):
            return environ[variable]
    return ""


def get_scheduler(
    name: str,
    *,
    timeout_s: float = 60.0,
    options: Mapping[str, str] | None = None,
    scheduler_args: Sequence[str] = (),
) -> Scheduler:
    """The backend called ``name``; ``options`` are its site settings (see each backend's ``__init__``).

    ``scheduler_args`` are ``HPC_SCHEDULER_ARGS`` (given to the submit command only, through
    ``JobSpec.extra_args``): the ones every other command needs as well, such as Slurm's cluster
    selection (``-M NAME``), are passed on to the backend (``Scheduler.lookup_options``).
    """
    try:
        backend = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}") from None
    return backend(timeout_s=timeout_s, **dict(options or {}), **backend.lookup_options(scheduler_args))


def option_problems(
    name: str,
    *,
    options: Mapping[str, str] | None = None,
    scheduler_args: Sequence[str] = (),
    directives: Sequence[str] = (),
) -> list[str]:
    """Why the site's settings for the backend called ``name`` cannot be used (none: []), each naming
    its setting: a site option the backend refuses (an unsafe value, an option the omit setting cannot
    leave out), and ``HPC_JOB_DIRECTIVES`` entries and ``HPC_SCHEDULER_ARGS`` arguments that set an
    option the bridge sets itself. Checked when the configuration is loaded, not per job."""
    try:
        backend = get_scheduler(name, options=options, scheduler_args=scheduler_args)
    except ValueError as exc:
        return [str(exc)]
    return backend.directive_problems(directives) + backend.argument_problems(scheduler_args)


def refused_site_options(name: str, values: Mapping[str, str]) -> dict[str, str]:
    """The site settings among ``values`` (setting name -> value) that the backend called ``name``
    refuses, each with why (a message naming it): a configuration that holds its default for each of
    them instead can still build the backend. Judged in the order the backend declares them, each
    with the ones before it that it took (HPC_SGE_OMIT names the resource of HPC_SGE_MEMORY_RESOURCE)."""
    backend = BACKENDS[name]
    taken: dict[str, str] = {}
    refused = {}
    for option in backend.site_options:
        if option.keyword and values.get(option.setting):
            try:
                get_scheduler(
                    name, options=backend.constructor_options({**taken, option.setting: values[option.setting]})
                )
                taken[option.setting] = values[option.setting]
            except ValueError as exc:
                refused[option.setting] = str(exc)
    return refused
