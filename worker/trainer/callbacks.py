"""Keras callbacks of the fit loop: keep the best epoch, stop early, shuffle, report every epoch.

The state of :class:`BestEpoch` and :class:`EarlyStopper` survives a checkpoint
(``state()`` / ``restore()``), and neither resets itself when a fit begins: a layer whose
training was interrupted continues over several fits, as one run.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from worker.trainer._keras import keras

log = logging.getLogger(__name__)

EpochCallback = Callable[[dict[str, Any]], None]
#: What both ModelCheckpoint and EarlyStopping watch in the original, with mode "max".
MONITOR = "val_accuracy"
#: The keys of every dict given to an EpochCallback.
EPOCH_KEYS = ("label", "epoch", "loss", "accuracy", "val_loss", "val_accuracy", "seconds", "samples_per_second")


class BestEpoch(keras.callbacks.Callback):  # type: ignore[misc]
    """``ModelCheckpoint(save_best_only=True, monitor="val_accuracy", mode="max")``, in memory.

    At the end of every epoch whose val_accuracy is strictly greater than the best so far
    (Keras' ``np.greater``; a tie keeps the earlier epoch) it copies the weights and, with
    ``keep_optimizer``, the optimizer's variables. Keeping copies instead of writing a file
    lets the file be written once, from a model that never trained (see :func:`save_model`).
    """

    def __init__(self, keep_optimizer: bool) -> None:
        super().__init__()
        self.keep_optimizer = keep_optimizer
        self.best = -math.inf
        self.best_epoch = 0
        self.weights: list[npt.NDArray[Any]] | None = None
        self.optimizer_variables: list[npt.NDArray[Any]] | None = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        current = (logs or {}).get(MONITOR)
        if current is None or not np.greater(current, self.best):
            return
        self.best = float(current)
        self.best_epoch = epoch + 1
        self.weights = [np.array(w, copy=True) for w in self.model.get_weights()]
        if self.keep_optimizer:
            self.optimizer_variables = variable_values(self.model.optimizer.variables)

    def state(self) -> dict[str, Any]:
        """The best value and epoch (JSON); the copies are ``weights`` and ``optimizer_variables``."""
        return {"best": self.best, "best_epoch": self.best_epoch}

    def restore(
        self,
        state: dict[str, Any],
        weights: list[npt.NDArray[Any]] | None,
        optimizer_variables: list[npt.NDArray[Any]] | None,
    ) -> None:
        self.best = float(state["best"])
        self.best_epoch = int(state["best_epoch"])
        self.weights = weights
        self.optimizer_variables = optimizer_variables


def variable_values(variables: Any) -> list[npt.NDArray[Any]]:
    """Copies of the values of Keras variables, as NumPy arrays."""
    return [np.array(keras.ops.convert_to_numpy(v), copy=True) for v in variables]


class EarlyStopper(keras.callbacks.Callback):  # type: ignore[misc]
    """``keras.callbacks.EarlyStopping(monitor="val_accuracy", mode="max", patience=patience)``,
    with a state that a checkpoint keeps.

    The same rule as Keras 3.15's (``min_delta`` 0, no baseline, ``start_from_epoch`` 0,
    ``restore_best_weights`` off): at every epoch end with a val_accuracy, ``wait`` grows by
    one; an improvement (``np.greater`` than the best so far, or the first value) makes it
    the best and resets ``wait`` to 0; otherwise, once ``wait >= patience`` and ``epoch > 0``
    (0-based), training stops after this epoch (``stopped_epoch = epoch``). Unlike Keras',
    ``on_train_begin`` resets nothing, so a layer trained over several fits (resumed from a
    checkpoint) stops at the same epoch as one trained in a single fit.
    """

    def __init__(self, patience: int) -> None:
        super().__init__()
        self.patience = patience
        self.wait = 0
        self.stopped_epoch = 0
        self.best: float | None = None
        self.best_epoch = 0

    @property
    def stopped(self) -> bool:
        """Whether this callback ended training (``stopped_epoch`` is at least 1 then)."""
        return self.stopped_epoch > 0

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        current = (logs or {}).get(MONITOR)
        if current is None:
            log.warning("early stopping watches %s, which this epoch did not report", MONITOR)
            return
        self.wait += 1
        if self.best is None or np.greater(current, self.best):
            self.best = float(current)
            self.best_epoch = epoch
            self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def state(self) -> dict[str, Any]:
        """``best`` (None before the first value), ``best_epoch`` (0-based), ``wait``, ``stopped_epoch`` (JSON)."""
        return {
            "best": self.best,
            "best_epoch": self.best_epoch,
            "wait": self.wait,
            "stopped_epoch": self.stopped_epoch,
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.best = None if state["best"] is None else float(state["best"])
        self.best_epoch = int(state["best_epoch"])
        self.wait = int(state["wait"])
        self.stopped_epoch = int(state["stopped_epoch"])


class EpochShuffle(keras.callbacks.Callback):  # type: ignore[misc]
    """Calls ``shuffle`` (a :meth:`worker.trainer.dataset.PatchDataset.shuffle`) at the start of every epoch.

    Keras calls ``on_epoch_begin`` of callbacks once per epoch, before it reads the
    epoch's first batch (and, unlike a dataset's own hook, never while it builds a model).
    """

    def __init__(self, shuffle: Callable[[], None]) -> None:
        super().__init__()
        self.shuffle = shuffle

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.shuffle()


class EpochReporter(keras.callbacks.Callback):  # type: ignore[misc]
    """Calls ``on_epoch`` once per epoch with the metrics and the time taken.

    ``seconds`` is the whole epoch, validation included; ``samples_per_second`` is the
    training patches divided by the time until validation began.
    """

    def __init__(self, label: str, train_samples: int, on_epoch: EpochCallback | None) -> None:
        super().__init__()
        self.label = label
        self.train_samples = train_samples
        self.on_epoch = on_epoch
        self._start = 0.0
        self._validation_start: float | None = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._start = time.perf_counter()
        self._validation_start = None

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self._validation_start is None:
            self._validation_start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        now = time.perf_counter()
        logs = logs or {}
        training = (self._validation_start or now) - self._start
        record: dict[str, Any] = {"label": self.label, "epoch": epoch + 1}
        for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
            record[key] = float(logs.get(key, math.nan))
        record["seconds"] = now - self._start
        record["samples_per_second"] = self.train_samples / training if training > 0 else math.nan
        log.info(
            "layer %r epoch %d: loss %.4f accuracy %.4f val_loss %.4f val_accuracy %.4f (%.1f s)",
            self.label, record["epoch"], record["loss"], record["accuracy"],
            record["val_loss"], record["val_accuracy"], record["seconds"],
        )  # fmt: skip
        if self.on_epoch is not None:
            self.on_epoch(record)
