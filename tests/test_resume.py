"""Interrupting and resuming real (tiny) training runs: the resumed run is the uninterrupted one.

Determinism: TensorFlow 2.21's CPU kernels (oneDNN and Eigen, on this 2-core machine) give
bit-identical results for identical inputs, in one process and across processes, without
``tf.config.experimental.enable_op_determinism()`` (checked while writing these tests:
three epochs of the SAE twice in one process and once in another, all weights equal). With
the same seed (``keras.utils.set_random_seed``, which train_page calls per layer), the same
samples, the same batch order and the restored weights, Adam state and metric sums, a
resumed run therefore ends with exactly the weights and history of an uninterrupted one,
and these tests assert exact equality, not a tolerance. (On a GPU, or with another thread
count, the kernels need not be deterministic; there only the epochs, the samples and the
order would be guaranteed identical.)
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("keras")  # the worker extra is not installed on login nodes

import keras

from tests.pages import striped_page
from tests.support.training import RESUME_SETTINGS, RecordingStore
from worker.trainer import CheckpointStore, Page, TrainingInputError, TrainingInterrupted, TrainSettings, train_page
from worker.trainer.callbacks import EarlyStopper
from worker.trainer.rundir import RunDirectory
from worker.trainer.sampling import sample_centres

pytestmark = [
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
    pytest.mark.training,
]

REPO = Path(__file__).resolve().parent.parent
SETTINGS = RESUME_SETTINGS
LABELS = ["Background", "Layer 0"]
METRICS = ("loss", "accuracy", "val_loss", "val_accuracy")


class StopAt:
    """A ``stop_requested`` that says yes after batch ``batch`` of the epoch after the record ``after``.

    train_page polls before each layer, after every batch but an epoch's last, and at every
    epoch end (after the epoch's record) that training goes on from. So after the record
    ``(label, e)``, the first poll is that epoch end's and the ``k + 1``-th follows batch ``k``
    of epoch ``e + 1``; without ``after`` the first is before the first layer, and again the
    ``k + 1``-th follows batch ``k`` (of its first epoch).
    """

    def __init__(self, after: tuple[str, int] | None, batch: int) -> None:
        self.after = after
        self.polls = batch + 1
        self.count = 0
        self.armed = after is None

    def on_epoch(self, event: dict[str, Any]) -> None:
        if (event["label"], event["epoch"]) == self.after:
            self.armed = True

    def __call__(self) -> bool:
        if not self.armed:
            return False
        self.count += 1
        return self.count >= self.polls


@dataclass
class Run:
    paths: dict[str, Path]
    events: list[dict[str, Any]]
    store: RecordingStore
    run_dir: RunDirectory
    final_weights: dict[str, list[np.ndarray]] = field(default_factory=dict)


def metrics(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(e["label"], int(e["epoch"]), *(float(e[key]) for key in METRICS)) for e in events]


def assert_same_weights(ours: dict[str, list[np.ndarray]], theirs: dict[str, list[np.ndarray]]) -> None:
    assert list(ours) == list(theirs)
    for label in ours:
        assert len(ours[label]) == len(theirs[label])
        for a, b in zip(ours[label], theirs[label], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=label)


def assert_same_models(ours: dict[str, Path], theirs: dict[str, Path]) -> None:
    assert list(ours) == list(theirs) == LABELS
    for label in LABELS:
        assert ours[label].name == theirs[label].name
        mine, reference = keras.models.load_model(ours[label]), keras.models.load_model(theirs[label])
        for a, b in zip(mine.get_weights(), reference.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=label)


def csv_rows(run: RunDirectory) -> list[tuple[Any, ...]]:
    with run.history_csv_path.open(newline="") as handle:
        return [(r["label"], int(r["epoch"]), *(float(r[k]) for k in METRICS)) for r in csv.DictReader(handle)]


def tensorboard_steps(run: RunDirectory, label: str) -> dict[str, list[int]]:
    """``"train/epoch_loss"`` -> every step logged, over every event file (a step twice shows twice)."""
    import tensorflow as tf

    steps: dict[str, list[int]] = {}
    for part in ("train", "validation"):
        for path in sorted((run.tensorboard_dir(label) / part).glob("events.out.tfevents.*")):
            for event in tf.compat.v1.train.summary_iterator(str(path)):
                for value in event.summary.value:
                    if value.tag in ("epoch_loss", "epoch_accuracy"):
                        steps.setdefault(f"{part}/{value.tag}", []).append(int(event.step))
    return {tag: sorted(found) for tag, found in sorted(steps.items())}


def assert_run_directory_complete(run: RunDirectory, reference: Run) -> None:
    """Every epoch once in history.csv / .npz and in TensorBoard, with the reference's values."""
    assert csv_rows(run) == csv_rows(reference.run_dir) == metrics(reference.events)
    with np.load(run.history_npz_path) as data:
        assert list(data["labels"]) == LABELS
        for label in LABELS:
            np.testing.assert_array_equal(data[f"{label}/epoch"], [1, 2, 3])
    for label in LABELS:
        steps = tensorboard_steps(run, label)
        assert steps == {tag: [0, 1, 2] for tag in steps} and len(steps) == 4, (label, steps)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The uninterrupted run (checkpointed, which must not change it)."""
    tmp = tmp_path_factory.mktemp("reference")
    events: list[dict[str, Any]] = []
    store = RecordingStore(tmp / "checkpoints")
    run_dir = RunDirectory.create(tmp / "runs", "reference")
    paths = train_page(
        striped_page(), SETTINGS, tmp / "models", on_epoch=events.append, run_dir=run_dir, checkpoints=store
    )
    assert [(e["label"], e["epoch"]) for e in events] == [(label, n) for label in LABELS for n in (1, 2, 3)]
    return Run(paths, events, store, run_dir, dict(store.final_weights))


def interrupt(tmp: Path, stop: StopAt, settings: TrainSettings = SETTINGS) -> tuple[TrainingInterrupted, Run]:
    events: list[dict[str, Any]] = []

    def on_epoch(event: dict[str, Any]) -> None:
        events.append(event)
        stop.on_epoch(event)

    store = RecordingStore(tmp / "checkpoints")
    run_dir = RunDirectory.create(tmp / "runs", "interrupted")
    with pytest.raises(TrainingInterrupted) as stopped:
        train_page(
            striped_page(), settings, tmp / "job-1", on_epoch=on_epoch, run_dir=run_dir,
            checkpoints=store, stop_requested=stop,
        )  # fmt: skip
    return stopped.value, Run({}, events, store, run_dir, dict(store.final_weights))


@pytest.mark.xdist_group("resume-reference")  # one worker trains the reference once
def test_the_unchanged_run_trains_on_the_seeds_samples(reference: Run) -> None:
    state = reference.store.load_latest()
    assert state is not None and state.current is None and [f.label for f in state.finished] == LABELS
    expected = sample_centres(
        striped_page().masks, 32, 32, 60, np.random.default_rng(np.random.SeedSequence(7).spawn(3)[0])
    )
    for label in LABELS:
        np.testing.assert_array_equal(state.centres[label], expected[label])
    # A checkpoint at every epoch end of every layer, none part-way.
    assert reference.store.saved == [(label, n, 0) for label in LABELS for n in (1, 2, 3)]


@pytest.mark.xdist_group("resume-reference")  # one worker trains the reference once
def test_interrupted_in_the_second_layer_resumes_as_if_never_stopped(reference: Run, tmp_path: Path) -> None:
    stopped, first = interrupt(tmp_path, StopAt(("Layer 0", 1), batch=2))
    assert str(stopped) == "layer 'Layer 0' epoch 2 batch 2 of 4"
    assert stopped.checkpoint is not None and stopped.checkpoint.exists()
    assert first.store.saved[-1] == ("Layer 0", 1, 16)  # 2 batches of 8 into epoch 2
    # The epochs before the interruption are the reference's, and the run directory has them.
    assert metrics(first.events) == metrics(reference.events)[:4]
    assert [row[:2] for row in csv_rows(first.run_dir)] == [(label, n) for label in LABELS for n in (1, 2, 3)][:4]

    # A continuation: a new store object, a new RunDirectory object and a new job directory.
    second = RecordingStore(tmp_path / "checkpoints")
    events: list[dict[str, Any]] = []
    again = RunDirectory(first.run_dir.path)
    paths = train_page(striped_page(), SETTINGS, tmp_path / "job-2", on_epoch=events.append, run_dir=again,
                       checkpoints=second)  # fmt: skip
    assert [(e["label"], e["epoch"]) for e in events] == [("Layer 0", 2), ("Layer 0", 3)]  # Background not retrained
    assert metrics(first.events + events) == metrics(reference.events)
    assert_same_weights({**first.final_weights, **second.final_weights}, reference.final_weights)
    assert_same_models(paths, reference.paths)
    assert_run_directory_complete(again, reference)
    latest, expected = second.load_latest(), reference.store.load_latest()
    assert latest is not None and expected is not None
    for label in LABELS:
        np.testing.assert_array_equal(latest.centres[label], expected.centres[label])


@pytest.mark.xdist_group("resume-reference")  # one worker trains the reference once
def test_interrupted_in_the_first_layer_resumes_in_a_fresh_process(reference: Run, tmp_path: Path) -> None:
    """The resumed run is another interpreter: nothing of the first run lives on in memory."""
    stopped, first = interrupt(tmp_path, StopAt(None, batch=2))
    assert (stopped.label, stopped.epoch, stopped.batch, stopped.batches) == ("Background", 1, 2, 4)
    assert first.events == [] and first.store.saved == [("Background", 0, 16)]

    code = """
        import json, sys
        from pathlib import Path
        import numpy as np
        from tests.pages import striped_page
        from tests.support.training import RESUME_SETTINGS as SETTINGS, RecordingStore
        from worker.trainer import train_page
        from worker.trainer.rundir import RunDirectory

        checkpoints, models, run, weights = (Path(a) for a in sys.argv[1:])
        store, events = RecordingStore(checkpoints), []
        paths = train_page(striped_page(), SETTINGS, models, on_epoch=events.append, run_dir=RunDirectory(run),
                           checkpoints=store)
        np.savez(weights, **{f"{k}/{i}": w for k, ws in store.final_weights.items() for i, w in enumerate(ws)})
        print(json.dumps({"events": events, "paths": {k: str(v) for k, v in paths.items()}}))
    """
    weights_file = tmp_path / "weights.npz"
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(tmp_path / "checkpoints"), str(tmp_path / "job-2"),
         str(first.run_dir.path), str(weights_file)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert metrics(result["events"]) == metrics(reference.events)
    with np.load(weights_file) as data:
        resumed = {
            label: [data[f"{label}/{i}"] for i in range(len(reference.final_weights[label]))] for label in LABELS
        }
    assert_same_weights(resumed, reference.final_weights)
    assert_same_models({k: Path(v) for k, v in result["paths"].items()}, reference.paths)
    assert_run_directory_complete(RunDirectory(first.run_dir.path), reference)


def test_early_stopping_stops_at_the_same_epoch_across_an_interruption(tmp_path: Path) -> None:
    # Blank paper: val_accuracy is 1.0 from the first epoch on and cannot improve. Patience 2
    # stops after epoch 3 (wait 1 after epoch 2, 2 after epoch 3). Interrupted in epoch 3 the
    # saved wait is 1; a stopper that forgot it (as Keras' EarlyStopping resets itself in
    # on_train_begin) would run to epoch 4.
    blank = Page(np.full((200, 200, 3), 255, np.uint8), {"Everything": np.ones((200, 200), bool)})
    settings = dataclasses.replace(SETTINGS, epochs=10, patience=2, max_samples_per_label=50)
    uninterrupted: list[dict[str, Any]] = []
    train_page(
        blank, settings, tmp_path / "a", on_epoch=uninterrupted.append, checkpoints=CheckpointStore(tmp_path / "ca")
    )
    assert [e["val_accuracy"] for e in uninterrupted] == [1.0, 1.0, 1.0]

    stop = StopAt(("Everything", 2), batch=1)
    events: list[dict[str, Any]] = []

    def on_epoch(event: dict[str, Any]) -> None:
        events.append(event)
        stop.on_epoch(event)

    with pytest.raises(TrainingInterrupted, match="layer 'Everything' epoch 3 batch 1 of"):
        train_page(blank, settings, tmp_path / "b", on_epoch=on_epoch, checkpoints=CheckpointStore(tmp_path / "cb"),
                   stop_requested=stop)  # fmt: skip
    state = CheckpointStore(tmp_path / "cb").load_latest()
    assert state is not None and state.current is not None
    assert state.current.early_stopping == {"best": 1.0, "best_epoch": 0, "wait": 1, "stopped_epoch": 0}
    train_page(blank, settings, tmp_path / "c", on_epoch=events.append, checkpoints=CheckpointStore(tmp_path / "cb"))
    assert metrics(events) == metrics(uninterrupted)  # epochs 1, 2, then 3: stopped there, as uninterrupted


def test_resuming_another_run_is_refused(tmp_path: Path) -> None:
    page = striped_page()
    unseeded = dataclasses.replace(SETTINGS, seed=None)
    store = CheckpointStore(tmp_path / "checkpoints")
    # without a seed the sample count (and so the batch count) is random
    with pytest.raises(TrainingInterrupted, match=r"^layer 'Background' epoch 1 batch 0 of \d+$"):
        train_page(page, unseeded, tmp_path / "out", checkpoints=store, stop_requested=lambda: True)
    saved = store.load_latest()
    assert saved is not None and saved.current is None and not saved.finished and list(saved.centres) == LABELS
    drawn = saved.seed  # no seed in the settings: one was drawn, and is kept

    def refused(page: Page, settings: TrainSettings, match: str) -> None:
        with pytest.raises(TrainingInputError, match=match):
            train_page(page, settings, tmp_path / "out", checkpoints=store)

    refused(
        page,
        dataclasses.replace(unseeded, patch_height=64),
        r"another training run.*patch_height is 64, the checkpoint's 32",
    )
    refused(page, dataclasses.replace(unseeded, epochs=4), "epochs is 4, the checkpoint's 3")
    refused(page, SETTINGS, "seed is 7, the checkpoint's None")
    refused(striped_page(300, 320), unseeded, r"the page is 320x300 pixels, the checkpoint's 300x300")
    other = striped_page()
    other.image[150, 150] = (0, 0, 0)
    refused(other, unseeded, "the page's image or layers differ")
    refused(Page(page.image, {"Layer 0": page.masks["Layer 0"], "Background": page.masks["Background"]}), unseeded,
            r"the layers are \['Layer 0', 'Background'\], the checkpoint's \['Background', 'Layer 0'\]")  # fmt: skip

    # The same run resumes (and keeps the drawn seed): stopped again at once, nothing new saved.
    with pytest.raises(TrainingInterrupted):
        train_page(page, unseeded, tmp_path / "out", checkpoints=store, stop_requested=lambda: True)
    again = store.load_latest()
    assert again is not None and again.seed == drawn and again.sequence == saved.sequence


@pytest.mark.filterwarnings("ignore:Early stopping conditioned on metric:UserWarning")
def test_early_stopper_is_keras_early_stopping() -> None:
    """The same stop epoch, best value, best epoch and wait as Keras' own, epoch by epoch."""
    rng = np.random.default_rng(5)
    for trial in range(200):
        patience = int(rng.integers(0, 4))
        values = rng.choice([0.5, 0.6, 0.7, 0.8], size=int(rng.integers(1, 12))).astype(np.float32)
        ours, theirs = (
            EarlyStopper(patience),
            keras.callbacks.EarlyStopping("val_accuracy", patience=patience, mode="max"),
        )
        models = types.SimpleNamespace(stop_training=False), types.SimpleNamespace(stop_training=False)
        ours.set_model(models[0])
        theirs.set_model(models[1])
        theirs.on_train_begin()
        for epoch, value in enumerate(values):
            logs = {"val_accuracy": float(value)} if trial % 10 or epoch != 1 else {}  # now and then none
            ours.on_epoch_end(epoch, dict(logs))
            theirs.on_epoch_end(epoch, dict(logs))
            assert (ours.wait, ours.best_epoch, ours.stopped_epoch) == (
                theirs.wait,
                theirs.best_epoch,
                theirs.stopped_epoch,
            )
            assert ours.best == (None if theirs.best is None else float(theirs.best))
            assert models[0].stop_training == models[1].stop_training
            if models[0].stop_training:
                break
        restored = EarlyStopper(patience)
        restored.restore(json.loads(json.dumps(ours.state())))
        assert restored.state() == ours.state()


@pytest.mark.xdist_group("resume-reference")  # one worker trains the reference once
def test_the_checkpoint_directory_holds_the_newest_two_checkpoints_and_the_models(reference: Run) -> None:
    names = sorted(p.name for p in reference.store.directory.iterdir())
    assert names[2:] == ["model-Background.hdf5", "model-Layer_0.hdf5"]
    assert [n.endswith(".ckpt") for n in names[:2]] == [True, True]  # no temporary files left either


def test_resume_under_mirrored_strategy_and_mixed_precision(tmp_path: Path) -> None:
    """Variables mirrored over replicas and a LossScaleOptimizer (its loss scale and step count too)."""
    page = striped_page()
    page = Page(page.image, {"Layer 0": page.masks["Layer 0"]})
    # 16x16 patches: float16 convolutions on a CPU are slow, and with oneDNN on a CPU that has
    # AVX512-FP16 (TensorFlow 2.21) very slow, ~1.3 s per batch of 16 at 32x32 (benchmarks/README.md).
    settings = dataclasses.replace(
        SETTINGS,
        epochs=1,
        batch_size=16,
        patch_height=16,
        patch_width=16,
        strategy=("/cpu:0",),
        mixed_precision="float16",
    )
    reference = RecordingStore(tmp_path / "reference")
    expected: list[dict[str, Any]] = []
    train_page(page, settings, tmp_path / "a", on_epoch=expected.append, checkpoints=reference)

    stop = StopAt(None, batch=1)
    first = RecordingStore(tmp_path / "checkpoints")
    with pytest.raises(TrainingInterrupted, match="layer 'Layer 0' epoch 1 batch 1 of 3"):
        train_page(page, settings, tmp_path / "b", checkpoints=first, stop_requested=stop)
    state = first.load_latest()
    assert state is not None and state.current is not None
    # The LossScaleOptimizer's iterations, learning rate, step counter and loss scale; then Adam's
    # iterations, learning rate, and two moments per weight.
    assert len(state.current.optimizer_variables) == 4 + 2 + 2 * len(state.current.weights)
    second = RecordingStore(tmp_path / "checkpoints")
    events: list[dict[str, Any]] = []
    train_page(page, settings, tmp_path / "c", on_epoch=events.append, checkpoints=second)
    assert metrics(events) == metrics(expected)
    assert_same_weights(second.final_weights, reference.final_weights)


def test_patches_drawn_every_epoch_resume_as_if_never_stopped(tmp_path: Path) -> None:
    """With ``patch_draws="every_epoch"`` each epoch trains on a new draw from a pool three times as
    large: interrupted part-way through an epoch, the continuation trains that epoch's own draw (kept
    in the checkpoint) and the next ones as the uninterrupted run does, bit for bit (mutation caught:
    a resumed epoch that draws its patches again, or a pool the continuation samples otherwise)."""
    settings = dataclasses.replace(SETTINGS, patch_draws="every_epoch")
    events: list[dict[str, Any]] = []
    store = RecordingStore(tmp_path / "ref-checkpoints")
    train_page(striped_page(), settings, tmp_path / "ref", on_epoch=events.append, checkpoints=store)
    reference = Run({}, events, store, RunDirectory.create(tmp_path / "runs", "unused"), dict(store.final_weights))
    state = store.load_latest()
    assert state is not None
    # Three epochs' worth of centres per layer, of which one epoch's share trains per epoch.
    once = sample_centres(striped_page().masks, 32, 32, SETTINGS.max_samples_per_label, np.random.default_rng(0))
    assert all(len(state.centres[label]) > 2 * len(once[label]) for label in LABELS)

    stopped, first = interrupt(tmp_path, StopAt(("Layer 0", 1), batch=1), settings)
    assert str(stopped).startswith("layer 'Layer 0' epoch 2 batch 1 of ")
    second = RecordingStore(tmp_path / "checkpoints")
    again: list[dict[str, Any]] = []
    train_page(striped_page(), settings, tmp_path / "job-2", on_epoch=again.append, checkpoints=second)
    assert metrics(first.events + again) == metrics(reference.events)
    assert_same_weights({**first.final_weights, **second.final_weights}, reference.final_weights)
