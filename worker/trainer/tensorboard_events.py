"""TensorBoard event files without TensorFlow: a small writer, and a Keras callback on top of it.

Keras' own ``keras.callbacks.TensorBoard`` writes through ``tensorflow.summary``, so on
the JAX backend it needs TensorFlow all the same (keras-team/keras#19121). The trainer
writes its epoch scalars with :class:`EpochTensorBoard` instead, on every backend: the
same tags at the same steps, in files that TensorBoard and ``tf.compat.v1.train.summary_iterator``
read, with nothing but the standard library.

The format: a file ``events.out.tfevents.<seconds>.<host>.<pid>.<n>.v2`` (``<n>`` zero-padded, so that
TensorBoard, which reads a folder's files in name order, reads one second's files in the order they
were written) is a sequence of
TFRecords, each ``uint64 length``, ``uint32 masked CRC32C of those 8 bytes``, ``data``,
``uint32 masked CRC32C of data`` (little-endian). Each record's data is one serialized
``tensorflow.Event`` protocol buffer, encoded here by hand; only these fields are used::

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

The first record is an Event with ``file_version = "brain.Event:2"``, then one Event per
scalar (``simple_value``: TensorBoard shows it as it shows the tensor summaries Keras' callback
writes). The callback flushes (and fsyncs) after every epoch's scalars, so a job killed later
leaves whole records; a record cut short by a kill is skipped by the readers, the ones before
it are read.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

from worker.trainer._keras import keras

FILE_VERSION = "brain.Event:2"
#: The folders of a log directory that hold the training and the validation scalars (Keras' names).
TRAIN, VALIDATION = "train", "validation"

_files = itertools.count()  # the <n> of the file name: tells apart the files of one process in one second


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return tuple(table)


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """The CRC32C (Castagnoli) of ``data``: ``crc32c(b"123456789") == 0xE3069283``."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC32C: rotated right by 15 bits, plus a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """``data`` framed as one TFRecord."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def _varint(number: int) -> bytes:
    number &= 0xFFFFFFFFFFFFFFFF  # an int64 below zero is sent as its two's complement (ten bytes)
    out = bytearray()
    while number > 0x7F:
        out.append(number & 0x7F | 0x80)
        number >>= 7
    out.append(number)
    return bytes(out)


def _field(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _field(number, 2) + _varint(len(payload)) + payload


def _float32(value: float) -> bytes:
    try:
        return struct.pack("<f", value)
    except OverflowError:  # finite, but beyond float32: what a float32 cast makes of it
        return struct.pack("<f", math.copysign(math.inf, value))


def event(
    wall_time: float, step: int = 0, *, file_version: str | None = None, scalar: tuple[str, float] | None = None
) -> bytes:
    """One serialized ``Event``: the file-version record, or one scalar ``(tag, value)``."""
    data = _field(1, 1) + struct.pack("<d", wall_time) + _field(2, 0) + _varint(step)
    if file_version is not None:
        data += _length_delimited(3, file_version.encode())
    if scalar is not None:
        tag, value = scalar
        value_message = _length_delimited(1, tag.encode()) + _field(2, 5) + _float32(value)
        data += _length_delimited(5, _length_delimited(1, value_message))
    return data


class EventFileWriter:
    """Writes scalars to a new event file in ``log_dir`` (made if missing); one thread at a time."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        directory = Path(log_dir)
        directory.mkdir(parents=True, exist_ok=True)
        while True:
            name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.{next(_files):06d}.v2"
            try:
                self._file = open(directory / name, "xb")  # closed by close()
                break
            except FileExistsError:  # never overwrite an event file: take the next number
                continue
        self.path = directory / name
        self._file.write(tfrecord(event(time.time(), file_version=FILE_VERSION)))
        self.flush()

    def scalar(self, tag: str, value: float, step: int) -> None:
        """Append ``value`` (stored as float32) under ``tag`` at ``step``; :meth:`flush` writes it out."""
        self._file.write(tfrecord(event(time.time(), step, scalar=(tag, float(value)))))

    def flush(self) -> None:
        """Hand everything written so far to the file system, and to its disk."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        """Flush and close the file (again: nothing happens)."""
        if not self._file.closed:
            self.flush()
            self._file.close()


class EpochTensorBoard(keras.callbacks.Callback):  # type: ignore[misc]
    """``keras.callbacks.TensorBoard(log_dir, histogram_freq=0, write_graph=False, update_freq="epoch")``
    on any backend, through :class:`EventFileWriter`.

    At every epoch end, ``<log_dir>/train`` gets ``epoch_<metric>`` for the training logs
    and ``epoch_learning_rate``, ``<log_dir>/validation`` gets ``epoch_<metric>`` for the
    ``val_`` logs, at step = the epoch (0-based); at every validation's end,
    ``<log_dir>/validation`` gets ``evaluation_<metric>_vs_iterations`` at step = the
    optimizer's iterations. Files are opened when first written to and closed by
    ``on_train_end``; a later fit writes new files in the same folders, as Keras' does.
    Only epoch- and validation-level hooks: Keras may still run batch hooks asynchronously.
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        super().__init__()
        self.log_dir = Path(log_dir)
        self._writers: dict[str, EventFileWriter] = {}

    def _writer(self, part: str) -> EventFileWriter:
        if part not in self._writers:
            self._writers[part] = EventFileWriter(self.log_dir / part)
        return self._writers[part]

    def _write(self, part: str, scalars: dict[str, float], step: int) -> None:
        if scalars:
            writer = self._writer(part)
            for tag, value in scalars.items():
                writer.scalar(tag, value, step)
            writer.flush()

    def _close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers = {}

    def _learning_rates(self) -> dict[str, float]:
        """Keras' ``TensorBoard._collect_learning_rate``: a loss-scaled optimizer's inner one, or each of several."""
        optimizer = self.model.optimizer
        optimizer = getattr(optimizer, "inner_optimizer", optimizer)
        if hasattr(optimizer, "optimizers"):
            return {f"learning_rate_{o.name}": _number(o.learning_rate) for o in optimizer.optimizers}
        if isinstance(optimizer, keras.optimizers.Optimizer):
            return {"learning_rate": _number(optimizer.learning_rate)}
        return {}

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self._close()  # a new fit: new files (those of a fit that ended without on_train_end are closed)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not logs:
            return
        train = {k: v for k, v in logs.items() if not k.startswith("val_")} | self._learning_rates()
        self._write(TRAIN, {f"epoch_{k}": float(v) for k, v in train.items()}, epoch)
        self._write(VALIDATION, {f"epoch_{k[4:]}": float(v) for k, v in logs.items() if k.startswith("val_")}, epoch)

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
        optimizer = self.model.optimizer
        if logs and optimizer and hasattr(optimizer, "iterations"):
            step = int(_number(optimizer.iterations))
            self._write(VALIDATION, {f"evaluation_{k}_vs_iterations": float(v) for k, v in logs.items()}, step)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self._close()


def _number(variable: Any) -> float:
    """A scalar Keras variable's value (any backend)."""
    return float(keras.ops.convert_to_numpy(variable))
