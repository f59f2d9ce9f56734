"""Writing trained models: Keras HDF5 files that Rodan's own TensorFlow opens.

**Who reads these files.** Rodan's classifier job opens each model with
``tensorflow.keras.models.load_model(path)`` (no ``custom_objects``, compiled) and predicts
on windows of the page; its trainer job takes earlier models on its input ports and
continues training them with ``fit``. Rodan's GPU container runs Python 3.7 with
TensorFlow 2.5.1 (Paco_classifier v2.0.4 pins ``tensorflow==2.5.1``, ``h5py~=3.1.0``);
the newest Paco_classifier runs TensorFlow 2.15.1 on Python 3.11. Both are Keras 2. The
worker trains with Keras 3 (TensorFlow 2.16 and later).

**Why not ``model.save``.** Keras 3 writes its own model config into the ``.hdf5``:
``batch_shape`` and ``optional`` on the input layer, dtype policies and initializers as
objects with ``module`` and ``registered_name``, nodes as ``args``/``kwargs``. TensorFlow
2.5.1 refuses it (``Unrecognized keyword arguments: ['batch_shape', 'optional']``), and so
does 2.15.1 (``Error when deserializing class 'InputLayer'``). The weights Keras 3 writes
were never the problem; the schema around them is.

**What we write instead.** :mod:`worker.trainer.keras2_hdf5` writes the whole file in the
schema of TensorFlow 2.5's Keras (2.5.0), which TensorFlow 2.15 and Keras 3 read too: the
model config translated key by key from Keras 3's (a key it does not know fails, so a
Keras upgrade that changes what it writes fails a test), the training config (binary
cross-entropy, accuracy, Adam(1e-4) as the original trainer compiled it, so the file loads compiled
and ``fit`` works on it), the float32 weights, and with ``include_optimizer`` Adam's
state of the best epoch in Keras 2's variable order. No second TensorFlow is needed: only
h5py and JSON. ``tests/test_consumers.py`` loads every model of a real training in
TensorFlow 2.5.1 (Python 3.7), 2.15.1 (Python 3.11) and the worker's Keras 3, and checks
``predict`` against the trained weights and one ``fit`` step against the original trainer's loss,
metric and optimizer (``consumers/``).

**Any window size.** The saved input is ``(None, None, None, 3)``: the network is fully
convolutional, so the model predicts windows of any height and width that are multiples
of 4 (it pools twice by 2), whatever patch size it trained on. Rodan's classifier may use
its own Height/Width.

**Float32 always.** The file is written from a freshly built float32 model given the best
weights (float32 variables under any precision policy), never from the model that trained.

**Known limit (Keras 3 only).** Keras 3's HDF5 reader (3.15) builds a loaded model's
optimizer for ``model._trainable_variables``, which is empty for a functional model: any
``.hdf5`` that carries optimizer state, its own files included, loads and predicts there but
``fit`` fails with ``Unknown variable``. Keras 3 users continue such a file with
``load_model(path, compile=False)`` and ``compile``. Rodan's TensorFlow 2.5.1 and 2.15.1
restore the state and train on (the consumer test checks one step against the worker's).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy.typing as npt

from bridge.atomic import atomic_file
from worker.trainer import keras2_hdf5
from worker.trainer.distribute import dtype_policy
from worker.trainer.model import build_sae, compile_sae
from worker.trainer.settings import PATCH_MULTIPLE, TrainSettings

MODEL_SUFFIX = ".hdf5"
#: What a saved model accepts, for logs and guides (see the module docstring).
MODEL_INPUT = f"windows of any height and width that are multiples of {PATCH_MULTIPLE}"


@dataclass
class LabelResult:
    """What training one layer produced; ``weights`` are those of the best epoch."""

    label: str
    weights: list[npt.NDArray[Any]]
    optimizer_variables: list[npt.NDArray[Any]] | None
    best_epoch: int  # 1-based; 0 if no epoch had a val_accuracy (the final weights are kept then)
    best_val_accuracy: float
    epochs_run: int
    train_samples: int
    validation_samples: int
    history: dict[str, list[float]] = field(default_factory=dict)
    #: Set when the kept model marks every validation pixel alike (:func:`worker.trainer.callbacks.one_class`).
    one_class: str | None = None
    fresh_starts: int = 0  # how often the layer started again from new weights


def model_file_names(labels: Iterable[str]) -> dict[str, str]:
    """A distinct, portable file name per label: "Layer 0" -> "Layer_0.hdf5"."""
    names: dict[str, str] = {}
    taken: set[str] = set()
    for label in labels:
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._-")[:100] or "layer"
        candidate, number = stem, 2
        while candidate.lower() in taken:  # also distinct on case-insensitive file systems
            candidate, number = f"{stem}_{number}", number + 1
        taken.add(candidate.lower())
        names[label] = candidate + MODEL_SUFFIX
    return names


def save_model(result: LabelResult, path: Path, settings: TrainSettings) -> Path:
    """Write ``result`` as a compiled Keras 2 HDF5 model file (see the module docstring).

    With ``settings.include_optimizer`` the file also holds Adam's state of the best epoch.
    The file appears under ``path`` only once it is complete.
    """
    with dtype_policy("float32"):
        model = build_sae(None, None)
        compile_sae(model)
    model.set_weights(result.weights)
    state = None
    if settings.include_optimizer:
        if result.optimizer_variables is None:
            raise ValueError(f"no optimizer state was kept for layer {result.label!r}")
        model.optimizer.build(model.trainable_variables)
        state = result.optimizer_variables
    path = Path(path)
    # h5py writes the temporary file by its name: through a Python handle it would write another
    # layout than the one Rodan's readers were tested on. mode=None: the umask's mode, as h5py's own.
    with atomic_file(path, mode=None) as handle:
        keras2_hdf5.write(Path(handle.name), model, state)
    return path
