"""oneDNN or not: measured once per kind of node and worker environment, outside any request's job.

TensorFlow's oneDNN kernels are switched by ``TF_ENABLE_ONEDNN_OPTS``, read once when
TensorFlow is imported. Since 2.9 TensorFlow turns them on by itself only on CPUs with
AVX-512 VNNI, BF16 or AMX; elsewhere they are off, although on an AVX2 node they trained
the SAE faster per step, while on an AVX-512/AMX machine TensorFlow's own choice (on) is the
fast one (both measured: ``benchmarks/README.md``, "Trainer"). Which is faster is a property
of the CPU, so it is measured rather than hard-coded: :func:`remember` times a few SAE training
steps in two short child processes, one per setting, picks the faster (oneDNN only when it is at
least :data:`MARGIN` faster) and keeps the result in :func:`tuning_dir` (``HPC_TUNING_DIR`` in the
jobs' environment, default ``~/.cache/hpc-bridge/tuning``, shared by the nodes where home
directories are). The record's name is a digest of what decides the kernels' speed (:func:`cpu_key`:
the CPU's model name and feature flags, the machine type, TensorFlow's and Python's versions), not
the host: nodes of one kind share one measurement. The record also holds the TensorFlow and Python
versions it was measured with, and is used only where both match (a record from another
environment is stale, never used).

**Who measures.** ``hpc-worker tune`` on a compute node: ``hpc-bridge doctor --job`` runs it in its
probe job (the ``node-worker`` line says what it found), ``hpc-bridge upgrade --build-on-node`` in
its build job once the new environment is built, and an operator may run it on each kind of node.
It measures when no usable record exists (or ``--again``); about 20-50 s, with the CPUs of the job
it runs in (the probe job has one): the choice follows the CPU's instructions, so one record serves
jobs of any CPU count.

**What a job does** (:func:`choose`, before TensorFlow is imported): it reads the record and never
measures. Without one (a new kind of node, a new TensorFlow) it keeps TensorFlow's own default and
says so in its log (``onednn_default``). Why not measure there, as the first job on a kind of node
once did: the measurement imports TensorFlow twice and trains (20-50 s on the job's CPUs) before
the user's training starts, on every first job of a kind of node and again after every upgrade;
measured in the background it would slow the training it runs beside and be skewed by it. The
default is safe: both settings compute the same network, only the speed differs (at most the
factor in benchmarks/README.md), and ``doctor --job``, which the guides have operators run after
every install and upgrade, removes the difference.

Not measured and not set: on Keras' JAX backend (``KERAS_BACKEND=jax``, or a worker environment
with JAX and no TensorFlow: TensorFlow is never imported there, so its switch means nothing); when
``TF_ENABLE_ONEDNN_OPTS`` is already set (an operator's choice, e.g. in ``HPC_JOB_PROLOGUE``);
when the node has NVIDIA GPUs (the network runs on them; the CPU only cuts patches).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
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
#: What a job without a usable record says it does, and how the operator removes the need.
DEFAULT_NOTE = (
    "TensorFlow's own default is kept and nothing is measured in this job; 'hpc-bridge doctor --job' "
    "(or 'hpc-worker tune' on such a node) measures it once for this kind of node and environment"
)


def python_version() -> str:
    return platform.python_version()


def tensorflow_version() -> str:
    for distribution in ("tensorflow", "tensorflow-cpu", "tensorflow-intel"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(distribution)
    return "unknown"


def cpu_key() -> str:
    """A short digest of what decides the kernels' speed: CPU model and features, machine type,
    TensorFlow's and Python's versions."""
    model, flags = "", ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            name, _, value = line.partition(":")
            name = name.strip()
            if name == "model name" and not model:
                model = value.strip()
            elif name in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    text = f"{model}\n{flags}\n{tensorflow_version()}\n{os.uname().machine}\npython {python_version()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tuning_dir() -> Path:
    """``HPC_TUNING_DIR``, else ``$XDG_CACHE_HOME/hpc-bridge/tuning`` (``~/.cache/...``)."""
    configured = os.environ.get("HPC_TUNING_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hpc-bridge" / "tuning"


def record_path(directory: Path) -> Path:
    """This node's record in ``directory`` (for its kind of CPU and this environment)."""
    return directory / f"onednn-{cpu_key()}.json"


def has_nvidia_gpu() -> bool:
    """Whether this job was given NVIDIA GPUs (device files, not TensorFlow: it is not imported yet)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "NoDevFiles"):
        return False
    return any(Path("/dev").glob("nvidia[0-9]*"))


def not_applicable(environ: Mapping[str, str] | None = None) -> str | None:
    """Why nothing is to be measured or set here (see the module docstring), or None."""
    from worker.trainer.backend import BackendError, choose_backend  # imports no backend

    environ = os.environ if environ is None else environ
    if VARIABLE in environ:
        return f"{VARIABLE}={environ[VARIABLE]} is set in the job's environment"
    try:
        backend = choose_backend(environ)
    except BackendError as exc:
        return f"no Keras backend to tune ({exc})"
    if backend != "tensorflow":
        return f"the worker trains on Keras' {backend} backend: TensorFlow's oneDNN switch does not apply"
    if has_nvidia_gpu():
        return "the job has NVIDIA GPUs: the network runs on them"
    return None


def read_record(path: Path) -> tuple[dict[str, Any] | None, str]:
    """The record at ``path`` if it may be used here; else None and why not."""
    try:
        decision = json.loads(path.read_text())
    except FileNotFoundError:
        return None, "no measurement for this kind of node and environment yet"
    except (OSError, ValueError) as exc:
        return None, f"the record {path} cannot be read ({type(exc).__name__})"
    if not isinstance(decision, dict) or decision.get("setting") not in ("0", "1"):
        return None, f"the record {path} holds no setting"
    here = {"tensorflow": tensorflow_version(), "python": python_version()}
    stale = {k: decision.get(k) for k, v in here.items() if decision.get(k) != v}
    if stale:
        then = ", ".join(f"{k} {v}" for k, v in stale.items())
        return None, f"the record {path} is stale: measured with {then}, this environment has " + ", ".join(
            f"{k} {here[k]}" for k in stale
        )
    return decision, ""


def choose(directory: Path) -> str | None:
    """Set ``TF_ENABLE_ONEDNN_OPTS`` for this process (and its children) from this node's record;
    return the value, None when TensorFlow's default is left alone. Never measures.

    Must run before TensorFlow is imported.
    """
    if VARIABLE in os.environ:
        return os.environ[VARIABLE]
    why = not_applicable()
    if why:
        log.info("onednn_skipped", reason=why)
        return None
    path = record_path(directory)
    decision, why = read_record(path)
    if decision is None:
        log.info("onednn_default", reason=why, note=DEFAULT_NOTE)
        return None
    os.environ[VARIABLE] = decision["setting"]
    log.info("onednn_chosen", setting=decision["setting"], step_s=decision["step_s"], measured_in=str(path))
    return str(decision["setting"])


@dataclass(frozen=True)
class Tuning:
    """What :func:`remember` did: ``outcome`` is ``skipped``, ``recorded`` (an earlier measurement),
    ``measured`` or ``failed``; ``setting`` the value jobs will set (None: TensorFlow's default)."""

    outcome: str
    setting: str | None = None
    detail: str = ""
    step_s: Mapping[str, float] | None = None

    def describe(self) -> str:
        if self.outcome == "skipped":
            return f"oneDNN not measured: {self.detail}"
        if self.outcome == "failed":
            return f"oneDNN could not be measured ({self.detail}): jobs keep TensorFlow's default"
        steps = ""
        if self.step_s:
            off, on = float(self.step_s["0"]), float(self.step_s["1"])
            steps = f" (a step: {off:.3f} s off, {on:.3f} s on)"
        how = "measured now" if self.outcome == "measured" else "measured before"
        return f"oneDNN {'on' if self.setting == '1' else 'off'} for this kind of node{steps}, {how}, in {self.detail}"


def remember(directory: Path, *, again: bool = False, timeout_s: float = MEASURE_TIMEOUT_S) -> Tuning:
    """Measure this node's choice unless a usable record exists (or ``again``), and keep it in
    ``directory`` for the jobs. Never sets ``TF_ENABLE_ONEDNN_OPTS`` in this process."""
    why = not_applicable()
    if why:
        log.info("onednn_skipped", reason=why)
        return Tuning("skipped", detail=why)
    path = record_path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(directory / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two probes on one kind of node measure once
            decision, _ = read_record(path)
            if decision is not None and not again:
                return Tuning("recorded", decision["setting"], str(path), decision.get("step_s"))
            decision = measure(timeout_s)
            if decision is None:
                return Tuning("failed", detail="a measuring process failed: see onednn_measure_failed in its log")
            atomic_write(path, (json.dumps(decision) + "\n").encode(), mode=None)
    except OSError as exc:
        log.warning("onednn_not_recorded", error=str(exc), note="jobs keep TensorFlow's default")
        return Tuning("failed", detail=f"{directory} cannot be written: {exc}")
    return Tuning("measured", decision["setting"], str(path), decision["step_s"])


def measure(timeout_s: float = MEASURE_TIMEOUT_S) -> dict[str, Any] | None:
    """Time SAE steps with oneDNN off and on, each in a fresh interpreter; None if either fails."""
    step_s: dict[str, float] = {}
    started = time.monotonic()
    for setting in ("0", "1"):
        env = {**os.environ, VARIABLE: setting, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
        try:
            done = run_command([sys.executable, "-m", "worker.onednn"], timeout=timeout_s, env=env)
            step_s[setting] = float(json.loads(done.stdout.strip().splitlines()[-1])["step_s"])
        except (CommandError, OSError, ValueError, KeyError, IndexError) as exc:
            log.warning("onednn_measure_failed", setting=setting, error=str(exc)[:500])
            return None
    chosen = "1" if step_s["1"] <= MARGIN * step_s["0"] else "0"
    log.info("onednn_measured", step_s=step_s, setting=chosen, seconds=round(time.monotonic() - started, 1))
    return {
        "setting": chosen,
        "step_s": step_s,
        "tensorflow": tensorflow_version(),
        "python": python_version(),
        "host": os.uname().nodename,  # where it was measured: for the operator, not part of the key
        "measured": time.time(),
    }


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
    """One measuring child (what :func:`measure` runs): time SAE steps under this process's setting."""
    parser = argparse.ArgumentParser(description="Time SAE training steps under this process's " + VARIABLE)
    parser.parse_args(argv)
    print(json.dumps({"setting": os.environ.get(VARIABLE), "step_s": _time_steps()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
