"""Batches of patches built on the fly from the uint8 page and the sampled centres.

Nothing float is kept between batches: the page stays uint8, each layer's mask bool, the
samples an ``(n, 2)`` int array. A batch of 16 256x256 patches is 12.6 MB of float32,
where the original's float64 arrays for 10,000 samples per label took gigabytes.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

from worker.trainer._tf import keras
from worker.trainer.sampling import Centres

#: ``INPUT_LOOKUP[v] == float32((255 - v) / 255)`` computed in float64 as the original
#: did: ink becomes high, paper low.
INPUT_LOOKUP: npt.NDArray[np.float32] = ((255.0 - np.arange(256, dtype=np.float64)) / 255.0).astype(np.float32)
#: ``(x, y)``, or ``(x, y, sample_weight)`` when several replicas share each batch.
Batch = tuple[npt.NDArray[np.float32], ...]


def split_validation(centres: Centres, validation_split: float) -> tuple[Centres, Centres]:
    """Split like Keras' ``fit(validation_split=...)``: the last part, in order, validates.

    The training part is the first ``floor(n * (1 - validation_split))`` samples.
    """
    split_at = math.floor(len(centres) * (1.0 - validation_split))
    return centres[:split_at], centres[split_at:]


def network_input(image_patches: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32]:
    """RGB uint8 patches ``(..., 3)`` to what the network sees.

    Channels are reversed to BGR because Rodan reads pages with OpenCV (``cv2.imread``),
    both when it trained these models and when its classifier applies them; then
    ``(255 - v) / 255``.
    """
    return INPUT_LOOKUP[image_patches[..., ::-1]]


class PatchDataset(keras.utils.PyDataset):  # type: ignore[misc]
    """A Keras dataset of ``(x, y)`` batches for one layer.

    ``x`` is float32 ``(b, ph, pw, 3)`` (see :func:`network_input`), ``y`` float32
    ``(b, ph, pw, 1)``, 1 where the layer is. With ``shuffle_rng``, :meth:`shuffle` draws a
    fresh permutation from it (the trainer calls it at the start of every epoch, see
    :class:`worker.trainer.callbacks.EpochShuffle`: what ``fit(shuffle=True)`` does to the
    training part); without it, and until the first :meth:`shuffle`, the samples keep
    their order (validation data). Keras' own ``on_epoch_begin`` hook is not used for
    this: Keras also calls it when it builds a model from a first batch, which would draw
    one permutation more in a fresh model's first fit than in a resumed one's, so the
    permutations would depend on where a run was resumed. ``order`` is the current
    permutation and ``rng`` the generator (a checkpoint keeps both, see
    :mod:`worker.trainer.checkpoint`); :meth:`remaining` gives the rest of an epoch
    interrupted part-way.

    Batches hold ``batch_size`` patches, the last one the rest. With ``multiple_of`` (the
    replicas of a MirroredStrategy, which splits every batch among them; ``batch_size``
    must be a multiple of it) the last batch is topped up to a multiple of it by repeating
    some of its own patches (fewer than ``multiple_of`` per epoch), so that every replica
    gets an equal, non-empty share: with an empty share oneDNN's convolution fails, and
    uneven shares failed now and then in Keras' distributed step (TF 2.21, Keras 3.15).
    Batches then carry sample weights ``(x, y, w)``, 0 for the copies. The real patches
    weigh ``padded / real`` in training data (``weigh_for="loss"``), so that the loss (Keras
    averages over all ``padded`` patches) and its gradient are those of the real patches
    alone, as on one replica; they weigh 1 in validation data (``weigh_for="accuracy"``), so
    that the weighted accuracy (see :func:`worker.trainer.model.compile_sae`), which picks the
    best epoch and stops early, counts every validation patch once, as on one replica.
    """

    def __init__(
        self,
        image: npt.NDArray[np.uint8],
        mask: npt.NDArray[np.bool_],
        centres: Centres,
        patch_height: int,
        patch_width: int,
        batch_size: int,
        shuffle_rng: np.random.Generator | None = None,
        multiple_of: int = 1,
        weigh_for: Literal["loss", "accuracy"] = "loss",
    ) -> None:
        super().__init__()
        self._images = sliding_window_view(image, (patch_height, patch_width, image.shape[2]))
        self._masks = sliding_window_view(mask, (patch_height, patch_width))
        self._corners = np.asarray(centres, dtype=np.int64) - np.array([patch_height // 2, patch_width // 2])
        self._batch_size = batch_size
        self._rng = shuffle_rng
        self._order: npt.NDArray[np.int64] = np.arange(len(self._corners), dtype=np.int64)
        if multiple_of < 1 or batch_size % multiple_of:
            raise ValueError(f"the batch size {batch_size} is not a multiple of {multiple_of}")
        self._multiple_of = multiple_of
        self._weigh_for = weigh_for

    @property
    def samples(self) -> int:
        return len(self._corners)

    def __len__(self) -> int:
        return math.ceil(len(self._corners) / self._batch_size)

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def rng(self) -> np.random.Generator | None:
        return self._rng

    @property
    def order(self) -> npt.NDArray[np.int64]:
        """The current order of the samples (a permutation of ``range(samples)``)."""
        return self._order

    def shuffle(self) -> None:
        """Draw a new order from ``shuffle_rng`` (nothing without one)."""
        if self._rng is not None:
            # A new array rather than an in-place shuffle: Keras may still be prefetching
            # from the previous order in another thread.
            self._order = self._rng.permutation(len(self._corners))

    def remaining(self, order: npt.NDArray[np.int64], start: int) -> RemainingBatches:
        """The batches of an epoch with ``order`` from its ``start``-th sample on (never reshuffled)."""
        order = np.asarray(order, dtype=np.int64)
        if order.shape != (self.samples,) or not 0 <= start < self.samples:
            raise ValueError(f"cannot continue an epoch of {self.samples} samples at {start} with order {order.shape}")
        return RemainingBatches(self, order[start:])

    def batch(self, chosen: npt.NDArray[np.int64]) -> Batch:
        """The ``(x, y)`` batch of the samples ``chosen`` (indices into the centres), with
        sample weights ``(x, y, w)`` when the replicas are several (see the class docstring)."""
        real = len(chosen)
        if real % self._multiple_of:  # the last batch: top it up with its own patches
            chosen = np.resize(chosen, -(-real // self._multiple_of) * self._multiple_of)
        rows, cols = self._corners[chosen, 0], self._corners[chosen, 1]
        x = network_input(self._images[rows, cols, 0])
        y = self._masks[rows, cols].astype(np.float32)[..., np.newaxis]
        if self._multiple_of == 1:
            return x, y
        weights = np.zeros((len(chosen), 1, 1), dtype=np.float32)  # broadcast over each patch's pixels
        weights[:real] = len(chosen) / real if self._weigh_for == "loss" else 1.0
        return x, y, weights

    def __getitem__(self, index: int) -> Batch:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.batch(self._order[index * self._batch_size : (index + 1) * self._batch_size])

    def __repr__(self) -> str:
        return f"PatchDataset(samples={self.samples}, batch_size={self._batch_size}, shuffle={self._rng is not None})"


class RemainingBatches(keras.utils.PyDataset):  # type: ignore[misc]
    """The rest of an interrupted epoch of a :class:`PatchDataset`: ``order`` in batches of its size.

    Batch ``i`` holds the same patches as batch ``k + i`` of the uninterrupted epoch when
    ``k`` whole batches were trained before the interruption.
    """

    def __init__(self, dataset: PatchDataset, order: npt.NDArray[np.int64]) -> None:
        super().__init__()
        self._dataset = dataset
        self._order = order

    @property
    def samples(self) -> int:
        return len(self._order)

    def __len__(self) -> int:
        return math.ceil(len(self._order) / self._dataset.batch_size)

    def __getitem__(self, index: int) -> Batch:
        if not 0 <= index < len(self):
            raise IndexError(index)
        size = self._dataset.batch_size
        return self._dataset.batch(self._order[index * size : (index + 1) * size])
