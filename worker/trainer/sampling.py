"""Where to cut training patches: the original trainer's random sampling, vectorised.

The original (Rodan's HPC version of Calvo's ``getTrain``) walks the page::

    count[l]  = number of pixels of layer l            (masks already ANDed with the regions)
    cap       = min(min over all layers of count[l], max_samples_per_label)
    ratio[l]  = factor * cap / count[l]
    for row in range(ph, H - ph - 1):
        for col in range(pw, W - pw - 1):
            if random() < 1 / factor:
                for l in layers:
                    if mask[l][row, col] and random() < ratio[l]:
                        take the ph x pw patch whose top-left corner is
                        (row - ph // 2, col - pw // 2) as a sample of layer l

so every candidate pixel passes a first test with probability ``p = min(1, 1/factor)`` and,
given that, each layer that covers it takes it, independently, with probability
``q[l] = min(1, ratio[l])``. The original draws the second ``random()`` only for the layers
that cover the pixel; drawing it for every layer and ignoring it where the layer does not
cover the pixel changes nothing, since all draws are independent. So: the passing candidates
are what independent Bernoulli(p) trials keep along the row-major sequence of candidates, and
layer ``l`` takes those of the passing candidates that independent Bernoulli(q[l]) trials
keep along *their* sequence and that ``l`` covers.

:func:`sample_centres` draws exactly that distribution without a random number per pixel:
the indices that independent Bernoulli(p) trials keep along a sequence are the partial sums
of independent geometric(p) gaps (:class:`BernoulliTrials`). On a real page (63 M pixels,
54 M candidates) that is about 0.5 M geometric numbers for the first test, then fewer than
that per layer, instead of 54 M uniforms and a Python-level step per pixel; and a mask is
looked up only where its layer's second test passed (about ``cap * candidates / count[l]``
times for layer ``l``), not at every passing candidate. It walks the page in bands of ``band_rows`` rows,
so its memory is bounded by a band, whatever the page's height: it never allocates anything
of the page's size (the masks are only read: counted, then looked up at a few pixels).

Each of the ``1 + len(masks)`` trial sequences has its own random stream, spawned from
``rng``, and consumes it in the same order whatever the bands are, so the samples depend on
``rng``'s state only: not on ``band_rows`` (tests check this). Samples come out in the
original's order (row-major, as appended), which matters because the validation split takes
the last ones. The same seed gives the same samples; it does not give the original loop's
samples for that seed, since the random numbers are drawn differently.

**Several pages** (Rodan 3.x trains each layer over all its samples at once):
:func:`sample_pages_centres` walks every page as above, but ``count[l]`` is the layer's pixels
on *all* pages, so the cap applies to the total and ``ratio[l] = factor * cap / total[l]`` is
the same on every page: page ``i``'s share of layer ``l``'s ``cap`` is ``count_i[l] / total[l]``,
in proportion to the layer's pixels there (none where the layer is not painted). The pages take
their random streams from the generator one after the other, so the samples depend on the seed
alone, and one page gives exactly :func:`sample_centres`' samples. Centres carry their page:
``(page, row, col)``, page by page, row-major within a page; the validation split then holds out
the last part of every page (:func:`worker.trainer.dataset.split_validation`). Memory stays that
of one band: the pages are walked one after the other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

#: The original's ``factor``: the first test passes one candidate pixel in a hundred.
SAMPLING_FACTOR = 100
#: Rows of the page walked at a time: bounds the memory (about ``8 * BAND_ROWS * width / factor``
#: bytes per array of passing candidates); it does not change which samples a seed draws.
BAND_ROWS = 512
#: The most geometric gaps drawn at a time per trial sequence (irrelevant to the samples drawn).
GAP_CHUNK = 1 << 14
#: The largest gap drawn between two kept indices: gaps are clipped there, which changes
#: nothing on any page of fewer than a trillion candidate pixels and keeps sums in int64.
MAX_GAP = float(1 << 40)

Centres = npt.NDArray[np.int64]
Indices = npt.NDArray[np.int64]


def samples_per_label(counts: Sequence[int], max_samples_per_label: int) -> int:
    """The common cap: the fewest pixels any layer has, but at most ``max_samples_per_label``."""
    return min(min(counts), max_samples_per_label)


def selection_ratios(
    counts: Mapping[str, int], max_samples_per_label: int, factor: float = SAMPLING_FACTOR
) -> dict[str, float]:
    """``ratio[l] = factor * cap / count[l]`` for every layer (all counts must be positive)."""
    cap = samples_per_label(list(counts.values()), max_samples_per_label)
    return {label: factor * cap / count for label, count in counts.items()}


def centre_ranges(height: int, width: int, patch_height: int, patch_width: int) -> tuple[range, range]:
    """The rows and columns a patch may be centred on: ``range(ph, H-ph-1)``, ``range(pw, W-pw-1)``."""
    return range(patch_height, height - patch_height - 1), range(patch_width, width - patch_width - 1)


class BernoulliTrials:
    """The indices ``0, 1, 2, ...`` that independent Bernoulli(``probability``) trials keep.

    Drawn lazily as geometric gaps (:meth:`_gaps`), at most :data:`GAP_CHUNK` at a time, and handed out in
    increasing order by :meth:`kept_below`. The indices kept depend only on ``rng`` and
    ``probability``, not on how the calls to :meth:`kept_below` split the sequence.
    """

    def __init__(self, rng: np.random.Generator, probability: float) -> None:
        self._rng = rng
        self._probability = min(1.0, probability)
        self._scale = 1.0 / -math.log1p(-self._probability) if 0.0 < self._probability < 1.0 else 0.0
        self._pending: Indices = np.empty(0, dtype=np.int64)
        self._last = -1  # the largest index drawn so far

    def _gaps(self, wanted: int) -> Indices:
        """``wanted`` independent geometric(p) gaps (1, 2, ...) between kept indices.

        ``floor(E / lambda) + 1`` with ``E`` standard exponential and ``lambda = -log(1 - p)``
        is geometric: it is ``k`` with probability ``exp(-(k-1) lambda) - exp(-k lambda) =
        (1-p)^(k-1) p``. (About twice as fast as ``Generator.geometric`` here.) Gaps are
        clipped at :data:`MAX_GAP`, far beyond any page, so that the indices cannot overflow.
        The exponentials come one after the other from the stream however many are drawn at
        a time, so ``wanted`` does not change the gaps.
        """
        if self._probability >= 1.0:  # every trial succeeds: no random numbers needed
            return np.ones(wanted, dtype=np.int64)
        scaled = self._rng.standard_exponential(wanted)
        scaled *= self._scale
        np.minimum(scaled, MAX_GAP, out=scaled)
        gaps: Indices = scaled.astype(np.int64)  # truncation is floor: the values are >= 0
        gaps += 1
        return gaps

    def kept_below(self, stop: int) -> Indices:
        """The kept indices below ``stop`` that no earlier call returned, in increasing order."""
        if self._probability <= 0.0:
            return np.empty(0, dtype=np.int64)
        parts: list[Indices] = []
        while True:
            if self._pending.size == 0:
                if self._last + 1 >= stop:
                    break
                # About as many gaps as reach ``stop`` (few on a small page), at most GAP_CHUNK.
                expected = self._probability * (stop - self._last - 1)
                gaps = self._gaps(min(GAP_CHUNK, int(expected + 4 * math.sqrt(expected)) + 16))
                self._pending = self._last + np.cumsum(gaps)
                self._last = int(self._pending[-1])
            below = int(np.searchsorted(self._pending, stop))
            if below:
                parts.append(self._pending[:below])
                self._pending = self._pending[below:]
            if self._pending.size:
                break
        if not parts:
            return np.empty(0, dtype=np.int64)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def sample_centres(
    masks: Mapping[str, npt.NDArray[np.bool_]],
    patch_height: int,
    patch_width: int,
    max_samples_per_label: int,
    rng: np.random.Generator,
    factor: float = SAMPLING_FACTOR,
    *,
    band_rows: int = BAND_ROWS,
) -> dict[str, Centres]:
    """Draw the sample centres of every layer, as the module docstring describes.

    Returns, per label and in the order of ``masks``, an ``(n, 2)`` int64 array of
    ``(row, col)`` centres in row-major order. The patch of a centre has its top-left
    corner at ``(row - patch_height // 2, col - patch_width // 2)``. Every mask must have
    the same 2-D shape and at least one (nonzero) pixel. ``band_rows`` only bounds the
    memory used; the centres drawn depend on ``rng``'s state alone.
    """
    _check_arguments(factor, band_rows)
    labels = list(masks)
    if not labels:
        return {}
    arrays = _page_arrays(masks)
    counts = {label: int(np.count_nonzero(array)) for label, array in zip(labels, arrays, strict=True)}
    if min(counts.values()) == 0:
        raise ValueError("every mask needs at least one pixel")
    ratios = selection_ratios(counts, max_samples_per_label, factor)
    found = _draw_page(arrays, [ratios[label] for label in labels], patch_height, patch_width, rng, factor, band_rows)
    return dict(zip(labels, found, strict=True))


def sample_pages_centres(
    pages: Sequence[Mapping[str, npt.NDArray[np.bool_]]],
    patch_height: int,
    patch_width: int,
    max_samples_per_label: int,
    rng: np.random.Generator,
    factor: float = SAMPLING_FACTOR,
    *,
    band_rows: int = BAND_ROWS,
) -> dict[str, Centres]:
    """Draw every layer's centres over several pages (the masks of each page, same labels, same order).

    **Semantics.** The per-label cap of :func:`samples_per_label` applies to the *total* over
    the pages: ``cap = min(min over layers of the layer's pixels on all pages,
    max_samples_per_label)``, and it is allotted to the pages in proportion to the layer's
    pixels on each: page ``i`` gets ``cap_i[l] = cap * count_i[l] / total[l]``, which makes
    the second test's ratio ``factor * cap_i[l] / count_i[l] = factor * cap / total[l]`` the
    same on every page. Each page is then walked exactly as :func:`sample_centres` walks one
    page (its own first test, its own streams), with that ratio. So a layer gets about
    ``cap`` samples in all (as on one page), each page contributing about its share of the
    layer's pixels, and a page where a layer has no pixels contributes none of that layer
    (but the layer needs pixels on some page).

    The pages draw their streams from ``rng`` one after the other (four integers each, as
    :func:`sample_centres` does), so the samples depend on ``rng``'s state alone; with one
    page they are exactly :func:`sample_centres`' (plus the page column).

    Returns, per label in the pages' order, an ``(n, 3)`` int64 array of ``(page, row, col)``:
    page 0's centres in row-major order, then page 1's, and so on.
    """
    _check_arguments(factor, band_rows)
    if not pages:
        return {}
    labels = list(pages[0])
    for index, masks in enumerate(pages):
        if list(masks) != labels:
            raise ValueError(f"page {index + 1} has the layers {list(masks)}, page 1 {labels}")
    if not labels:
        return {}
    per_page = [_page_arrays(masks) for masks in pages]
    totals = {label: 0 for label in labels}
    for arrays in per_page:
        for label, array in zip(labels, arrays, strict=True):
            totals[label] += int(np.count_nonzero(array))
    if min(totals.values()) == 0:
        raise ValueError("every layer needs at least one pixel on some page")
    ratios = selection_ratios(totals, max_samples_per_label, factor)
    found: list[list[Centres]] = [[] for _ in labels]
    for page_index, arrays in enumerate(per_page):
        drawn = _draw_page(
            arrays, [ratios[label] for label in labels], patch_height, patch_width, rng, factor, band_rows
        )
        for parts, centres in zip(found, drawn, strict=True):
            tagged = np.empty((len(centres), 3), dtype=np.int64)
            tagged[:, 0] = page_index
            tagged[:, 1:] = centres
            parts.append(tagged)
    return {label: np.concatenate(parts) for label, parts in zip(labels, found, strict=True)}


def _check_arguments(factor: float, band_rows: int) -> None:
    if factor <= 0:
        raise ValueError(f"the sampling factor must be positive, not {factor}")
    if band_rows < 1:
        raise ValueError(f"band_rows must be at least 1, not {band_rows}")


def _page_arrays(masks: Mapping[str, npt.NDArray[np.bool_]]) -> list[npt.NDArray[np.bool_]]:
    """The masks of one page as arrays (views: never a copy of a mask), checked to share one 2-D shape."""
    arrays = [np.asarray(mask) for mask in masks.values()]
    shape = arrays[0].shape if arrays else ()
    if len(shape) != 2 or any(array.shape != shape for array in arrays):
        raise ValueError(f"the masks must all have the same 2-D shape, not {[a.shape for a in arrays]}")
    return arrays


def _draw_page(
    arrays: Sequence[npt.NDArray[np.bool_]],
    ratios: Sequence[float],
    patch_height: int,
    patch_width: int,
    rng: np.random.Generator,
    factor: float,
    band_rows: int,
) -> list[Centres]:
    """One page's ``(n, 2)`` centres per layer: the walk of the module docstring with these ratios."""
    height, width = arrays[0].shape
    # One independent stream per trial sequence, all derived from rng's state.
    seeds = np.random.SeedSequence(rng.integers(0, 2**63, size=4)).spawn(1 + len(arrays))
    streams = [np.random.default_rng(seed) for seed in seeds]
    passing = BernoulliTrials(streams[0], 1.0 / factor)
    taking = [BernoulliTrials(stream, ratio) for stream, ratio in zip(streams[1:], ratios, strict=True)]
    # Looking pixels up by their flat index is twice as fast, where the mask allows it.
    flat = [array.reshape(-1) if array.flags.c_contiguous else None for array in arrays]

    rows, cols = centre_ranges(height, width, patch_height, patch_width)
    found: list[list[Centres]] = [[] for _ in arrays]
    passed_before = 0  # candidates that passed the first test in earlier bands
    if len(rows) > 0 and len(cols) > 0:
        for band_start in range(0, len(rows), band_rows):
            band_stop = min(band_start + band_rows, len(rows))
            candidates = passing.kept_below(band_stop * len(cols))  # row-major indices in the window
            passed = candidates.size
            for index, array in enumerate(arrays):
                # Layer l's second test for every passing candidate, then whether l covers those
                # that pass it: the same as testing only the covered ones, and far fewer look-ups.
                trials = taking[index].kept_below(passed_before + passed) - passed_before
                if trials.size == 0:
                    continue
                r, c = np.divmod(candidates[trials], len(cols))
                r += rows.start
                c += cols.start
                page_flat = flat[index]
                covered = page_flat[r * width + c] if page_flat is not None else array[r, c]
                if covered.dtype != np.bool_:
                    covered = covered != 0
                if covered.any():
                    found[index].append(np.stack([r[covered], c[covered]], axis=1))
            passed_before += passed
    return [np.concatenate(parts) if parts else np.empty((0, 2), dtype=np.int64) for parts in found]


def run_centres(
    masks: Mapping[str, npt.NDArray[np.bool_]],
    patch_height: int,
    patch_width: int,
    max_samples_per_label: int,
    seed: int | None,
) -> dict[str, Centres]:
    """The centres :func:`worker.trainer.train.train_page` trains on with ``seed`` (None: fresh
    entropy): :func:`sample_centres` with the first child of ``SeedSequence(seed)`` (the
    other children seed the layers' shuffling and initial weights)."""
    sampling_seed = np.random.SeedSequence(seed).spawn(1)[0]
    return sample_centres(masks, patch_height, patch_width, max_samples_per_label, np.random.default_rng(sampling_seed))


def run_pages_centres(
    pages: Sequence[Mapping[str, npt.NDArray[np.bool_]]],
    patch_height: int,
    patch_width: int,
    max_samples_per_label: int,
    seed: int | None,
) -> dict[str, Centres]:
    """The ``(page, row, col)`` centres :func:`worker.trainer.train.train_pages` trains on with
    ``seed`` over several pages: :func:`sample_pages_centres` with the generator
    :func:`run_centres` uses (so page 0 of a one-page list gets :func:`run_centres`' centres)."""
    sampling_seed = np.random.SeedSequence(seed).spawn(1)[0]
    return sample_pages_centres(
        pages, patch_height, patch_width, max_samples_per_label, np.random.default_rng(sampling_seed)
    )
