"""The run directory: where a chain keeps everything, and its event log.

:class:`RunDir` names the files of one chain (``chain.json``, ``chain.log``, ``checkpoints/``,
``logs/`` for the scheduler's output, ``scripts/`` for the batch scripts, and the ``DONE`` /
``FAILED`` markers) and reads and writes them. :class:`ChainLog` appends one JSON event per
line to ``chain.log``; the submitting command, every link and a follower all write to it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

import structlog

from bridge.chain.settings import ChainError
from bridge.spool import atomic_write, atomic_write_json, read_json

log = structlog.get_logger(__name__)

CHAIN_FILE = "chain.json"
LOG_FILE = "chain.log"
DONE_FILE = "DONE"
FAILED_FILE = "FAILED"


@dataclass(frozen=True)
class RunDir:
    """``chain.json``, ``chain.log``, ``checkpoints/``, ``logs/`` (scheduler output), ``scripts/``, markers."""

    path: Path

    @property
    def chain_file(self) -> Path:
        return self.path / CHAIN_FILE

    @property
    def log_file(self) -> Path:
        return self.path / LOG_FILE

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def scripts(self) -> Path:
        return self.path / "scripts"

    @property
    def done_marker(self) -> Path:
        return self.path / DONE_FILE

    @property
    def failed_marker(self) -> Path:
        return self.path / FAILED_FILE

    def create(self) -> None:
        if self.chain_file.exists():
            raise ChainError(f"{self.path} already holds a chain ({CHAIN_FILE}): choose another --run-dir")
        for directory in (self.path, self.checkpoints, self.logs, self.scripts):
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    def read(self) -> dict[str, Any]:
        data = read_json(self.chain_file)
        if not isinstance(data, dict):
            raise ChainError(f"{self.chain_file} is not a JSON object")
        return data

    def write(self, record: Mapping[str, Any]) -> None:
        atomic_write_json(self.chain_file, dict(record))

    def marker(self) -> tuple[str, dict[str, Any]] | None:
        """("done" | "failed", its record) once a link has finished or failed the chain."""
        for kind, path in (("done", self.done_marker), ("failed", self.failed_marker)):
            try:
                data = read_json(path)
            except FileNotFoundError:
                continue
            except (OSError, ValueError):
                data = {}
            return kind, data if isinstance(data, dict) else {}
        return None

    def write_marker(self, path: Path, record: Mapping[str, Any]) -> None:
        atomic_write(path, (json.dumps(dict(record), sort_keys=True) + "\n").encode(), mode=0o600)

    def events(self) -> list[dict[str, Any]]:
        """Every complete event in chain.log, oldest first."""
        try:
            text = self.log_file.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return []
        return [e for e in (_parse_event(line) for line in text.splitlines()) if e is not None]


def default_run_dir(name: str, cwd: Path, now: datetime | None = None) -> Path:
    """``./chain-runs/<name>-<UTC timestamp>`` (a suffix if that exists already)."""
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    base = cwd / "chain-runs" / f"{name}-{stamp}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def _parse_event(line: str) -> dict[str, Any] | None:
    try:
        event = json.loads(line)
    except ValueError:
        return None  # a line still being written, or not ours
    return event if isinstance(event, dict) and "event" in event else None


class ChainLog:
    """Appends JSON events to chain.log (one ``write`` per line, ``O_APPEND``: links, the
    submitting command and a follower may all write). Each event is also logged as usual
    (the job's output inside a link)."""

    def __init__(self, path: Path, **context: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handle: TextIO = path.open("a", encoding="utf-8", buffering=1)
        self._events = structlog.wrap_logger(
            structlog.WriteLogger(self._handle),
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.JSONRenderer(sort_keys=False),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET),  # whatever the log level
        ).bind(**context)
        self._context = context

    def bind(self, **context: Any) -> None:
        self._events = self._events.bind(**context)
        self._context.update(context)

    def emit(self, event: str, *, level: str = "info", **fields: Any) -> None:
        getattr(self._events, level)(event, **fields)
        getattr(log, level)(event, **self._context, **fields)

    def close(self) -> None:
        self._handle.close()
