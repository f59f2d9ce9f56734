"""The status (heartbeat) message: what Rodan's admins read to see that the HPC side is alive.

The daemon publishes one every ``HPC_STATUS_INTERVAL`` seconds, and ``check`` one at the end of
each pass, to ``HPC_STATUS_QUEUE`` (default ``hpc-bridge.status``; ``none`` turns it off). The
queue is durable and keeps only the latest ``STATUS_QUEUE_LENGTH`` messages (``x-max-length``,
``x-overflow=drop-head``: the oldest is dropped); the messages are transient (not persistent),
JSON, ``type=hpc-bridge.status``. Nobody needs to consume them: an admin reads them without
taking them away, e.g.::

    rabbitmqadmin get queue=hpc-bridge.status count=10 ackmode=reject_requeue_true

or the management UI's queue page, "Get messages" (Ack mode: "Nack message requeue true"). The
last message is the newest; its ``at`` older than a few ``interval_s`` means the bridge is not
running (or cannot reach the broker).

The message holds counts, names and times only: no URL, no path, no user name, no password, no
token (``tests/test_heartbeat.py`` checks it against every secret of the configuration).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from bridge.ledger import RequestRecord, RequestState
from bridge.ops.metrics import STATES, count, display_state
from bridge.version import package_version

#: The status queue keeps this many messages (the newest); older ones are dropped by the broker.
STATUS_QUEUE_LENGTH = 10
#: The AMQP ``type`` property of a status message, and its ``type`` field.
MESSAGE_TYPE = "hpc-bridge.status"
SCHEMA = 1


def status_queue_arguments() -> dict[str, Any]:
    """How the status queue is declared (the same everywhere, or the broker refuses with 406)."""
    return {"x-max-length": STATUS_QUEUE_LENGTH, "x-overflow": "drop-head"}


@dataclass
class QueueCounts:
    """What the broker said about our queues (None: not known, e.g. the broker is down)."""

    waiting: int | None = None  # requests ready in the request queue (not those the bridge holds)
    consumers: int | None = None  # consumers on the request queue (the daemon is one)
    dead_letters: int | None = None


def _iso(at: float | None) -> str | None:
    if not at:
        return None
    return datetime.fromtimestamp(at, tz=timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def build_status(
    records: Iterable[RequestRecord],
    *,
    mode: str,
    scheduler: str,
    request_queue: str,
    interval_s: float | None,
    started_at: float,
    last_pass_at: float | None,
    last_pass_ok: bool | None,
    passes: int,
    held: int,
    outbox: int,
    queues: QueueCounts,
    broker_connected: bool,
    now: float | None = None,
) -> dict[str, Any]:
    """The status message as a JSON-ready dict (counts from the ledger; nothing secret).

    One pass over ``records``, never a list of them (a ledger holds HPC_RETENTION_DAYS of requests)."""
    now = time.time() if now is None else now
    by_state: Counter[str] = Counter()
    jobs: Counter[str] = Counter()
    in_flight = 0

    def tallied() -> Iterator[RequestRecord]:
        nonlocal in_flight
        for r in records:
            by_state[display_state(r)] += 1
            if r.state is RequestState.SUBMITTED:
                jobs[(r.job_state or "UNKNOWN").upper()] += 1
            in_flight += not r.state.is_final
            yield r

    totals = count(tallied())
    return {
        "type": MESSAGE_TYPE,
        "schema": SCHEMA,
        "version": package_version(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "mode": mode,
        "scheduler": scheduler,
        "at": round(now, 3),
        "at_utc": _iso(now),
        "interval_s": interval_s,
        "started_at_utc": _iso(started_at),
        "last_pass_utc": _iso(last_pass_at),
        "last_pass_ok": last_pass_ok,
        "passes": passes,
        "broker_connected": broker_connected,
        "request_queue": request_queue,
        "requests_waiting": queues.waiting,
        "request_queue_consumers": queues.consumers,
        "requests_held": held,
        "requests_in_flight": in_flight,
        "requests_by_state": {state: by_state.get(state, 0) for state in STATES},
        "jobs_by_state": dict(sorted(jobs.items())),
        "dead_letters": queues.dead_letters,
        "outbox_replies": outbox,
        "totals": totals.to_json(),
    }


def encode(status: dict[str, Any]) -> bytes:
    return json.dumps(status, sort_keys=False, separators=(",", ":")).encode("utf-8")


def status_line(status: dict[str, Any]) -> str:
    """One line for ``systemctl status`` (sd_notify STATUS=)."""
    jobs = ", ".join(f"{n} {s.lower()}" for s, n in status["jobs_by_state"].items()) or "no jobs"
    waiting = status["requests_waiting"]
    return (
        f"{'connected' if status['broker_connected'] else 'broker unreachable'}; "
        f"{status['requests_in_flight']} requests in flight ({jobs}); "
        f"{'?' if waiting is None else waiting} waiting in {status['request_queue']}; "
        f"outbox {status['outbox_replies']}; last pass {status['last_pass_utc'] or 'none yet'}"
    )
