"""``hpc-bridge status``: every request the bridge knows, its job, its state, and the queues."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.config import BridgeConfig
from bridge.errors import BrokerUnavailable, SchedulerRejected, SchedulerUnavailable
from bridge.ledger import Ledger, RequestRecord, RequestState
from bridge.ops.metrics import STATES, count, display_state, outbox_size
from bridge.schedulers import get_scheduler, short_name
from bridge.spool import Spool

EPILOG = """states: queued (received, not yet submitted), submitting, submitted, pending, running,
continued (the training went on in a new job), replied-ok, replied-error, reply-expired (its queue
never came back: HPC_REPLY_WAIT), rejected (dead-lettered).
--state replied matches both replied states.

examples:
  hpc-bridge status                                   # the table, with live job states
  hpc-bridge status --state running --state pending   # open jobs only
  hpc-bridge status --older-than 1d --no-scheduler    # stale requests, without asking the scheduler
  hpc-bridge status --json | jq '.requests[] | select(.state == "replied-error")'

exit status:
  0  the broker answered (a scheduler that did not answer is a note: the states are the last seen)
  1  the broker is unreachable (or the connection was lost): the requests are still listed, from
     the spool, and the queue depths are "-"
  2  configuration error
"""
#: ``status``'s exit statuses (2, a configuration error, is the command line's).
EXIT_OK, EXIT_BROKER_DOWN = 0, 1
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
WIDTH = 80


def parse_duration(text: str) -> float:
    """``90`` / ``90s``, ``30m``, ``2h``, ``1d``, ``1w`` -> seconds."""
    match = _DURATION.match(text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"expected a duration like 30m, 2h or 1d, got {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def format_age(seconds: float | None) -> str:
    """An age or a time spent, compact: 45s, 12m, 3h05, 2d04; '-' when unknown."""
    if seconds is None or seconds < 0:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}"
    return f"{s // 86400}d{s % 86400 // 3600:02d}"


def _state_arg(text: str) -> str:
    value = text.lower()
    if value not in STATES and value != "replied":
        raise argparse.ArgumentTypeError(f"unknown state {text!r}: one of {', '.join(STATES)}, replied")
    return value


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="every request the bridge knows: its job, state, age and last event; queue depths",
        description="List the requests in the ledger with their jobs and states, then the queue depths\n"
        "and the outbox. Exit status 1 when the broker does not answer (see below).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="one JSON object: requests, queues, outbox, counters")
    p.add_argument(
        "--state", action="append", type=_state_arg, default=[], metavar="STATE", help="only these states (repeatable)"
    )
    p.add_argument("--older-than", type=parse_duration, metavar="DURATION", help="received more than 30m/2h/1d ago")
    p.add_argument("--newer-than", type=parse_duration, metavar="DURATION", help="received less than 30m/2h/1d ago")
    p.add_argument("--no-scheduler", action="store_true", help="do not ask the scheduler (use the last state seen)")
    p.set_defaults(operator=run)


@dataclass
class Row:
    correlation_id: str
    generation: str
    scheduler: str
    job_id: str
    state: str
    continuations: int
    age_s: float
    training_s: float | None
    last_event: str
    job_state: str
    dead_lettered: bool
    reason: str
    created_at: float
    replied_at: float
    job_ids: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def runs_dir(config: BridgeConfig) -> Path:
    return config.runs_dir or config.spool_dir / "runs"


def job_log_summary(runs: Path, key: str) -> tuple[str, float | None]:
    """The last event of the request's newest ``job.log`` and the training seconds its epochs took."""
    candidates = sorted(runs.glob(f"*-{key}")) if runs.is_dir() else []
    if not candidates:
        return "", None
    path = candidates[-1] / "job.log"
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "", None
    seconds: float | None = None
    last = ""
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            last = line.strip()
            continue
        if not isinstance(event, dict):
            continue
        if event.get("event") == "epoch" and isinstance(event.get("seconds"), int | float):
            seconds = (seconds or 0.0) + float(event["seconds"])
        last = _describe_event(event)
    return last, seconds


def _describe_event(event: Mapping[str, Any]) -> str:
    name = str(event.get("event", ""))
    details = [f"{k}={event[k]}" for k in ("layer", "epoch", "error") if k in event]
    return " ".join([name, *details]).strip()


def query_scheduler(config: BridgeConfig, records: Sequence[RequestRecord]) -> tuple[dict[str, str], str]:
    """correlation id -> live scheduler state of its newest job, and a note when the scheduler failed."""
    open_jobs = {r.correlation_id: r.job_id for r in records if r.state is RequestState.SUBMITTED and r.job_id}
    if not open_jobs:
        return {}, ""
    try:
        scheduler = get_scheduler(
            config.scheduler,
            timeout_s=config.scheduler_timeout_s,
            options=config.scheduler_options,
            scheduler_args=config.scheduler_args,
        )
        infos = scheduler.query(sorted(set(open_jobs.values())))
    except (SchedulerUnavailable, SchedulerRejected, OSError) as exc:
        return {}, f"scheduler did not answer ({exc}); states are the last ones seen"
    return {c: infos[j].state.value for c, j in open_jobs.items() if j in infos}, ""


def queue_depths(config: BridgeConfig) -> tuple[dict[str, int | None], str]:
    """Depth of each queue by passive declare (None: no such queue), and a note when the broker is down
    or the connection was lost (empty when the broker answered)."""
    import pika.exceptions

    from bridge.amqp import CONNECTION_ERRORS, connect

    names = {"request": config.request_queue, "reply": config.reply_queue, "dead_letter": config.dead_letter_queue}
    try:
        connection = connect(
            config.broker_url, heartbeat=config.broker_heartbeat_s, ca_file=config.broker_ca_file, name="hpc-status"
        )
    except BrokerUnavailable as exc:
        return {role: None for role in names}, f"broker down: {exc}"
    depths: dict[str, int | None] = {}
    try:
        for role, name in names.items():
            channel = connection.channel()  # a 404 closes the channel: one each
            try:
                frame = channel.queue_declare(queue=name, passive=True)
                depths[role] = int(frame.method.message_count)
            except pika.exceptions.ChannelClosedByBroker:
                depths[role] = None
                continue
            channel.close()
    except CONNECTION_ERRORS as exc:
        return {role: depths.get(role) for role in names}, f"broker connection lost: {exc}"
    finally:
        with contextlib.suppress(*CONNECTION_ERRORS):
            if connection.is_open:
                connection.close()
    return depths, ""


def build_rows(
    config: BridgeConfig, records: Sequence[RequestRecord], job_states: Mapping[str, str], now: float
) -> list[Row]:
    runs = runs_dir(config)
    rows = []
    for r in records:
        last, training = job_log_summary(runs, r.key)
        rows.append(
            Row(
                correlation_id=r.correlation_id,
                generation=r.generation,
                scheduler=r.scheduler,
                job_id=r.job_id,
                state=display_state(r, job_states.get(r.correlation_id)),
                continuations=r.continuations,
                age_s=round(now - r.created_at, 1),
                training_s=training,
                last_event=last or r.reason,
                job_state=job_states.get(r.correlation_id, r.job_state),
                dead_lettered=r.dead_lettered,
                reason=r.reason,
                created_at=r.created_at,
                replied_at=r.replied_at,
                job_ids=list(r.job_ids),
            )
        )
    return rows


def select(rows: Sequence[Row], states: Sequence[str], older_than: float | None, newer_than: float | None) -> list[Row]:
    def wanted(row: Row) -> bool:
        if states and not any(row.state == s or row.state.startswith(f"{s}-") for s in states):
            return False
        if older_than is not None and row.age_s < older_than:
            return False
        return newer_than is None or row.age_s <= newer_than

    return [row for row in rows if wanted(row)]


def format_table(rows: Sequence[Row], width: int = WIDTH) -> list[str]:
    """Fixed columns, the last event takes what is left of ``width``."""
    head = f"{'ID':<8} {'GEN':<3} {'JOB':<12} {'STATE':<14} {'AGE':>5} {'TRAIN':>5} "
    rest = width - len(head)
    lines = [(head + "LAST EVENT").rstrip()]
    for row in rows:
        job = f"{short_name(row.scheduler)} {row.job_id}".strip() if row.job_id else "-"
        state = f"continued {row.continuations}x" if row.state == "continued" else row.state
        last = " ".join(row.last_event.split()) or "-"
        if len(last) > rest:
            last = last[: rest - 1] + "~"
        line = (
            f"{row.correlation_id[:8]:<8} {(row.generation or '-')[:3]:<3} {job[:12]:<12} {state[:14]:<14} "
            f"{format_age(row.age_s):>5} {format_age(row.training_s):>5} {last}"
        )
        lines.append(line.rstrip())
    return lines


def format_summary(depths: Mapping[str, int | None], outbox: int, notes: Sequence[str]) -> list[str]:
    def show(value: int | None) -> str:
        return "-" if value is None else str(value)

    lines = [
        f"queues: request {show(depths.get('request'))}  reply {show(depths.get('reply'))}  "
        f"dead-letter {show(depths.get('dead_letter'))}  |  outbox {outbox}"
    ]
    lines += [note[: WIDTH - 1] for note in notes if note]
    return lines


def run(config: BridgeConfig, args: argparse.Namespace) -> int:
    spool = Spool(config.spool_dir)
    records = sorted(Ledger(spool).all(), key=lambda r: r.created_at) if spool.ledger_dir.is_dir() else []
    notes: list[str] = []
    job_states: dict[str, str] = {}
    if not args.no_scheduler:
        job_states, note = query_scheduler(config, records)
        notes.append(note)
    now = time.time()
    rows = select(build_rows(config, records, job_states, now), args.state, args.older_than, args.newer_than)
    depths, broker_note = queue_depths(config)
    notes.append(broker_note)
    status = EXIT_BROKER_DOWN if broker_note else EXIT_OK
    outbox = outbox_size(spool) if spool.outbox_dir.is_dir() else 0
    if args.json:
        print(
            json.dumps(
                {
                    "requests": [row.to_json() for row in rows],
                    "queues": {
                        role: {"name": name, "depth": depths.get(role)}
                        for role, name in (
                            ("request", config.request_queue),
                            ("reply", config.reply_queue),
                            ("dead_letter", config.dead_letter_queue),
                        )
                    },
                    "outbox": outbox,
                    "counters": count(records).to_json(),
                    "notes": [n for n in notes if n],
                },
                indent=1,
            )
        )
        return status
    for line in format_table(rows):
        print(line)
    for line in format_summary(depths, outbox, notes):
        print(line)
    return status
