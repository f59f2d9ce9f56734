"""``hpc-bridge chain`` without a cluster: a scheduler that records what it was given, a chain
submitted to it, and the environment a link runs in."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from bridge.chain import ChainRunDir, ChainSettings
from bridge.chain.submit import submit_chain
from bridge.schedulers import JobInfo, JobSpec, JobState, SlurmScheduler

PY = sys.executable


class Recording(SlurmScheduler):
    """Renders real Slurm scripts but submits nothing: every job id is made up and pending."""

    def __init__(self) -> None:
        super().__init__()
        self.submitted: list[JobSpec] = []
        self.cancelled: list[str] = []

    def submit(self, script: Path, spec: JobSpec) -> str:
        self.submitted.append(spec)
        return str(100 + len(self.submitted))

    def query(self, job_ids: Any) -> dict[str, JobInfo]:
        return {j: JobInfo(j, JobState.PENDING, "PENDING") for j in job_ids if j not in self.cancelled}

    def cancel(self, job_id: str) -> None:
        self.cancelled.append(job_id)


def make_chain(tmp_path: Path, command: list[str], links: int = 3, **extra: Any) -> tuple[Path, Recording]:
    run = tmp_path / "run"
    settings = ChainSettings(
        name="unit",
        links=links,
        time_limit_s=600,
        warn_s=0,
        cpus=1,
        memory_mb=100,
        gpus=0,
        command=tuple(command),
        workdir=str(tmp_path),
        scheduler="slurm",
        **extra,
    )
    scheduler = Recording()
    assert submit_chain(settings, ChainRunDir(run), scheduler) == [str(101 + i) for i in range(links)]
    return run, scheduler


def link_env(job_id: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPC_")}
    env.update(HPC_JOB_ID=job_id, HPC_JOB_TIME_LIMIT_S="600", HPC_JOB_WARN_S="0", HPC_JOB_STARTED=str(int(time.time())))
    env.update(extra)
    return env
