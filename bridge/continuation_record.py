"""The record a training job leaves when it continues itself in a new job.

A job warned before its time limit checkpoints and continues: Slurm requeues the same
job id, Grid Engine (and Slurm with ``HPC_SLURM_CONTINUE=successor``) runs a successor
held on it. Just before asking the scheduler, the
job writes ``jobs/KEY/continuation.json`` (and rewrites it with the successor's id once
it has one), so that reconciliation knows the request is still alive, in which job,
and how many times it continued. A successor that was submitted but never recorded
(the job died between the two writes) is still found by job name (see reconcile.py).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bridge.spool import Spool, atomic_write_json, read_json

FILE_NAME = "continuation.json"


@dataclass(frozen=True)
class Continuation:
    count: int  # continuations so far (1 = the second job of the request is next)
    previous_job_id: str  # the job that stopped
    job_id: str = ""  # the job that continues (a requeue: the same id; empty until the scheduler answered)
    stopped_at: str = ""  # where training stopped, for people ("layer 'Layer 1' epoch 3 batch 12 of 40")
    at: float = field(default_factory=time.time)


def continuation_path(spool: Spool, key: str) -> Path:
    return spool.job_dir(key) / FILE_NAME


def write_continuation(spool: Spool, key: str, record: Continuation) -> None:
    atomic_write_json(continuation_path(spool, key), asdict(record))


def read_continuation(spool: Spool, key: str) -> Continuation | None:
    """The latest continuation of request ``key``, or None (none yet, or unreadable)."""
    try:
        data = read_json(continuation_path(spool, key))
        return Continuation(
            count=int(data["count"]),
            previous_job_id=str(data["previous_job_id"]),
            job_id=str(data.get("job_id", "")),
            stopped_at=str(data.get("stopped_at", "")),
            at=float(data.get("at", 0.0)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
