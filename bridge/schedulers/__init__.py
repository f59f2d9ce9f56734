"""Batch schedulers behind one small interface (see base.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from bridge.schedulers.base import TERMINAL_STATES, JobInfo, JobSpec, JobState, Scheduler
from bridge.schedulers.gridengine import GridEngineScheduler
from bridge.schedulers.slurm import SlurmScheduler, slurm_cluster_args

__all__ = [
    "TERMINAL_STATES",
    "GridEngineScheduler",
    "JobInfo",
    "JobSpec",
    "JobState",
    "Scheduler",
    "SlurmScheduler",
    "get_scheduler",
    "slurm_cluster_args",
]

#: Backend name (HPC_SCHEDULER after aliases) -> class.
BACKENDS: dict[str, type[Scheduler]] = {"slurm": SlurmScheduler, "gridengine": GridEngineScheduler}


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
