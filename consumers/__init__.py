"""The TensorFlow environments that open our model files the way Rodan does.

A model only counts once it loads where Rodan runs it. Each :class:`Consumer` is a Python
with a TensorFlow that opens ``.hdf5`` models with ``tensorflow.keras.models.load_model``:

=================  ======  ===================  ===============================================
name               Python  TensorFlow (Keras)   who opens models with it
=================  ======  ===================  ===============================================
tf2.5.1-py3.7      3.7     2.5.1 (Keras 2.5)    Rodan's GPU container (Paco_classifier v2.0.4)
tf2.15.1-py3.11    3.11    2.15.1 (Keras 2.15)  the newest Paco_classifier
worker             this    the worker's         a Rodan on Keras 3; the worker's own Keras 3
=================  ======  ===================  ===============================================

The first two are virtual environments built from ``consumers/requirements/NAME.txt`` by
``python -m consumers build`` (``deploy/dev/setup.sh`` runs it) under
``HPC_CONSUMERS_DIR`` (default ``~/.cache/hpc-bridge/consumers``), once per content of the
requirements file: later runs reuse them. Their Pythons come from ``HPC_PYTHON_3_7`` (and
so on), else pyenv's versions, else ``python3.7`` on the PATH; when none exists the build
fails and says how to get one. :func:`run_check` runs ``check_model.py`` inside one of them;
:mod:`consumers.verify` compares what they give with the trained weights.

Dev and test tooling: it is not installed with the project.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge.shell import CommandError, run_command

HERE = Path(__file__).resolve().parent
CHECK_SCRIPT = HERE / "check_model.py"
CLASSIFY_SCRIPT = HERE / "classify_page.py"
#: Seconds one consumer may take to check a batch of models (TensorFlow imports included).
CHECK_TIMEOUT_S = 600.0


class ConsumerUnavailable(RuntimeError):
    """A consumer environment is not built, or its Python is missing: the message says what to do."""


@dataclass(frozen=True)
class Consumer:
    name: str
    #: "3.7", "3.11"; None: the Python running this code (the worker's environment).
    python_version: str | None
    description: str

    @property
    def requirements(self) -> Path | None:
        return None if self.python_version is None else HERE / "requirements" / f"{self.name}.txt"

    @property
    def directory(self) -> Path:
        return cache_dir() / self.name

    def fingerprint(self) -> str:
        """What the environment was built from: its requirements file and Python version."""
        assert self.requirements is not None
        text = f"{self.python_version}\n{self.requirements.read_text()}"
        return hashlib.sha256(text.encode()).hexdigest()

    def python(self) -> Path:
        """The interpreter of the built environment; raises ConsumerUnavailable if not built."""
        if self.python_version is None:
            return Path(sys.executable)
        python = self.directory / "bin" / "python"
        stamp = self.directory / STAMP
        if not python.exists() or not stamp.exists():
            raise ConsumerUnavailable(
                f"consumer {self.name} is not built in {self.directory}: run deploy/dev/setup.sh "
                "(or python -m consumers build)"
            )
        if stamp.read_text().strip() != self.fingerprint():
            raise ConsumerUnavailable(
                f"consumer {self.name} in {self.directory} was built from other requirements: "
                "run deploy/dev/setup.sh (or python -m consumers build) to rebuild it"
            )
        return python


#: The file in a built environment that records what it was built from.
STAMP = ".hpc-bridge-consumer"

CONSUMERS: tuple[Consumer, ...] = (
    Consumer("tf2.5.1-py3.7", "3.7", "Rodan's GPU container today (Paco_classifier v2.0.4)"),
    Consumer("tf2.15.1-py3.11", "3.11", "the newest Paco_classifier"),
    Consumer("worker", None, "the worker's own TensorFlow and Keras 3"),
)


def by_name(name: str) -> Consumer:
    for consumer in CONSUMERS:
        if consumer.name == name:
            return consumer
    raise KeyError(f"no consumer {name!r}; known: {', '.join(c.name for c in CONSUMERS)}")


def cache_dir() -> Path:
    configured = os.environ.get("HPC_CONSUMERS_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hpc-bridge" / "consumers"


def find_python(version: str) -> Path:
    """An interpreter for ``version`` ("3.7"): HPC_PYTHON_3_7, pyenv's newest 3.7.x, or python3.7."""
    variable = "HPC_PYTHON_" + version.replace(".", "_")
    looked: list[str] = []
    configured = os.environ.get(variable)
    if configured:
        if _reports(Path(configured), version):
            return Path(configured)
        raise ConsumerUnavailable(f"{variable}={configured} is not a working Python {version}")
    looked.append(f"${variable} (unset)")
    pyenv_root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    candidates = sorted(
        (pyenv_root / "versions").glob(f"{version}.*/bin/python{version}"),
        key=lambda p: [int(part) if part.isdigit() else -1 for part in p.parents[1].name.split(".")],
        reverse=True,
    )
    looked.append(f"{pyenv_root}/versions/{version}.*")
    on_path = shutil.which(f"python{version}")
    if on_path and "/shims/" not in on_path:  # a pyenv shim answers only for the selected version
        candidates.append(Path(on_path))
    looked.append(f"python{version} on the PATH")
    for candidate in candidates:
        if _reports(candidate, version):
            return candidate
    raise ConsumerUnavailable(
        f"no Python {version} found (looked at {'; '.join(looked)}). Install one, e.g. "
        f"`pyenv install {version}`, or set {variable} to its interpreter"
    )


def _reports(python: Path, version: str) -> bool:
    try:
        done = run_command([str(python), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], timeout=60)
    except (CommandError, OSError):
        return False
    return done.stdout.strip() == version


def _consumer_env() -> dict[str, str]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTHONPATH", None)  # the consumer's own packages only
    # TensorFlow's own default, as Rodan runs it: not a oneDNN choice the caller's process made
    # (the worker sets it for itself; TensorFlow 2.5.1 with it on dies of SIGFPE on some files).
    env.pop("TF_ENABLE_ONEDNN_OPTS", None)
    return env


def classify(consumer: Consumer, page: Path, models: list[Path], window: tuple[int, int], out: Path) -> dict[str, Any]:
    """Classify ``page`` with Paco_classifier's ``process_image_msae`` in ``consumer``, as Rodan 3.x does.

    ``models`` in Rodan's port order (``Background Model``, ``Model 1``, ...); ``window`` is the
    classifier job's patch (height, width), which Paco's padding needs to be more than 51 pixels.
    The label image (uint8, the winning model's index per pixel) goes to ``out`` (``.npy``);
    returns the versions that ran and the shape.
    """
    from consumers.paco import paco_source

    env = {**_consumer_env(), "PYTHONPATH": str(paco_source())}
    done = run_command(
        [str(consumer.python()), str(CLASSIFY_SCRIPT), str(page), str(out), str(window[0]), str(window[1]),
         *map(str, models)],
        timeout=CHECK_TIMEOUT_S,
        env=env,
    )  # fmt: skip
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{consumer.name}: classify_page.py printed nothing: {done.stderr[-3000:]}")
    result: dict[str, Any] = lines[-1]
    return result


def run_check(consumer: Consumer, models: list[Path], data: Path, out_dir: Path) -> list[dict[str, Any]]:
    """Run check_model.py for ``models`` in ``consumer``; one result dict per model, in order.

    Each result has ``model``, ``environment`` (Python, TensorFlow, Keras versions) and
    either ``load_error`` or ``input_shape``, ``loss``, ``optimizer``, ``fit`` (or
    ``fit_error``) and ``arrays`` (the ``.npz`` of predictions and weights after the step).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    env = _consumer_env()
    done = run_command(
        [str(consumer.python()), str(CHECK_SCRIPT), str(data), str(out_dir), *map(str, models)],
        timeout=CHECK_TIMEOUT_S,
        env=env,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines or "environment" not in lines[0]:
        raise RuntimeError(f"{consumer.name}: check_model.py printed no environment: {done.stderr[-3000:]}")
    environment, results = lines[0]["environment"], lines[1:]
    if len(results) != len(models):
        raise RuntimeError(f"{consumer.name}: {len(results)} results for {len(models)} models: {done.stderr[-3000:]}")
    return [{**result, "environment": environment} for result in results]
