"""Build the consumer environments (virtual environments with Rodan's TensorFlow), once.

An environment is rebuilt only when its requirements file or Python version changed: the
stamp file in it records both, and is written last, under a lock, so an interrupted or
concurrent build never leaves a half-built environment that looks ready.
"""

from __future__ import annotations

import fcntl
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from bridge.shell import CommandError, run_command
from consumers import STAMP, Consumer, ConsumerUnavailable, cache_dir, find_python

#: pip may download a few hundred MB per environment.
INSTALL_TIMEOUT_S = 1800.0


def build(consumer: Consumer, say: Callable[[str], None] = print) -> Path:
    """Make ``consumer``'s environment current; return its interpreter. Raises ConsumerUnavailable."""
    if consumer.python_version is None or consumer.requirements is None:
        return consumer.python()
    target = consumer.directory
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = target / STAMP
        if stamp.exists() and stamp.read_text().strip() == consumer.fingerprint():
            say(f"consumer {consumer.name}: up to date ({target})")
            return consumer.python()
        python = find_python(consumer.python_version)
        say(f"consumer {consumer.name}: building with {python} from {consumer.requirements.name} (a minute or two)")
        started = time.monotonic()
        shutil.rmtree(target, ignore_errors=True)
        try:
            run_command([str(python), "-m", "venv", str(target)], timeout=300)
            pip = [str(target / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
            run_command([*pip, "install", "-r", str(consumer.requirements)], timeout=INSTALL_TIMEOUT_S)
        except CommandError as exc:
            raise ConsumerUnavailable(f"consumer {consumer.name}: building it failed: {exc}") from exc
        stamp.write_text(consumer.fingerprint() + "\n")  # last: only now does the environment count
        say(f"consumer {consumer.name}: built in {time.monotonic() - started:.0f} s ({target})")
        return consumer.python()


def build_all(consumers: Iterable[Consumer], say: Callable[[str], None] = print) -> None:
    """Build every environment; raise ConsumerUnavailable naming all that could not be built."""
    failures = []
    for consumer in consumers:
        try:
            build(consumer, say)
        except ConsumerUnavailable as exc:
            failures.append(str(exc))
    if failures:
        raise ConsumerUnavailable("; ".join(failures) + f" (environments live in {cache_dir()})")
