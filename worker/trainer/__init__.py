"""Train Rodan's patchwise selectional auto-encoders ("Calvo" models) with TensorFlow 2 / Keras 3.

This package only trains: it never talks to RabbitMQ or Rodan (the worker around it
downloads the inputs and sends the models back).

Importing it does not import TensorFlow: :func:`train_page` and :func:`train_pages` (and
so Keras) are loaded on first use, and so is ``keras`` itself (on the backend the worker
environment chose: :mod:`worker.trainer.backend`), for code outside the trainer that needs the
trainer's Keras (``consumers/``); so the checkpoint machinery (:class:`CheckpointStore`,
:func:`open_checkpoints`, :class:`TrainingInterrupted`) is cheap to import, e.g. in a process
that only copies or checks checkpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from worker.trainer.checkpoint import CheckpointStore, TrainingInterrupted
from worker.trainer.errors import TrainingInputError
from worker.trainer.page import Page, load_page
from worker.trainer.settings import TrainSettings
from worker.trainer.sync import open_checkpoints

if TYPE_CHECKING:
    from worker.trainer._keras import keras
    from worker.trainer.train import train_page, train_pages

__all__ = [
    "CheckpointStore",
    "Page",
    "TrainSettings",
    "TrainingInputError",
    "TrainingInterrupted",
    "keras",
    "load_page",
    "open_checkpoints",
    "train_page",
    "train_pages",
]


def __getattr__(name: str) -> Any:
    if name in ("train_page", "train_pages"):
        from worker.trainer import train

        return getattr(train, name)
    if name == "keras":
        from worker.trainer._keras import keras

        return keras
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
