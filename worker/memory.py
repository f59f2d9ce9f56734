"""Give back the library pages that importing TensorFlow touched once.

Importing TensorFlow maps about a gigabyte of shared libraries and reads many of their
read-only pages while it starts (static initialisers, symbol lookups, the kernel's
read-around): most of a process's resident memory after ``import tensorflow`` is such clean,
file-backed pages, most of which training never touches again. They count in the
process's RSS, which is what Slurm's and Grid Engine's accounting report as a job's
memory (and what ``bench_trainer.py`` compares with the original trainer's).

:func:`release_library_pages` unmaps them from the process (``madvise`` with
``MADV_DONTNEED``) on every read-only mapping of a shared library that holds no private
copy of a page: the page cache keeps them, so nothing is lost and nothing is read from
disk again, and the pages training does use come back as minor faults. (Mappings with
private copies, e.g. the relocated read-only data of a library, are left alone: dropping
those copies would bring back the file's unrelocated bytes. ``MADV_PAGEOUT`` would instead
evict the pages from the page cache, and every continuation job would read TensorFlow
from disk again.) What it gives back, and that the step does not slow down:
``benchmarks/README.md`` ("Trainer", memory). On anything but Linux it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import structlog

log = structlog.get_logger(__name__)

#: ``MADV_DONTNEED`` from ``<sys/mman.h>``: unmap these pages (file pages stay cached).
MADV_DONTNEED = 4


def rss_bytes() -> int:
    """This process's resident set size now (0 where ``/proc`` has none)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def library_mappings() -> list[tuple[int, int]]:
    """``(start, end)`` of every read-only, private mapping of a shared library that holds
    only the file's own pages (``Anonymous: 0 kB`` in ``/proc/self/smaps``)."""
    mappings: list[tuple[int, int]] = []
    current: tuple[int, int] | None = None
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                parts = line.split()
                if not parts:
                    continue
                if "-" in parts[0] and not parts[0].endswith(":"):  # a mapping's header line
                    current = None
                    if len(parts) < 6 or "w" in parts[1] or "s" in parts[1]:
                        continue
                    name = parts[5].rsplit("/", 1)[-1]
                    if name.endswith(".so") or ".so." in name:
                        start, end = (int(value, 16) for value in parts[0].split("-"))
                        current = (start, end)
                elif current is not None and parts[0] == "Anonymous:":
                    if int(parts[1]) == 0:
                        mappings.append(current)
                    current = None
    except (OSError, ValueError):
        return []
    return mappings


def release_library_pages() -> int:
    """Unmap the clean, file-only pages of this process's shared libraries (see the module
    docstring); return how many bytes the RSS shrank by (0 where it cannot)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return 0
    libc = ctypes.CDLL(name, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    before = rss_bytes()
    for start, end in library_mappings():
        libc.madvise(start, end - start, MADV_DONTNEED)
    after = rss_bytes()
    log.info("library_pages_released", rss_mb_before=before >> 20, rss_mb_after=after >> 20)
    return max(0, before - after)
