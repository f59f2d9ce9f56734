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
#: Receives the trainer's layer events (see :func:`worker.trainer.train.train_pages`): a dict with
#: ``event`` ("fresh_start" or "layer_trained") and ``label``.
LayerCallback = Callable[[dict[str, Any]], None]
#: What both ModelCheckpoint and EarlyStopping watch in the original, with mode "max".
MONITOR = "val_accuracy"
#: The keys of every dict given to an EpochCallback.
EPOCH_KEYS = ("label", "epoch", "loss", "accuracy", "val_loss", "val_accuracy", "seconds", "samples_per_second")


class BestEpoch(keras.callbacks.Callback):  # type: ignore[misc]
    """``ModelCheckpoint(save_best_only=True, monitor="val_accuracy", mode="max")``, in memory,
    except that a model that tells pixels apart beats one that does not.

    At the end of every epoch whose val_accuracy is strictly greater than the best so far
    (Keras' ``np.greater``; a tie keeps the earlier epoch) it copies the weights and, with
    ``keep_optimizer``, the optimizer's variables. Keeping copies instead of writing a file
    lets the file be written once, from a model that never trained (see :func:`save_model`).

    ``trivial`` ((val_accuracy, val_predicted_share or None) -> answer, e.g. :func:`one_class`)
    names the epochs whose model marks every validation pixel, or nearly every one, alike: on a rare
    layer "nothing is the layer" scores a high accuracy (0.87 on staff lines that cover 13 % of the
    pixels), higher than a model that has begun to find the layer, which ModelCheckpoint would then
    never keep. Such an epoch is kept
    only while no epoch has been better than trivial, and the first epoch that is replaces it
    whatever its val_accuracy.
    """

    def __init__(
        self, keep_optimizer: bool, trivial: Callable[[float, float | None], str | None] | None = None
    ) -> None:
        super().__init__()
        self.keep_optimizer = keep_optimizer
        self.trivial = trivial
        self.best = -math.inf
        self.best_share: float | None = None  # the best epoch's val_predicted_share
        self.best_epoch = 0
        self.weights: list[npt.NDArray[Any]] | None = None
        self.optimizer_variables: list[npt.NDArray[Any]] | None = None

    def _is_trivial(self, value: float, share: float | None) -> bool:
        return self.trivial is not None and math.isfinite(value) and self.trivial(value, share) is not None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        current = (logs or {}).get(MONITOR)
        if current is None:
            return
        share = epoch_share(logs)
        held_trivial = self.weights is not None and self._is_trivial(self.best, self.best_share)
        if self._is_trivial(float(current), share):
            if self.weights is not None and not held_trivial:
                return  # a model that tells pixels apart is kept over one that does not
            better = np.greater(current, self.best)
        else:
            better = held_trivial or np.greater(current, self.best)
        if not better:
            return
        self.best = float(current)
        self.best_share = share
        self.best_epoch = epoch + 1
        self.weights = [np.array(w, copy=True) for w in self.model.get_weights()]
        if self.keep_optimizer:
            self.optimizer_variables = variable_values(self.model.optimizer.variables)

    def state(self) -> dict[str, Any]:
        """The best value, its predicted share and its epoch (JSON); the copies are ``weights`` and
        ``optimizer_variables``."""
        return {"best": self.best, "best_share": self.best_share, "best_epoch": self.best_epoch}

    def restore(
        self,
        state: dict[str, Any],
        weights: list[npt.NDArray[Any]] | None,
        optimizer_variables: list[npt.NDArray[Any]] | None,
    ) -> None:
        self.best = float(state["best"])
        share = state.get("best_share")  # absent from the checkpoints of 0.3.0 and before
        self.best_share = None if share is None else float(share)
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


#: What :func:`one_class` answers for a model that gave every pixel the same class.
ALL_NON_LAYER = "no pixel as the layer"
ALL_LAYER = "every pixel as the layer"
#: What it answers for a model that gave nearly every pixel the same class (see :data:`NEARLY`).
ALMOST_NO_PIXEL = "almost no pixel as the layer"
ALMOST_EVERY_PIXEL = "almost every pixel as the layer"
#: A model that marks less than this fraction of the layer's share of the validation pixels as the
#: layer (or of the other pixels' share as not the layer) has learned nothing worth returning: its
#: recall is below 0.1, its F1 below 0.18. Measured on the demo's staff lines (seed 2, trainer of
#: 040ffeb): val_accuracy 0.748-0.750 at every epoch, against a share of the other pixels of 0.75.
NEARLY = 0.1
#: The key Keras logs the validation's :data:`~worker.trainer.model.PREDICTED_SHARE` under.
VAL_PREDICTED_SHARE = "val_predicted_share"


def one_class(val_accuracy: float, layer_pixels: int, pixels: int, predicted_share: float | None = None) -> str | None:
    """Whether an epoch's ``val_accuracy`` (and ``predicted_share``, the share of the validation
    pixels the model marks as the layer, when the trainer measured it) shows a model that answered
    one class for every pixel, or for nearly every pixel.

    Keras' accuracy is the share of validation pixels whose prediction (> 0.5) matches the mask.
    A model that marks no pixel as the layer scores exactly the non-layer share, one that marks
    every pixel exactly the layer's share; within half a pixel, so that no other answer can match
    (``pixels`` is in the tens of thousands, float32 keeps seven digits). A model that marks less
    than :data:`NEARLY` of the layer's share as the layer (or of the others' as not) nearly answers one
    class. Returns :data:`ALL_NON_LAYER`, :data:`ALL_LAYER`, :data:`ALMOST_NO_PIXEL`,
    :data:`ALMOST_EVERY_PIXEL` or None (the model tells pixels apart).
    """
    if not 0 < layer_pixels < pixels or not math.isfinite(val_accuracy):
        return None  # validation patches all of one class: one answer for every pixel may be right
    half_pixel = 0.5 / pixels
    if abs(val_accuracy - (pixels - layer_pixels) / pixels) < half_pixel:
        return ALL_NON_LAYER
    if abs(val_accuracy - layer_pixels / pixels) < half_pixel:
        return ALL_LAYER
    if predicted_share is None or not math.isfinite(predicted_share):
        return None
    share = layer_pixels / pixels
    if predicted_share < NEARLY * share:
        return ALMOST_NO_PIXEL
    if 1.0 - predicted_share < NEARLY * (1.0 - share):
        return ALMOST_EVERY_PIXEL
    return None


def epoch_share(logs: dict[str, Any] | None) -> float | None:
    """The epoch's :data:`VAL_PREDICTED_SHARE`, None when the model was compiled without it."""
    value = (logs or {}).get(VAL_PREDICTED_SHARE)
    return None if value is None else float(value)


def constant_answer_loss(layer_pixels: int, pixels: int, probability: float) -> float:
    """The binary cross-entropy of answering ``probability`` for every pixel, ``layer_pixels`` of
    ``pixels`` being the layer's: what a model that has learned nothing scores."""
    if pixels <= 0:
        return math.nan
    p = min(max(probability, 1e-7), 1.0 - 1e-7)  # Keras clips its probabilities the same way
    share = layer_pixels / pixels
    return -(share * math.log(p) + (1.0 - share) * math.log(1.0 - p))


class FreshStart(Exception):
    """Raised by :class:`FirstEpochGuard`: the layer's model could not move; train it again from new weights."""

    def __init__(self, label: str, answer: str, loss: float, start_loss: float) -> None:
        super().__init__(
            f"layer {label!r}: after its first epoch the model marks {answer} (val_loss {loss:.4f}, "
            f"its starting answer's {start_loss:.4f})"
        )
        self.label = label
        self.answer = answer
        self.loss = loss
        self.start_loss = start_loss


class FirstEpochGuard(keras.callbacks.Callback):  # type: ignore[misc]
    """Raises :class:`FreshStart` when the model's first epoch ends where it started.

    Before it has learned anything a model answers one probability for every pixel
    (``start_probability``: the layer's share of the training targets with the trainer's prior
    output bias, 0.5 with a zero bias). After its first epoch a model has not left that point if it
    still marks every validation pixel alike (:func:`one_class`), or if its validation loss is not
    below that constant answer's (:func:`constant_answer_loss`). Measured on ``bench_paco.py``'s pages
    (``tests/test_fresh_start.py``, benchmarks/README.md): the two ReLU units that feed the output
    end up zero on the layer's pixels (or on all others), so those pixels' probability is the output
    bias alone, which Adam at 1e-4 moves by 1e-4 a step; such a model kept marking every pixel as
    background for 12 epochs while its loss fell on the other pixels. Models that learn tell some
    pixels apart within their first epoch. The guard must come first among the callbacks, so that
    nothing records the epoch it rejects. ``enabled`` False (no fresh start left, a starting model
    given, a layer resumed past its first epoch) makes it watch nothing.
    """

    def __init__(self, label: str, layer_pixels: int, pixels: int, start_probability: float, enabled: bool) -> None:
        super().__init__()
        self.label = label
        self.layer_pixels = layer_pixels
        self.pixels = pixels
        self.start_loss = constant_answer_loss(layer_pixels, pixels, start_probability)
        self.enabled = enabled

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not self.enabled or epoch != 0 or not 0 < self.layer_pixels < self.pixels:
            return  # validation patches all of one class: nothing to tell apart
        logs = logs or {}
        loss = float(logs.get("val_loss", math.nan))
        answer = one_class(float(logs.get(MONITOR, math.nan)), self.layer_pixels, self.pixels, epoch_share(logs))
        if answer is None and not (math.isfinite(loss) and loss >= self.start_loss):
            return  # it tells pixels apart, and knows more than the constant answer
        raise FreshStart(self.label, answer or "about the same probability everywhere", loss, self.start_loss)
