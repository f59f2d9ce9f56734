"""Tests of worker.trainer.checkpoint and worker.trainer.sync: atomic checkpoints, kills, background sync.

No TensorFlow here: the checkpoint machinery imports NumPy only (the kill test starts over
a hundred child processes, each saving through the real writer until it is SIGKILLed).
"""

from __future__ import annotations

import math
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("numpy")  # the worker extra is not installed on login nodes

import numpy as np

from tests.checkpoint_writer import state_for
from worker.trainer.checkpoint import (
    HEADER,
    MODEL_PREFIX,
    TEMP_SUFFIX,
    CheckpointStore,
    CorruptCheckpoint,
    FinishedLayer,
    LayerState,
    TrainingInterrupted,
    TrainingState,
    checkpoint_name,
    decode_state,
    encode_state,
    generator_from_state,
    read_checkpoint,
    sha256_file,
)
from worker.trainer.sync import CheckpointSync, copy_file_atomic, open_checkpoints

REPO = Path(__file__).resolve().parent.parent
KILLS = 100


def full_state(seed: int = 3) -> TrainingState:
    """A state with every field used, the odd values included (NaN, -inf, None, big integers)."""
    rng = np.random.default_rng(seed)
    shuffle = np.random.default_rng(99)
    permutation = shuffle.permutation(40)
    layer = LayerState(
        label="Layer 1/ä",
        epoch=2,
        sample_offset=24,
        batch=3,
        batches=5,
        batch_size=8,
        weights=[rng.standard_normal((3, 3, 3, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)],
        optimizer_variables=[np.array(17, np.int64), np.array(1e-4, np.float32), rng.random((3, 3, 3, 4), np.float32)],
        metric_variables=[np.array(12.5, np.float32), np.array(24.0, np.float32)],
        early_stopping={"best": 0.75, "best_epoch": 1, "wait": 1, "stopped_epoch": 0},
        best={"best": 0.75, "best_epoch": 2},
        best_weights=[np.ones((2, 2), np.float32)],
        best_optimizer_variables=None,
        rng_state=dict(shuffle.bit_generator.state),
        permutation=permutation,
        history={"loss": [0.7, 0.6], "val_accuracy": [math.nan, 0.75]},
    )
    return TrainingState(
        run={"page": {"height": 300, "width": 300, "labels": ["Background", "Layer 1/ä"]}, "settings": {"seed": None}},
        seed=2**62 + 5,
        centres={"Background": rng.integers(0, 300, (7, 2)), "Layer 1/ä": rng.integers(0, 300, (5, 2))},
        finished=[FinishedLayer("Background", "model-Background.hdf5", "ab" * 32, 3, 0.9, 3, {"loss": [0.5]})],
        current=layer,
        records=[{"label": "Background", "epoch": 1, "loss": 0.5, "val_accuracy": -math.inf}],
    )


def small_state(k: int) -> TrainingState:
    return state_for(k, 0.01)


def temporary_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f".*{TEMP_SUFFIX}"))


# --------------------------------------------------------------------------- the format


def test_state_round_trip_keeps_everything() -> None:
    state = full_state()
    again = decode_state(encode_state(state))
    assert again.run == state.run and again.seed == state.seed and again.records[0]["loss"] == 0.5
    assert again.records[0]["val_accuracy"] == -math.inf
    assert list(again.centres) == list(state.centres)  # the training order
    for label in state.centres:
        assert again.centres[label].dtype == np.int64
        np.testing.assert_array_equal(again.centres[label], state.centres[label])
    assert again.finished == state.finished
    layer, saved = again.current, state.current
    assert layer is not None and saved is not None
    for name in ("label", "epoch", "sample_offset", "batch", "batches", "batch_size", "early_stopping", "best"):
        assert getattr(layer, name) == getattr(saved, name), name
    assert layer.history["loss"] == [0.7, 0.6] and math.isnan(layer.history["val_accuracy"][0])
    for ours, theirs in (
        (layer.weights, saved.weights),
        (layer.optimizer_variables, saved.optimizer_variables),
        (layer.metric_variables, saved.metric_variables),
        (layer.best_weights, saved.best_weights),
    ):
        assert ours is not None and theirs is not None and len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
    assert layer.best_optimizer_variables is None
    np.testing.assert_array_equal(layer.permutation, saved.permutation)
    # The shuffling continues exactly where it was: the same next permutation.
    expected = np.random.default_rng(99)
    expected.permutation(40)
    np.testing.assert_array_equal(generator_from_state(layer.rng_state).permutation(40), expected.permutation(40))


def test_a_damaged_checkpoint_is_refused() -> None:
    data = encode_state(full_state())
    decode_state(data)
    with pytest.raises(CorruptCheckpoint, match="torn or truncated"):
        decode_state(data[:-1])
    with pytest.raises(CorruptCheckpoint, match="shorter than the header"):
        decode_state(data[:20])
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        decode_state(bytes(flipped))
    with pytest.raises(CorruptCheckpoint, match="magic"):
        decode_state(b"PK\x03\x04" + data[4:])
    assert HEADER.size == 48


def test_interruption_says_where() -> None:
    stop = TrainingInterrupted("Layer 1", 3, 12, 40, Path("c.ckpt"))
    assert str(stop) == "layer 'Layer 1' epoch 3 batch 12 of 40" == stop.where
    assert (stop.label, stop.epoch, stop.batch, stop.batches, stop.checkpoint) == ("Layer 1", 3, 12, 40, Path("c.ckpt"))
    again = pickle.loads(pickle.dumps(stop))  # e.g. across a process pool
    assert str(again) == str(stop) and again.checkpoint == Path("c.ckpt")


# --------------------------------------------------------------------------- the store


def test_store_keeps_the_newest_and_numbers_on(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "c")
    assert store.load_latest() is None
    for k in range(1, 6):
        path = store.save(small_state(k))
        assert path.name == checkpoint_name(k)
    assert [p.name for p in store.checkpoints()] == [checkpoint_name(4), checkpoint_name(5)]  # keep=2
    latest = CheckpointStore(tmp_path / "c").load_latest()
    assert latest is not None and latest.sequence == 5 and latest.seed == 5
    reopened = CheckpointStore(tmp_path / "c")
    assert reopened.save(small_state(6)).name == checkpoint_name(6)  # numbering goes on
    assert not temporary_files(tmp_path / "c")


def test_torn_or_garbage_newest_falls_back_to_the_previous(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=5)
    store.save(small_state(1))
    newest = store.save(small_state(2))
    good = newest.read_bytes()

    newest.write_bytes(good[: len(good) // 2])  # torn: a write that stopped half-way
    state = store.load_latest()
    assert state is not None and state.seed == 1 and state.sequence == 1

    newest.write_bytes(os.urandom(len(good)))  # garbage of the right length
    assert store.load_latest().seed == 1  # type: ignore[union-attr]

    (tmp_path / checkpoint_name(9)).write_bytes(b"")  # an empty file with a newer number
    assert store.load_latest().seed == 1  # type: ignore[union-attr]

    newest.write_bytes(good)
    assert store.load_latest().seed == 2  # type: ignore[union-attr]  # (9 is still skipped)
    assert store.save(small_state(3)).name == checkpoint_name(10)  # after every number seen
    assert store.load_latest().seed == 3  # type: ignore[union-attr]


def test_a_checkpoint_whose_model_file_is_missing_or_differs_is_skipped(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(small_state(1))
    model = store.write_file(MODEL_PREFIX + "Background.hdf5", b"model bytes")
    second = small_state(2)
    second.finished = [FinishedLayer("Background", model.name, sha256_file(model), 2, 0.9, 2)]
    store.save(second)
    assert store.load_latest().seed == 2  # type: ignore[union-attr]
    model.write_bytes(b"other bytes")
    assert store.load_latest().seed == 1  # type: ignore[union-attr]
    model.unlink()
    assert store.load_latest().seed == 1  # type: ignore[union-attr]
    with pytest.raises(CorruptCheckpoint, match="missing"):
        read_checkpoint(store.checkpoints()[-1])
    with pytest.raises(ValueError):
        store.write_file("../escape", b"")
    with pytest.raises(ValueError):
        store.write_file(checkpoint_name(3), b"")


def test_a_new_store_removes_what_a_killed_writer_left(tmp_path: Path) -> None:
    CheckpointStore(tmp_path).save(small_state(1))
    (tmp_path / f".{checkpoint_name(2)}.x1y2{TEMP_SUFFIX}").write_bytes(b"half a checkpoint")
    (tmp_path / "notes.txt").write_text("kept")
    store = CheckpointStore(tmp_path)
    assert not temporary_files(tmp_path)
    assert (tmp_path / "notes.txt").exists() and store.load_latest().seed == 1  # type: ignore[union-attr]


@pytest.mark.slow  # 100 writer processes killed
def test_kill_9_at_random_instants_never_leaves_a_corrupt_checkpoint(tmp_path: Path) -> None:
    """SIGKILL a process that writes 4 MB checkpoints, at a random instant, 100 times.

    After every kill each checkpoint file there must be whole (it loads and checks), the
    newest must be at least the last one the child reported saved (a save that returned is
    never lost), at most one temporary file may be left (the next writer removes it), and no
    more than ``keep + 1`` checkpoints (killed between writing one and pruning the old).
    """
    directory = tmp_path / "checkpoints"
    rng = random.Random(1234)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    mid_write = saves_seen = 0
    started = time.monotonic()
    for iteration in range(KILLS):
        child = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "checkpoint_writer.py"), str(directory), "4"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        if iteration % 2:  # anywhere in the first few saves (one takes about 20 ms here) ...
            time.sleep(rng.uniform(0.0, 0.1))
        else:  # ... or, so that many kills land inside a write, soon after a temporary file appears
            deadline = time.monotonic() + 10
            while not temporary_files(directory) and time.monotonic() < deadline:
                time.sleep(0.0005)
            time.sleep(rng.uniform(0.0, 0.005))
        child.send_signal(signal.SIGKILL)
        child.wait()
        reported = [line.split() for line in child.stdout.read().splitlines() if line.startswith("saved ")]
        child.stdout.close()
        assert child.returncode == -signal.SIGKILL
        saves_seen += len(reported)

        left = temporary_files(directory)
        assert len(left) <= 1, left
        mid_write += len(left)
        files = sorted(directory.glob("checkpoint-*.ckpt"))
        assert len(files) <= 3, files
        for path in files:
            state = read_checkpoint(path)  # raises if torn
            layer = state.current
            assert layer is not None and state.records == [{"label": "Layer 0", "epoch": state.seed}]
            assert layer.weights[0].size + layer.weights[1].size == 1 << 20
            assert np.all(layer.weights[0] == state.seed) and np.all(layer.weights[1] == -state.seed)
        if reported:
            newest = read_checkpoint(files[-1])
            assert files[-1].name >= reported[-1][1] and newest.seed >= int(reported[-1][2])
    print(
        f"\n{KILLS} kills in {time.monotonic() - started:.1f} s: {mid_write} during a write (temporary file "
        f"left), {saves_seen} saves reported before the kills"
    )
    assert mid_write >= 10  # the kills did land inside writes, not only between them
    final = CheckpointStore(directory)
    assert not temporary_files(directory)
    assert final.load_latest() is not None


# --------------------------------------------------------------------------- sync


def test_copy_reads_the_file_it_opened_even_if_it_is_replaced(tmp_path: Path) -> None:
    source, destination = tmp_path / "a.ckpt", tmp_path / "out" / "a.ckpt"
    destination.parent.mkdir()
    original = os.urandom(3 * (1 << 20) + 5)
    source.write_bytes(original)
    replacement = tmp_path / "b"
    replacement.write_bytes(b"new")

    def replace_source_after_first_chunk(size: int) -> None:
        if replacement.exists():
            os.replace(replacement, source)  # what the store does to a file while a copy runs

    assert copy_file_atomic(source, destination, throttle=replace_source_after_first_chunk) == len(original)
    assert destination.read_bytes() == original and source.read_bytes() == b"new"
    assert not temporary_files(destination.parent)


def test_flush_delivers_the_latest_checkpoint_and_models(tmp_path: Path) -> None:
    persistent, local = tmp_path / "persistent", tmp_path / "local"
    with open_checkpoints(persistent, local, sync_interval_s=3600) as store:
        assert store.directory == local
        store.save(small_state(1))
        model = store.write_file(MODEL_PREFIX + "Background.hdf5", b"weights")
        state = small_state(2)
        state.finished = [FinishedLayer("Background", model.name, sha256_file(model), 1, 0.5, 1)]
        store.save(state)
        assert not list(persistent.iterdir())  # the thread waits an hour: nothing there yet
        store.flush()
        delivered = CheckpointStore(persistent).load_latest()
        assert delivered is not None and delivered.seed == 2 and delivered.finished == state.finished
        assert (persistent / model.name).read_bytes() == b"weights"
        assert sorted(p.name for p in persistent.iterdir()) == [checkpoint_name(2), model.name]


def test_save_never_waits_for_the_sync(tmp_path: Path) -> None:
    """The copy to persistent storage blocks (a hung shared filesystem) while saves go on."""
    persistent, local = tmp_path / "persistent", tmp_path / "local"
    entered, release = threading.Event(), threading.Event()
    copies: list[str] = []

    def hung_copy(source: Path, destination: Path) -> None:
        copies.append(source.name)
        entered.set()
        release.wait()
        copy_file_atomic(source, destination)

    sync = CheckpointSync(local, persistent, interval_s=0.01, copy_file=hung_copy)
    store = CheckpointStore(local, flush=sync.flush)
    store.save(small_state(1))
    with sync:
        assert entered.wait(30)  # the thread is now stuck in the copy of checkpoint 1

        def save_more() -> None:
            for k in (2, 3, 4):
                store.save(small_state(k))

        saver = threading.Thread(target=save_more)
        saver.start()
        saver.join(timeout=60)
        assert not saver.is_alive()  # every save returned while the copy was still blocked
        assert not release.is_set() and copies == [checkpoint_name(1)]
        assert [p.name for p in store.checkpoints()] == [checkpoint_name(3), checkpoint_name(4)]
        release.set()
        store.flush()  # waits for the pass in progress, then copies the newest
        assert CheckpointStore(persistent).load_latest().seed == 4  # type: ignore[union-attr]
    # Checkpoint 1 was pruned locally while its copy hung, so that pass copied the newest instead.
    assert [p.name for p in CheckpointStore(persistent).checkpoints()] == [checkpoint_name(4)]


def test_the_thread_syncs_on_its_own(tmp_path: Path) -> None:
    persistent, local = tmp_path / "persistent", tmp_path / "local"
    with open_checkpoints(persistent, local, sync_interval_s=0.05) as store:
        store.save(small_state(1))
        deadline = time.monotonic() + 30
        while not (persistent / checkpoint_name(1)).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (persistent / checkpoint_name(1)).exists()


def test_leaving_the_block_syncs_a_last_time(tmp_path: Path) -> None:
    persistent, local = tmp_path / "persistent", tmp_path / "local"
    with open_checkpoints(persistent, local, sync_interval_s=3600) as store:
        store.save(small_state(1))
    assert CheckpointStore(persistent).load_latest().seed == 1  # type: ignore[union-attr]

    with pytest.raises(TrainingInterrupted), open_checkpoints(persistent, local, sync_interval_s=3600) as store:
        store.save(small_state(2))
        raise TrainingInterrupted("Layer 0", 1, 1, 2)
    assert CheckpointStore(persistent).load_latest().seed == 2  # type: ignore[union-attr]


def test_a_new_node_resumes_from_persistent_storage(tmp_path: Path) -> None:
    persistent = tmp_path / "persistent"
    with open_checkpoints(persistent, tmp_path / "node-a", sync_interval_s=3600) as store:
        model = store.write_file(MODEL_PREFIX + "Background.hdf5", b"weights")
        state = small_state(7)
        state.finished = [FinishedLayer("Background", model.name, sha256_file(model), 1, 0.5, 1)]
        store.save(state)
    with open_checkpoints(persistent, tmp_path / "node-b", sync_interval_s=3600) as store:
        resumed = store.load_latest()
        assert resumed is not None and resumed.seed == 7 and resumed.sequence == 1
        assert (tmp_path / "node-b" / model.name).read_bytes() == b"weights"
        assert store.save(small_state(8)).name == checkpoint_name(2)
    # A node-local directory that holds a newer checkpoint than persistent storage keeps it.
    CheckpointStore(tmp_path / "node-b").save(small_state(9))
    with open_checkpoints(persistent, tmp_path / "node-b", sync_interval_s=3600) as store:
        assert store.load_latest().seed == 9  # type: ignore[union-attr]
    assert CheckpointStore(persistent).load_latest().seed == 9  # type: ignore[union-attr]


def test_without_a_local_directory_saves_go_straight_to_persistent_storage(tmp_path: Path) -> None:
    with open_checkpoints(tmp_path / "persistent", None, sync_interval_s=1) as store:
        store.save(small_state(1))
        store.flush()  # nothing to do
        assert (tmp_path / "persistent" / checkpoint_name(1)).exists()


def test_a_checkpoint_from_before_the_anchor_and_learning_rate_were_recorded_resumes_with_their_old_values() -> None:
    """Checkpoints written before ``patch_anchor`` and ``learning_rate`` joined RUN_SETTINGS trained with
    the centre anchor and 1e-4: they resume with those, and are refused with others (mutation caught:
    the two settings left out of the identity, or compared without their earlier values)."""
    from tests.pages import striped_page
    from worker.trainer import TrainSettings
    from worker.trainer.errors import TrainingInputError
    from worker.trainer.train import check_same_run, run_identity

    page = striped_page(120, 120)
    base = dict(epochs=1, max_samples_per_label=20, patch_height=16, patch_width=16, batch_size=4, patience=1, seed=1)
    now = run_identity(page, TrainSettings(**base))  # type: ignore[arg-type]
    before = {
        **now,
        "settings": {k: v for k, v in now["settings"].items() if k not in ("patch_anchor", "learning_rate")},
    }
    check_same_run(before, now, "old")  # resumes
    for changed in ({"patch_anchor": "corner"}, {"learning_rate": 1e-3}):
        other = run_identity(page, TrainSettings(**base, **changed))  # type: ignore[arg-type]
        with pytest.raises(TrainingInputError, match=next(iter(changed))):
            check_same_run(before, other, "old")
