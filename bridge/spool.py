"""The private spool: where the bridge and its jobs keep state on shared storage.

Layout (directory 0700, files 0600; the root 0710 once HPC_RUNS_SHARED=group keeps SPOOL/runs
here: the group may pass through to ``runs/`` by name and list nothing)::

    SPOOL/
      bridge.lock          held by the one bridge process working at a time
      ledger/KEY.json      the bridge's record of each request (see ledger.py)
      params/KEY.json      parameter file for the job (holds the token; the worker deletes it)
      jobs/KEY/            batch script and scheduler output of the request's job
      jobs/KEY/inputs/     HPC_INPUTS_FETCH=login: the inputs the bridge fetched at intake (removed
                           with the run directory's inputs/, once the final reply is out)
      outbox/KEY.{body,json}  a reply waiting to be published (see replies.py)
      replies/KEY.json     marker: the final reply of this request was published

KEY is the correlation id when it is a safe file name, else its SHA-256.
Every write is atomic (:mod:`bridge.atomic`): temp file, flush, fsync, ``os.replace``, directory fsync.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bridge.atomic import atomic_write as atomic_write  # re-exported
from bridge.atomic import atomic_write_json as atomic_write_json  # re-exported
from bridge.atomic import fsync_dir as fsync_dir  # re-exported
from bridge.errors import ConfigError

#: What flock(2) raises where the filesystem keeps no locks (NFS without lockd, Lustre mounted
#: without ``flock``, some FUSE filesystems). ENOTSUP is EOPNOTSUPP on Linux.
NO_LOCKS = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})
#: The fix the lock error and ``doctor`` give.
LOCK_FIX = (
    "put the spool on a filesystem with POSIX locks, e.g. project space "
    "(NFS needs lockd; Lustre the flock mount option)"
)

_SAFE_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def safe_key(correlation_id: str) -> str:
    """A file-name-safe key for a correlation id (which comes from the network)."""
    if _SAFE_KEY.fullmatch(correlation_id):  # not .match: '$' would let a trailing newline in
        return correlation_id
    return "sha256-" + hashlib.sha256(correlation_id.encode("utf-8", "surrogatepass")).hexdigest()


def read_json(path: Path) -> Any:
    with path.open("rb") as handle:
        return json.load(handle)


def mount_of(path: Path) -> tuple[str, str]:
    """(mount point, filesystem type) of ``path``, from /proc/mounts; ("", "") when unknown."""
    resolved = str(Path(path).resolve())
    best = ("", "")
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, fields[2])
    return best


def no_locks_error(directory: Path, exc: OSError) -> ConfigError:
    """The configuration error for a spool whose filesystem refused a lock with ``exc``."""
    point, fstype = mount_of(directory)
    where = f"{fstype or 'an unknown filesystem'} mounted at {point or '?'}"
    return ConfigError(
        f"the spool {directory} is on {where}, which does not support file locks "
        f"({exc.strerror or errno.errorcode.get(exc.errno or 0, exc)}): {LOCK_FIX}; or set HPC_SPOOL_DIR elsewhere"
    )


class Spool:
    def __init__(self, root: Path) -> None:
        self.root = root

    def ensure(self) -> Spool:
        """Create the layout, private to the owner (also tightens an existing spool).

        The root keeps a group execute bit (0710) that a worker with HPC_RUNS_SHARED=group set
        so that the group reaches SPOOL/runs; nothing else of the group's or others' survives.
        """
        for sub in ("", "ledger", "params", "jobs", "outbox", "replies"):
            directory = self.root / sub
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            keep = stat.S_IMODE(directory.stat().st_mode) & stat.S_IXGRP if sub == "" else 0
            os.chmod(directory, 0o700 | keep)
        return self

    def claim(self, instance: str) -> Spool:
        """Mark the spool as ``instance``'s (``SPOOL/instance``), or refuse one another instance owns.

        Two bridges on one spool would answer each other's requests and cancel each other's jobs as
        lost; the lock alone only takes turns. A spool from before instances is claimed as found.
        """
        marker = self.root / "instance"
        try:
            owner = marker.read_text().strip()
        except FileNotFoundError:
            atomic_write(marker, f"{instance}\n".encode())
            return self
        if owner != instance:
            raise ConfigError(
                f"the spool {self.root} belongs to instance {owner!r}, not {instance!r}: give this instance "
                f"a spool of its own (HPC_SPOOL_DIR), or run it as --instance {owner}"
            )
        return self

    @property
    def ledger_dir(self) -> Path:
        return self.root / "ledger"

    @property
    def outbox_dir(self) -> Path:
        return self.root / "outbox"

    @property
    def replies_dir(self) -> Path:
        return self.root / "replies"

    def params_path(self, key: str) -> Path:
        return self.root / "params" / f"{key}.json"

    def job_dir(self, key: str) -> Path:
        return self.root / "jobs" / key

    def inputs_dir(self, key: str) -> Path:
        """Where the bridge puts a request's inputs with HPC_INPUTS_FETCH=login (the job reads them there)."""
        return self.job_dir(key) / "inputs"

    def drop_inputs(self, key: str) -> None:
        """Remove the inputs fetched for ``key`` (its reply is out, or it will never have a job)."""
        shutil.rmtree(self.inputs_dir(key), ignore_errors=True)

    def reply_marker(self, key: str) -> Path:
        return self.replies_dir / f"{key}.json"

    @contextlib.contextmanager
    def lock(self) -> Iterator[bool]:
        """Yield True when this process holds the bridge lock, False if another one does.

        Raises :class:`ConfigError` (naming the mount and its filesystem type) where the
        spool's filesystem keeps no locks: two bridges could then work on it at once.
        """
        self.ensure()
        fd = os.open(self.root / "bridge.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            except OSError as exc:
                if exc.errno in NO_LOCKS:
                    raise no_locks_error(self.root, exc) from exc
                raise
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            try:
                yield True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
