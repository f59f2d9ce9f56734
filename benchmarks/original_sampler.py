"""The original trainer's patch-centre sampling, ported faithfully: a Python loop over every pixel.

Only for comparison with :func:`worker.trainer.sampling.sample_centres` (the benchmark
``benchmarks/bench_sampling.py`` times both, ``tests/test_sampling.py`` checks that both
draw the same distribution); the product never uses it. It is the original procedure of
Rodan's trainer, line for line:

    count[label] = pixels of the label mask (already ANDed with the selected regions)
    samples_per_class = min(min over all labels of count, max_samples_per_label)
    ratio[label] = factor * samples_per_class / count[label],  factor = 100
    for row in range(ph, H - ph - 1):
        for col in range(pw, W - pw - 1):
            if random() < 1 / factor:
                for label in labels:
                    if mask[label][row, col] and random() < ratio[label]:
                        take centre (row, col) for that label

except that it returns the centres instead of cutting the patches, and that the source
of ``random()`` can be passed in (``random.Random(seed).random``) to make a run
reproducible; by default it is the module's ``random.random``, as in the original.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

import numpy as np
import numpy.typing as npt

FACTOR = 100


def original_sample(
    masks: Mapping[str, npt.NDArray[np.bool_]],
    patch_height: int,
    patch_width: int,
    max_samples_per_label: int,
    factor: float = FACTOR,
    random_source: Callable[[], float] = random.random,
) -> dict[str, list[tuple[int, int]]]:
    """The centres each label takes, as ``(row, col)`` in the loop's (row-major) order."""
    gt = dict(masks)
    height, width = next(iter(gt.values())).shape
    hspan, vspan = patch_width, patch_height

    count = {}
    for label in gt:
        count[label] = int(np.count_nonzero(gt[label]))
    samples_per_class = min(min(count.values()), max_samples_per_label)
    ratio = {}
    for label in gt:
        ratio[label] = factor * samples_per_class / float(count[label])

    centres: dict[str, list[tuple[int, int]]] = {label: [] for label in gt}
    for row in range(vspan, height - vspan - 1):
        for col in range(hspan, width - hspan - 1):
            if random_source() < 1.0 / factor:
                for label in gt:
                    if gt[label][row, col] and random_source() < ratio[label]:
                        centres[label].append((row, col))
    return centres
