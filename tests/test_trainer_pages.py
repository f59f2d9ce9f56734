"""Multi-page training (``train_pages``) and starting models: samples drawn across the pages,
validation held out on every page, bounded memory, checkpoints across pages, and starting
models of ours and of Paco's trainer (run from its own source, in Rodan's TensorFlow 2.15.1)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import tarfile
import textwrap
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("keras")  # the worker extra is not installed on login nodes

import h5py

from consumers import by_name
from tests.pages import striped_page
from tests.support.training import RecordingStore
from worker.trainer import Page, TrainingInputError, TrainingInterrupted, TrainSettings
from worker.trainer.dataset import PatchDataset, network_order, split_validation
from worker.trainer.sampling import (
    SAMPLING_FACTOR,
    centre_ranges,
    run_centres,
    run_pages_centres,
    sample_centres,
    sample_pages_centres,
)
from worker.trainer.train import draw_factor

pytestmark = pytest.mark.filterwarnings(  # TensorFlow's variables and NumPy 2, inside Keras
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)

REPO = Path(__file__).resolve().parent.parent
#: Paco_classifier's source (MIT), run here as Rodan 3.x runs it: shared/ beside the checkout.
PACO_ARCHIVE = Path(
    os.environ.get("HPC_PACO_ARCHIVE") or REPO.parent / "shared" / "rodan" / "paco-classifier-64cb949.tar.gz"
)
#: 2 pages, 32x32 patches, 60 samples per label at most, batches of 8, 2 epochs, no fresh starts (the
#: first-epoch guard is tests/test_fresh_start.py's subject; here it would train each first epoch up to
#: three times).
SETTINGS = TrainSettings(
    epochs=2,
    max_samples_per_label=60,
    patch_height=32,
    patch_width=32,
    batch_size=8,
    patience=5,
    seed=7,
    max_fresh_starts=0,
)
LABELS = ["Background", "Layer 0"]


def second_page() -> Page:
    """Vertical ink (Layer 0) on a bluish page of another size (320x260): more ink than :func:`striped_page`'s."""
    height, width = 260, 320
    ink = np.zeros((height, width), dtype=bool)
    for col in range(10, width, 12):
        ink[:, col : col + 6] = True
    image = np.empty((height, width, 3), dtype=np.uint8)
    image[:] = (210, 230, 240)
    image[ink] = (10, 30, 60)
    return Page(image, {"Background": ~ink, "Layer 0": ink}, name="vertical")


def pages() -> list[Page]:
    return [striped_page(), second_page()]


def random_masks(rng: np.random.Generator, shape: tuple[int, int], density: dict[str, float]) -> dict[str, np.ndarray]:
    return {label: rng.random(shape) < d for label, d in density.items()}


# --------------------------------------------------------------------------- sampling


def test_one_page_is_sampled_as_by_the_one_page_sampler() -> None:
    """With one page the multi-page sampler draws exactly the one-page sampler's centres."""
    page = striped_page()
    for seed in (0, 7, 123):
        one = sample_centres(page.masks, 32, 32, 60, np.random.default_rng(seed))
        many = sample_pages_centres([page.masks], 32, 32, 60, np.random.default_rng(seed))
        assert list(many) == list(one)
        for label in one:
            assert many[label].shape == (len(one[label]), 3) and many[label].dtype == np.int64
            assert (many[label][:, 0] == 0).all()
            np.testing.assert_array_equal(many[label][:, 1:], one[label])
        run_one, run_many = run_centres(page.masks, 32, 32, 60, seed), run_pages_centres([page.masks], 32, 32, 60, seed)
        for label in one:
            np.testing.assert_array_equal(run_many[label][:, 1:], run_one[label])


def test_the_cap_is_shared_by_the_pages_in_proportion_to_each_pages_pixels() -> None:
    """The mean count per page and layer over many seeds is what the documented rule gives:
    ``cap = min(fewest pixels of any layer over all pages, max)``, each candidate pixel that a
    layer covers taken with probability ``(1 / factor) * min(1, factor * cap / total pixels)``."""
    rng = np.random.default_rng(1)
    shapes = [(60, 80), (90, 70), (50, 50)]
    density = [{"A": 0.5, "B": 0.05}, {"A": 0.2, "B": 0.15}, {"A": 0.9, "B": 0.0}]  # page 3 has no B
    masks = [random_masks(rng, shape, d) for shape, d in zip(shapes, density, strict=True)]
    factor, patch, max_samples = 4, 4, 150
    totals = {label: sum(int(m[label].sum()) for m in masks) for label in ("A", "B")}
    cap = min(min(totals.values()), max_samples)
    expected = np.zeros((3, 2))
    for page, page_masks in enumerate(masks):
        rows, cols = centre_ranges(shapes[page][0], shapes[page][1], patch, patch)
        for j, label in enumerate(("A", "B")):
            covered = int(page_masks[label][rows.start : rows.stop, cols.start : cols.stop].sum())
            expected[page, j] = covered / factor * min(1.0, factor * cap / totals[label])
    runs = 400
    counts = np.zeros((runs, 3, 2))
    for seed in range(runs):
        found = sample_pages_centres(masks, patch, patch, max_samples, np.random.default_rng(seed), factor)
        for j, label in enumerate(("A", "B")):
            counts[seed, :, j] = np.bincount(found[label][:, 0], minlength=3)
    mean = counts.mean(axis=0)
    # Each count is a sum of independent Bernoulli trials: its variance is at most its mean.
    tolerance = 5 * np.sqrt(np.maximum(expected, 1) / runs)
    assert (np.abs(mean - expected) < tolerance).all(), (mean, expected)
    assert (counts[:, 2, 1] == 0).all()  # no B on page 3, none sampled there
    # About cap samples per label in all (the window leaves out a border's share of the pixels).
    assert 0.6 * cap < mean[:, 0].sum() <= cap * 1.05 and 0.6 * cap < mean[:, 1].sum() <= cap * 1.05


def test_pages_centres_are_on_their_pages_layer_pixels_in_page_then_row_major_order() -> None:
    rng = np.random.default_rng(2)
    masks = [random_masks(rng, shape, {"A": 0.3, "B": 0.6}) for shape in ((40, 50), (64, 48), (33, 70))]
    first = sample_pages_centres(masks, 6, 8, 500, np.random.default_rng(9), 2)
    again = sample_pages_centres(masks, 6, 8, 500, np.random.default_rng(9), 2)
    other = sample_pages_centres(masks, 6, 8, 500, np.random.default_rng(10), 2)
    for label in ("A", "B"):
        np.testing.assert_array_equal(first[label], again[label])
        assert not np.array_equal(first[label], other[label])
        centres = first[label]
        assert set(np.unique(centres[:, 0])) == {0, 1, 2}
        key = centres[:, 0] * 10_000 + centres[:, 1] * 100 + centres[:, 2]
        assert (np.diff(key) > 0).all()  # page by page, row-major within a page, no repeats
        for page, page_masks in enumerate(masks):
            on = centres[centres[:, 0] == page]
            height, width = page_masks[label].shape
            rows, cols = centre_ranges(height, width, 6, 8)
            assert page_masks[label][on[:, 1], on[:, 2]].all()
            assert (on[:, 1] >= rows.start).all() and (on[:, 1] < rows.stop).all()
            assert (on[:, 2] >= cols.start).all() and (on[:, 2] < cols.stop).all()
    with pytest.raises(ValueError, match=r"page 2 has the layers \['B', 'A'\], page 1 \['A', 'B'\]"):
        sample_pages_centres([masks[0], {"B": masks[1]["B"], "A": masks[1]["A"]}], 6, 8, 500, np.random.default_rng(0))
    with pytest.raises(ValueError, match="at least one pixel on some page"):
        sample_pages_centres(
            [{"A": m["A"], "B": np.zeros_like(m["B"])} for m in masks], 6, 8, 5, np.random.default_rng(0)
        )


def test_validation_holds_out_the_last_part_of_every_page() -> None:
    centres = np.array([[0, r, r] for r in range(10)] + [[1, r, r] for r in range(5)] + [[2, 7, 7]], dtype=np.int64)
    train, validation = split_validation(centres, 0.2)
    np.testing.assert_array_equal(train, np.concatenate([centres[:8], centres[10:14]]))
    np.testing.assert_array_equal(validation, np.concatenate([centres[8:10], centres[14:16]]))
    plain = np.arange(20, dtype=np.int64).reshape(10, 2)  # (row, col): one page, as always
    assert [len(part) for part in split_validation(plain, 0.2)] == [8, 2]


# --------------------------------------------------------------------------- batches and memory


@pytest.mark.parametrize("multiple_of", [1, 2])
def test_every_patch_is_cut_from_its_own_page(multiple_of: int) -> None:
    rng = np.random.default_rng(4)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((40, 50), (30, 61), (45, 45))]
    masks = [rng.random(image.shape[:2]) < 0.5 for image in images]
    ph, pw = 8, 12
    centres = np.array(
        [
            [
                p,
                rng.integers(ph // 2, images[p].shape[0] - ph // 2),
                rng.integers(pw // 2, images[p].shape[1] - pw // 2),
            ]
            for p in rng.integers(0, 3, 37)
        ],
        dtype=np.int64,
    )
    data = PatchDataset(images, masks, centres, ph, pw, 6, multiple_of=multiple_of)
    chosen = rng.permutation(len(centres))[:11]
    patches, cut_masks, *weights = data.raw_batch(chosen)
    expected_size = 11 if multiple_of == 1 else 12
    assert patches.shape == (expected_size, ph, pw, 3) and cut_masks.shape == (expected_size, ph, pw)
    for i, index in enumerate(np.resize(chosen, expected_size)):
        page, row, col = centres[index]
        top, left = row - ph // 2, col - pw // 2
        np.testing.assert_array_equal(patches[i], images[page][top : top + ph, left : left + pw, ::-1])
        np.testing.assert_array_equal(cut_masks[i], masks[page][top : top + ph, left : left + pw])
    if multiple_of == 2:
        np.testing.assert_array_equal(weights[0].ravel(), np.array([12 / 11] * 11 + [0.0], dtype=np.float32))
    # Whole epochs: the blocks hold every sample once, in the dataset's order.
    blocks = list(data.raw_blocks(3))
    stacked = np.concatenate([block[0].reshape(-1, ph, pw, 3) for block in blocks])
    assert len(stacked) >= len(centres)
    np.testing.assert_array_equal(stacked[: len(centres)], data.raw_batch(np.arange(len(centres)))[0][: len(centres)])


def test_a_multi_page_epoch_and_its_sampling_allocate_a_batch_not_a_page() -> None:
    """Pages stay uint8 and are never copied: cutting a whole epoch of batches from three pages
    allocates about one block of patches at a time, and sampling them less than a band of rows."""
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (1500, 1200, 3), dtype=np.uint8) for _ in range(3)]
    bgr = [network_order(image) for image in images]
    masks = [rng.random((1500, 1200)) < 0.3 for _ in range(3)]
    page_bytes = images[0].nbytes  # 5.4 MB
    tracemalloc.start()
    try:
        found = sample_pages_centres([{"A": m} for m in masks], 64, 64, 2000, np.random.default_rng(1))
        _, sampling_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        data = PatchDataset(images, masks, found["A"], 64, 64, 16, shuffle_rng=np.random.default_rng(2), bgr=bgr)
        data.shuffle()
        per_block = 4
        samples = 0
        for block in data.raw_blocks(per_block):
            samples += block[0].shape[0] * block[0].shape[1]
        _, epoch_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert samples == len(found["A"]) > 1000 and len(np.unique(found["A"][:, 0])) == 3
    block_bytes = per_block * 16 * 64 * 64 * 4  # uint8 patches and bool masks of one block
    assert epoch_peak < 4 * block_bytes < page_bytes, (epoch_peak, block_bytes)
    assert sampling_peak < page_bytes / 8, sampling_peak


# --------------------------------------------------------------------------- training


def train_pages_now(*args: Any, **kwargs: Any) -> dict[str, Path]:
    from worker.trainer import train_pages

    return train_pages(*args, **kwargs)


@pytest.mark.training
def test_the_pages_must_have_the_same_layers_in_the_same_order(tmp_path: Path) -> None:
    first, second = pages()
    swapped = Page(second.image, {"Layer 0": second.masks["Layer 0"], "Background": second.masks["Background"]})
    with pytest.raises(
        TrainingInputError,
        match=r"^page 2 has the layers \['Layer 0', 'Background'\], page 1 has \['Background', 'Layer 0'\]: "
        "every page must have the same layers in the same order$",
    ):
        train_pages_now([first, swapped], SETTINGS, tmp_path)
    fewer = Page(second.image, {"Background": second.masks["Background"]}, name="Sample 2")
    with pytest.raises(TrainingInputError, match=r"^page 2 \(Sample 2\) has the layers \['Background'\]"):
        train_pages_now([first, fewer], SETTINGS, tmp_path)
    small = Page(first.image[:60, :60], {k: m[:60, :60] for k, m in first.masks.items()})
    with pytest.raises(TrainingInputError, match=r"^page 3: the page \(60x60 pixels\) is too small for 32x32"):
        train_pages_now([first, second, small], SETTINGS, tmp_path)
    blank = {k: np.zeros_like(m) if k == "Layer 0" else m for k, m in first.masks.items()}
    with pytest.raises(TrainingInputError, match="layer 'Layer 0' has no pixels inside the selected regions on any"):
        train_pages_now([Page(first.image, blank), Page(first.image.copy(), dict(blank))], SETTINGS, tmp_path)
    with pytest.raises(TrainingInputError, match="no pages"):
        train_pages_now([], SETTINGS, tmp_path)
    assert not list(tmp_path.iterdir())  # nothing trained, nothing written


@pytest.mark.training
def test_two_pages_train_one_model_per_layer_on_samples_of_both(tmp_path: Path) -> None:
    events: list[dict[str, Any]] = []
    store = RecordingStore(tmp_path / "checkpoints")
    paths = train_pages_now(pages(), SETTINGS, tmp_path / "models", on_epoch=events.append, checkpoints=store)
    assert list(paths) == LABELS and all(path.is_file() for path in paths.values())
    assert [(e["label"], e["epoch"]) for e in events] == [(label, n) for label in LABELS for n in (1, 2)]
    state = store.load_latest()
    assert state is not None and [f.label for f in state.finished] == LABELS
    assert state.run["pages"][1]["width"] == 320 and len(state.run["pages"]) == 2 and "page" not in state.run
    # The sampler's walk at the run's cap: one draw's samples per label, or with patch_draws="every_epoch" one
    # per epoch (worker.trainer.train.draw_factor).
    expected = run_pages_centres([p.masks for p in pages()], 32, 32, 60 * draw_factor(SETTINGS), SETTINGS.seed)
    for label in LABELS:
        np.testing.assert_array_equal(state.centres[label], expected[label])
        train, validation = split_validation(state.centres[label], SETTINGS.validation_split)
        assert set(train[:, 0]) == set(validation[:, 0]) == {0, 1}  # both pages train and validate
    # Layer 0 (ink) has almost twice the pixels on the second page: it gets most of the samples there.
    ink = [int(p.masks["Layer 0"].sum()) for p in pages()]
    per_page = np.bincount(state.centres["Layer 0"][:, 0], minlength=2)
    assert ink[1] > 1.8 * ink[0] and per_page[1] > per_page[0]
    with h5py.File(paths["Layer 0"], "r") as f:
        assert json.loads(f.attrs["model_config"])["config"]["layers"][0]["config"]["batch_input_shape"] == [
            None, None, None, 3,
        ]  # fmt: skip


class StopAfter:
    """``stop_requested`` that says yes at its ``polls``-th poll (after batch ``polls - 1`` of the first epoch)."""

    def __init__(self, polls: int) -> None:
        self.polls, self.count = polls, 0

    def __call__(self) -> bool:
        self.count += 1
        return self.count >= self.polls


def assert_same_weights(ours: dict[str, list[np.ndarray]], theirs: dict[str, list[np.ndarray]]) -> None:
    assert list(ours) == list(theirs)
    for label in ours:
        for a, b in zip(ours[label], theirs[label], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=label)


@pytest.mark.training
def test_a_two_page_run_resumed_part_way_through_an_epoch_ends_bit_identical(tmp_path: Path) -> None:
    """One layer (the one-page tests cover resuming at any layer), 2 epochs of about 4 batches."""
    settings = SETTINGS

    def ink_pages() -> list[Page]:
        return [Page(p.image, {"Layer 0": p.masks["Layer 0"]}, name=p.name) for p in pages()]

    reference = RecordingStore(tmp_path / "reference")
    expected: list[dict[str, Any]] = []
    train_pages_now(ink_pages(), settings, tmp_path / "a", on_epoch=expected.append, checkpoints=reference)
    assert [(e["label"], e["epoch"]) for e in expected] == [("Layer 0", 1), ("Layer 0", 2)]

    first = RecordingStore(tmp_path / "checkpoints")
    events: list[dict[str, Any]] = []
    with pytest.raises(TrainingInterrupted, match=r"^layer 'Layer 0' epoch 1 batch 2 of [3-9]$"):
        train_pages_now(ink_pages(), settings, tmp_path / "b", on_epoch=events.append, checkpoints=first,
                        stop_requested=StopAfter(3))  # fmt: skip
    assert first.saved == [("Layer 0", 0, 16)] and events == []
    state = first.load_latest()
    assert state is not None and state.current is not None and state.current.permutation is not None
    assert set(state.centres["Layer 0"][:, 0]) == {0, 1}  # the samples of both pages are in the checkpoint

    # The pages in another order, or one page changed, are another run: refused.
    for other, difference in (
        (ink_pages()[::-1], r"page 1 is 320x260 pixels, the checkpoint's 300x300"),
        ([ink_pages()[0]] * 2, "page 2 is 300x300 pixels, the checkpoint's 320x260"),
        (ink_pages()[:1], r"the run has 1 page\(s\), the checkpoint's 2"),
    ):
        with pytest.raises(TrainingInputError, match=difference):
            train_pages_now(other, settings, tmp_path / "c", checkpoints=RecordingStore(tmp_path / "checkpoints"))
    changed = ink_pages()
    changed[1].image[100, 100] = (1, 2, 3)
    with pytest.raises(TrainingInputError, match="page 2's image or layers differ from the checkpoint's"):
        train_pages_now(changed, settings, tmp_path / "c", checkpoints=RecordingStore(tmp_path / "checkpoints"))

    second = RecordingStore(tmp_path / "checkpoints")
    paths = train_pages_now(ink_pages(), settings, tmp_path / "c", on_epoch=events.append, checkpoints=second)
    metrics = [(e["label"], e["epoch"], e["loss"], e["accuracy"], e["val_loss"], e["val_accuracy"]) for e in events]
    assert metrics == [
        (e["label"], e["epoch"], e["loss"], e["accuracy"], e["val_loss"], e["val_accuracy"]) for e in expected
    ]
    assert_same_weights(second.final_weights, reference.final_weights)
    from worker.trainer.starting import read_starting_model  # the saved files' weights, in order

    for label, path in paths.items():
        ours, theirs = (
            read_starting_model(path, label, 32, 32),
            read_starting_model(tmp_path / "a" / path.name, "", 32, 32),
        )
        assert_same_weights({label: ours}, {label: theirs})


# --------------------------------------------------------------------------- starting models


def build_paco_model(tmp_path: Path, size: int, steps: int) -> tuple[Path, Path]:
    """A model made by Paco_classifier's own ``get_sae`` in TensorFlow 2.15.1, trained ``steps``
    steps and saved as Paco's trainer saves it (``model.save(path)``, .hdf5, Keras 2): automatic
    layer names, Adam's state inside. Returns the model and an .npz of its predictions."""
    if not PACO_ARCHIVE.is_file():
        pytest.fail(f"Paco_classifier's source is not at {PACO_ARCHIVE} (set HPC_PACO_ARCHIVE)")
    source = tmp_path / "paco"
    with tarfile.open(PACO_ARCHIVE) as archive:
        archive.extractall(source, filter="data")
    package = next(source.rglob("training_engine_sae.py")).parent
    code = f"""
        import sys, types
        import numpy as np
        import tensorflow as tf
        # The package's __init__ imports the classifier too (OpenCV); the trainer's module alone is enough.
        package = types.ModuleType("Paco_classifier")
        package.__path__ = [{str(package)!r}]
        sys.modules["Paco_classifier"] = package
        from Paco_classifier.training_engine_sae import get_sae

        tf.keras.utils.set_random_seed(3)
        model = get_sae(height={size}, width={size})
        x = np.random.default_rng(0).random((8, {size}, {size}, 3)).astype("float32")
        y = (x[..., :1] > 0.5).astype("float32")
        model.fit(x, y, batch_size=8, epochs={steps}, verbose=0)
        model.save(sys.argv[1])
        np.savez(sys.argv[2], x=x, p=model.predict(x, verbose=0), names=[l.name for l in model.layers])
    """
    model, predictions = tmp_path / "Paco model.hdf5", tmp_path / "paco-predictions.npz"
    done = subprocess.run(
        [str(by_name("tf2.15.1-py3.11").python()), "-c", textwrap.dedent(code), str(model), str(predictions)],
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return model, predictions


@pytest.mark.training
@pytest.mark.slow  # Paco's model built in TensorFlow 2.15.1, three short trainings, three consumers
@pytest.mark.heavy
def test_a_model_paco_wrote_starts_training_and_the_result_opens_in_rodans_tensorflow(tmp_path: Path) -> None:
    """Paco's automatic layer names, its Masking layer, its Adam state and its 64x64 input, read by
    layer order: the weights predict in Keras 3 what they predicted in TensorFlow 2.15.1; training
    on 32x32 patches starts from them with a fresh Adam; the result opens in Rodan's TensorFlow."""
    from consumers.verify import verify
    from worker.trainer.model import build_sae
    from worker.trainer.starting import read_starting_model

    paco, predictions = build_paco_model(tmp_path, size=64, steps=3)
    with h5py.File(paco, "r") as f:
        assert "optimizer_weights" in f and "conv2d_3" in f["model_weights"]  # as Paco's trainer writes it
    weights = read_starting_model(paco, "Paco's model", 32, 32)
    with np.load(predictions) as saved:
        assert "masking" in list(saved["names"])
        model = build_sae(None, None)
        model.set_weights(weights)
        np.testing.assert_allclose(model.predict(saved["x"], verbose=0), saved["p"], atol=1e-5)

    store = RecordingStore(tmp_path / "checkpoints")
    settings = dataclasses.replace(SETTINGS, epochs=1)
    with pytest.raises(TrainingInterrupted):
        train_pages_now(pages(), settings, tmp_path / "stopped", checkpoints=store,
                        initial_models={"Layer 0": paco}, stop_requested=StopAfter(2))  # fmt: skip
    # Interrupted after the first batch of the first layer (Background): a fresh SAE.
    state = store.load_latest()
    assert state is not None and state.current is not None and state.current.label == "Background"
    assert max(float(np.abs(a - b).max()) for a, b in zip(state.current.weights, weights, strict=True)) > 0.01
    assert len(state.run["starting_models"]["Layer 0"]) == 64  # the file's SHA-256 identifies the run

    # The whole run: Layer 0 starts from Paco's weights. Stopped after its first step, its
    # weights are one Adam step (at most about the learning rate per weight) from the file's,
    # and Adam counts one iteration: the file's state (3 steps) was not taken over.
    store = RecordingStore(tmp_path / "checkpoints-2")
    polls = StopAtLayer("Layer 0", batch=1)
    with pytest.raises(TrainingInterrupted, match="layer 'Layer 0' epoch 1 batch 1 of"):
        train_pages_now(pages(), settings, tmp_path / "stopped-2", checkpoints=store, on_epoch=polls.on_epoch,
                        initial_models={"Layer 0": paco}, stop_requested=polls)  # fmt: skip
    state = store.load_latest()
    assert state is not None and state.current is not None and state.current.label == "Layer 0"
    moved = [float(np.abs(a - b).max()) for a, b in zip(state.current.weights, weights, strict=True)]
    assert 0 < max(moved) <= 1.01e-4, moved
    assert int(state.current.optimizer_variables[0]) == 1

    paths = train_pages_now(pages(), settings, tmp_path / "models", checkpoints=store, initial_models={"Layer 0": paco})
    verdicts = verify({"Layer 0 from Paco's model": paths["Layer 0"]}, pages()[0].image, (32, 32))
    assert verdicts and all(v.ok for v in verdicts), [(v.consumer, v.error) for v in verdicts]
    assert {v.consumer for v in verdicts} >= {"tf2.5.1-py3.7", "tf2.15.1-py3.11"}


class StopAtLayer:
    """``stop_requested`` that says yes after batch ``batch`` of ``label``'s first epoch (runs of
    one epoch, where no epoch end is polled: the first poll after the previous layer's record is
    the one before ``label``, the ``k + 1``-th follows batch ``k``)."""

    def __init__(self, label: str, batch: int) -> None:
        self.label, self.batch, self.count, self.armed = label, batch, 0, False

    def on_epoch(self, event: dict[str, Any]) -> None:
        if event["label"] != self.label and not self.armed:
            self.armed = True  # the previous layer's epochs end; the next polls are this layer's

    def __call__(self) -> bool:
        if not self.armed:
            return False
        self.count += 1
        return self.count >= self.batch + 1


@pytest.mark.training
def test_our_own_model_starts_a_layer_and_a_changed_starting_model_is_another_run(tmp_path: Path) -> None:
    from worker.trainer.starting import read_starting_model

    settings = dataclasses.replace(SETTINGS, epochs=1)
    first = train_pages_now([striped_page()], settings, tmp_path / "first")
    own = read_starting_model(first["Layer 0"], "ours", 32, 32)
    store = RecordingStore(tmp_path / "checkpoints")
    polls = StopAtLayer("Layer 0", batch=1)
    with pytest.raises(TrainingInterrupted):
        train_pages_now(pages(), settings, tmp_path / "b", checkpoints=store, on_epoch=polls.on_epoch,
                        initial_models={"Layer 0": first["Layer 0"]}, stop_requested=polls)  # fmt: skip
    state = store.load_latest()
    assert state is not None and state.current is not None and state.current.label == "Layer 0"
    assert 0 < max(float(np.abs(a - b).max()) for a, b in zip(state.current.weights, own, strict=True)) <= 1.01e-4
    # Resuming with another starting model (or none) is another run.
    for models in ({"Layer 0": first["Background"]}, {}):
        with pytest.raises(TrainingInputError, match=r"the starting models of 'Layer 0' differ from the checkpoint's"):
            train_pages_now(pages(), settings, tmp_path / "c", checkpoints=RecordingStore(tmp_path / "checkpoints"),
                            initial_models=models)  # fmt: skip


def write_keras_like(path: Path, layers: list[tuple[str, list[tuple[int, ...]]]], dtype: str = "float32") -> Path:
    """An HDF5 file laid out as Keras writes models: ``model_weights/<layer>/<layer>/<weight>``."""
    with h5py.File(path, "w") as f:
        group = f.create_group("model_weights")
        group.attrs["layer_names"] = np.array([name.encode() for name, _ in layers])
        for name, shapes in layers:
            layer = group.create_group(name)
            names = [f"{name}/{kind}:0" for kind in ("kernel", "bias", "extra")[: len(shapes)]]
            layer.attrs["weight_names"] = np.array([n.encode() for n in names]) if names else np.array([], "f8")
            for weight_name, shape in zip(names, shapes, strict=True):
                layer.create_dataset(weight_name, data=np.zeros(shape, dtype=dtype))
    return path


def sae_layout(patch: int = 32) -> list[tuple[str, list[tuple[int, ...]]]]:
    from worker.trainer.starting import expected_shapes

    return [("input_1", []), *((f"conv2d_{i}", shapes) for i, shapes in enumerate(expected_shapes(patch, patch)))]


@pytest.mark.training
def test_a_starting_model_of_another_shape_or_kind_is_refused_naming_what_differs(tmp_path: Path) -> None:
    from worker.trainer.starting import MAX_MODEL_BYTES, read_starting_model

    def refused(path: Path, match: str, label: str = "Layer 0") -> None:
        with pytest.raises(TrainingInputError, match=match):
            train_pages_now(pages(), SETTINGS, tmp_path / "out", initial_models={label: path})

    layout = sae_layout()
    assert len(read_starting_model(write_keras_like(tmp_path / "ok.hdf5", layout), "ok", 32, 32)) == 28
    narrow = [*layout]
    narrow[4] = ("conv2d_3", [(3, 3, 64, 32), (32,)])
    refused(
        write_keras_like(tmp_path / "narrow.hdf5", narrow),
        r"^the starting model of layer 'Layer 0' \(narrow.hdf5\) is not the SAE this trainer trains: its layer 4 "
        r"with weights \('conv2d_3'\) has weights of shapes \(3, 3, 64, 32\), \(32,\), the SAE's "
        r"\(3, 3, 64, 64\), \(64,\)$",
    )
    refused(write_keras_like(tmp_path / "short.hdf5", layout[:-1]), r"has 13 layers with weights, the SAE 14")
    refused(write_keras_like(tmp_path / "ints.hdf5", layout, "int32"), r"weight .* is int32, not a floating-point type")
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f["x"] = np.zeros(3)
    refused(tmp_path / "data.h5", r"\(data.h5\) is an HDF5 file but not a Keras model")
    (tmp_path / "page.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    refused(tmp_path / "page.png", r"\(page.png\) is not a Keras HDF5 model file \(it starts with 89504e47")
    big = tmp_path / "big.hdf5"
    with big.open("wb") as handle:
        handle.write(b"\x89HDF\r\n\x1a\n")
        handle.truncate(MAX_MODEL_BYTES + 1)  # sparse: nothing of it is read
    refused(big, rf"\(big.hdf5\) is {MAX_MODEL_BYTES + 1} bytes, more than the 256 MiB")
    refused(tmp_path / "missing.hdf5", r"\(missing.hdf5\) cannot be read as a starting model: the file does not exist")
    refused(
        tmp_path / "ok.hdf5", r"starting models were given for 'Model 7', which the pages have no layer of", "Model 7"
    )
    assert not (tmp_path / "out").exists()  # refused before anything trained
    assert math.isclose(SAMPLING_FACTOR, 100)
