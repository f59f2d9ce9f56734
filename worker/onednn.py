"""oneDNN or not: measured once per CPU model and TensorFlow version, then remembered.

TensorFlow's oneDNN kernels are switched by ``TF_ENABLE_ONEDNN_OPTS``, read once when
TensorFlow is imported. Since 2.9 TensorFlow turns them on by itself only on CPUs with
AVX-512 VNNI, BF16 or AMX; elsewhere they are off, although on an AVX2 node they trained
the SAE faster per step, while on an AVX-512/AMX machine TensorFlow's own choice (on) is the
fast one (both measured: ``benchmarks/README.md``, "Trainer"). Which is faster is a property
of the CPU, so the worker measures it
instead of hard-coding either: :func:`choose`, called before TensorFlow is imported, times
a few SAE training steps in two short child processes, one per setting, picks the faster
(oneDNN only when it is at least :data:`MARGIN` faster) and keeps the result in
:func:`tuning_dir` (``HPC_TUNING_DIR``, default ``~/.cache/hpc-bridge/tuning``, shared by
the nodes where home directories are), keyed by the CPU's model name and feature flags
and TensorFlow's version. The first job on a new kind of node pays for the measurement (a few
training steps per setting); later ones read the file.

Not measured: when ``TF_ENABLE_ONEDNN_OPTS`` is already set (an operator's choice, e.g. in
``HPC_JOB_PROLOGUE`` or the batch environment), and when the node has NVIDIA GPUs (the
network then runs on them; the CPU only cuts patches).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import structlog

from bridge.atomic import atomic_write
from bridge.shell import CommandError, run_command

log = structlog.get_logger(__name__)

#: The environment variable TensorFlow reads at import.
VARIABLE = "TF_ENABLE_ONEDNN_OPTS"
#: oneDNN is chosen when its step takes at most this fraction of the other's.
MARGIN = 0.95
#: Seconds each measuring child may take (TensorFlow's import included).
MEASURE_TIMEOUT_S = 180.0
#: The measurement: SAE steps at this patch side and batch, after warm-up steps.
PATCH, BATCH, WARMUP_STEPS, TIMED_STEPS = 64, 8, 2, 4


def cpu_key() -> str:
    """A short digest of what decides the kernels' speed: CPU model, features, TensorFlow version."""
    model, flags = "", ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            name, _, value = line.partition(":")
            name = name.strip()
            if name == "model name" and not model:
                model = value.strip()
            elif name in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    text = f"{model}\n{flags}\n{tensorflow_version()}\n{os.uname().machine}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tensorflow_version() -> str:
    for distribution in ("tensorflow", "tensorflow-cpu", "tensorflow-intel"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(distribution)
    return "unknown"


def tuning_dir() -> Path:
    """``HPC_TUNING_DIR``, else ``$XDG_CACHE_HOME/hpc-bridge/tuning`` (``~/.cache/...``)."""
    configured = os.environ.get("HPC_TUNING_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hpc-bridge" / "tuning"


def has_nvidia_gpu() -> bool:
    """Whether this job was given NVIDIA GPUs (device files, not TensorFlow: it is not imported yet)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "NoDevFiles"):
        return False
    return any(Path("/dev").glob("nvidia[0-9]*"))


def choose(directory: Path) -> str | None:
    """Set ``TF_ENABLE_ONEDNN_OPTS`` for this process (and its children) from this CPU's
    measurement, measuring first if no earlier job did; return the value, None when left alone.

    Must run before TensorFlow is imported. A measurement that fails leaves TensorFlow's
    default and is retried by the next job.
    """
    if VARIABLE in os.environ:
        return os.environ[VARIABLE]
    if has_nvidia_gpu():
        return None
    path = directory / f"onednn-{cpu_key()}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(directory / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # jobs starting together on one kind of node measure once
            decision = _read(path)
            if decision is None:
                decision = measure()
                if decision is None:
                    return None
                atomic_write(path, (json.dumps(decision) + "\n").encode(), mode=None)
    except OSError as exc:
        log.warning("onednn_not_chosen", error=str(exc), note="TensorFlow's default is kept")
        return None
    os.environ[VARIABLE] = decision["setting"]
    log.info("onednn_chosen", setting=decision["setting"], step_s=decision["step_s"], measured_in=str(path))
    return str(decision["setting"])


def _read(path: Path) -> dict[str, Any] | None:
    try:
        decision = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return decision if isinstance(decision, dict) and decision.get("setting") in ("0", "1") else None


def measure() -> dict[str, Any] | None:
    """Time SAE steps with oneDNN off and on, each in a fresh interpreter; None if either fails."""
    step_s: dict[str, float] = {}
    started = time.monotonic()
    for setting in ("0", "1"):
        env = {**os.environ, VARIABLE: setting, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
        try:
            done = run_command([sys.executable, "-m", "worker.onednn"], timeout=MEASURE_TIMEOUT_S, env=env)
            step_s[setting] = float(json.loads(done.stdout.strip().splitlines()[-1])["step_s"])
        except (CommandError, OSError, ValueError, KeyError, IndexError) as exc:
            log.warning("onednn_measure_failed", setting=setting, error=str(exc)[:500])
            return None
    chosen = "1" if step_s["1"] <= MARGIN * step_s["0"] else "0"
    log.info("onednn_measured", step_s=step_s, setting=chosen, seconds=round(time.monotonic() - started, 1))
    return {"setting": chosen, "step_s": step_s, "tensorflow": tensorflow_version(), "measured": time.time()}


def _time_steps() -> float:
    """The fastest of TIMED_STEPS training steps of the SAE in this process (after warm-up)."""
    import numpy as np

    from worker.trainer.model import get_sae

    rng = np.random.default_rng(0)
    x = rng.random((BATCH, PATCH, PATCH, 3), dtype=np.float32)
    y = (rng.random((BATCH, PATCH, PATCH, 1)) < 0.1).astype(np.float32)
    model = get_sae(PATCH, PATCH)
    for _ in range(WARMUP_STEPS):
        model.train_on_batch(x, y)
    times = []
    for _ in range(TIMED_STEPS):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Time SAE training steps under this process's " + VARIABLE)
    parser.parse_args(argv)
    print(json.dumps({"setting": os.environ.get(VARIABLE), "step_s": _time_steps()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
