"""Prometheus metrics of the bridge, computed from the ledger and the outbox (text format 0.0.4).

Written atomically to ``HPC_METRICS_FILE`` (mode 0644, for node_exporter's textfile collector)
at the end of every ``check`` pass and every reconciliation of ``run``. No client library is
needed: the text format is simple enough to write by hand.

Every sample of an instance other than ``default`` (bridge/instance.py) carries the label
``bridge="NAME"``: two instances' files in one textfile directory then never hold the same series
(node_exporter refuses a series collected twice), and the default instance's names stay as they were.

node_exporter runs as a user of its own, in no lab's group, so the file is world-readable (it
holds counts, no names and no secrets), and the folders the bridge makes for it are 0755, also
under cron's ``umask 077``. A folder that exists already is left as it is: the operator's to open.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from bridge.instance import DEFAULT_INSTANCE
from bridge.ledger import RequestRecord, RequestState
from bridge.schedulers import job_state_value
from bridge.spool import Spool, atomic_write
from bridge.version import package_version

#: Request states as operators see them (``hpc-bridge status --state``), in lifecycle order.
STATES: tuple[str, ...] = (
    "queued",
    "submitting",
    "submitted",
    "pending",
    "running",
    "continued",
    "replied-ok",
    "replied-error",
    "reply-expired",
    "rejected",
    "cancelled-by-rodan",
)
#: Reply latency buckets in seconds: a minute to three days.
LATENCY_BUCKETS: tuple[float, ...] = (60, 300, 900, 1800, 3600, 7200, 21600, 43200, 86400, 259200)


def job_state_word(scheduler: str, state: str) -> str:
    """A job state as a :class:`~bridge.schedulers.JobState` value: the live ones and the ledger's
    are already; a scheduler's own word (a record made in memory, or by an older bridge: Grid
    Engine's ``r``) is translated by its backend; a word no backend knows stays as it is."""
    return job_state_value(scheduler, state)


def display_state(record: RequestRecord, job_state: str | None = None) -> str:
    """The operator's state of a request; ``job_state`` is the scheduler's (else the last one seen)."""
    if record.state is RequestState.RECEIVED:
        return "queued"
    if record.state is RequestState.SUBMITTING:
        return "submitting"
    if record.state is RequestState.REPLIED:
        return {"error": "replied-error", "expired": "reply-expired"}.get(record.outcome, "replied-ok")
    if record.state is RequestState.REJECTED:
        return "rejected"
    if record.state is RequestState.CANCELLED_BY_RODAN:
        return "cancelled-by-rodan"
    if record.continuations:
        return "continued"
    seen = job_state_word(record.scheduler, job_state if job_state is not None else record.job_state)
    if seen == "RUNNING":
        return "running"
    if seen in ("PENDING", "REQUEUED", "SUSPENDED"):
        return "pending"
    return "submitted"


@dataclass(frozen=True)
class Counters:
    """What the bridge did, counted from the ledger (so it survives restarts)."""

    received: int
    submitted: int
    replied_ok: int
    replied_error: int
    reply_expired: int
    rejected: int
    dead_lettered: int
    continuations: int
    cancelled_by_rodan: int

    def to_json(self) -> dict[str, int]:
        return dict(self.__dict__)


def count(records: Iterable[RequestRecord]) -> Counters:
    """The counters, in one pass over ``records``: a ledger (``Ledger.all()``) is read one record at a
    time, never held whole (the daemon's memory would grow with the records kept)."""
    n: Counter[str] = Counter()
    for r in records:
        n["received"] += 1
        n["submitted"] += bool(r.job_id or r.submitted_at)
        if r.state is RequestState.REPLIED:
            n[{"error": "replied_error", "expired": "reply_expired"}.get(r.outcome, "replied_ok")] += 1
        n["rejected"] += r.state is RequestState.REJECTED
        n["cancelled_by_rodan"] += r.state is RequestState.CANCELLED_BY_RODAN
        n["dead_lettered"] += bool(r.dead_lettered)
        n["continuations"] += r.continuations
    return Counters(**{f.name: n[f.name] for f in fields(Counters)})  # a count never seen is 0


def outbox_size(spool: Spool) -> int:
    """Replies staged and not yet published."""
    return len(list(spool.outbox_dir.glob("*.json"))) if spool.outbox_dir.exists() else 0


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def render(
    records: Iterable[RequestRecord],
    *,
    outbox: int,
    job_states: Mapping[str, str] | None = None,
    reconciliations: int | None = None,
    broker_reconnects: int | None = None,
    now: float | None = None,
    instance: str = DEFAULT_INSTANCE,
) -> str:
    """The metrics in Prometheus text format. ``job_states``: correlation id -> scheduler state.

    One pass over ``records`` (see :func:`count`): what the families need is tallied on the way."""
    states = job_states or {}
    bounds = (*LATENCY_BUCKETS, math.inf)
    hits = [0] * len(bounds)
    latency_sum, latency_count = 0.0, 0
    by_state: Counter[str] = Counter()
    jobs: Counter[str] = Counter()
    open_since: float | None = None

    def tallied() -> Iterator[RequestRecord]:
        nonlocal latency_sum, latency_count, open_since
        for r in records:
            if r.state.is_final and r.replied_at > 0:
                latency = r.replied_at - r.created_at
                for i, bound in enumerate(bounds):
                    hits[i] += latency <= bound
                latency_sum += latency
                latency_count += 1
            by_state[display_state(r, states.get(r.correlation_id))] += 1
            if r.state is RequestState.SUBMITTED:
                jobs[job_state_word(r.scheduler, states.get(r.correlation_id) or r.job_state or "UNKNOWN")] += 1
            if not r.state.is_final:
                open_since = r.created_at if open_since is None else min(open_since, r.created_at)
            yield r

    counters = count(tallied())
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")

    family("hpc_bridge_requests_total", "counter", "Requests the bridge has handled, by outcome (from the ledger).")
    outcomes = {
        "received": counters.received,
        "submitted": counters.submitted,
        "replied_ok": counters.replied_ok,
        "replied_error": counters.replied_error,
        "reply_expired": counters.reply_expired,
        "rejected": counters.rejected,
        "cancelled_by_rodan": counters.cancelled_by_rodan,
        "dead_lettered": counters.dead_lettered,
    }
    for outcome, value in outcomes.items():
        lines.append(f'hpc_bridge_requests_total{{outcome="{outcome}"}} {value}')
    family("hpc_bridge_continuations_total", "counter", "Times a training continued in a new job.")
    lines.append(f"hpc_bridge_continuations_total {counters.continuations}")

    family("hpc_bridge_reply_latency_seconds", "histogram", "Seconds from receiving a request to its final reply.")
    for bound, hit in zip(bounds, hits, strict=True):
        lines.append(f'hpc_bridge_reply_latency_seconds_bucket{{le="{_fmt(bound)}"}} {hit}')
    lines.append(f"hpc_bridge_reply_latency_seconds_sum {_fmt(round(latency_sum, 3))}")
    lines.append(f"hpc_bridge_reply_latency_seconds_count {latency_count}")

    family("hpc_bridge_ledger_requests", "gauge", "Requests the ledger holds, by state.")
    for state in STATES:
        lines.append(f'hpc_bridge_ledger_requests{{state="{state}"}} {by_state.get(state, 0)}')
    family("hpc_bridge_jobs", "gauge", "Jobs of open requests, by the scheduler state last seen.")
    for job_state in sorted(jobs):
        lines.append(f'hpc_bridge_jobs{{state="{job_state}"}} {jobs[job_state]}')
    family("hpc_bridge_outbox_replies", "gauge", "Replies staged on disk and not yet published.")
    lines.append(f"hpc_bridge_outbox_replies {outbox}")
    clock = now if now is not None else time.time()
    family("hpc_bridge_oldest_open_request_age_seconds", "gauge", "Age of the oldest unanswered request (0: none).")
    oldest = max(0.0, clock - open_since) if open_since is not None else 0.0
    lines.append(f"hpc_bridge_oldest_open_request_age_seconds {_fmt(round(oldest, 3))}")
    family("hpc_bridge_build_info", "gauge", "Always 1; the version label is the bridge's package version.")
    lines.append(f'hpc_bridge_build_info{{version="{package_version()}"}} 1')
    if reconciliations is not None:
        family("hpc_bridge_reconciliations_total", "counter", "Reconciliation runs by this bridge process.")
        lines.append(f"hpc_bridge_reconciliations_total {reconciliations}")
    if broker_reconnects is not None:
        family("hpc_bridge_broker_reconnects_total", "counter", "Broker connections lost and retried by this process.")
        lines.append(f"hpc_bridge_broker_reconnects_total {broker_reconnects}")
    family("hpc_bridge_metrics_timestamp_seconds", "gauge", "When these metrics were written (Unix time).")
    lines.append(f"hpc_bridge_metrics_timestamp_seconds {_fmt(round(clock, 3))}")
    if instance != DEFAULT_INSTANCE:
        lines = [line if line.startswith("#") else labelled(line, "bridge", instance) for line in lines]
    return "\n".join(lines) + "\n"


def labelled(sample: str, name: str, value: str) -> str:
    """A sample line (``metric{a="b"} 1`` or ``metric 1``) with one more label, placed first."""
    metric, _, rest = sample.partition(" ")
    base, brace, labels = metric.partition("{")
    inner = f'{name}="{value}"' + ("," + labels if brace and labels != "}" else "}")
    return f"{base}{{{inner} {rest}"


def write_metrics(
    path: Path,
    records: Iterable[RequestRecord],
    *,
    outbox: int,
    reconciliations: int,
    broker_reconnects: int,
    instance: str = DEFAULT_INSTANCE,
) -> None:
    """Replace ``path`` atomically with the current metrics (0644: node_exporter reads it)."""
    text = render(
        records,
        outbox=outbox,
        reconciliations=reconciliations,
        broker_reconnects=broker_reconnects,
        instance=instance,
    )
    make_readable_folder(path.parent)
    atomic_write(path, text.encode("utf-8"), mode=0o644)


def make_readable_folder(folder: Path) -> None:
    """Make ``folder`` and its missing parents, each 0755 whatever the umask; an existing one stays."""
    missing: list[Path] = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for directory in reversed(missing):
        directory.mkdir(exist_ok=True)
        os.chmod(directory, 0o755)  # noqa: S103 - node_exporter (another user) must reach the file
