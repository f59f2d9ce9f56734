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

from worker.trainer.callbacks import (
    ALL_LAYER,
    ALL_NON_LAYER,
    ALMOST_EVERY_PIXEL,
    ALMOST_NO_PIXEL,
    BestEpoch,
    one_class,
)

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
    # Validation patches all of the layer (or none of it): answering one class may be right.
    assert one_class(1.0, pixels, pixels) is None and one_class(1.0, 0, pixels) is None


def test_nearly_one_class_is_less_than_a_tenth_of_either_share() -> None:
    """The demo's staff lines of seed 2 (trainer of 040ffeb): val_accuracy 0.748-0.750 against the
    others' share 0.75, a few pixels marked. With the share of pixels it marks, such a model is found;
    one that marks a tenth of the layer's share or more is not (mutation: a threshold on
    val_accuracy alone, which cannot tell 0.749 from a model that marks the right pixels and as many
    wrong ones)."""
    pixels, layer = 27 * 32 * 32, 6_750  # the layer's share 0.244
    share = layer / pixels
    assert one_class(0.749, layer, pixels, predicted_share=0.002) == ALMOST_NO_PIXEL
    assert one_class(0.749, layer, pixels, predicted_share=0.099 * share) == ALMOST_NO_PIXEL
    assert one_class(0.749, layer, pixels, predicted_share=0.101 * share) is None
    assert one_class(0.30, layer, pixels, predicted_share=1.0 - 0.099 * (1.0 - share)) == ALMOST_EVERY_PIXEL
    assert one_class(0.96, layer, pixels, predicted_share=share) is None
    # Without the measure (a model compiled without it) only the exact answers are found.
    assert one_class(0.749, layer, pixels) is None
    # The exact answer is named as such whatever the share says.
    assert one_class(float(np.float32((pixels - layer) / pixels)), layer, pixels, 0.0) == ALL_NON_LAYER


class _Weights:
    """What BestEpoch reads of a model: its weights (one number: the epoch that made them)."""

    def __init__(self) -> None:
        self.epoch = 0

    def get_weights(self) -> list[np.ndarray]:
        return [np.array(self.epoch)]


def _kept(values: list[float], trivial_values: set[float]) -> tuple[int, float]:
    best = BestEpoch(keep_optimizer=False, trivial=lambda v, share: "trivial" if v in trivial_values else None)
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


def test_an_epoch_that_marks_almost_nothing_is_not_kept_over_one_that_finds_the_layer() -> None:
    """The share the model marks reaches BestEpoch: 0.749 marking 0.1 % of the pixels loses to 0.74
    marking a fifth, and the kept epoch's share survives a checkpoint (mutation: BestEpoch deciding on
    val_accuracy alone keeps epoch 1)."""
    pixels, layer = 27 * 32 * 32, 6_750
    best = BestEpoch(keep_optimizer=False, trivial=lambda v, share: one_class(v, layer, pixels, share))
    model = _Weights()
    best.set_model(model)
    for epoch, (accuracy, share) in enumerate([(0.749, 0.001), (0.74, 0.2), (0.745, 0.0005)]):
        model.epoch = epoch + 1
        best.on_epoch_end(epoch, {"val_accuracy": accuracy, "val_predicted_share": share})
    assert (best.best_epoch, best.best, best.best_share) == (2, 0.74, 0.2)
    again = BestEpoch(keep_optimizer=False)
    again.restore(best.state(), best.weights, None)
    assert again.best_share == 0.2
    again.restore({"best": 0.74, "best_epoch": 2}, best.weights, None)  # a checkpoint of 0.3.0
    assert again.best_share is None


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


def _train_layer(
    tmp_path: Path,
    fresh_starts: int,
    seed: int = 3,
    layer: int = 0,
    epochs: int = 2,
    **options: Any,
) -> tuple[Any, list[dict[str, Any]]]:
    """Layer ``layer`` of ``seed`` exactly as train_pages trains it (its seeds and samples); by default
    the background of seed 3 for 2 epochs."""
    from worker.trainer import TrainSettings
    from worker.trainer import train as train_module

    pages = _bench_pages(tmp_path)
    settings = TrainSettings(
        epochs=epochs, max_samples_per_label=160, patch_height=32, patch_width=32, batch_size=16, patience=15,
        seed=seed, mixed_precision="off", max_fresh_starts=fresh_starts, **options,
    )  # fmt: skip
    centres = train_module._sample(pages, settings, seed)
    labels = list(pages[0].masks)
    shuffle_seed, init_seed = train_module.layer_seeds(seed, len(labels))[layer]
    events: list[dict[str, Any]] = []
    result = train_module.train_label(
        pages,
        labels[layer],
        centres[labels[layer]],
        settings,
        shuffle_rng=np.random.default_rng(shuffle_seed),
        init_seed=init_seed,
        on_layer=events.append,
    )
    return result, events


#: The sampler the frozen models were found with (the defaults until 0.4.0).
AS_IT_WAS: dict[str, Any] = {"patch_anchor": "centre", "patch_draws": "once"}
#: The frozen model's best val_accuracy: the validation's background share, at every epoch.
FROZEN_VAL_ACCURACY = 0.8294


@pytest.mark.training
def test_the_frozen_background_of_seed_3_is_reproduced_as_the_trainer_was(tmp_path: Path) -> None:
    """The trainer as it was (Keras' zero output bias, no fresh start): every epoch marks every pixel
    as background, with the benchmark's figure."""
    result, events = _train_layer(tmp_path, fresh_starts=0, **AS_IT_WAS, output_start="keras")
    assert events == []
    assert result.one_class == ALL_LAYER  # the background layer marks every pixel as background
    assert result.history["val_accuracy"] == pytest.approx([FROZEN_VAL_ACCURACY] * 2, abs=5e-5)


@pytest.mark.training
def test_the_frozen_background_of_seed_3_learns_with_the_trainers_defaults(tmp_path: Path) -> None:
    """The same layer, seeds and samples with today's defaults (the output bias at the layer's share,
    fresh starts on): after 2 epochs its model tells the ink from the parchment, its val_accuracy
    above the frozen 0.8294 by far more than the 0.5 / 32 768 of a pixel (mutation caught: the
    output bias left at zero with fresh starts off, which is the test above)."""
    result, _ = _train_layer(tmp_path, fresh_starts=2, **AS_IT_WAS)
    assert result.one_class is None
    assert result.best_val_accuracy > FROZEN_VAL_ACCURACY + 0.03


@pytest.mark.training
def test_a_first_epoch_no_better_than_the_constant_answer_starts_again(tmp_path: Path) -> None:
    """The guard alone (zero output bias, as the frozen run): the first epoch's val_loss is above the
    0.6931 of answering 0.5 everywhere, so the epoch is rejected and the layer starts again from new
    weights; the rejected epoch is not counted (mutation caught: no FirstEpochGuard in the callbacks)."""
    result, events = _train_layer(tmp_path, fresh_starts=2, **AS_IT_WAS, output_start="keras")
    assert events and events[0]["event"] == "fresh_start" and events[0]["fresh_start"] == 1
    assert events[0]["answer"] == ALL_LAYER
    assert events[0]["start_loss"] == pytest.approx(0.6931, abs=1e-4)
    assert events[0]["val_loss"] >= events[0]["start_loss"]
    assert result.fresh_starts == len(events)
    assert result.epochs_run == 2


#: The staff lines (layer 2) of seed 2 froze under the output bias alone, in all three starts.
SILENT_SEED, STAFF_LINES = 2, 2
#: Their frozen val_accuracy: the validation's share of the pixels that are not staff lines.
SILENT_VAL_ACCURACY = 0.7559


@pytest.mark.training
def test_the_silent_staff_lines_of_seed_2_are_reproduced_as_the_trainer_was(tmp_path: Path) -> None:
    """The trainer of 040ffeb (output bias at the prior, both output weights as Keras drew them, two
    fresh starts): every start's first epoch marks no pixel as a staff line, and so does the kept one's
    every epoch. Its loss fell all the same (0.51 to 0.36 over 10 epochs): both ReLU units learned to
    fire on the other pixels with negative weights, so the staff lines sit at the bias's probability."""
    result, events = _train_layer(
        tmp_path, fresh_starts=2, seed=SILENT_SEED, layer=STAFF_LINES, epochs=3, **AS_IT_WAS,
        output_start="prior",
    )  # fmt: skip
    assert [e["answer"] for e in events] == [ALL_NON_LAYER, ALL_NON_LAYER]
    assert result.one_class == ALL_NON_LAYER
    assert result.history["val_accuracy"] == pytest.approx([SILENT_VAL_ACCURACY] * 3, abs=5e-5)
    assert result.history["val_predicted_share"] == [0.0, 0.0, 0.0]


@pytest.mark.training
def test_the_silent_staff_lines_of_seed_2_learn_with_opposed_output_weights(tmp_path: Path) -> None:
    """The same layer, seeds and samples, 10 epochs, with today's defaults (the output's two weights of
    opposite signs): its model marks about the staff lines' share and scores far above the frozen
    0.7559 (mutation caught: ``output_start="prior"``, the test above, whose every epoch marks nothing)."""
    result, _ = _train_layer(tmp_path, fresh_starts=2, seed=SILENT_SEED, layer=STAFF_LINES, epochs=10, **AS_IT_WAS)
    assert result.one_class is None
    assert result.best_val_accuracy > SILENT_VAL_ACCURACY + 0.15
    share = result.history["val_predicted_share"][result.best_epoch - 1]
    assert 0.5 * (1 - SILENT_VAL_ACCURACY) < share < 1.5 * (1 - SILENT_VAL_ACCURACY)


@pytest.mark.training
def test_a_job_stopped_right_after_a_fresh_start_resumes_the_new_start(tmp_path: Path) -> None:
    """Found by the Grid Engine continuation test: a job told to stop just after a fresh start left no
    checkpoint of it, so every continuation repeated the rejected first epoch, was stopped at the same
    point, and the request ran out of continuations. The stop now saves the new start (epoch 0, one
    fresh start counted), and a resumed layer goes on from there (mutation caught: raising without
    saving, as before, leaves nothing to resume but the rejected start)."""
    from worker.trainer import TrainingInterrupted
    from worker.trainer import train as train_module
    from worker.trainer.checkpoint import generator_from_state

    pages = _bench_pages(tmp_path)
    settings_fields = {"epochs": 2, "max_samples_per_label": 160, "patch_height": 32, "patch_width": 32,
                       "batch_size": 16, "patience": 15, "seed": FROZEN_SEED, "mixed_precision": "off",
                       **AS_IT_WAS, "output_start": "keras", "max_fresh_starts": 2}  # fmt: skip
    from worker.trainer import TrainSettings

    settings = TrainSettings(**settings_fields)
    centres = train_module._sample(pages, settings, FROZEN_SEED)
    label = next(iter(pages[0].masks))
    shuffle_seed, init_seed = train_module.layer_seeds(FROZEN_SEED, len(pages[0].masks))[0]
    saved: list[Any] = []
    events: list[dict[str, Any]] = []

    def save(state: Any) -> Path:
        saved.append(state)
        return tmp_path / f"checkpoint-{len(saved)}"

    with pytest.raises(TrainingInterrupted) as stopped:
        train_module.train_label(
            pages, label, centres[label], settings, shuffle_rng=np.random.default_rng(shuffle_seed),
            init_seed=init_seed, on_layer=events.append, save=save, stop_requested=lambda: bool(events),
        )  # fmt: skip
    assert [e["event"] for e in events] == ["fresh_start"]
    assert stopped.value.checkpoint == tmp_path / f"checkpoint-{len(saved)}"
    state = saved[-1]
    assert (state.epoch, state.fresh_starts) == (0, 1)

    again: list[dict[str, Any]] = []
    result = train_module.train_label(
        pages, label, centres[label], settings, shuffle_rng=generator_from_state(state.rng_state),
        init_seed=init_seed, on_layer=again.append, resume=state,
    )  # fmt: skip
    assert result.fresh_starts >= 1 and result.epochs_run == 2
