"""Batch schedulers behind one small interface (see base.py)."""

from __future__ import annotations

from collections.abc import Mapping

from bridge.schedulers.base import TERMINAL_STATES, JobInfo, JobSpec, JobState, Scheduler
from bridge.schedulers.gridengine import GridEngineScheduler
from bridge.schedulers.slurm import SlurmScheduler

__all__ = [
    "TERMINAL_STATES",
    "GridEngineScheduler",
    "JobInfo",
    "JobSpec",
    "JobState",
    "Scheduler",
    "SlurmScheduler",
    "get_scheduler",
]

#: Backend name (HPC_SCHEDULER after aliases) -> class.
BACKENDS: dict[str, type[Scheduler]] = {"slurm": SlurmScheduler, "gridengine": GridEngineScheduler}


def get_scheduler(name: str, *, timeout_s: float = 60.0, options: Mapping[str, str] | None = None) -> Scheduler:
    """The backend called ``name``; ``options`` are its site settings (see each backend's ``__init__``)."""
    try:
        backend = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}") from None
    return backend(timeout_s=timeout_s, **dict(options or {}))
