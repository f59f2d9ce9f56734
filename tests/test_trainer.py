"""Tests of worker.trainer: real TensorFlow on the CPU, small pages."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("keras")  # the worker extra is not installed on login nodes

import h5py
import keras
from PIL import Image

from tests.pages import striped_page
from tests.support.training import batch_count, fit_batches
from worker.trainer import Page, TrainingInputError, TrainSettings, load_page, train_page
from worker.trainer.callbacks import EPOCH_KEYS
from worker.trainer.dataset import INPUT_LOOKUP, PatchDataset, split_validation, training_input
from worker.trainer.model import PARAMETER_COUNT, build_sae, get_sae
from worker.trainer.sampling import centre_ranges, sample_centres, samples_per_label, selection_ratios
from worker.trainer.saving import LabelResult, model_file_names, save_model
from worker.trainer.train import train_label

pytestmark = pytest.mark.filterwarnings(  # TensorFlow's variables and NumPy 2, inside Keras
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)

PATCH = 32
TINY = TrainSettings(
    epochs=2, max_samples_per_label=60, patch_height=PATCH, patch_width=PATCH, batch_size=16, patience=3, seed=7
)


# --------------------------------------------------------------------------- helpers


def reference_sample(
    masks: dict[str, np.ndarray], ph: int, pw: int, max_samples: int, rng: np.random.Generator, factor: float
) -> dict[str, list[tuple[int, int]]]:
    """The original per-pixel loop, literally."""
    height, width = next(iter(masks.values())).shape
    counts = {label: int(mask.sum()) for label, mask in masks.items()}
    cap = min(min(counts.values()), max_samples)
    ratio = {label: factor * cap / counts[label] for label in masks}
    taken: dict[str, list[tuple[int, int]]] = {label: [] for label in masks}
    for row in range(ph, height - ph - 1):
        for col in range(pw, width - pw - 1):
            if rng.random() < 1.0 / factor:
                for label, mask in masks.items():
                    if mask[row, col] == 1 and rng.random() < ratio[label]:
                        taken[label].append((row, col))
    return taken


def write_rgba(path: Path, alpha: np.ndarray, colour: tuple[int, int, int] = (200, 0, 0)) -> Path:
    pixels = np.zeros((*alpha.shape, 4), dtype=np.uint8)
    pixels[..., :3] = colour
    pixels[..., 3] = alpha
    Image.fromarray(pixels, "RGBA").save(path)
    return path


# --------------------------------------------------------------------------- model


def test_parameter_count_is_the_originals() -> None:
    assert PARAMETER_COUNT == 1_429_733
    small = build_sae(32, 32)
    assert small.count_params() == 1_429_733
    assert small.output_shape == (None, 32, 32, 1)
    big = get_sae(256, 192)
    assert big.count_params() == 1_429_733
    assert big.output_shape == (None, 256, 192, 1)
    assert type(big.optimizer).__name__ == "Adam"
    assert float(keras.ops.convert_to_numpy(big.optimizer.learning_rate)) == pytest.approx(1e-4)
    assert big.loss == "binary_crossentropy"


# --------------------------------------------------------------------------- sampling


def test_cap_is_min_over_all_layers() -> None:
    assert samples_per_label([1000, 50, 400], 100) == 50
    assert samples_per_label([1000, 50, 400], 10) == 10
    ratios = selection_ratios({"a": 1000, "b": 50, "c": 400}, 100)
    assert ratios == pytest.approx({"a": 100 * 50 / 1000, "b": 100.0, "c": 100 * 50 / 400})

    # With factor 1 every pixel passes the first test, so a layer gets each of its pixels
    # inside the margins with probability min(1, cap / count): one common cap for all.
    masks = {"big": np.zeros((60, 60), bool), "small": np.zeros((60, 60), bool)}
    masks["big"][:, :40] = True  # 2400 px, 30 x 24 = 720 inside the margins (rows/cols 5..54)
    masks["small"][20:30, 45:55] = True  # 100 px, 10 x 10 inside
    rows, cols = centre_ranges(60, 60, 5, 5)
    inside = {k: int(m[rows.start : rows.stop, cols.start : cols.stop].sum()) for k, m in masks.items()}
    runs = [sample_centres(masks, 5, 5, 1000, np.random.default_rng(seed), factor=1) for seed in range(40)]
    mean_big = np.mean([len(r["big"]) for r in runs])
    assert mean_big == pytest.approx(inside["big"] * 100 / 2400, rel=0.1)  # cap = 100, not 1000
    assert all(len(r["small"]) == inside["small"] for r in runs)  # ratio 1: every pixel


def test_sampler_has_the_reference_distribution() -> None:
    masks = {"A": np.zeros((24, 24), bool), "B": np.zeros((24, 24), bool), "C": np.zeros((24, 24), bool)}
    masks["A"][:, :12] = True
    masks["B"][:14, :] = True  # overlaps A
    masks["C"][8:13, 14:19] = True  # the smallest layer: it sets the cap (25)
    factor, runs = 4, 800

    def summary(results: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        counts = {label: np.array([len(r[label]) for r in results], float) for label in masks}
        both = [len({tuple(p) for p in r["A"]} & {tuple(p) for p in r["B"]}) for r in results]
        counts["A&B"] = np.array(both, float)
        return counts

    ours = summary([sample_centres(masks, 4, 4, 1000, np.random.default_rng(s), factor) for s in range(runs)])
    theirs = summary(
        [reference_sample(masks, 4, 4, 1000, np.random.default_rng(10_000 + s), factor) for s in range(runs)]
    )
    rows, cols = centre_ranges(24, 24, 4, 4)
    window = (slice(rows.start, rows.stop), slice(cols.start, cols.stop))
    ratio = selection_ratios({k: int(m.sum()) for k, m in masks.items()}, 1000, factor)
    expected = {k: m[window].sum() / factor * min(1.0, ratio[k]) for k, m in masks.items()}
    expected["A&B"] = (masks["A"] & masks["B"])[window].sum() / factor * ratio["A"] * ratio["B"]
    for key, value in expected.items():
        se = math.sqrt(ours[key].var() / runs + theirs[key].var() / runs)
        assert abs(ours[key].mean() - theirs[key].mean()) < 5 * se + 1e-9, key
        assert ours[key].mean() == pytest.approx(value, abs=5 * math.sqrt(ours[key].var() / runs)), key


def test_sampler_default_factor_matches_expectation() -> None:
    page = striped_page()
    counts = {k: int(m.sum()) for k, m in page.masks.items()}
    ratio = selection_ratios(counts, 150)
    rows, cols = centre_ranges(page.height, page.width, PATCH, PATCH)
    found = [sample_centres(page.masks, PATCH, PATCH, 150, np.random.default_rng(s)) for s in range(100)]
    for label, mask in page.masks.items():
        inside = mask[rows.start : rows.stop, cols.start : cols.stop].sum()
        expected = inside / 100 * min(1.0, ratio[label])
        mean = np.mean([len(f[label]) for f in found])
        assert mean == pytest.approx(expected, rel=0.05), label


def test_centres_inside_margins_on_layer_pixels_in_selected_regions(tmp_path: Path) -> None:
    height, width, ph, pw = 90, 110, 8, 12
    rng = np.random.default_rng(3)
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(tmp_path / "page.png")
    layer0 = np.where(rng.random((height, width)) < 0.5, 255, 0).astype(np.uint8)
    layer1 = np.where(layer0 == 255, 0, 255).astype(np.uint8)
    layer1[::7] = 254  # not quite opaque: not part of the layer
    regions = np.zeros((height, width), np.uint8)
    regions[10:80, 30:100] = 255
    paths = {
        "Layer 0": write_rgba(tmp_path / "l0.png", layer0),
        "Layer 1": write_rgba(tmp_path / "l1.png", layer1),
    }
    page = load_page(tmp_path / "page.png", paths, write_rgba(tmp_path / "regions.png", regions))
    assert list(page.masks) == ["Layer 0", "Layer 1"]
    centres = sample_centres(page.masks, ph, pw, 10_000, np.random.default_rng(5), factor=2)
    for label, found in centres.items():
        assert len(found) > 20
        r, c = found[:, 0], found[:, 1]
        assert r.min() >= ph and r.max() < height - ph - 1
        assert c.min() >= pw and c.max() < width - pw - 1
        assert page.masks[label][r, c].all()
        assert (regions[r, c] == 255).all()
        assert np.all(np.diff(r * width + c) > 0)  # row-major, like the original loops
    assert (layer1[centres["Layer 1"][:, 0], centres["Layer 1"][:, 1]] == 255).all()


def test_same_seed_same_samples() -> None:
    page = striped_page()
    first = sample_centres(page.masks, PATCH, PATCH, 200, np.random.default_rng(11))
    again = sample_centres(page.masks, PATCH, PATCH, 200, np.random.default_rng(11))
    other = sample_centres(page.masks, PATCH, PATCH, 200, np.random.default_rng(12))
    for label in page.masks:
        assert np.array_equal(first[label], again[label])
        assert first[label].dtype == np.int64 and first[label].shape[1] == 2
    assert not all(np.array_equal(first[k], other[k]) for k in page.masks)


# --------------------------------------------------------------------------- data


def test_validation_split_is_the_last_part_like_keras() -> None:
    from keras.src.trainers.data_adapters.array_slicing import train_validation_split

    for n in (5, 13, 64, 99, 100, 101):
        centres = np.stack([np.arange(n), np.arange(n)], axis=1).astype(np.int64)
        train, validation = split_validation(centres, 0.2)
        assert len(train) == math.floor(n * 0.8)
        assert np.array_equal(np.concatenate([train, validation]), centres)  # in order, last part held out
        keras_train, keras_validation = train_validation_split(centres, validation_split=0.2)
        assert np.array_equal(train, keras_train) and np.array_equal(validation, keras_validation)


def test_batches_are_built_from_uint8_page() -> None:
    page = striped_page(120, 130)
    mask = page.masks["Layer 0"]
    centres = np.array([[40, 50], [33, 80], [70, 33], [60, 60], [85, 96]], dtype=np.int64)
    data = PatchDataset(page.image, mask, centres, PATCH, PATCH, batch_size=2)
    assert len(data) == 3
    xs, ys = zip(*(data[i] for i in range(len(data))), strict=True)
    x, y = np.concatenate(xs), np.concatenate(ys)
    assert x.dtype == np.float32 and y.dtype == np.float32
    assert x.shape == (5, PATCH, PATCH, 3) and y.shape == (5, PATCH, PATCH, 1)
    for i, (row, col) in enumerate(centres):
        top, left = row - PATCH // 2, col - PATCH // 2
        patch = page.image[top : top + PATCH, left : left + PATCH].astype(np.float64)
        # BGR, as cv2.imread gives Rodan, then (255 - v) / 255
        np.testing.assert_array_equal(x[i], ((255.0 - patch[..., ::-1]) / 255.0).astype(np.float32))
        np.testing.assert_array_equal(y[i, ..., 0], mask[top : top + PATCH, left : left + PATCH])
    assert INPUT_LOOKUP[0] == 1.0 and INPUT_LOOKUP[255] == 0.0

    # Training data: every sample once per epoch, in a new order each epoch.
    many = np.stack([np.full(40, 50), np.arange(20, 60)], axis=1).astype(np.int64)
    shuffled = PatchDataset(page.image, mask, many, PATCH, PATCH, 16, shuffle_rng=np.random.default_rng(0))
    orders = []
    for _ in range(2):
        shuffled.shuffle()
        seen = np.concatenate([shuffled[i][0][:, 0, 0, 0] for i in range(len(shuffled))])
        assert len(seen) == 40
        orders.append(tuple(shuffled._order))
        assert sorted(shuffled._order) == list(range(40))
    assert orders[0] != orders[1]


def test_an_epoch_of_a_larger_pool_trains_a_new_draw_of_that_many_patches() -> None:
    """``epoch_samples`` (``patch_draws="every_epoch"``): every epoch holds that many distinct centres
    of the pool, a new draw each time, so the epochs together see more than one epoch's patches; the
    layer's share counts the whole pool (mutation caught: shuffle() permuting the whole pool, which
    makes every epoch 40 samples long)."""
    page = striped_page(120, 130)
    mask = page.masks["Layer 0"]
    pool = np.stack([np.full(40, 50), np.arange(20, 60)], axis=1).astype(np.int64)
    data = PatchDataset(page.image, mask, pool, PATCH, PATCH, 4, shuffle_rng=np.random.default_rng(0), epoch_samples=10)
    assert (data.samples, data.pool, len(data)) == (10, 40, 3)
    seen: set[int] = set()
    orders = []
    for _ in range(3):
        data.shuffle()
        order = data.order
        assert len(order) == 10 and len(set(order.tolist())) == 10 and order.max() < 40
        assert sum(len(data[i][0]) for i in range(len(data))) == 10
        orders.append(tuple(order))
        seen.update(order.tolist())
    assert len(set(orders)) == 3 and len(seen) > 10
    whole = PatchDataset(page.image, mask, pool, PATCH, PATCH, 4)
    assert data.layer_pixels() == whole.layer_pixels()
    # The estimate over a few patches spread over the pool: centres 0, 13, 26 and 39.
    spread = PatchDataset(page.image, mask, pool[[0, 13, 26, 39]], PATCH, PATCH, 4)
    assert data.layer_pixels(most=4) == spread.layer_pixels() != whole.layer_pixels()
    with pytest.raises(ValueError, match="41 samples an epoch out of 40"):
        PatchDataset(page.image, mask, pool, PATCH, PATCH, 4, epoch_samples=41)


def test_training_input_gives_the_numpy_batches_bit_for_bit() -> None:
    """What fit reads (tf.data converted in TensorFlow ops, or on JAX converted on the device) equals
    the NumPy batches, every one of the 256 pixel values included, and follows the order drawn
    before each iteration."""
    page = striped_page(120, 130)
    page.image[:16, :16] = np.arange(256, dtype=np.uint8).reshape(16, 16)[..., None]  # every value
    mask = page.masks["Layer 0"]
    many = np.stack([np.repeat([20, 40, 60], 9)[:25], np.tile(np.arange(20, 29), 3)[:25]], axis=1).astype(np.int64)
    many[0] = (PATCH // 2, PATCH // 2)  # a patch holding the 256 values
    for multiple_of, weigh_for in ((1, "loss"), (4, "loss"), (4, "accuracy")):
        data = PatchDataset(
            page.image, mask, many, PATCH, PATCH, 8, shuffle_rng=np.random.default_rng(1),
            multiple_of=multiple_of, weigh_for=weigh_for,  # type: ignore[arg-type]
        )  # fmt: skip
        pipeline = training_input(data)
        assert batch_count(pipeline) == len(data) == 4
        for _ in range(2):  # a new order each time, read when the iteration starts
            data.shuffle()
            got = fit_batches(pipeline)
            want = [data[i] for i in range(len(data))]
            assert len(got) == len(want)
            for got_batch, want_batch in zip(got, want, strict=True):
                assert len(got_batch) == len(want_batch) == (2 if multiple_of == 1 else 3)
                for g, w in zip(got_batch, want_batch, strict=True):
                    assert g.dtype == w.dtype and g.shape == w.shape
                    np.testing.assert_array_equal(g, w)
    x_all = fit_batches(training_input(PatchDataset(page.image, mask, many[:1], PATCH, PATCH, 1)))[0][0]
    assert set(np.unique(x_all)) == set(INPUT_LOOKUP)  # all 256 values went through the backend's conversion


def test_training_input_of_large_patches_gives_the_numpy_batches() -> None:
    """Batches of over 2 MB of patches are cut one at a time (no blocks): the same batches."""
    rng = np.random.default_rng(3)
    image = rng.integers(0, 256, (300, 320, 3), dtype=np.uint8)
    mask = rng.random((300, 320)) < 0.4
    centres = np.stack([rng.integers(128, 171, 100), rng.integers(128, 191, 100)], axis=1)
    for multiple_of in (1, 16):
        data = PatchDataset(image, mask, centres, 128, 128, 48, shuffle_rng=np.random.default_rng(1),
                            multiple_of=multiple_of)  # fmt: skip
        data.shuffle()
        got = fit_batches(training_input(data))
        assert [len(g[0]) for g in got] == [48, 48, 16 if multiple_of == 16 else 4]
        for got_batch, want_batch in zip(got, (data[i] for i in range(len(data))), strict=True):
            for g, w in zip(got_batch, want_batch, strict=True):
                assert g.dtype == w.dtype
                np.testing.assert_array_equal(g, w)


# --------------------------------------------------------------------------- input errors


def test_load_page_converts_and_restricts(tmp_path: Path) -> None:
    grey = np.arange(20 * 30, dtype=np.uint32).reshape(20, 30) % 256
    Image.fromarray(grey.astype(np.uint8), "L").save(tmp_path / "grey.png")
    alpha = np.zeros((20, 30), np.uint8)
    alpha[5:10] = 255
    page = load_page(tmp_path / "grey.png", {"Neumes": write_rgba(tmp_path / "n.png", alpha)}, None)
    assert page.image.dtype == np.uint8 and page.image.shape == (20, 30, 3)
    assert (page.image[..., 0] == grey).all() and (page.image[..., 2] == grey).all()
    assert page.masks["Neumes"].dtype == bool and page.masks["Neumes"].sum() == 5 * 30

    rgba = np.zeros((20, 30, 4), np.uint8)
    rgba[..., 0], rgba[..., 3] = 10, 0  # a transparent RGBA image: alpha dropped, not composited
    Image.fromarray(rgba, "RGBA").save(tmp_path / "rgba.png")
    Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(tmp_path / "page.jpg")
    assert (load_page(tmp_path / "rgba.png", {}, None).image[..., 0] == 10).all()
    assert load_page(tmp_path / "page.jpg", {}, None).image.shape == (20, 30, 3)


def test_load_page_errors(tmp_path: Path) -> None:
    Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(tmp_path / "page.png")
    full = np.full((20, 30), 255, np.uint8)
    good = write_rgba(tmp_path / "good.png", full)
    wrong_size = write_rgba(tmp_path / "wrong.png", np.full((21, 30), 255, np.uint8))
    (tmp_path / "junk.png").write_bytes(b"this is not a PNG at all")
    Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(tmp_path / "opaque_rgb.png")

    with pytest.raises(TrainingInputError, match=r"'Staff lines'.*30x21.*30x20"):
        load_page(tmp_path / "page.png", {"Background": good, "Staff lines": wrong_size}, None)
    with pytest.raises(TrainingInputError, match="selected regions"):
        load_page(tmp_path / "page.png", {"Background": good}, wrong_size)
    with pytest.raises(TrainingInputError, match=r"the image \(junk.png\) is not a readable image"):
        load_page(tmp_path / "junk.png", {"Background": good}, None)
    with pytest.raises(TrainingInputError, match=r"'Neumes'.*not a readable image"):
        load_page(tmp_path / "page.png", {"Neumes": tmp_path / "junk.png"}, None)
    with pytest.raises(TrainingInputError, match=r"'Neumes'.*no alpha channel"):
        load_page(tmp_path / "page.png", {"Neumes": tmp_path / "opaque_rgb.png"}, None)
    with pytest.raises(FileNotFoundError):
        load_page(tmp_path / "missing.png", {}, None)


def test_train_page_input_errors(tmp_path: Path) -> None:
    page = striped_page(120, 120)
    with pytest.raises(TrainingInputError, match=r"patch \(32x256 pixels\) is larger than the page \(120x120\)"):
        train_page(page, dataclasses.replace(TINY, patch_height=256), tmp_path)
    with pytest.raises(TrainingInputError, match="too small"):
        train_page(striped_page(64, 80), TINY, tmp_path)  # 32 px patches need a 66 x 66 page
    empty = Page(page.image, {"Background": page.masks["Background"], "Neumes": np.zeros((120, 120), bool)})
    with pytest.raises(TrainingInputError, match="layer 'Neumes' has no pixels"):
        train_page(empty, TINY, tmp_path)
    border = np.zeros((120, 120), bool)
    border[:3] = True  # only outside the margins: nothing can be sampled
    with pytest.raises(TrainingInputError, match="only 0 patches could be sampled for layer 'Edge'"):
        train_page(Page(page.image, {"Background": ~border, "Edge": border}), TINY, tmp_path)
    with pytest.raises(TrainingInputError, match="layer 'Odd'"):
        train_page(Page(page.image, {"Odd": np.ones((120, 121), bool)}), TINY, tmp_path)
    with pytest.raises(TrainingInputError, match="multiple of 4"):
        dataclasses.replace(TINY, patch_height=30)
    assert not list(tmp_path.iterdir())  # nothing trained, nothing written


def test_model_file_names() -> None:
    names = model_file_names(["Background", "Layer 0", "layer_0", "../../etc/passwd", "", "Neumes (é)"])
    assert names == {
        "Background": "Background.hdf5",
        "Layer 0": "Layer_0.hdf5",
        "layer_0": "layer_0_2.hdf5",
        "../../etc/passwd": "etc_passwd.hdf5",
        "": "layer.hdf5",
        "Neumes (é)": "Neumes.hdf5",
    }


# --------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], list[dict[str, Any]]]:
    epochs: list[dict[str, Any]] = []
    out = tmp_path_factory.mktemp("models")
    return train_page(striped_page(), TINY, out, on_epoch=epochs.append), epochs


@pytest.mark.training
def test_tiny_training_writes_loadable_models(trained: tuple[dict[str, Path], list[dict[str, Any]]]) -> None:
    paths, _ = trained
    assert list(paths) == ["Background", "Layer 0"]
    assert [p.name for p in paths.values()] == ["Background.hdf5", "Layer_0.hdf5"]
    assert sorted(p.name for p in next(iter(paths.values())).parent.iterdir()) == ["Background.hdf5", "Layer_0.hdf5"]
    page = striped_page()
    patch = page.image[100 : 100 + PATCH, 50 : 50 + PATCH]
    x = ((255.0 - patch[np.newaxis, ..., ::-1]) / 255.0).astype(np.float32)
    for path in paths.values():
        model = keras.models.load_model(path)
        assert model.count_params() == 1_429_733
        prediction = model.predict(x, verbose=0)
        assert prediction.shape == (1, PATCH, PATCH, 1)
        assert np.all((prediction >= 0) & (prediction <= 1))
        # Compiled as the original trainer compiled it; no optimizer state by default.
        with h5py.File(path, "r") as f:
            assert "optimizer_weights" not in f
            training = json.loads(f.attrs["training_config"])
            assert (training["loss"], training["metrics"]) == ("binary_crossentropy", ["accuracy"])
            assert training["optimizer_config"]["class_name"] == "Adam"
        assert path.stat().st_size < 6_000_000


@pytest.mark.training
def test_on_epoch_once_per_epoch_per_label(trained: tuple[dict[str, Path], list[dict[str, Any]]]) -> None:
    _, epochs = trained
    assert [(e["label"], e["epoch"]) for e in epochs] == [
        ("Background", 1), ("Background", 2), ("Layer 0", 1), ("Layer 0", 2),
    ]  # fmt: skip
    for record in epochs:
        assert set(record) == set(EPOCH_KEYS)
        for key in EPOCH_KEYS[2:]:
            assert isinstance(record[key], float) and math.isfinite(record[key]), key
        assert 0 <= record["val_accuracy"] <= 1 and record["seconds"] > 0 and record["samples_per_second"] > 0


class Recorder(keras.callbacks.Callback):  # type: ignore[misc]
    """Keeps every epoch's weights and Adam state; wrecks the model before ``sabotage_epoch``."""

    def __init__(self, sabotage_epoch: int) -> None:
        super().__init__()
        self.sabotage_epoch = sabotage_epoch
        self.weights: list[list[np.ndarray]] = []
        self.optimizer: list[list[np.ndarray]] = []

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if epoch + 1 == self.sabotage_epoch:  # predict "not the layer" everywhere: val_accuracy collapses
            wrecked = [np.zeros_like(w) for w in self.model.get_weights()]
            wrecked[-1][:] = -30.0
            self.model.set_weights(wrecked)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.weights.append([np.array(w) for w in self.model.get_weights()])
        self.optimizer.append([np.array(keras.ops.convert_to_numpy(v)) for v in self.model.optimizer.variables])
        self.optimizer_paths = [v.path for v in self.model.optimizer.variables]
        self.trainable_paths = [v.path for v in self.model.trainable_variables]

    def keras2_adam(self, epoch: int) -> dict[str, np.ndarray]:
        """Adam's state after ``epoch`` (0-based) under its Keras 2 names, matched by variable path."""
        # Keras 3 names them "<optimizer>/iteration", "<optimizer>/conv1_1_kernel_momentum", ...
        by_path = {p.split("/", 1)[1]: v for p, v in zip(self.optimizer_paths, self.optimizer[epoch], strict=True)}
        state = {"Adam/iter:0": by_path["iteration"]}
        for moment, suffix in (("m", "momentum"), ("v", "velocity")):
            for path in self.trainable_paths:
                state[f"Adam/{path}/{moment}:0"] = by_path[f"{path.replace('/', '_')}_{suffix}"]
        return state


@pytest.mark.training
def test_saved_model_is_the_best_epoch(tmp_path: Path) -> None:
    page = striped_page()
    settings = dataclasses.replace(TINY, epochs=3, include_optimizer=True)
    centres = sample_centres(page.masks, PATCH, PATCH, 80, np.random.default_rng(1))["Background"]
    recorder = Recorder(sabotage_epoch=3)
    result = train_label(
        page, "Background", centres, settings, shuffle_rng=np.random.default_rng(2), init_seed=3, callbacks=[recorder]
    )
    history = result.history["val_accuracy"]
    assert result.epochs_run == 3 and len(recorder.weights) == 3
    best = int(np.argmax(history))  # first maximum, as ModelCheckpoint keeps it
    assert best < 2, history  # the wrecked last epoch is worse
    assert result.best_epoch == best + 1 and result.best_val_accuracy == pytest.approx(history[best])
    assert result.train_samples + result.validation_samples == len(centres)
    for ours, theirs in zip(result.weights, recorder.weights[best], strict=True):
        np.testing.assert_array_equal(ours, theirs)

    # Default: no optimizer; the file holds exactly the best epoch's weights.
    plain = save_model(result, tmp_path / "plain.hdf5", dataclasses.replace(settings, include_optimizer=False))
    loaded = keras.models.load_model(plain)
    for ours, theirs in zip(loaded.get_weights(), recorder.weights[best], strict=True):
        np.testing.assert_array_equal(ours, theirs)
    reference = build_sae(PATCH, PATCH)
    reference.set_weights(recorder.weights[best])
    x, _ = PatchDataset(page.image, page.masks["Background"], centres[-8:], PATCH, PATCH, 8)[0]
    np.testing.assert_allclose(loaded.predict(x, verbose=0), reference.predict(x, verbose=0), atol=1e-6)
    last = build_sae(PATCH, PATCH)
    last.set_weights(recorder.weights[-1])
    assert not np.allclose(loaded.predict(x, verbose=0), last.predict(x, verbose=0), atol=1e-3)

    # include_optimizer=True: Adam's state of the best epoch is in the file, and it loads compiled.
    # Stored in Keras 2's order (iterations, every first moment, every second moment), under the
    # names Keras 2 gives them: matched here by the trained variables' paths, not by position.
    full = save_model(result, tmp_path / "full.hdf5", settings)
    with h5py.File(full, "r") as f:
        group = f["optimizer_weights"]
        names = [n.decode() if isinstance(n, bytes) else n for n in group.attrs["weight_names"]]
        stored = {name: np.asarray(group[name]) for name in names}
    expected = recorder.keras2_adam(best)
    assert names == list(expected)  # iter, m of every weight, v of every weight
    assert names[1].endswith("/m:0") and names[-1].endswith("/v:0")
    for name, value in expected.items():
        np.testing.assert_array_equal(stored[name], value)
    assert int(stored["Adam/iter:0"]) == math.ceil(result.train_samples / settings.batch_size) * (best + 1)
    assert full.stat().st_size > 2.5 * plain.stat().st_size
    assert keras.models.load_model(full).optimizer is not None


@pytest.mark.training
def test_early_stopping_when_val_accuracy_cannot_improve(tmp_path: Path) -> None:
    # Blank paper is all zeros after (255 - v) / 255, so only the output bias learns: after one
    # epoch it is positive, every pixel is predicted as the layer (val_accuracy 1.0), and
    # nothing can beat that. Patience 1 stops at epoch 2 of 10.
    blank = Page(np.full((200, 200, 3), 255, np.uint8), {"Everything": np.ones((200, 200), bool)})
    settings = dataclasses.replace(TINY, epochs=10, patience=1, max_samples_per_label=50)
    epochs: list[dict[str, Any]] = []
    paths = train_page(blank, settings, tmp_path, on_epoch=epochs.append)
    assert [e["val_accuracy"] for e in epochs] == [1.0, 1.0]
    assert paths["Everything"].exists()


def test_label_result_is_plain_data() -> None:
    fields = {f.name for f in dataclasses.fields(LabelResult)}
    assert {"weights", "best_epoch", "best_val_accuracy", "history"} <= fields
