"""Batches of patches built on the fly from the uint8 page and the sampled centres.

Nothing float is kept between batches: the page stays uint8, each layer's mask bool, the
samples an ``(n, 2)`` int array. A batch of 16 256x256 patches is 12.6 MB of float32,
where the original's float64 arrays for 10,000 samples per label took gigabytes.

**The input pipeline** (:func:`training_input`, what ``fit`` reads). Python only cuts
batches out of a BGR copy of the page (:func:`network_order`, made once per page), as
uint8, several small batches per call (a fancy-indexed copy, cheap); turning them into the
network's float32 input, the part that costs (far less in TensorFlow than in NumPy), runs in
``tf.data`` as TensorFlow ops, on two blocks at once and outside the GIL, and the next batches
are prefetched while the model steps. ``tf.data``'s autotuning is off: with it, destroying each
epoch's iterator waited for its autotune thread, stalling every epoch on a 2-core node, and a
fixed depth needs no tuning when a step takes milliseconds on a GPU and seconds on a CPU.
``bench_input.py`` measures what it delivers with the model replaced by nothing; the figures are
in ``benchmarks/README.md`` ("Input pipeline", "Trainer"). On Keras' JAX backend there is no
``tf.data``: each uint8 batch goes to the device and is converted there
(:mod:`worker.trainer.jax_input`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

from worker.trainer.sampling import Centres
from worker.trainer.settings import PATCH_ANCHOR_CHOICES

#: ``INPUT_LOOKUP[v] == float32((255 - v) / 255)`` computed in float64 as the original
#: did: ink becomes high, paper low.
INPUT_LOOKUP: npt.NDArray[np.float32] = ((255.0 - np.arange(256, dtype=np.float64)) / 255.0).astype(np.float32)
#: ``(x, y)``, or ``(x, y, sample_weight)`` when several replicas share each batch.
Batch = tuple[npt.NDArray[np.float32], ...]
#: ``(uint8 BGR patches, bool masks)``, or ``(..., sample_weight)``: a batch as cut from the page.
RawBatch = tuple[npt.NDArray[Any], ...]
#: Blocks (see :meth:`PatchDataset.raw_blocks`) converted at once by ``tf.data``, each on one thread.
PARALLEL_BLOCKS = 2
#: Batches ready ahead of the one the model steps on.
PREFETCH_BATCHES = 4
#: About how many bytes of uint8 patches Python cuts per call: 10 batches of 16 64x64
#: patches, one of 256x256.
BLOCK_BYTES = 2 << 20


def split_validation(centres: Centres, validation_split: float) -> tuple[Centres, Centres]:
    """Split like Keras' ``fit(validation_split=...)``: the last part, in order, validates.

    The training part is the first ``floor(n * (1 - validation_split))`` samples.

    Centres of several pages (``(page, row, col)`` rows, grouped by page as
    :func:`~worker.trainer.sampling.sample_pages_centres` draws them) are split page by
    page: the last part of every page's centres validates, so every page is held out in
    proportion to its samples (and the training part is every page's first part, in page
    order). With ``(row, col)`` centres (one page) this is the plain split.
    """
    centres = np.asarray(centres)
    if centres.ndim == 2 and centres.shape[1] == 3 and len(centres):
        pages = centres[:, 0]
        starts = np.flatnonzero(np.r_[True, pages[1:] != pages[:-1]])
        stops = np.r_[starts[1:], len(centres)]
        train, validation = [], []
        for start, stop in zip(starts, stops, strict=True):
            split_at = start + math.floor((stop - start) * (1.0 - validation_split))
            train.append(centres[start:split_at])
            validation.append(centres[split_at:stop])
        return np.concatenate(train), np.concatenate(validation)
    split_at = math.floor(len(centres) * (1.0 - validation_split))
    return centres[:split_at], centres[split_at:]


def network_input(image_patches: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32]:
    """RGB uint8 patches ``(..., 3)`` to what the network sees.

    Channels are reversed to BGR because Rodan reads pages with OpenCV (``cv2.imread``),
    both when it trained these models and when its classifier applies them; then
    ``(255 - v) / 255``.
    """
    return INPUT_LOOKUP[image_patches[..., ::-1]]


def network_order(image: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """A contiguous copy of an RGB page in the network's channel order (BGR, see :func:`network_input`).

    Made once per page: reversing the channels of every batch instead costs more than
    everything else the input pipeline does (``benchmarks/README.md``, "Input pipeline"), and a
    contiguous page is cut with plain copies.
    """
    return np.ascontiguousarray(image[..., ::-1])


def to_network_batch(raw: RawBatch) -> Batch:
    """A :data:`RawBatch` as the network trains on it, in NumPy: ``x`` as :func:`network_input`
    makes it (the patches are BGR already), ``y`` float32 ``(b, ph, pw, 1)``, the weights unchanged."""
    patches, masks, *weights = raw
    return (INPUT_LOOKUP[patches], masks.astype(np.float32)[..., np.newaxis], *weights)


#: Where a sampled pixel sits in its patch (``TrainSettings.patch_anchor``).
PATCH_ANCHORS = PATCH_ANCHOR_CHOICES


def anchor_offset(anchor: str, patch_height: int, patch_width: int) -> tuple[int, int]:
    """From a sampled pixel to its patch's top-left corner: ``centre`` (the original HPC trainer's:
    the pixel in the middle) subtracts half a patch, ``corner`` (Paco_classifier's: the pixel is the
    top-left corner) nothing. Both stay on the page: centres lie at least a patch from its edges."""
    if anchor == "centre":
        return patch_height // 2, patch_width // 2
    if anchor == "corner":
        return 0, 0
    raise ValueError(f"the patch anchor must be one of {', '.join(PATCH_ANCHORS)}, not {anchor!r}")


class PatchDataset:
    """The ``(x, y)`` batches of one layer (``fit`` reads them through :func:`training_input`).

    One page (``image``, ``mask`` arrays, ``(n, 2)`` ``(row, col)`` centres) or several
    (``image``, ``mask`` and ``bgr`` sequences, one per page, and ``(n, 3)``
    ``(page, row, col)`` centres): every batch is cut from the pages its samples lie on, page
    by page, into one uint8 block; no page is copied, whatever their number.

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
        image: npt.NDArray[np.uint8] | Sequence[npt.NDArray[np.uint8]],
        mask: npt.NDArray[np.bool_] | Sequence[npt.NDArray[np.bool_]],
        centres: Centres,
        patch_height: int,
        patch_width: int,
        batch_size: int,
        shuffle_rng: np.random.Generator | None = None,
        multiple_of: int = 1,
        weigh_for: Literal["loss", "accuracy"] = "loss",
        *,
        bgr: npt.NDArray[np.uint8] | Sequence[npt.NDArray[np.uint8]] | None = None,
        anchor: str = "centre",
        epoch_samples: int | None = None,
    ) -> None:
        images = [image] if isinstance(image, np.ndarray) else list(image)
        masks = [mask] if isinstance(mask, np.ndarray) else list(mask)
        if bgr is None:
            bgrs = [network_order(page) for page in images]
        else:
            bgrs = [bgr] if isinstance(bgr, np.ndarray) else list(bgr)
        if not images or len(masks) != len(images) or len(bgrs) != len(images):
            raise ValueError(f"{len(images)} images, {len(masks)} masks and {len(bgrs)} BGR pages")
        for page, page_bgr in zip(images, bgrs, strict=True):
            if page_bgr.shape != page.shape:
                raise ValueError(f"the BGR page is {page_bgr.shape}, the page {page.shape}")
        self._images = [sliding_window_view(b, (patch_height, patch_width, b.shape[2])) for b in bgrs]
        self._masks = [sliding_window_view(m, (patch_height, patch_width)) for m in masks]
        centres = np.asarray(centres, dtype=np.int64)
        # The page of every sample, None with one page (then batches are cut as they always were).
        self._pages: npt.NDArray[np.int64] | None = None
        if centres.ndim == 2 and centres.shape[1] == 3:
            pages = centres[:, 0]
            if len(pages) and (pages.min() < 0 or pages.max() >= len(images)):
                raise ValueError(f"centres on pages {pages.min()}..{pages.max()} of {len(images)}")
            if len(images) > 1:
                self._pages = np.ascontiguousarray(pages)
            centres = centres[:, 1:]
        elif len(images) > 1:
            raise ValueError(f"{len(images)} pages need (page, row, col) centres, not {centres.shape}")
        self._corners = centres - np.array(anchor_offset(anchor, patch_height, patch_width))
        self._batch_size = batch_size
        self._patch_shape = (patch_height, patch_width)
        self._rng = shuffle_rng
        if epoch_samples is not None and not 1 <= epoch_samples <= len(self._corners):
            raise ValueError(f"{epoch_samples} samples an epoch out of {len(self._corners)}")
        self._epoch_samples = len(self._corners) if epoch_samples is None else epoch_samples
        self._order: npt.NDArray[np.int64] = np.arange(self._epoch_samples, dtype=np.int64)
        if multiple_of < 1 or batch_size % multiple_of:
            raise ValueError(f"the batch size {batch_size} is not a multiple of {multiple_of}")
        self._multiple_of = multiple_of
        self._weigh_for = weigh_for

    @property
    def samples(self) -> int:
        """The samples of one epoch: all the centres, or ``epoch_samples`` of them."""
        return self._epoch_samples

    @property
    def pool(self) -> int:
        """All the centres an epoch's samples are drawn from."""
        return len(self._corners)

    def __len__(self) -> int:
        return math.ceil(self._epoch_samples / self._batch_size)

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def patch_shape(self) -> tuple[int, int]:
        """``(patch_height, patch_width)``."""
        return self._patch_shape

    @property
    def weighted(self) -> bool:
        """Whether batches carry sample weights (several replicas share them)."""
        return self._multiple_of > 1

    @property
    def rng(self) -> np.random.Generator | None:
        return self._rng

    @property
    def order(self) -> npt.NDArray[np.int64]:
        """The current epoch's samples in order: indices of ``samples`` of the ``pool`` centres."""
        return self._order

    def shuffle(self) -> None:
        """Draw a new order from ``shuffle_rng`` (nothing without one): a permutation of all the
        centres, or with ``epoch_samples`` that many of them, drawn without replacement, in
        random order (a new set of patches every epoch, as Paco_classifier's generator draws)."""
        if self._rng is not None:
            # A new array rather than an in-place shuffle: Keras may still be prefetching
            # from the previous order in another thread.
            if self._epoch_samples == len(self._corners):
                self._order = self._rng.permutation(len(self._corners))
            else:
                self._order = self._rng.choice(len(self._corners), self._epoch_samples, replace=False)

    def remaining(self, order: npt.NDArray[np.int64], start: int) -> RemainingBatches:
        """The batches of an epoch with ``order`` from its ``start``-th sample on (never reshuffled)."""
        order = np.asarray(order, dtype=np.int64)
        if order.shape != (self.samples,) or not 0 <= start < self.samples or order.max() >= self.pool:
            raise ValueError(f"cannot continue an epoch of {self.samples} samples at {start} with order {order.shape}")
        return RemainingBatches(self, order[start:])

    def raw_batch(self, chosen: npt.NDArray[np.int64]) -> RawBatch:
        """The batch of the samples ``chosen`` (indices into the centres) as cut from the page:
        uint8 BGR patches ``(b, ph, pw, 3)`` and bool masks ``(b, ph, pw)``, with sample weights
        ``(b, 1, 1)`` when the replicas are several (see the class docstring).
        :func:`to_network_batch` (NumPy) and :func:`training_input` (``tf.data``) turn it into
        what the network trains on."""
        real = len(chosen)
        if real % self._multiple_of:  # the last batch: top it up with its own patches
            chosen = np.resize(chosen, -(-real // self._multiple_of) * self._multiple_of)
        rows, cols = self._corners[chosen, 0], self._corners[chosen, 1]
        if self._pages is None:
            patches, masks = self._images[0][rows, cols, 0], self._masks[0][rows, cols]
        else:
            patches, masks = self._cut_pages(self._pages[chosen], rows, cols)
        if self._multiple_of == 1:
            return patches, masks
        weights = np.zeros((len(chosen), 1, 1), dtype=np.float32)  # broadcast over each patch's pixels
        weights[:real] = len(chosen) / real if self._weigh_for == "loss" else 1.0
        return patches, masks, weights

    def _cut_pages(
        self, pages: npt.NDArray[np.int64], rows: npt.NDArray[np.int64], cols: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.bool_]]:
        """The patches and masks at ``(pages[i], rows[i], cols[i])``, in that order: one cut per page present."""
        height, width = self._patch_shape
        channels = self._images[0].shape[-1]
        patches = np.empty((len(pages), height, width, channels), dtype=np.uint8)
        masks = np.empty((len(pages), height, width), dtype=np.bool_)
        for page in np.unique(pages).tolist():  # a few pages per batch at most: one cut each
            where = np.flatnonzero(pages == page)
            patches[where] = self._images[page][rows[where], cols[where], 0]
            masks[where] = self._masks[page][rows[where], cols[where]]
        return patches, masks

    def layer_pixels(self, chunk: int = 256, most: int | None = None) -> tuple[int, int]:
        """``(pixels of the layer, all pixels)`` over every centre's patch (each once, no top-up), or
        over ``most`` centres spread evenly over the pool when it holds more (an estimate of the
        layer's share that costs the same for a pool of 50 epochs' draws as for one)."""
        height, width = self._patch_shape
        centres = np.arange(self.pool)
        if most is not None and self.pool > most:
            centres = np.linspace(0, self.pool - 1, most).round().astype(np.int64)
        layer = 0
        for start in range(0, len(centres), chunk):
            chosen = centres[start : start + chunk]
            rows, cols = self._corners[chosen, 0], self._corners[chosen, 1]
            pages = np.zeros(len(chosen), dtype=np.int64) if self._pages is None else self._pages[chosen]
            for page in np.unique(pages).tolist():  # the masks only: no image patch is cut
                where = pages == page
                layer += int(np.count_nonzero(self._masks[page][rows[where], cols[where]]))
        return layer, len(centres) * height * width

    def batch(self, chosen: npt.NDArray[np.int64]) -> Batch:
        """The ``(x, y)`` batch of the samples ``chosen``, ``(x, y, w)`` with several replicas."""
        return to_network_batch(self.raw_batch(chosen))

    def raw_blocks(self, per_block: int, order: npt.NDArray[np.int64] | None = None) -> Iterator[RawBatch]:
        """The batches of an epoch in ``order`` (default: the current one), cut as by
        :meth:`raw_batch` but ``per_block`` batches at a time, stacked on a new leading axis
        (``(k, b, ph, pw, 3)``...): one Python call and one copy per block, which matters for
        small patches. The last, smaller batch comes alone, as a block of one."""
        order = self._order if order is None else order  # shuffle() replaces the array, never changes it
        size = self._batch_size
        full = len(order) // size
        for first in range(0, full, per_block):
            count = min(per_block, full - first)
            chosen = order[first * size : (first + count) * size]
            # Full batches need no top-up and weigh 1 (padded / real = 1): one cut serves them all.
            yield tuple(part.reshape(count, size, *part.shape[1:]) for part in self.raw_batch(chosen))
        if len(order) > full * size:
            yield tuple(part[np.newaxis] for part in self.raw_batch(order[full * size :]))

    def raw_item(self, index: int) -> RawBatch:
        """Batch ``index`` of the current order as cut from the page (see :meth:`raw_batch`)."""
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.raw_batch(self._order[index * self._batch_size : (index + 1) * self._batch_size])

    def __getitem__(self, index: int) -> Batch:
        return to_network_batch(self.raw_item(index))

    def __repr__(self) -> str:
        return f"PatchDataset(samples={self.samples}, batch_size={self._batch_size}, shuffle={self._rng is not None})"


class RemainingBatches:
    """The rest of an interrupted epoch of a :class:`PatchDataset`: ``order`` in batches of its size.

    Batch ``i`` holds the same patches as batch ``k + i`` of the uninterrupted epoch when
    ``k`` whole batches were trained before the interruption.
    """

    def __init__(self, dataset: PatchDataset, order: npt.NDArray[np.int64]) -> None:
        self._dataset = dataset
        self._order = order

    @property
    def samples(self) -> int:
        return len(self._order)

    def __len__(self) -> int:
        return math.ceil(len(self._order) / self._dataset.batch_size)

    @property
    def batch_size(self) -> int:
        return self._dataset.batch_size

    @property
    def patch_shape(self) -> tuple[int, int]:
        return self._dataset.patch_shape

    @property
    def weighted(self) -> bool:
        return self._dataset.weighted

    def raw_item(self, index: int) -> RawBatch:
        if not 0 <= index < len(self):
            raise IndexError(index)
        size = self._dataset.batch_size
        return self._dataset.raw_batch(self._order[index * size : (index + 1) * size])

    def __getitem__(self, index: int) -> Batch:
        return to_network_batch(self.raw_item(index))

    def raw_blocks(self, per_block: int) -> Iterator[RawBatch]:
        return self._dataset.raw_blocks(per_block, self._order)


def _network_batch_tf(patches: Any, masks: Any, *weights: Any) -> tuple[Any, ...]:
    """:func:`to_network_batch` in TensorFlow ops: the same float32 values, bit for bit
    (``255 - v`` is exact in float32 and its division by 255 correctly rounded, as in
    :data:`INPUT_LOOKUP`; ``tests/test_trainer.py`` checks all 256 values)."""
    import tensorflow as tf

    x = (255.0 - tf.cast(patches, tf.float32)) / 255.0
    y = tf.cast(masks, tf.float32)[..., tf.newaxis]
    return (x, y, *weights)


def training_input(
    source: PatchDataset | RemainingBatches, parallel: int = PARALLEL_BLOCKS, prefetch: int = PREFETCH_BATCHES
) -> Any:
    """What ``fit`` reads for ``source``'s batches, on the backend Keras runs on.

    Every pass over it (Keras makes one per epoch, after the callbacks' ``on_epoch_begin``,
    so after :class:`~worker.trainer.callbacks.EpochShuffle` drew the epoch's order) yields
    the batches of ``source`` in its order at that moment, exactly those of ``source[i]``.
    On TensorFlow it is a ``tf.data.Dataset`` (:func:`tf_training_input`), on JAX a Keras
    ``PyDataset`` whose uint8 batches are converted on the device
    (:class:`worker.trainer.jax_input.DeviceBatches`).
    """
    from worker.trainer._keras import BACKEND

    if BACKEND == "jax":
        from worker.trainer.jax_input import DeviceBatches

        return DeviceBatches(source)
    return tf_training_input(source, parallel, prefetch)


def tf_training_input(
    source: PatchDataset | RemainingBatches, parallel: int = PARALLEL_BLOCKS, prefetch: int = PREFETCH_BATCHES
) -> Any:
    """The ``tf.data.Dataset`` of ``source``'s batches (see the module docstring)."""
    import tensorflow as tf

    height, width = source.patch_shape
    per_block = max(1, min(16, BLOCK_BYTES // (source.batch_size * height * width * 3)))
    # Blocks of one (large patches) go as plain batches: unbatching them would cost a copy.
    block: tuple[None, ...] = (None,) if per_block > 1 else ()
    signature: tuple[Any, ...] = (
        tf.TensorSpec((*block, None, height, width, 3), tf.uint8),
        tf.TensorSpec((*block, None, height, width), tf.bool),
    )
    if source.weighted:
        signature += (tf.TensorSpec((*block, None, 1, 1), tf.float32),)

    def batches() -> Iterator[RawBatch]:
        for raw in source.raw_blocks(per_block):
            yield raw if block else tuple(part[0] for part in raw)

    data = tf.data.Dataset.from_generator(batches, output_signature=signature)
    data = data.map(_network_batch_tf, num_parallel_calls=parallel, deterministic=True)
    if block:
        data = data.unbatch()
    data = data.take(len(source)).prefetch(prefetch)  # no more than len(source), should a subclass cap it
    options = tf.data.Options()
    options.autotune.enabled = False
    options.deterministic = True
    options.experimental_optimization.apply_default_optimizations = False
    return data.with_options(options).apply(tf.data.experimental.assert_cardinality(len(source)))
