"""Replacing a file atomically and durably: the one way this project writes a file in place.

:func:`atomic_file` writes to a temporary file beside the target (same directory, so the same
filesystem), named ``.<name>.<random>.tmp`` (:data:`TEMP_SUFFIX`). When the block ends, the file
is flushed and ``os.fsync``-ed, renamed over the target with ``os.replace``, and the directory is
fsync-ed, so that the rename survives a crash too. A reader therefore sees the old file or the
new one, never a mix, and a crash at any instant leaves the old file intact and at most one
temporary file (an owner of a directory may remove such leftovers on start). An exception inside
the block removes the temporary file and leaves the target untouched.

:func:`atomic_write` and :func:`atomic_write_json` write bytes and JSON through it;
:func:`fsync_dir` makes a rename or unlink in a directory durable.

Standard library only: ``worker.trainer``, which imports nothing else of the project, uses it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

#: Temporary files are ``.<final name>.<random>.tmp``: hidden, in the target's directory.
TEMP_SUFFIX = ".tmp"
#: How many random names :func:`atomic_file` tries before it gives up (each clash is 1 in 2**64).
_NAME_TRIES = 100


def _create_temporary(path: Path, mode: int | None) -> tuple[Path, BinaryIO]:
    """A new, empty temporary file beside ``path``, open for writing; private (0600) while written
    unless ``mode`` is None, when it gets the umask's default mode as ``open`` would."""
    permissions = 0o666 if mode is None else 0o600
    for _ in range(_NAME_TRIES):
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")
        try:
            # "xb": O_CREAT | O_EXCL, so neither an existing file nor a symbolic link is opened.
            handle = open(temporary, "xb", opener=lambda name, flags: os.open(name, flags, permissions))
        except FileExistsError:
            continue
        return temporary, handle
    raise FileExistsError(f"no free temporary name beside {path}")


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Path | str, mode: int | None = 0o600, *, durable: bool = True) -> Iterator[BinaryIO]:
    """Replace ``path`` with what the block writes to the yielded binary handle.

    ``mode``: the file's permissions, whatever the umask (None: ``0o666`` less the umask, as a
    plain ``open`` would create it). The handle's ``name`` is the temporary file's path, for a
    writer that must open a file by name (h5py): it may write there while the block runs, and the
    fsync at the end covers the file whichever descriptor wrote it.

    ``durable=False`` skips both fsyncs: the replace stays atomic (never a mix of old and new for
    a reader), but a crash of the machine may lose the new file or leave it empty. Only for a file
    rewritten so often that the fsyncs cost measurably and that the next rewrite makes good.
    """
    path = Path(path)
    temporary, handle = _create_temporary(path, mode)
    try:
        with handle:
            if mode is not None:
                os.fchmod(handle.fileno(), mode)
            yield handle
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write(path: Path, data: bytes | bytearray | memoryview, *, mode: int | None = 0o600) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old or the new file, never a mix.

    Missing parent directories are made (the innermost one 0700, as ``Path.mkdir(mode=)`` does)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with atomic_file(path, mode) as handle:
        handle.write(data)


def atomic_write_json(path: Path, obj: Any, *, mode: int | None = 0o600) -> None:
    """:func:`atomic_write` of ``obj`` as indented JSON with sorted keys (UTF-8)."""
    atomic_write(path, json.dumps(obj, indent=1, sort_keys=True).encode("utf-8"), mode=mode)
