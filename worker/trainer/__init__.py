"""Train Rodan's patchwise selectional auto-encoders ("Calvo" models) with TensorFlow 2 / Keras 3.

This package only trains: it never talks to RabbitMQ or Rodan (the worker around it
downloads the inputs and sends the models back).

Importing it does not import TensorFlow: :func:`train_page` and :func:`train_pages` (and
so Keras) are loaded on first use, so the checkpoint machinery (:class:`CheckpointStore`,
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
    from worker.trainer.train import train_page, train_pages

__all__ = [
    "CheckpointStore",
    "Page",
    "TrainSettings",
    "TrainingInputError",
    "TrainingInterrupted",
    "load_page",
    "open_checkpoints",
    "train_page",
    "train_pages",
]


def __getattr__(name: str) -> Any:
    if name in ("train_page", "train_pages"):
        from worker.trainer import train

        return getattr(train, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
