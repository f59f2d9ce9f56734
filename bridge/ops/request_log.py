"""``hpc-bridge logs CORRELATION_ID``: everything logged about one request, merged in time order.

Sources (each event gets a ``source``):

* ``bridge``: lines of ``HPC_LOG_FILE`` (and its rotated siblings ``*.1``, ``*.N.gz``) whose
  ``correlation_id`` is the request's;
* ``worker``: every line of ``job.log`` in the request's run directories
  (``HPC_RUNS_DIR`` or ``SPOOL/runs``, ``<UTC timestamp>-<key>[-N]/``);
* ``scheduler``: the scheduler's output files in ``SPOOL/jobs/KEY/`` (not ``job.sh``). The worker's
  JSON lines there repeat ``job.log`` and are left out; other lines (tracebacks, the batch
  script's own messages) are shown as text, timed by their file's modification time.

The id may be a unique prefix of a correlation id in the ledger (as git takes short hashes).
Everything printed goes through ``bridge.logs.redact``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bridge.config import BridgeConfig
from bridge.ledger import Ledger
from bridge.logs import redact
from bridge.spool import Spool, safe_key

EPILOG = """examples:
  hpc-bridge logs 5f0c2a9e                  # a unique prefix of the correlation id is enough
  hpc-bridge logs 5f0c2a9e --json | jq 'select(.event == "epoch")'
  hpc-bridge logs 5f0c2a9e --follow         # keep printing new events (Ctrl-C to stop)
"""
#: Shown in the TIME/SOURCE/EVENT columns, or not at all, in the compact output.
_SKIPPED_KEYS = frozenset({"timestamp", "event", "correlation_id", "component", "level", "source"})
_VALUE_LIMIT = 60
_RUN_DIR_STAMP = re.compile(r"^\d{8}-\d{6}-")


@dataclass(frozen=True)
class Event:
    time: float
    source: str
    order: int  # position within its source, for a stable order among equal times
    data: dict[str, Any]


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "logs",
        help="the merged, time-ordered log of one request (bridge, worker, scheduler output)",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("correlation_id", metavar="CORRELATION_ID", help="the request's id, or a unique prefix of it")
    parser.add_argument("--json", action="store_true", help="print the raw JSON events, with a 'source' field added")
    parser.add_argument("--follow", "-f", action="store_true", help="keep printing new events until interrupted")
    parser.set_defaults(operator=run)


def run(config: BridgeConfig, args: argparse.Namespace) -> int:
    spool = Spool(config.spool_dir)
    corr = resolve(spool, args.correlation_id)
    if isinstance(corr, int):
        return corr
    seen: set[tuple[str, str]] = set()
    try:
        while True:
            for event in collect(config, corr):
                ident = (event.source, json.dumps(event.data, sort_keys=True))
                if ident in seen:
                    continue
                seen.add(ident)
                print(redact(format_event(event, as_json=args.json)), flush=True)
            if not args.follow:
                return 0
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0


def resolve(spool: Spool, wanted: str) -> str | int:
    """The full correlation id ``wanted`` names, or an exit status (1 unknown, 2 ambiguous)."""
    ledger = Ledger(spool)
    if spool.ledger_dir.is_dir() and ledger.get(wanted) is not None:
        return wanted
    candidates = (
        sorted(r.correlation_id for r in ledger.all() if r.correlation_id.startswith(wanted))
        if (spool.ledger_dir.is_dir())
        else []
    )
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        print(redact(f"hpc-bridge: no request {wanted!r} in the ledger ({spool.ledger_dir})"), file=sys.stderr)
        return 1
    print(redact(f"hpc-bridge: {wanted!r} is ambiguous; it starts:"), file=sys.stderr)
    for candidate in candidates:
        print(redact(f"  {candidate}"), file=sys.stderr)
    return 2


def collect(config: BridgeConfig, corr: str) -> list[Event]:
    key = safe_key(corr)
    events: list[Event] = []
    if config.log_file is not None:
        for path in _rotated(config.log_file):
            for order, data in enumerate(_json_lines(path)):
                if data.get("correlation_id") == corr:
                    events.append(Event(_time_of(data, 0.0), "bridge", order, data))
    worker_lines: set[str] = set()
    runs_dir = config.runs_dir or config.spool_dir / "runs"
    for run_dir in run_dirs(runs_dir, key):
        log_path = run_dir / "job.log"
        for order, line in enumerate(_lines(log_path)):
            worker_lines.add(line)
            data = _parse(line) or {"event": "text", "text": line}
            events.append(Event(_time_of(data, _mtime(log_path)), "worker", order, data))
    job_dir = config.spool_dir / "jobs" / key
    outputs = sorted((p for p in job_dir.glob("*") if p.is_file() and p.name != "job.sh"), key=_mtime)
    for path in outputs:
        for order, line in enumerate(_lines(path)):
            if line in worker_lines or not line.strip():
                continue
            parsed = _parse(line)
            data = (
                parsed
                if parsed is not None and "event" in parsed
                else {"event": "output", "file": path.name, "text": line}
            )
            events.append(Event(_time_of(data, _mtime(path)), "scheduler", order, data))
    source_rank = {"bridge": 0, "worker": 1, "scheduler": 2}
    events.sort(key=lambda e: (e.time, source_rank[e.source], e.order))
    return events


def format_event(event: Event, *, as_json: bool) -> str:
    if as_json:
        return json.dumps({**event.data, "source": event.source})
    data = event.data
    when = datetime.fromtimestamp(event.time, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    level = str(data.get("level", ""))
    name = str(data.get("event", "?")) + (f" [{level}]" if level and level != "info" else "")
    fields = " ".join(f"{k}={_short(v)}" for k, v in data.items() if k not in _SKIPPED_KEYS)
    return f"{when}  {event.source:<9}  {name}  {fields}".rstrip()


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = value if isinstance(value, str) else json.dumps(value)
    # Redact before cutting: a secret cut in two would no longer match and its first part would show.
    text = redact(text).replace("\n", "\\n")
    if len(text) > _VALUE_LIMIT:
        text = text[: _VALUE_LIMIT - 3] + "..."
    return json.dumps(text) if " " in text else text


def _rotated(log_file: Path) -> list[Path]:
    """The log and its rotated siblings, oldest first (``bridge.log.3.gz``, ... ``.1``, the log)."""

    def number(path: Path) -> int:
        match = re.match(rf"^{re.escape(log_file.name)}\.(\d+)(?:\.gz)?$", path.name)
        return int(match.group(1)) if match else -1

    siblings = [p for p in log_file.parent.glob(f"{log_file.name}.*") if number(p) >= 0]
    return sorted(siblings, key=number, reverse=True) + ([log_file] if log_file.exists() else [])


def run_dirs(runs_dir: Path, key: str) -> list[Path]:
    """The run directories of request ``key`` under ``runs_dir`` (a continued request may have one)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("._-")[:80] or "run"  # worker.trainer.rundir.safe_name
    if not runs_dir.is_dir():
        return []
    found = []
    for path in sorted(runs_dir.iterdir()):
        if not _RUN_DIR_STAMP.match(path.name) or not path.is_dir():
            continue
        rest = path.name[16:]  # after "YYYYmmdd-HHMMSS-"; a second run in the same second has "-N"
        if rest == name or re.fullmatch(re.escape(name) + r"-\d+", rest):
            found.append(path)
    return found


def _lines(path: Path) -> Iterator[str]:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8", errors="replace") as handle:
                yield from (line.rstrip("\n") for line in handle)
        else:
            with path.open(encoding="utf-8", errors="replace") as handle:
                yield from (line.rstrip("\n") for line in handle)
    except OSError:
        return


def _json_lines(path: Path) -> Iterator[dict[str, Any]]:
    for line in _lines(path):
        data = _parse(line)
        if data is not None:
            yield data


def _parse(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    try:
        data = json.loads(line)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _time_of(data: dict[str, Any], default: float) -> float:
    stamp = data.get("timestamp")
    if isinstance(stamp, str):
        try:
            moment = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        except ValueError:
            return default
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)
        return moment.timestamp()
    return default


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
