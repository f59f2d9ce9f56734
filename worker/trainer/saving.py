"""Writing trained models: legacy Keras HDF5 files that Rodan loads with ``load_model``."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy.typing as npt

from worker.trainer.model import build_sae, compile_sae
from worker.trainer.settings import TrainSettings

MODEL_SUFFIX = ".hdf5"


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


@contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def save_model(result: LabelResult, path: Path, settings: TrainSettings) -> Path:
    """Write ``result`` as a legacy Keras HDF5 file that ``keras.models.load_model`` reads.

    The file is written from a freshly built model given the best weights, never from the
    model that trained: in Keras 3.15 an HDF5 save with the optimizer mutates the model's
    compile config. Without ``settings.include_optimizer`` the model is saved uncompiled
    (it loads uncompiled, which is all inference needs); with it, the model is compiled as
    for training and its Adam variables are set to those of the best epoch. The file
    appears under ``path`` only once it is complete.
    """
    model = build_sae(settings.patch_height, settings.patch_width)
    model.set_weights(result.weights)
    if settings.include_optimizer:
        if result.optimizer_variables is None:
            raise ValueError(f"no optimizer state was kept for layer {result.label!r}")
        compile_sae(model)
        model.optimizer.build(model.trainable_variables)
        for variable, value in zip(model.optimizer.variables, result.optimizer_variables, strict=True):
            variable.assign(value)
    path = Path(path)
    partial = path.with_name(f".{path.stem}.partial{path.suffix}")
    try:
        with _quiet("absl"):  # "HDF5 ... is considered legacy": it is what Rodan reads
            model.save(str(partial), include_optimizer=settings.include_optimizer)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path
