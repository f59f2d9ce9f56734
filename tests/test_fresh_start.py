"""A layer's model that cannot move is found, started again, and, if it still learned nothing, reported.

The fault (issue #26): in ``benchmarks/bench_paco.py``'s accuracy run of seed 3 (two 1024 x 1024
crops of the real Einsiedeln masks, 32 x 32 patches, batches of 16, 160 samples per label), the
background model marked every pixel as background at every epoch (best val_accuracy 0.8294, the
validation's background share, at 3 epochs and at 10). Its loss fell all the same: the two ReLU units
that feed the output were zero on the ink, so the ink's probability was the output bias alone, about
0.5, which Adam at 1e-4 moves by 1e-4 a step. :class:`~worker.trainer.callbacks.FirstEpochGuard`
rejects such a first epoch and the layer starts again from new weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from worker.trainer.callbacks import ALL_LAYER, ALL_NON_LAYER, BestEpoch, one_class

pytestmark = pytest.mark.filterwarnings(  # TensorFlow's variables and NumPy 2, inside Keras
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)


# --------------------------------------------------------------------------- what "one class" is


def test_one_class_is_exactly_the_share_of_one_class_and_nothing_a_pixel_away() -> None:
    pixels, layer = 32 * 32 * 32, 5_600
    all_background = np.float32((pixels - layer) / pixels)  # as Keras' float32 mean reports it
    all_layer = np.float32(layer / pixels)
    assert one_class(float(all_background), layer, pixels) == ALL_NON_LAYER
    assert one_class(float(all_layer), layer, pixels) == ALL_LAYER
    # One pixel right or wrong is a model that tells pixels apart (mutation: a tolerance of a percent).
    assert one_class((pixels - layer + 1) / pixels, layer, pixels) is None
    assert one_class((pixels - layer - 1) / pixels, layer, pixels) is None
    assert one_class(0.95, layer, pixels) is None
    assert one_class(float("nan"), layer, pixels) is None


class _Weights:
    """What BestEpoch reads of a model: its weights (one number: the epoch that made them)."""

    def __init__(self) -> None:
        self.epoch = 0

    def get_weights(self) -> list[np.ndarray]:
        return [np.array(self.epoch)]


def _kept(values: list[float], trivial_values: set[float]) -> tuple[int, float]:
    best = BestEpoch(keep_optimizer=False, trivial=lambda v: "trivial" if v in trivial_values else None)
    model = _Weights()
    best.set_model(model)
    for epoch, value in enumerate(values):
        model.epoch = epoch + 1
        best.on_epoch_end(epoch, {"val_accuracy": value})
    assert best.weights is not None
    assert int(best.weights[0]) == best.best_epoch  # the weights kept are the best epoch's
    return best.best_epoch, best.best


def test_the_best_epoch_is_one_that_tells_pixels_apart_even_at_a_lower_accuracy() -> None:
    # Staff lines (13 % of the pixels): "no staff line anywhere" scores 0.87; a model that has
    # begun to find them scores 0.86 and then 0.88. ModelCheckpoint would keep epoch 1 for ever
    # until 0.88; ours keeps epoch 2 at once (mutation: BestEpoch without ``trivial``).
    assert _kept([0.87, 0.86], {0.87}) == (2, 0.86)
    assert _kept([0.87, 0.86, 0.88], {0.87}) == (3, 0.88)
    # A later one-class epoch never replaces a model that tells pixels apart, whatever its accuracy.
    assert _kept([0.86, 0.87], {0.87}) == (1, 0.86)
    # Only one-class epochs: the best of them is kept (it is reported as having learned nothing).
    assert _kept([0.80, 0.87], {0.80, 0.87}) == (2, 0.87)
    # Without one-class epochs it is ModelCheckpoint: strictly greater, ties keep the earlier.
    assert _kept([0.90, 0.95, 0.95, 0.93], set()) == (2, 0.95)


# --------------------------------------------------------------------------- the frozen model, for real

#: ``bench_paco.py``'s accuracy setting (the benchmark's defaults) and the seed whose background froze.
FROZEN_SEED = 3


def _bench_pages(tmp_path: Path) -> list[Any]:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_paco

    from worker.sample_zips import read_samples

    zips, _ = bench_paco.prepare(tmp_path / "crops", bench_paco.CROP_PAIRS["32r"])
    samples = read_samples({f"Sample {i}": z for i, z in enumerate(zips, 1)}, {}, tmp_path / "unpack")
    return [sample.page for sample in samples]


def _train_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_starts: int, **options: Any
) -> tuple[Any, list[dict[str, Any]]]:
    """The background layer of seed 3 exactly as train_pages trains it (its seeds and samples), 2 epochs."""
    from worker.trainer import TrainSettings
    from worker.trainer import train as train_module

    pages = _bench_pages(tmp_path)
    settings = TrainSettings(
        epochs=2, max_samples_per_label=160, patch_height=32, patch_width=32, batch_size=16, patience=15,
        seed=FROZEN_SEED, mixed_precision="off", **options,
    )  # fmt: skip
    monkeypatch.setattr(train_module, "MAX_FRESH_STARTS", fresh_starts)
    centres = train_module._sample(pages, settings, FROZEN_SEED)
    labels = list(pages[0].masks)
    shuffle_seed, init_seed = train_module.layer_seeds(FROZEN_SEED, len(labels))[0]
    events: list[dict[str, Any]] = []
    result = train_module.train_label(
        pages,
        labels[0],
        centres[labels[0]],
        settings,
        shuffle_rng=np.random.default_rng(shuffle_seed),
        init_seed=init_seed,
        on_layer=events.append,
    )
    return result, events


#: The frozen model's best val_accuracy: the validation's background share, at every epoch.
FROZEN_VAL_ACCURACY = 0.8294


@pytest.mark.training
def test_the_frozen_background_of_seed_3_is_reproduced_as_the_trainer_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer as it was (Keras' zero output bias, no fresh start): every epoch marks every pixel
    as background, with the benchmark's figure."""
    result, events = _train_background(tmp_path, monkeypatch, fresh_starts=0, output_bias="zero")
    assert events == []
    assert result.one_class == ALL_LAYER  # the background layer marks every pixel as background
    assert result.history["val_accuracy"] == pytest.approx([FROZEN_VAL_ACCURACY] * 2, abs=5e-5)


@pytest.mark.training
def test_the_frozen_background_of_seed_3_learns_with_the_trainers_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same layer, seeds and samples with today's defaults (the output bias at the layer's share,
    fresh starts on): after 2 epochs its model tells the ink from the parchment, its val_accuracy
    above the frozen 0.8294 by far more than the 0.5 / 32 768 of a pixel (mutation caught: the
    output bias left at zero with fresh starts off, which is the test above)."""
    result, _ = _train_background(tmp_path, monkeypatch, fresh_starts=2)
    assert result.one_class is None
    assert result.best_val_accuracy > FROZEN_VAL_ACCURACY + 0.03


@pytest.mark.training
def test_a_first_epoch_no_better_than_the_constant_answer_starts_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard alone (zero output bias, as the frozen run): the first epoch's val_loss is above the
    0.6931 of answering 0.5 everywhere, so the epoch is rejected and the layer starts again from new
    weights; the rejected epoch is not counted (mutation caught: no FirstEpochGuard in the callbacks)."""
    result, events = _train_background(tmp_path, monkeypatch, fresh_starts=2, output_bias="zero")
    assert events and events[0]["event"] == "fresh_start" and events[0]["fresh_start"] == 1
    assert events[0]["answer"] == ALL_LAYER
    assert events[0]["start_loss"] == pytest.approx(0.6931, abs=1e-4)
    assert events[0]["val_loss"] >= events[0]["start_loss"]
    assert result.fresh_starts == len(events)
    assert result.epochs_run == 2
