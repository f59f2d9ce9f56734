"""Paco_classifier's source, for running Rodan 3.x's own classifier on our models.

Rodan 3.x classifies a page with Paco_classifier's ``recognition_engine.process_image_msae``.
The consumer environments run that very function (``consumers/classify_page.py``) on the models
we train. Its source is Paco_classifier at :data:`PACO_COMMIT` (MIT License), taken from:

1. ``HPC_PACO_SOURCE``: a folder holding the ``Paco_classifier`` package, or a ``.tar.gz`` of it;
2. else ``../shared/rodan/paco-classifier-*.tar.gz`` beside this checkout (the project machines'
   local copy of the upstream repository);
3. else the upstream repository, cloned with git at :data:`PACO_COMMIT`.

Archives and clones are unpacked once under ``HPC_CONSUMERS_DIR`` (``paco-<commit>``). It is a
test dependency: nothing of it is copied into the product.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from bridge.shell import CommandError, run_command
from consumers import HERE, ConsumerUnavailable, cache_dir

PACO_REPOSITORY = "https://github.com/DDMAL/Paco_classifier.git"
PACO_COMMIT = "64cb949"
#: Where the project machines keep a copy of the upstream archives (relative to the checkout).
SHARED_RODAN = HERE.parent.parent / "shared" / "rodan"


def _package_root(folder: Path) -> Path | None:
    """The folder that holds the importable ``Paco_classifier`` package, searched two levels down."""
    for candidate in (folder, *folder.glob("*"), *folder.glob("*/*")):
        if (candidate / "Paco_classifier" / "recognition_engine.py").is_file():
            return candidate
    return None


def _unpack(archive: Path, target: Path) -> Path:
    staging = Path(tempfile.mkdtemp(prefix=".paco-", dir=target.parent))
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")  # refuses links out and absolute paths
        root = _package_root(staging)
        if root is None:
            raise ConsumerUnavailable(f"{archive} holds no Paco_classifier/recognition_engine.py")
        shutil.rmtree(target, ignore_errors=True)
        root.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _clone(target: Path) -> Path:
    staging = Path(tempfile.mkdtemp(prefix=".paco-", dir=target.parent))
    try:
        run_command(["git", "clone", "--quiet", PACO_REPOSITORY, str(staging / "repo")], timeout=600)
        run_command(["git", "-C", str(staging / "repo"), "checkout", "--quiet", PACO_COMMIT], timeout=120)
        shutil.rmtree(staging / "repo" / ".git", ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
        (staging / "repo").rename(target)
    except CommandError as exc:
        raise ConsumerUnavailable(
            f"Paco_classifier could not be cloned from {PACO_REPOSITORY} ({exc}); set HPC_PACO_SOURCE "
            "to a checkout or archive of it"
        ) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def paco_source() -> Path:
    """A folder whose ``Paco_classifier`` package Python can import (see the module docstring)."""
    configured = os.environ.get("HPC_PACO_SOURCE")
    if configured:
        path = Path(configured)
        if path.is_dir():
            root = _package_root(path)
            if root is None:
                raise ConsumerUnavailable(f"HPC_PACO_SOURCE={configured} holds no Paco_classifier package")
            return root
        archive: Path | None = path
    else:
        archives = sorted(SHARED_RODAN.glob("paco-classifier-*.tar.gz"))
        archive = archives[-1] if archives else None
    target = cache_dir() / f"paco-{PACO_COMMIT}"
    if target.is_dir() and _package_root(target) == target:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    return _unpack(archive, target) if archive is not None else _clone(target)
