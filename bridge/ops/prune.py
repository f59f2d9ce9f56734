"""``hpc-bridge prune``: forget requests settled longer than ``HPC_RETENTION_DAYS`` ago.

A settled request is one that has had its final reply (or was rejected and dead-lettered, or
its reply expired). After the retention period its ledger record, reply marker, job folder
(batch script, scheduler output) and run directories (job.log, metrics, TensorBoard files) are
deleted, so the spool does not grow for ever. The bridge runs this itself after a pass, at most
hourly (every quarter of a retention under four hours: ``Bridge.prune_interval_s``); the
command is for operators who want to see what goes (``--dry-run``) or choose another age
(``--older-than``).

What is kept is what a redelivery still needs: a request forgotten here and delivered again
would be handled as new, which is why the retention period is counted in days, far beyond any
redelivery (Rodan's queues are not durable, and the dead-letter queue keeps its own copies).
"""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from bridge.config import BridgeConfig
from bridge.ledger import Ledger, RequestRecord, RequestState
from bridge.ops.request_log import run_dirs
from bridge.spool import Spool

log = structlog.get_logger(__name__)

DAY_S = 86400.0


@dataclass
class PruneReport:
    requests: list[str] = field(default_factory=list)  # correlation ids forgotten
    paths: list[Path] = field(default_factory=list)  # files and folders deleted (or to delete)


def settled_at(record: RequestRecord) -> float | None:
    """When ``record`` was settled for good, or None while something may still happen to it."""
    if record.state is RequestState.REPLIED:
        return record.replied_at or record.updated_at
    if record.state is RequestState.REJECTED and record.dead_lettered:
        return record.updated_at
    if record.state is RequestState.CANCELLED_BY_RODAN and record.job_ended:
        return record.updated_at
    return None


def prune(
    config: BridgeConfig,
    spool: Spool,
    ledger: Ledger,
    *,
    older_than_days: float | None = None,
    dry_run: bool = False,
    now: float | None = None,
) -> PruneReport:
    """Delete what belongs to requests settled more than ``older_than_days`` (HPC_RETENTION_DAYS) ago."""
    now = time.time() if now is None else now
    cutoff = now - (config.retention_days if older_than_days is None else older_than_days) * DAY_S
    runs_dir = config.runs_dir or spool.root / "runs"
    report = PruneReport()
    for record in ledger.all():
        when = settled_at(record)
        if when is None or when > cutoff:
            continue
        paths = [
            *run_dirs(runs_dir, record.key),
            spool.job_dir(record.key),
            spool.params_path(record.key),
            spool.reply_marker(record.key),
            spool.reply_marker(record.key).with_suffix(".sending"),
            ledger.path(record.key),  # last: a pass killed half-way is finished by the next one
        ]
        paths = [p for p in paths if p.exists() or p.is_symlink()]
        report.requests.append(record.correlation_id)
        report.paths.extend(paths)
        if dry_run:
            continue
        for path in paths:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
    if report.requests and not dry_run:
        log.info(
            "requests_pruned", requests=len(report.requests), paths=len(report.paths), older_than_s=int(now - cutoff)
        )
    return report


# --- the command ------------------------------------------------------------------------------

EPILOG = """examples:
  hpc-bridge prune --dry-run            # what would go (HPC_RETENTION_DAYS, default 30)
  hpc-bridge prune --older-than 7       # forget requests settled more than a week ago
"""


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "prune",
        help="delete the records, job folders and run directories of long-settled requests",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--older-than", type=float, metavar="DAYS", help="default: HPC_RETENTION_DAYS (30)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    parser.set_defaults(operator=run)


def run(config: BridgeConfig, args: argparse.Namespace) -> int:
    spool = Spool(config.spool_dir)
    if not spool.ledger_dir.is_dir():
        print(f"no spool at {config.spool_dir}: nothing to prune")
        return 0
    with spool.lock() as held:
        if not held and not args.dry_run:
            print("another hpc-bridge is working on this spool; it prunes by itself after its passes")
            return 1
        report = prune(config, spool, Ledger(spool), older_than_days=args.older_than, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    for path in report.paths:
        print(f"{verb} {path}")
    print(f"{len(report.requests)} settled request(s), {len(report.paths)} path(s) {verb}")
    return 0
