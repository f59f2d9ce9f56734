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

so every candidate pixel passes a first test with probability ``1/factor`` and, given
that, each layer that covers it takes it independently with probability
``min(1, ratio[l])``. :func:`sample_centres` draws exactly that distribution with array
operations, a block of rows at a time: one uniform per candidate pixel for the first test,
then one uniform per (passing pixel, layer) for the second. The original draws the second
uniform only when the layer covers the pixel (``and`` short-circuits), but all draws are
independent, so drawing them for every layer and ignoring those of uncovered layers leaves
the joint distribution unchanged; so does not drawing any for pixels that failed the first
test, whose second draws the original never makes. Samples come out in the original's
order (row-major, as appended), which matters because the validation split takes the last
ones. The same seed gives the same samples; it does not give the original loop's samples
for that seed, since the random numbers are consumed in another order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

#: The original's ``factor``: the first test passes one candidate pixel in a hundred.
SAMPLING_FACTOR = 100
#: Rows are processed in blocks of about this many candidate pixels (bounds memory; part of
#: what makes a seed reproducible, so changing it changes the samples drawn for a seed).
BLOCK_PIXELS = 1 << 20

Centres = npt.NDArray[np.int64]


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


def sample_centres(
    masks: Mapping[str, npt.NDArray[np.bool_]],
    patch_height: int,
    patch_width: int,
    max_samples_per_label: int,
    rng: np.random.Generator,
    factor: float = SAMPLING_FACTOR,
) -> dict[str, Centres]:
    """Draw the sample centres of every layer, as the module docstring describes.

    Returns, per label and in the order of ``masks``, an ``(n, 2)`` int64 array of
    ``(row, col)`` centres in row-major order. The patch of a centre has its top-left
    corner at ``(row - patch_height // 2, col - patch_width // 2)``. Every mask must have
    the same shape and at least one pixel.
    """
    labels = list(masks)
    if not labels:
        return {}
    stack = [np.asarray(masks[label], dtype=bool) for label in labels]
    height, width = stack[0].shape
    counts = {label: int(np.count_nonzero(mask)) for label, mask in zip(labels, stack, strict=True)}
    if min(counts.values()) == 0:
        raise ValueError("every mask needs at least one pixel")
    ratios = np.array(list(selection_ratios(counts, max_samples_per_label, factor).values()))
    rows, cols = centre_ranges(height, width, patch_height, patch_width)
    found: list[list[Centres]] = [[] for _ in labels]
    if len(rows) > 0 and len(cols) > 0:
        block = max(1, BLOCK_PIXELS // len(cols))
        threshold = 1.0 / factor
        for first in range(rows.start, rows.stop, block):
            last = min(first + block, rows.stop)
            passed = rng.random((last - first, len(cols))) < threshold
            r, c = np.nonzero(passed)  # row-major order, like the loops
            r = r + first
            c = c + cols.start
            takes = rng.random((r.size, len(labels))) < ratios
            for index, mask in enumerate(stack):
                chosen = mask[r, c] & takes[:, index]
                found[index].append(np.stack([r[chosen], c[chosen]], axis=1).astype(np.int64))
    result: dict[str, Centres] = {}
    for label, parts in zip(labels, found, strict=True):
        result[label] = np.concatenate(parts) if parts else np.empty((0, 2), dtype=np.int64)
    return result
