"""A chain's run directory (not a training run's: that is worker/trainer/rundir.py), and its event log.

:class:`ChainRunDir` names the files of one chain (``chain.json``, ``chain.log``, ``checkpoints/``,
``logs/`` for the scheduler's output, ``scripts/`` for the batch scripts, and the ``DONE`` /
``FAILED`` markers) and reads and writes them. :class:`ChainLog` appends one JSON event per
line to ``chain.log``; the submitting command, every link and a follower all write to it.

A later link runs what ``chain.json`` says, so the run directory is trusted only while nobody
else can change it: it is created private (directories 0700, files 0600), and before a link
(or a follower) uses it, :meth:`ChainRunDir.verify` and :meth:`ChainRunDir.read` check that the run
directory, its ``checkpoints/``, ``logs/`` and ``scripts/`` and ``chain.json`` are real (no
symbolic link), belong to this user and are not writable by group or others
(``mode & 0o022 == 0``); otherwise :class:`ChainError` says which path and how to fix it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shlex
import stat
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
#: Bits that let someone other than the owner change a run directory or a file in it.
SHARED_WRITE = 0o022


def check_trusted(path: Path, info: os.stat_result, *, directory: bool) -> None:
    """Refuse (:class:`ChainError`) a run-directory path whose ``info`` (an ``lstat`` or the
    ``fstat`` of a descriptor opened without following links) shows that anyone but this user
    could change it: a symbolic link, another owner, or write permission for group or others."""
    kind = "directory" if directory else "file"
    if stat.S_ISLNK(info.st_mode):
        raise ChainError(
            f"{path} is a symbolic link: a chain's run directory and its files must be real ones (whoever can "
            f"change the link decides what the chain runs); give the directory itself as --run-dir"
        )
    if not (stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)):
        raise ChainError(f"{path} is not a {kind}: a chain's run directory holds only what hpc-bridge chain made")
    me = os.geteuid()
    if info.st_uid != me:
        raise ChainError(
            f"{path} belongs to uid {info.st_uid}, not to you (uid {me}): a chain runs only from a run directory "
            f"of its own user; submit it again with a --run-dir of your own"
        )
    if info.st_mode & SHARED_WRITE:
        raise ChainError(
            f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o}): they could change "
            f"what the chain runs; make it private with: chmod go-w {shlex.quote(str(path))}"
        )


def _open_trusted(path: Path, *, directory: bool, dir_fd: int | None = None) -> int:
    """A descriptor of ``path`` (opened without following a symbolic link; relative to
    ``dir_fd`` when given) after :func:`check_trusted` passed on what it opened."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECTORY if directory else os.O_NONBLOCK)
    try:
        fd = os.open(path.name if dir_fd is not None else path, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        check_trusted(path, os.lstat(path), directory=directory)  # says what it is (a link, a file)
        raise
    try:
        check_trusted(path, os.fstat(fd), directory=directory)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass(frozen=True)
class ChainRunDir:
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

    @property
    def folders(self) -> tuple[Path, ...]:
        """The directories a link trusts: the run directory first."""
        return (self.path, self.checkpoints, self.logs, self.scripts)

    def create(self) -> None:
        """Make the run directory and its folders, private (0700; missing parents too); an
        existing one must pass :func:`check_trusted` and hold no chain yet."""
        if os.path.lexists(self.chain_file):
            raise ChainError(f"{self.path} already holds a chain ({CHAIN_FILE}): choose another --run-dir")
        missing: list[Path] = []
        ancestor = self.path
        while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
            missing.append(ancestor)
            ancestor = ancestor.parent
        for directory in reversed(missing):
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700)
        check_trusted(self.path, os.lstat(self.path), directory=True)
        for directory in self.folders[1:]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700)
        self.verify()

    def verify(self) -> None:
        """Refuse (:class:`ChainError`) a run directory that anyone but this user could change
        (see :func:`check_trusted`); its folders that exist are checked too."""
        fd = _open_trusted(self.path, directory=True)
        os.close(fd)
        for folder in self.folders[1:]:
            try:
                info = os.lstat(folder)
            except FileNotFoundError:
                continue
            check_trusted(folder, info, directory=True)

    def read(self) -> dict[str, Any]:
        """``chain.json``, read only after the run directory and the file passed :func:`check_trusted`."""
        dir_fd = _open_trusted(self.path, directory=True)
        try:
            fd = _open_trusted(self.chain_file, directory=False, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        with os.fdopen(fd, "rb") as handle:
            data = json.load(handle)
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
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._handle: TextIO = os.fdopen(fd, "a", encoding="utf-8", buffering=1)
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
