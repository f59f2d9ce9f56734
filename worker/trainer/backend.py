"""Which Keras backend the trainer runs on: TensorFlow or JAX, chosen by the worker environment.

``KERAS_BACKEND`` in the job's environment decides when it is set (``tensorflow`` or ``jax``;
e.g. ``export KERAS_BACKEND=jax`` in ``HPC_JOB_PROLOGUE``). When it is not, the environment the
worker runs in decides: TensorFlow where it is installed (``pip install 'hpc-bridge[worker]'``
or ``[worker-gpu]``), else JAX (``[worker-jax]``, a GPU site's choice). Both backends train the
same network on the same batches and write the same model files; what differs is described in
``docs/design-jax.md``.

This module imports neither backend: :func:`worker.trainer._keras` calls :func:`configure` before
it imports Keras, and ``doctor --job`` asks :func:`choose_backend` what a job would run on.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path

#: The backends the trainer runs on.
BACKENDS = ("tensorflow", "jax")
#: The environment variable Keras reads, and so does the worker.
ENV_VAR = "KERAS_BACKEND"


class BackendError(RuntimeError):
    """The environment names a backend the trainer does not run on, or has none installed."""


def choose_backend(environ: Mapping[str, str] | None = None) -> str:
    """The backend a worker in this environment trains on (see the module docstring)."""
    environ = os.environ if environ is None else environ
    named = environ.get(ENV_VAR, "").strip().lower()
    if named:
        if named not in BACKENDS:
            raise BackendError(f"{ENV_VAR}={named!r}: the trainer runs on {' or '.join(BACKENDS)}")
        return named
    for backend in BACKENDS:
        if importlib.util.find_spec(backend) is not None:
            return backend
    raise BackendError(
        "neither TensorFlow nor JAX is installed in this environment: install hpc-bridge[worker] "
        "(TensorFlow) or hpc-bridge[worker-jax] (JAX)"
    )


def configure() -> str:
    """Set ``KERAS_BACKEND`` to :func:`choose_backend`'s answer (before Keras is imported) and return it."""
    backend = choose_backend()
    os.environ[ENV_VAR] = backend
    return backend


#: Where JAX keeps compiled programs between processes unless ``JAX_COMPILATION_CACHE_DIR`` says.
COMPILATION_CACHE = Path("hpc-bridge") / "jax-compilation"


def compilation_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``JAX_COMPILATION_CACHE_DIR``, else ``$XDG_CACHE_HOME`` (default ``~/.cache``) / :data:`COMPILATION_CACHE`."""
    environ = os.environ if environ is None else environ
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(environ["JAX_COMPILATION_CACHE_DIR"])
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / COMPILATION_CACHE


def use_compilation_cache() -> Path:
    """Make JAX keep every compiled program in :func:`compilation_cache_dir` (JAX only).

    XLA compiles the training step, the validation step and every weight initializer once per
    process: tens of seconds on a CPU, and again in every continuation of a run. With the cache
    a later process (the next job of a run, the next run on these settings) loads them instead.
    Programs are kept whatever their compile time (JAX's default keeps only those over a second,
    which leaves out the initializers); the whole SAE's are under a megabyte.
    """
    import jax

    directory = compilation_cache_dir()
    jax.config.update("jax_compilation_cache_dir", str(directory))  # type: ignore[no-untyped-call]
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # type: ignore[no-untyped-call]
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)  # type: ignore[no-untyped-call]
    return directory
