"""Batch schedulers behind one small interface (see base.py)."""

from __future__ import annotations

from bridge.schedulers.base import TERMINAL_STATES, JobInfo, JobSpec, JobState, Scheduler
from bridge.schedulers.slurm import SlurmScheduler

__all__ = ["TERMINAL_STATES", "JobInfo", "JobSpec", "JobState", "Scheduler", "SlurmScheduler", "get_scheduler"]


def get_scheduler(name: str, *, timeout_s: float = 60.0) -> Scheduler:
    if name == "slurm":
        return SlurmScheduler(timeout_s=timeout_s)
    raise ValueError(f"unknown scheduler {name!r}")
