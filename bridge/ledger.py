"""The bridge's durable record of every request, keyed by correlation id.

One small JSON file per request under ``SPOOL/ledger``. The ledger is what
makes a redelivered request harmless: a request already submitted is never
submitted again, and a request already answered is never answered again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any

from bridge.schedulers import job_state_value
from bridge.spool import Spool, atomic_write_json, read_json, safe_key
from bridge.version import package_version


class RequestState(str, Enum):
    """Where a request stands, from the bridge's point of view."""

    RECEIVED = "received"  # taken from the queue, not yet submitted (transient failures retry from here)
    SUBMITTING = "submitting"  # the submit command may have run: confirm with the scheduler before resubmitting
    SUBMITTED = "submitted"  # a job exists; reconciliation watches it until a reply is published
    REPLIED = "replied"  # the final reply (models or error) was published
    REJECTED = "rejected"  # never submitted; an error reply was published and the message dead-lettered
    # Rodan 3: the run was cancelled, deleted or retried in Rodan (bridge/rodan_cancel.py); its jobs were
    # cancelled and no reply is ever published: nobody reads it.
    CANCELLED_BY_RODAN = "cancelled_by_rodan"

    @property
    def is_final(self) -> bool:
        return self in (RequestState.REPLIED, RequestState.REJECTED, RequestState.CANCELLED_BY_RODAN)


@dataclass
class RequestRecord:
    correlation_id: str
    key: str
    reply_to: str
    state: RequestState = RequestState.RECEIVED
    generation: str = ""
    scheduler: str = ""
    job_id: str = ""
    job_name: str = ""
    attempts: int = 0
    outcome: str = ""  # "ok" or "error" once replied
    reason: str = ""  # last error, or what the final error reply said
    job_state: str = ""  # last job state seen, a JobState value ("RUNNING"; see from_json for older records)
    job_ended: bool = False  # reconciliation saw the job in a terminal state (or gone for good)
    continuations: int = 0  # times the training continued in a new job (or a requeue) after a time-limit warning
    job_ids: list[str] = field(default_factory=list)  # every job of this request, oldest first
    time_limit: str = ""
    memory_mb: int = 0
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    submitted_at: float = 0.0
    replied_at: float = 0.0
    missing_since: float = 0.0
    dead_lettered: bool = False
    deliveries: int = 0  # times intake began on this request without finishing: a crash or kill (poison count)
    deferred_since: float = 0.0  # first transient failure of the current run of them (HPC_DEFER_LIMIT)
    pending_since: float = 0.0  # when reconciliation first saw the job PENDING this time (HPC_MAX_PENDING)
    bridge_version: str = field(default_factory=package_version)  # the hpc-bridge that took the request
    rodan_runjob: str = ""  # generation 3: the RunJob's uuid (one RunJob, one request per attempt)
    rodan_checked_at: float = 0.0  # when the bridge last asked Rodan for the RunJob's status
    rodan_seen: bool = False  # Rodan showed the RunJob to the bridge's account once (a 404 then means deleted)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["state"] = self.state.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["state"] = RequestState(values.get("state", RequestState.RECEIVED.value))
        values.setdefault("bridge_version", "")  # written before versions were recorded: not this one
        # Written before the ledger kept JobState values: the scheduler's own word (Grid Engine's "r",
        # Slurm's "CANCELLED by 0") is translated by its backend; a word it does not know is kept
        # (upper case), and is read as "submitted" (neither running nor pending) by status and metrics.
        if values.get("job_state"):
            values["job_state"] = job_state_value(str(values.get("scheduler") or ""), str(values["job_state"]))
        return cls(**values)


class Ledger:
    def __init__(self, spool: Spool) -> None:
        self.spool = spool

    def path(self, key: str) -> Path:
        return self.spool.ledger_dir / f"{key}.json"

    def get(self, correlation_id: str) -> RequestRecord | None:
        path = self.path(safe_key(correlation_id))
        if not path.exists():
            return None
        return RequestRecord.from_json(read_json(path))

    def open(self, correlation_id: str, reply_to: str) -> RequestRecord:
        """The existing record, or a new one (not yet saved)."""
        existing = self.get(correlation_id)
        if existing is not None:
            return existing
        return RequestRecord(correlation_id=correlation_id, key=safe_key(correlation_id), reply_to=reply_to)

    def save(self, record: RequestRecord) -> None:
        record.updated_at = time.time()
        atomic_write_json(self.path(record.key), record.to_json())

    def adopt_job(self, record: RequestRecord, job_ids: list[str]) -> None:
        """A submit whose outcome was not recorded (a crash, a lost message) did make a job: the
        request is that job's (the first of ``job_ids``, the scheduler's jobs with its name)."""
        record.state = RequestState.SUBMITTED
        record.job_id = job_ids[0]
        record.job_ids = [job_ids[0]]
        record.submitted_at = record.submitted_at or time.time()
        self.save(record)

    def all(self) -> Iterator[RequestRecord]:
        """Every record, in key order, read one at a time: a pass over the whole ledger (every
        reconciliation, the status message, the metrics) holds the names of HPC_RETENTION_DAYS' worth
        of records (about 100 bytes each), never the records or a ``Path`` each (benchmarks/README.md,
        "Months of running")."""
        for name in self.names():
            try:
                yield RequestRecord.from_json(read_json(self.spool.ledger_dir / name))
            except (OSError, ValueError):
                continue

    def names(self) -> list[str]:
        """The ledger's file names (``KEY.json``), sorted; none while the folder does not exist."""
        try:
            with os.scandir(self.spool.ledger_dir) as entries:
                return sorted(e.name for e in entries if e.name.endswith(".json") and not e.name.startswith("."))
        except FileNotFoundError:
            return []

    def in_state(self, *states: RequestState) -> list[RequestRecord]:
        return [r for r in self.all() if r.state in states]


def reopen_for_requeue(record: RequestRecord) -> RequestRecord:
    """The transition ``hpc-bridge requeue-dead`` makes: a dead-lettered request becomes new again.

    ``Intake`` treats a REJECTED record as a duplicate once it was dead-lettered, and a SUBMITTED or
    REPLIED one as done, so a request put back on the queue is only processed afresh from RECEIVED.
    Attempts and the deferral clock start again (so ``HPC_DEFER_LIMIT`` applies anew), and the outcome, reason and
    job fields of the previous try are cleared; ``created_at`` is kept. Save it with ``Ledger.save``.
    """
    record.state = RequestState.RECEIVED
    record.attempts = 0
    record.outcome = ""
    record.reason = ""
    record.job_id = ""
    record.job_ids = []
    record.job_name = ""
    record.job_state = ""
    record.job_ended = False
    record.continuations = 0
    record.submitted_at = 0.0
    record.replied_at = 0.0
    record.missing_since = 0.0
    record.dead_lettered = False
    record.deliveries = 0
    record.deferred_since = 0.0
    record.pending_since = 0.0
    return record
