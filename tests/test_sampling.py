"""The vectorised patch-centre sampler against the original per-pixel loop: same distribution.

Fast and without TensorFlow: ``worker.trainer``'s package imports Keras, so the two modules
under test (NumPy only) are loaded from their files. The reference is the original trainer's loop as
ported in ``benchmarks/original_sampler.py`` (Python ``random``), and both are compared with the
analytic distribution. All seeds are fixed, so every statistical test is deterministic.

Analytic distribution. With ``p = min(1, 1/factor)`` and ``q[l] = min(1, ratio[l])``, a
candidate pixel (inside the margins) that layer ``l`` covers becomes a centre of ``l`` with
probability ``p * q[l]``, independently of every other pixel, so the number of centres of
``l`` is a sum of independent Bernoulli(``p q[l]``) over the layer's candidate pixels:

    E[n_l]   = p q[l] * (number of candidate pixels of l)
    Var[n_l] = p q[l] (1 - p q[l]) * (number of candidate pixels of l)

(pixels outside the margins count in ``count[l]``, hence in ``ratio[l]``, but are never
candidates). A pixel that layers ``a`` and ``b`` both cover is a centre of both with
probability ``p q[a] q[b]`` (one first test, two independent second tests).
"""

from __future__ import annotations

import importlib.util
import math
import random
import sys
import tracemalloc
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


sampling = load("_sampling_under_test", ROOT / "worker" / "trainer" / "sampling.py")
original_sampler = load("_original_sampler_under_test", ROOT / "benchmarks" / "original_sampler.py")

SEEDS = 600  # runs of each sampler per configuration
GRID = 4  # spatial histograms: GRID x GRID bins over the candidate window
PATCH = 4


# --------------------------------------------------------------------------- helpers


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X chi-square with ``df`` (integer) degrees of freedom (no SciPy here)."""
    half = x / 2
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for j in range(1, df // 2):
            term *= half / j
            total += term
        return math.exp(-half) * total
    total = math.erfc(math.sqrt(half))
    for j in range(1, (df - 1) // 2 + 1):
        total += math.exp(-half + (j - 0.5) * math.log(half) - math.lgamma(j + 0.5)) if half > 0 else 0.0
    return total


def test_chi2_sf_matches_tables() -> None:
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, abs=1e-6)
    assert chi2_sf(5.991465, 2) == pytest.approx(0.05, abs=1e-6)
    assert chi2_sf(24.99579, 15) == pytest.approx(0.05, abs=1e-6)
    assert chi2_sf(32.0, 16) == pytest.approx(0.01, abs=1e-4)
    assert chi2_sf(37.697, 15) == pytest.approx(0.001, abs=1e-5)
    assert chi2_sf(0.0, 7) == pytest.approx(1.0)


def small_page() -> dict[str, np.ndarray]:
    """64 x 64, four layers of different sizes and shapes; C, the smallest, sets the cap."""
    size = 64
    noise = np.random.default_rng(2024).random((size, size))
    cols = np.arange(size)[None, :]
    rows = np.arange(size)[:, None]
    a = noise < cols / size  # denser to the right: a spatial gradient
    b = np.broadcast_to(rows % 6 < 2, (size, size)).copy()  # stripes, overlapping A
    c = np.zeros((size, size), bool)
    c[1:9, 50:56] = True  # 48 px, partly outside the margins (rows 0-3 are never centres)
    background = ~(a | b | c)
    return {"Background": background, "A": a, "B": b, "C": c}


def window(shape: tuple[int, int], ph: int, pw: int) -> tuple[slice, slice]:
    rows, cols = sampling.centre_ranges(shape[0], shape[1], ph, pw)
    return slice(rows.start, rows.stop), slice(cols.start, cols.stop)


def take_probabilities(masks: dict[str, np.ndarray], max_samples: int, factor: float) -> dict[str, float]:
    """``p * q[l]``: the probability that a candidate pixel of ``l`` becomes a centre of ``l``."""
    counts = {label: int(mask.sum()) for label, mask in masks.items()}
    ratios = sampling.selection_ratios(counts, max_samples, factor)
    return {label: min(1.0, 1.0 / factor) * min(1.0, ratios[label]) for label in masks}


def bin_edges(length: int) -> np.ndarray:
    return np.linspace(0, length, GRID + 1)


def histogram(centres: np.ndarray, origin: tuple[int, int], extent: tuple[int, int]) -> np.ndarray:
    """Counts of centres in GRID x GRID bins over the candidate window."""
    found, _, _ = np.histogram2d(
        centres[:, 0] - origin[0], centres[:, 1] - origin[1], bins=[bin_edges(extent[0]), bin_edges(extent[1])]
    )
    return found.ravel()


def pixel_bins(mask_window: np.ndarray) -> np.ndarray:
    """For every pixel of the window, the number of its GRID x GRID bin (as :func:`histogram`)."""
    height, width = mask_window.shape
    r = np.clip(np.searchsorted(bin_edges(height), np.arange(height), side="right") - 1, 0, GRID - 1)
    c = np.clip(np.searchsorted(bin_edges(width), np.arange(width), side="right") - 1, 0, GRID - 1)
    return r[:, None] * GRID + c[None, :]


@cache
def runs(factor: float, max_samples: int) -> dict[str, Any]:
    """Both samplers, SEEDS times each on :func:`small_page`: per-run counts, pooled centres and histograms."""
    masks = small_page()
    rows, cols = window((64, 64), PATCH, PATCH)
    origin, extent = (rows.start, cols.start), (rows.stop - rows.start, cols.stop - cols.start)
    out: dict[str, Any] = {"masks": masks, "origin": origin, "extent": extent}
    for name in ("ours", "original"):
        counts = {label: np.zeros(SEEDS) for label in [*masks, "A&B"]}
        all_centres: dict[str, list[np.ndarray]] = {label: [] for label in masks}
        for s in range(SEEDS):
            if name == "ours":
                found = sampling.sample_centres(masks, PATCH, PATCH, max_samples, np.random.default_rng(s), factor)
            else:
                loop = original_sampler.original_sample(
                    masks, PATCH, PATCH, max_samples, factor, random_source=random.Random(1_000_000 + s).random
                )
                found = {k: np.array(v, dtype=np.int64).reshape(-1, 2) for k, v in loop.items()}
            for label, centres in found.items():
                counts[label][s] = len(centres)
                all_centres[label].append(centres)
            a, b = (found[k][:, 0] * 64 + found[k][:, 1] for k in ("A", "B"))
            counts["A&B"][s] = np.intersect1d(a, b).size
        pooled = {k: np.concatenate(v) for k, v in all_centres.items()}
        hist = {k: histogram(v, origin, extent) for k, v in pooled.items()}
        out[name] = {"counts": counts, "hist": hist, "centres": pooled}
    return out


CONFIGS = [
    pytest.param(4, 1000, id="factor4-cap-is-smallest-layer"),  # q[C] = 1 (clipped ratio 4)
    pytest.param(4, 10, id="factor4-cap-is-max-samples"),  # every q < 1
    pytest.param(1, 30, id="factor1-every-candidate-passes"),  # p = 1
]


# --------------------------------------------------------------------------- distribution


@pytest.mark.parametrize(("factor", "max_samples"), CONFIGS)
def test_counts_match_the_original_loop_and_the_expectation(factor: int, max_samples: int) -> None:
    data = runs(factor, max_samples)
    masks = data["masks"]
    inside = window((64, 64), PATCH, PATCH)
    take = take_probabilities(masks, max_samples, factor)
    pixels = {label: int(mask[inside].sum()) for label, mask in masks.items()}
    mean = {label: pixels[label] * take[label] for label in masks}
    var = {label: pixels[label] * take[label] * (1 - take[label]) for label in masks}
    both = int((masks["A"] & masks["B"])[inside].sum())
    p = min(1.0, 1.0 / factor)
    joint = p * (take["A"] / p) * (take["B"] / p)  # one first test, two independent second tests
    mean["A&B"], var["A&B"] = both * joint, both * joint * (1 - joint)
    for key in mean:
        ours, original = data["ours"]["counts"][key], data["original"]["counts"][key]
        se_analytic = math.sqrt(var[key] / SEEDS)
        se_difference = math.sqrt(ours.var() / SEEDS + original.var() / SEEDS)
        assert abs(ours.mean() - original.mean()) < 4 * se_difference + 1e-9, key
        assert abs(ours.mean() - mean[key]) < 4 * se_analytic + 1e-9, key
        assert abs(original.mean() - mean[key]) < 4 * se_analytic + 1e-9, key  # the port is right too
        if var[key] > 0:  # binomial spread, not just the right mean (sd of a variance: ~sqrt(2/n))
            assert ours.var() == pytest.approx(var[key], rel=5 * math.sqrt(2 / SEEDS)), key
        else:
            assert ours.var() == 0, key


@pytest.mark.parametrize(("factor", "max_samples"), CONFIGS)
def test_spatial_histograms_match_the_original_loop_and_the_expectation(factor: int, max_samples: int) -> None:
    data = runs(factor, max_samples)
    masks = data["masks"]
    inside = window((64, 64), PATCH, PATCH)
    take = take_probabilities(masks, max_samples, factor)
    for label, mask in masks.items():
        ours, original = data["ours"]["hist"][label], data["original"]["hist"][label]
        # Two-sample chi-square (homogeneity) of our histogram against the original loop's.
        used = (ours + original) > 0
        k1, k2 = math.sqrt(original.sum() / ours.sum()), math.sqrt(ours.sum() / original.sum())
        stat = float(np.sum((k1 * ours[used] - k2 * original[used]) ** 2 / (ours[used] + original[used])))
        assert chi2_sf(stat, int(used.sum()) - 1) > 0.001, (label, "vs original loop", stat)
        # Against the analytic histogram: per bin, SEEDS x the bin's pixels x p q[l] expected.
        pixels = np.bincount(pixel_bins(mask[inside]).ravel(), weights=mask[inside].ravel(), minlength=GRID * GRID)
        expected = SEEDS * pixels * take[label]
        variance = expected * (1 - take[label])
        if take[label] == 1.0:  # deterministic: every candidate pixel, every time
            assert np.array_equal(ours, expected), label
            continue
        for name, found in (("ours", ours), ("original", original)):
            stat = float(np.sum((found[pixels > 0] - expected[pixels > 0]) ** 2 / variance[pixels > 0]))
            assert chi2_sf(stat, int((pixels > 0).sum())) > 0.001, (label, name, stat)


@pytest.mark.parametrize(("factor", "max_samples"), CONFIGS)
def test_centres_inside_the_margins_on_layer_pixels_in_row_major_order(factor: int, max_samples: int) -> None:
    data = runs(factor, max_samples)
    rows, cols = sampling.centre_ranges(64, 64, PATCH, PATCH)
    for label, mask in data["masks"].items():
        centres = data["ours"]["centres"][label]
        assert centres.dtype == np.int64 and centres.ndim == 2 and centres.shape[1] == 2
        assert centres.shape[0] > 0
        r, c = centres[:, 0], centres[:, 1]
        assert r.min() >= rows.start and r.max() < rows.stop, label
        assert c.min() >= cols.start and c.max() < cols.stop, label
        assert mask[r, c].all(), label
    for s in range(20):
        found = sampling.sample_centres(data["masks"], PATCH, PATCH, max_samples, np.random.default_rng(s), factor)
        for centres in found.values():
            assert np.all(np.diff(centres[:, 0] * 64 + centres[:, 1]) > 0)  # row-major, no repeats


def test_cap_is_the_smallest_layer_or_max_samples() -> None:
    assert sampling.samples_per_label([1000, 50, 400], 100) == 50
    assert sampling.samples_per_label([1000, 50, 400], 10) == 10
    ratios = sampling.selection_ratios({"a": 1000, "b": 50, "c": 400}, 100)
    assert ratios == pytest.approx({"a": 100 * 50 / 1000, "b": 100.0, "c": 100 * 50 / 400})
    # factor 1: every candidate passes; each layer then takes each of its candidate pixels
    # with probability min(1, cap / count), one cap for all layers: the smallest one's count.
    masks = {"big": np.zeros((60, 60), bool), "small": np.zeros((60, 60), bool)}
    masks["big"][:, :40] = True  # 2400 px
    masks["small"][20:30, 44:54] = True  # 100 px, all candidates (rows and columns 5..53)
    inside = window((60, 60), 5, 5)
    assert masks["small"][inside].sum() == 100
    big = int(masks["big"][inside].sum())
    found = [sampling.sample_centres(masks, 5, 5, 1000, np.random.default_rng(s), factor=1) for s in range(200)]
    assert all(len(f["small"]) == 100 for f in found)  # ratio 1: every pixel, every time
    mean_big = np.mean([len(f["big"]) for f in found])
    sd = math.sqrt(big * (100 / 2400) * (1 - 100 / 2400) / 200)
    assert abs(mean_big - big * 100 / 2400) < 4 * sd  # the cap is 100, not 1000


# --------------------------------------------------------------------------- reproducibility


def test_same_seed_same_centres_other_seed_other_centres() -> None:
    masks = small_page()
    first = sampling.sample_centres(masks, PATCH, PATCH, 1000, np.random.default_rng(11), 4)
    again = sampling.sample_centres(masks, PATCH, PATCH, 1000, np.random.default_rng(11), 4)
    other = sampling.sample_centres(masks, PATCH, PATCH, 1000, np.random.default_rng(12), 4)
    assert list(first) == list(masks)
    for label in masks:
        assert np.array_equal(first[label], again[label])
    assert not all(np.array_equal(first[k], other[k]) for k in masks)
    # the generator's state counts, not just its seed: a second draw from it differs
    rng = np.random.default_rng(11)
    sampling.sample_centres(masks, PATCH, PATCH, 1000, rng, 4)
    later = sampling.sample_centres(masks, PATCH, PATCH, 1000, rng, 4)
    assert not all(np.array_equal(first[k], later[k]) for k in masks)


@pytest.mark.parametrize("factor", [1, 4, 100])
def test_band_size_and_gap_chunk_do_not_change_the_centres(factor: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(99)
    masks = {"x": rng.random((300, 170)) < 0.6, "y": rng.random((300, 170)) < 0.05, "z": rng.random((300, 170)) < 0.3}
    expected = sampling.sample_centres(masks, 8, 6, 500, np.random.default_rng(5), factor)
    assert all(len(v) > 0 for v in expected.values())
    for band_rows in (1, 2, 7, 64, 283, 284, 10_000):
        found = sampling.sample_centres(masks, 8, 6, 500, np.random.default_rng(5), factor, band_rows=band_rows)
        for label in masks:
            assert np.array_equal(found[label], expected[label]), (band_rows, label)
    monkeypatch.setattr(sampling, "GAP_CHUNK", 3)
    found = sampling.sample_centres(masks, 8, 6, 500, np.random.default_rng(5), factor, band_rows=5)
    for label in masks:
        assert np.array_equal(found[label], expected[label]), label


def test_any_mask_layout_and_dtype_gives_the_same_centres() -> None:
    masks = small_page()
    expected = sampling.sample_centres(masks, PATCH, PATCH, 20, np.random.default_rng(3), 4)
    layouts = {
        "fortran": {k: np.asfortranarray(v) for k, v in masks.items()},
        "strided view": {k: np.repeat(v, 2, axis=1)[:, ::2] for k, v in masks.items()},
        "uint8 0/255": {k: v.astype(np.uint8) * 255 for k, v in masks.items()},
    }
    for name, variant in layouts.items():
        found = sampling.sample_centres(variant, PATCH, PATCH, 20, np.random.default_rng(3), 4)
        for label in masks:
            assert np.array_equal(found[label], expected[label]), (name, label)


def test_bernoulli_trials_keep_the_right_fraction_however_they_are_asked() -> None:
    for probability in (0.003, 0.3, 0.9, 1.0):
        whole = sampling.BernoulliTrials(np.random.default_rng(8), probability).kept_below(200_000)
        assert np.all(np.diff(whole) > 0) and whole.min() >= 0 and whole.max() < 200_000
        sd = math.sqrt(200_000 * probability * (1 - probability))
        assert abs(whole.size - 200_000 * probability) <= 4 * sd, probability
        trials = sampling.BernoulliTrials(np.random.default_rng(8), probability)
        pieces = [trials.kept_below(stop) for stop in (0, 5, 5, 1234, 99_999, 200_000)]
        assert np.array_equal(np.concatenate(pieces), whole), probability
    assert sampling.BernoulliTrials(np.random.default_rng(8), 0.0).kept_below(10**6).size == 0
    # geometric gaps: P(gap = 1) = p, P(gap = 2) = p (1 - p)
    gaps = np.diff(sampling.BernoulliTrials(np.random.default_rng(1), 0.3).kept_below(10**6))
    assert np.mean(gaps == 1) == pytest.approx(0.3, abs=0.005)
    assert np.mean(gaps == 2) == pytest.approx(0.21, abs=0.005)


def test_bad_input_is_refused() -> None:
    masks = small_page()
    with pytest.raises(ValueError, match="factor"):
        sampling.sample_centres(masks, PATCH, PATCH, 10, np.random.default_rng(0), 0)
    with pytest.raises(ValueError, match="band_rows"):
        sampling.sample_centres(masks, PATCH, PATCH, 10, np.random.default_rng(0), band_rows=0)
    with pytest.raises(ValueError, match="same 2-D shape"):
        sampling.sample_centres({"a": masks["A"], "b": masks["B"][:-1]}, PATCH, PATCH, 10, np.random.default_rng(0))
    with pytest.raises(ValueError, match="at least one pixel"):
        sampling.sample_centres({"a": masks["A"], "b": np.zeros_like(masks["B"])}, 4, 4, 10, np.random.default_rng(0))
    assert sampling.sample_centres({}, PATCH, PATCH, 10, np.random.default_rng(0)) == {}
    # a page too small for the patches: nothing to sample, but no error here (train.py checks)
    tiny = sampling.sample_centres({"a": np.ones((8, 8), bool)}, PATCH, PATCH, 10, np.random.default_rng(0), 1)
    assert tiny["a"].shape == (0, 2) and tiny["a"].dtype == np.int64


# --------------------------------------------------------------------------- memory


def test_a_real_page_size_needs_less_memory_than_a_bit_per_pixel() -> None:
    """A 4872 x 12992 page (63 M pixels) with 3 layers, at the default settings.

    The bound is H * W / 8 bytes (7.9 MB): a page bitmap at ONE BIT per pixel, an eighth of
    one bool mask. Any array with an entry per page pixel (a mask copy, a combined mask, a
    float64 band of uniforms over the whole page: 506 MB) breaks it, whatever its dtype; what
    the sampler needs is proportional to a band (``BAND_ROWS`` rows) and to the samples
    drawn, about 2 MB here, the same for a page twice as high. The masks themselves are the
    caller's and are allocated before tracing starts.
    """
    height, width = 12992, 4872
    rows, cols = np.arange(height), np.arange(width)
    staff_rows = (rows >= 300) & (rows < height - 300) & ((rows - 300) % 60 < 25) & (rows % 5 == 0)
    staff = staff_rows[:, None] & ((cols >= 200) & (cols < width - 200))[None, :]  # 5-line staves
    neume_rows = (rows >= 330) & (rows < height - 300) & ((rows - 330) % 180 < 30)
    neumes = neume_rows[:, None] & ((cols >= 300) & (cols < width - 300) & (cols % 100 < 14))[None, :]
    background = ~staff
    background &= ~neumes
    masks = {"Background": background, "Neumes": neumes, "StaffLines": staff}
    tracemalloc.start()
    try:
        found = sampling.sample_centres(masks, 256, 256, 10_000, np.random.default_rng(0))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < height * width / 8, f"peak {peak / 2**20:.1f} MiB"
    take = take_probabilities(masks, 10_000, sampling.SAMPLING_FACTOR)
    inside = window((height, width), 256, 256)
    for label, centres in found.items():
        expected = int(masks[label][inside].sum()) * take[label]
        assert abs(len(centres) - expected) < 5 * math.sqrt(expected), (label, len(centres), expected)
        assert masks[label][centres[:, 0], centres[:, 1]].all()
