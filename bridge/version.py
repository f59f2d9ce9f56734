"""Which version of hpc-bridge this is, and which worker environment a job is pinned to.

The version comes from the installed package's metadata (``pyproject.toml``'s ``version`` when it
was installed), never from a literal here. The bridge writes it into every parameter file and
ledger record; the worker compares it with its own, and ``hpc-bridge doctor`` compares the worker
environment's with the bridge's.
"""

from __future__ import annotations

import functools
import os
from importlib.metadata import PackageNotFoundError, version

#: The distribution name in ``pyproject.toml`` (both ``bridge`` and ``worker`` ship in it).
DISTRIBUTION = "hpc-bridge"
#: What ``package_version`` says when the package is not installed (run from a bare source tree).
UNKNOWN = "unknown"


@functools.cache
def package_version() -> str:
    """The installed hpc-bridge version, e.g. ``0.1.0``."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return UNKNOWN


def pinned_worker_python(worker_python: str) -> str:
    """``HPC_WORKER_PYTHON`` with its directories resolved, as a job must run it.

    With ``HPC_WORKER_PYTHON=~/hpc-bridge/envs/current/bin/python`` and ``current`` a symlink to
    ``worker-0.2.0``, a job gets ``~/hpc-bridge/envs/worker-0.2.0/bin/python``: switching the symlink
    to another environment (an upgrade) changes only the jobs submitted afterwards, and a job
    that continues in a new job keeps its environment. Only the directories are resolved, not the
    file itself: a virtual environment's ``python`` is a symlink to the system interpreter, which
    would leave the environment behind.
    """
    directory, name = os.path.split(worker_python)
    return os.path.join(os.path.realpath(directory), name)
