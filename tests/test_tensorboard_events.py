"""Tests of worker.trainer.tensorboard_events: its files, read by TensorFlow's and TensorBoard's own readers."""

from __future__ import annotations

import itertools
import math
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("keras")  # the worker extra is not installed on login nodes
pytest.importorskip("tensorflow")  # the real readers: TensorFlow's and TensorBoard's
pytest.importorskip("tensorboard")

import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

from worker.trainer import tensorboard_events
from worker.trainer._keras import keras
from worker.trainer.rundir import RunDirectory
from worker.trainer.tensorboard_events import EpochTensorBoard, EventFileWriter, crc32c

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)

#: (tag, value, step) as written; the values are read back as float32.
SCALARS = [("epoch_loss", 0.1, 0), ("epoch_accuracy", 2 / 3, 0), ("epoch_loss", -7.25, 1), ("epoch_loss", 1e39, 2**40)]
FILE_NAME = re.compile(r"events\.out\.tfevents\.(\d+)\.(.+)\.(\d+)\.(\d+)\.v2")


def float32(value: float) -> float:
    return float(np.float32(value)) if abs(value) < 3.5e38 else math.copysign(math.inf, value)


def events(path: Path) -> Iterator[Any]:
    """The Event protos of one file, through TensorFlow's reader (it checks every CRC)."""
    yield from tf.compat.v1.train.summary_iterator(str(path))


def number(value: Any) -> float | None:
    """A summary value's scalar: Keras' callback writes tensors, ours simple_value."""
    if value.HasField("tensor"):
        return float(tf.make_ndarray(value.tensor))
    return float(value.simple_value) if value.HasField("simple_value") else None


def scalars_by_tensorflow(log_dir: Path) -> dict[tuple[str, str, int], list[float]]:
    """(``train``/``validation``, tag, step) -> every value logged there, in every event file."""
    found: dict[tuple[str, str, int], list[float]] = {}
    for path in sorted(log_dir.glob("*/events.out.tfevents.*")):
        for event in events(path):
            for value in event.summary.value:
                if (scalar := number(value)) is not None:
                    found.setdefault((path.parent.name, value.tag, int(event.step)), []).append(scalar)
    return found


def write(directory: Path, scalars: list[tuple[str, float, int]]) -> Path:
    writer = EventFileWriter(directory)
    for tag, value, step in scalars:
        writer.scalar(tag, value, step)
    writer.close()
    return writer.path


# --------------------------------------------------------------------------- the writer alone


def test_crc32c_known_values() -> None:
    assert crc32c(b"") == 0
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720, B.4


def test_tensorflow_reads_the_file_version_and_every_scalar(tmp_path: Path) -> None:
    before = time.time()
    path = write(tmp_path / "train", SCALARS)
    after = time.time()
    match = FILE_NAME.fullmatch(path.name)
    assert match and path.parent == tmp_path / "train", path
    assert before - 1 < int(match[1]) <= after and match[2] == socket.gethostname()

    read = list(events(path))
    assert read[0].file_version == "brain.Event:2" and not read[0].summary.value
    assert len(read) == 1 + len(SCALARS)
    for event, (tag, value, step) in zip(read[1:], SCALARS, strict=True):
        assert before <= event.wall_time <= after
        assert event.step == step and not event.file_version
        assert [(v.tag, v.simple_value) for v in event.summary.value] == [(tag, float32(value))]
    assert [e.wall_time for e in read[1:]] == sorted(e.wall_time for e in read[1:])


def test_tensorboard_reads_the_scalars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A process's 9th and 10th files: TensorBoard reads a folder in name order, and "10" sorts before "9".
    monkeypatch.setattr(tensorboard_events, "_files", itertools.count(9))
    before = time.time()
    write(tmp_path, SCALARS[:2])
    write(tmp_path, SCALARS[2:])  # a second file in the same folder, as after a resumed fit
    after = time.time()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2

    accumulator = event_accumulator.EventAccumulator(str(tmp_path))
    accumulator.Reload()
    assert accumulator.file_version == 2.0
    assert sorted(accumulator.Tags()["scalars"]) == ["epoch_accuracy", "epoch_loss"]
    for tag in ("epoch_accuracy", "epoch_loss"):
        read = accumulator.Scalars(tag)
        assert [(s.step, s.value) for s in read] == [(step, float32(v)) for t, v, step in SCALARS if t == tag]
        assert all(before <= s.wall_time <= after for s in read)


def test_a_damaged_record_is_refused(tmp_path: Path) -> None:
    """The readers check our CRCs: a changed byte is a DataLossError, not a wrong value."""
    path = write(tmp_path, SCALARS[:1])
    data = bytearray(path.read_bytes())
    data[-6] ^= 0x01  # inside the last record's float
    path.write_bytes(bytes(data))
    with pytest.raises(tf.errors.DataLossError):
        list(events(path))


def test_a_record_cut_short_leaves_the_earlier_ones_readable(tmp_path: Path) -> None:
    """A job killed in the middle of a write: both readers still give every whole record."""
    writer = EventFileWriter(tmp_path)
    for tag, value, step in SCALARS:
        writer.scalar(tag, value, step)
        writer.flush()
        if step == 1:
            whole = writer.path.stat().st_size
    writer.close()
    cut = whole + (writer.path.stat().st_size - whole) // 2
    with writer.path.open("r+b") as handle:
        handle.truncate(cut)  # half of the last record written

    read: list[Any] = []
    try:
        for event in events(writer.path):
            read.append(event)
    except tf.errors.DataLossError:  # "truncated record": what comes before it was read
        pass
    assert [(e.summary.value[0].tag, e.step) for e in read[1:]] == [(t, s) for t, _, s in SCALARS[:3]]

    accumulator = event_accumulator.EventAccumulator(str(tmp_path))
    accumulator.Reload()
    assert [(s.step, s.value) for s in accumulator.Scalars("epoch_loss")] == [(0, float32(0.1)), (1, -7.25)]


def test_writers_never_share_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensorboard_events, "time", SimpleNamespace(time=lambda: 1700000000.5))  # the same second
    monkeypatch.setattr(tensorboard_events, "_files", itertools.chain([7, 7], itertools.count(8)))  # the same <n>
    first, second = EventFileWriter(tmp_path), EventFileWriter(tmp_path)
    assert (first.path.name, second.path.name) == (
        f"events.out.tfevents.1700000000.{socket.gethostname()}.{os.getpid()}.000007.v2",
        f"events.out.tfevents.1700000000.{socket.gethostname()}.{os.getpid()}.000008.v2",
    )
    first.close()
    first.close()  # again: nothing happens
    second.close()
    assert all(len(list(events(path))) == 1 for path in (first.path, second.path))


# --------------------------------------------------------------------------- the Keras callback


def tiny_model() -> Any:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy", metrics=["accuracy"])
    return model


def test_the_callback_leaves_batches_to_keras() -> None:
    """No batch hook: Keras may dispatch the batch callbacks asynchronously."""
    for hook in ("on_batch_end", "on_train_batch_end", "on_test_batch_end", "on_predict_batch_end"):
        assert getattr(EpochTensorBoard, hook) is getattr(keras.callbacks.Callback, hook), hook


def test_the_callback_closes_its_files_and_opens_new_ones(tmp_path: Path) -> None:
    """on_train_end (also called by the trainer when training is interrupted) closes; the next epoch opens."""
    callback = EpochTensorBoard(tmp_path)
    callback.set_model(tiny_model())
    assert not list(tmp_path.rglob("events.out.tfevents.*"))  # opened when first written to
    callback.on_epoch_end(0, {"loss": 0.5, "accuracy": 0.25, "val_loss": 0.75, "val_accuracy": 0.125})
    assert scalars_by_tensorflow(tmp_path)[("validation", "epoch_loss", 0)] == [0.75]  # flushed: a kill keeps it
    writers = dict(callback._writers)
    callback.on_train_end()
    assert all(writer._file.closed for writer in writers.values()) and not callback._writers
    callback.on_epoch_end(1, {"loss": 0.25})
    assert len(list((tmp_path / "train").glob("events.out.tfevents.*"))) == 2
    assert len(list((tmp_path / "validation").glob("events.out.tfevents.*"))) == 1
    callback.on_train_end()
    assert scalars_by_tensorflow(tmp_path) == {
        ("train", "epoch_loss", 0): [0.5],
        ("train", "epoch_accuracy", 0): [0.25],
        ("train", "epoch_learning_rate", 0): [float32(0.01)],
        ("validation", "epoch_loss", 0): [0.75],
        ("validation", "epoch_accuracy", 0): [0.125],
        ("train", "epoch_loss", 1): [0.25],
        ("train", "epoch_learning_rate", 1): [float32(0.01)],
    }


@pytest.mark.training
def test_a_fit_writes_what_keras_tensorboard_writes(tmp_path: Path) -> None:
    """The same fits with both callbacks: the same (folder, tag, step) and values, the same files."""
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(3)
    x = rng.random((32, 3), dtype=np.float32)
    y = (x.sum(axis=1) > 1.5).astype(np.float32)
    model = tiny_model()
    ours = RunDirectory.create(tmp_path / "runs", "tiny").tensorboard_callback("Layer 0")
    assert isinstance(ours, EpochTensorBoard)
    theirs = keras.callbacks.TensorBoard(tmp_path / "keras", histogram_freq=0, write_graph=False, update_freq="epoch")
    for first, last in ((0, 2), (2, 3)):  # a later fit of the same layer, as after a resumed epoch
        model.fit(
            x, y, batch_size=8, initial_epoch=first, epochs=last, validation_data=(x[:8], y[:8]),
            callbacks=[ours, theirs], verbose=0,
        )  # fmt: skip

    expected = {
        ("train", "epoch_loss"), ("train", "epoch_accuracy"), ("train", "epoch_learning_rate"),
        ("validation", "epoch_loss"), ("validation", "epoch_accuracy"),
    }  # fmt: skip
    written = scalars_by_tensorflow(ours.log_dir)
    assert {(part, tag) for part, tag, step in written if tag.startswith("epoch_")} == expected
    for part, tag in expected:
        assert [step for p, t, step in sorted(written) if (p, t) == (part, tag)] == [0, 1, 2], (part, tag)
    assert all(len(values) == 1 and math.isfinite(values[0]) for values in written.values())
    assert written == scalars_by_tensorflow(tmp_path / "keras")
    for part in ("train", "validation"):
        assert len(list((ours.log_dir / part).glob("events.out.tfevents.*"))) == 2  # one per fit, as Keras'
        assert len(list((tmp_path / "keras" / part).glob("events.out.tfevents.*"))) == 2
