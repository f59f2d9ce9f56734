"""Checkpoints on fast node-local disk, copied to persistent storage in the background.

A shared filesystem can stall for seconds under load; training should not. So, as users do
by hand with ``rsync`` in their batch scripts, checkpoints are written to a node-local
directory and a thread copies them to the persistent one every ``sync_interval_s``
seconds, and once more, blocking, on :meth:`CheckpointStore.flush` and when the job ends.
:func:`open_checkpoints` is the one entry point::

    with open_checkpoints(run_dir / "checkpoints", node_local_dir, sync_interval_s=60) as store:
        try:
            train_page(page, settings, out_dir, checkpoints=store, stop_requested=flag)
        except TrainingInterrupted:
            store.flush()       # the checkpoint is on persistent storage before the job goes
            ...                 # requeue
    # leaving the block stops the thread and syncs a last time

Saving only ever writes to the local directory: the copying thread never holds anything
that :meth:`CheckpointStore.save` waits for. Each pass (:meth:`CheckpointSync.sync`)
copies the other files first (finished layers' models: immutable, copied when missing or
of another size), then the newest checkpoint if the destination lacks it, then removes the
destination's checkpoints beyond the newest ``keep``. Every file is copied from an open
descriptor (a file the store replaces or removes meanwhile is still read whole) into a
temporary file at the destination that is fsync-ed and renamed into place
(:func:`copy_file_atomic`): the persistent directory only ever holds whole files, and a
checkpoint there never refers to a model file that is not there yet (the models are listed
after the checkpoint chosen, so every model written before it is seen).

On start, :func:`open_checkpoints` copies the newest intact checkpoint (and the model files
it needs) from the persistent directory to the local one unless the local one holds a
newer one already, so a job continued on another node resumes where the last one stopped.

The node-local directory lies under a base every user of the node shares (``$TMPDIR``,
``/tmp``), with a name others can guess, so it is used only as :func:`claim_node_local_dir`
leaves it: made by this job with mode 0700 (never through a symbolic link), or, if it exists
already, a real directory of this user that nobody else may enter. Anything else (another
user's directory, a symbolic link, open permissions) is left alone and a fresh directory with
an unpredictable name is made beside it (warning event ``node_local_dir_unsafe``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

import structlog

from bridge.atomic import atomic_file
from worker.trainer.checkpoint import (
    CHUNK,
    KEEP,
    CheckpointStore,
    Throttle,
    checkpoint_name,
    checkpoint_sequence,
    list_checkpoints,
    remove_temporary_files,
)

log = logging.getLogger(__name__)
events = structlog.get_logger("worker")  # the worker's JSON log: the node-local directory's events

#: How often the thread copies when the caller does not say.
DEFAULT_SYNC_INTERVAL_S = 60.0
#: A pass retries this often when the store removed the checkpoint it was about to copy.
RETRIES = 5

#: ``copy_file(source, destination)``: copies one file atomically (tests and benchmarks pass their own).
CopyFile = Callable[[Path, Path], object]


def copy_file_atomic(source: Path, destination: Path, throttle: Throttle | None = None) -> int:
    """Copy ``source`` to ``destination`` atomically and durably; returns the bytes copied.

    ``source`` is opened first and read through that descriptor, so a concurrent
    ``os.replace`` or unlink of ``source`` cannot tear the copy. ``destination`` appears
    only once complete and fsync-ed (see :func:`bridge.atomic.atomic_file`).
    ``throttle`` is called after every chunk with its size.
    """
    total = 0
    with open(source, "rb") as reader, atomic_file(Path(destination)) as writer:
        while chunk := reader.read(CHUNK):
            writer.write(chunk)
            total += len(chunk)
            if throttle is not None:
                throttle(len(chunk))
    return total


class CheckpointSync:
    """Copies the checkpoint directory ``source`` to ``destination`` every ``interval_s`` seconds.

    :meth:`start` starts the (daemon) thread; :meth:`sync` (also :meth:`flush`) runs one pass
    now and blocks until it is done; :meth:`close` stops the thread and runs a last pass.
    As a context manager it starts on entry and closes on exit. Passes never overlap. A
    failing pass in the thread is logged and retried at the next interval; one run by
    :meth:`sync` or :meth:`close` raises (except while another exception leaves the block:
    then it is logged, and the original goes on).
    """

    def __init__(
        self,
        source: Path,
        destination: Path,
        interval_s: float = DEFAULT_SYNC_INTERVAL_S,
        *,
        copy_file: CopyFile = copy_file_atomic,
        keep: int = KEEP,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"the sync interval must be positive, not {interval_s}")
        self.source = Path(source)
        self.destination = Path(destination)
        self.interval_s = interval_s
        self.keep = keep
        self._copy_file = copy_file
        self._lock = threading.Lock()  # one pass at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.passes = 0
        self.files_copied = 0
        self.last_error: BaseException | None = None
        self.destination.mkdir(parents=True, exist_ok=True)
        remove_temporary_files(self.destination)

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the sync thread was started already")
        self._thread = threading.Thread(target=self._run, name="checkpoint-sync", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sync()
            except Exception as exc:  # the slow filesystem failed: try again next time
                self.last_error = exc
                log.warning("syncing %s to %s failed; retrying in %g s", self.source, self.destination,
                            self.interval_s, exc_info=True)  # fmt: skip

    def sync(self) -> int:
        """Run one pass now (waiting for one in progress to finish first); returns the files copied."""
        with self._lock:
            copied = self._pass()
            self.passes += 1
            self.files_copied += copied
            return copied

    def flush(self) -> None:
        """Block until everything in ``source`` now is in ``destination``."""
        self.sync()

    def close(self) -> None:
        """Stop the thread (after the pass it may be in) and run a last pass."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sync()

    def __enter__(self) -> CheckpointSync:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        try:
            self.close()
        except Exception:
            if exc is None:
                raise
            log.exception("the final sync of %s to %s failed", self.source, self.destination)

    def _pass(self) -> int:
        for _ in range(RETRIES):
            checkpoints = list_checkpoints(self.source)  # first: the files listed next include its models
            copied = self._copy_other_files()
            if not checkpoints:
                return copied
            _, newest = checkpoints[-1]
            target = self.destination / newest.name
            if not target.exists():
                try:
                    self._copy_file(newest, target)
                except FileNotFoundError:
                    continue  # replaced by a newer one since it was listed: list again
                copied += 1
            for _, old in list_checkpoints(self.destination)[: -self.keep]:
                old.unlink(missing_ok=True)
            return copied
        raise RuntimeError(f"the checkpoints in {self.source} changed {RETRIES} times during one sync")

    def _copy_other_files(self) -> int:
        copied = 0
        for entry in os.scandir(self.source):
            if entry.name.startswith(".") or checkpoint_sequence(entry.name) is not None:
                continue
            if not entry.is_file(follow_symlinks=False):
                continue
            target = self.destination / entry.name
            with contextlib.suppress(FileNotFoundError):
                if target.stat().st_size == entry.stat().st_size:
                    continue  # these files never change once written
            self._copy_file(Path(entry.path), target)
            copied += 1
        return copied


def seed_local(persistent_dir: Path, local_dir: Path, copy_file: CopyFile = copy_file_atomic) -> int | None:
    """Copy the newest intact checkpoint of ``persistent_dir`` (and its models) to ``local_dir``,
    unless ``local_dir`` holds one at least as new; returns the sequence copied, or None."""
    remote = CheckpointStore(persistent_dir).load_latest()
    if remote is None:
        return None
    here = CheckpointStore(local_dir).load_latest()
    if here is not None and here.sequence >= remote.sequence:
        log.info("the node-local checkpoint %d is at least as new as the persistent one", here.sequence)
        return None
    for finished in remote.finished:
        copy_file(Path(persistent_dir) / finished.file, Path(local_dir) / finished.file)
    name = checkpoint_name(remote.sequence)
    copy_file(Path(persistent_dir) / name, Path(local_dir) / name)
    log.info("copied checkpoint %d from %s to %s", remote.sequence, persistent_dir, local_dir)
    return remote.sequence


def _not_private(path: Path) -> str | None:
    """Why ``path`` (looked at without following a symbolic link) is no directory of this job's
    own: None when it is a real directory of this user with no permission for anyone else."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return "a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory"
    if info.st_uid != os.geteuid():
        return f"owned by uid {info.st_uid}"
    if info.st_mode & 0o077:
        return f"open to other users (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def claim_node_local_dir(path: Path) -> Path | None:
    """A directory only this user can enter, for this job's node-local checkpoints: ``path``
    itself or, when that is not safe, a fresh one beside it; None when none can be made (the
    checkpoints then go straight to the run directory).

    ``path`` is made with mode 0700 (``mkdir`` never follows a symbolic link). If it exists
    already it is used only when it is a real directory (``lstat``), owned by this user, with
    ``mode & 0o077 == 0`` (e.g. this job's own, from before a requeue on the same node).
    Otherwise it is left alone, and a directory with an unpredictable name is made in the same
    base (``tempfile.mkdtemp``: mode 0700, ``PATH-xxxxxxxx``) with the warning event
    ``node_local_dir_unsafe``. The caller removes what it gets when done.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        problem = _not_private(path)
        if problem is None:
            return path
        fresh = Path(tempfile.mkdtemp(prefix=f"{path.name}-", dir=path.parent))
    except OSError as exc:
        events.warning(
            "node_local_dir_unusable", path=str(path), error=str(exc), note="checkpoints go to the run directory"
        )
        return None
    events.warning("node_local_dir_unsafe", path=str(path), problem=problem, using=str(fresh))
    return fresh


@contextlib.contextmanager
def open_checkpoints(
    persistent_dir: Path, local_dir: Path | None = None, sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S
) -> Iterator[CheckpointStore]:
    """The checkpoint store for ``train_page(checkpoints=...)``: see the module docstring.

    Without ``local_dir`` the store writes straight to ``persistent_dir`` and its ``flush()``
    does nothing. With it, the store writes to ``local_dir`` (what it holds counts as this
    run's), a thread copies it to ``persistent_dir`` every ``sync_interval_s`` seconds,
    ``store.flush()`` copies now and blocks until done, and leaving the block stops the
    thread and copies a last time. Both directories are made if missing; on entry the
    newest checkpoint of ``persistent_dir`` is copied to ``local_dir`` unless that holds a
    newer one.

    ``local_dir`` is used only as :func:`claim_node_local_dir` leaves it: where that is not
    ``local_dir`` itself, the store writes to the fresh directory it made instead, which is
    removed on leaving the block; where no private directory can be had, the store writes
    straight to ``persistent_dir``.
    """
    persistent_dir = Path(persistent_dir)
    persistent_dir.mkdir(parents=True, exist_ok=True)
    local = None if local_dir is None else claim_node_local_dir(Path(local_dir))
    if local is None:
        yield CheckpointStore(persistent_dir)
        return
    try:
        seed_local(persistent_dir, local)
        with CheckpointSync(local, persistent_dir, sync_interval_s) as sync:
            yield CheckpointStore(local, flush=sync.flush)
    finally:
        if local_dir is not None and local != Path(local_dir):  # made here: nobody else knows it
            shutil.rmtree(local, ignore_errors=True)
