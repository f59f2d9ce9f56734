"""Small trainings for the trainer's tests (these import TensorFlow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from worker.trainer import CheckpointStore, TrainSettings
from worker.trainer.checkpoint import TrainingState

#: 30 and 28 training patches of 32x32, batches of 8: 4 batches per epoch, 3 epochs, 2 layers. One draw
#: of patches for the whole run, so that the tests can name every batch; a new draw every epoch (the
#: default) resumes as well (tests/test_resume.py, test_patches_drawn_every_epoch_resume_as_if_never_stopped).
#: No fresh starts (``max_fresh_starts=0``): the first-epoch guard is tests/test_fresh_start.py's subject
#: (with a resume right after a fresh start); here it would train each layer's first epoch up to three times.
RESUME_SETTINGS = TrainSettings(
    epochs=3, max_samples_per_label=60, patch_height=32, patch_width=32, batch_size=8, patience=5, seed=7,
    patch_draws="once", max_fresh_starts=0,
)  # fmt: skip


class RecordingStore(CheckpointStore):
    """A CheckpointStore that also remembers the weights of each layer's last epoch end it saved."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.final_weights: dict[str, list[np.ndarray]] = {}
        self.saved: list[tuple[str, int, int]] = []  # (label, epochs done, samples into the next)

    def save(self, state: TrainingState) -> Path:
        layer = state.current
        if layer is not None:
            self.saved.append((layer.label, layer.epoch, layer.sample_offset))
            if layer.sample_offset == 0:
                self.final_weights[layer.label] = layer.weights
        return super().save(state)


def fit_batches(pipeline: Any) -> list[tuple[np.ndarray[Any, Any], ...]]:
    """The batches ``fit`` reads from ``training_input(...)`` (one pass), as NumPy arrays, on either
    backend: a ``tf.data.Dataset`` on TensorFlow, a Keras ``PyDataset`` of device arrays on JAX."""
    if hasattr(pipeline, "cardinality"):
        return [tuple(t.numpy() for t in batch) for batch in pipeline]
    return [tuple(np.asarray(t) for t in pipeline[i]) for i in range(pipeline.num_batches)]


def batch_count(pipeline: Any) -> int:
    """How many batches one pass over ``training_input(...)`` gives, as the backend's own object says."""
    return int(pipeline.cardinality()) if hasattr(pipeline, "cardinality") else int(pipeline.num_batches)


REPO = Path(__file__).resolve().parents[2]


def run_python(code: str, *args: str, timeout: float = 600, **environ: str) -> subprocess.CompletedProcess[str]:
    """``code`` (dedented) in a fresh interpreter at the repository root, with ``environ`` added to
    this process's environment (TensorFlow's start-up chatter off)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO), **environ}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def last_json(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The last line a child printed, as JSON, once it exited 0 (else its stderr's tail is the failure)."""
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
