"""Checkpoints of a training run: the whole state, in files that a kill -9 cannot corrupt.

A checkpoint holds everything :func:`worker.trainer.train.train_page` needs to continue a
run exactly where it stopped (:class:`TrainingState`): the run's seed and what identifies
the run (page and settings), the sampled centres of every layer, the layers already
finished (their ``.hdf5`` files are kept beside the checkpoints, see
:meth:`CheckpointStore.write_file`), the epoch records so far, and for the layer in
progress (:class:`LayerState`) the epoch and the position within it, the weights, the
optimizer's and the metrics' variables, the early-stopping and best-epoch state, the
shuffling generator's state and the epoch's permutation, and the history.

**Files.** A :class:`CheckpointStore` owns one directory (one writer per directory)::

    checkpoint-0000000012.ckpt      the newest checkpoints (``keep`` of them, 2 by default;
                                    ``keep + 1`` while a new one is being written)
    checkpoint-0000000011.ckpt
    model-Background.hdf5           the trained model of every finished layer (immutable)
    .checkpoint-0000000013.ckpt.*.tmp   a write in progress (or cut short: removed on the next start)

Every file is written the same way (:func:`write_atomic`, through
:func:`bridge.atomic.atomic_file`, the one module of the project outside ``worker.trainer``
that this package imports): a temporary file in the same directory, written, flushed and
``os.fsync``-ed, renamed over the final name with ``os.replace``, then the directory is
fsync-ed. A kill at any instant therefore leaves the previous files intact and at most one
temporary file, which the next store on the directory removes. Checkpoint names never repeat
(the sequence number grows), so a file once complete never changes, which also makes copying
them elsewhere simple (see :mod:`worker.trainer.sync`).

**Format** (version 1) of a ``.ckpt`` file::

    bytes 0-7     b"HPCCKPT1"  (magic and format version)
    bytes 8-15    payload length, unsigned 64-bit little-endian
    bytes 16-47   SHA-256 of the payload
    bytes 48-     payload: an ``.npz`` archive (``np.savez``, read with ``allow_pickle=False``)

The archive holds the arrays (``centres/<i>`` per layer in training order,
``current/weights/<i>``, ``current/optimizer/<i>``, ``current/metrics/<i>``,
``current/best_weights/<i>``, ``current/best_optimizer/<i>``, ``current/permutation``)
and ``meta.json``, a uint8 array of UTF-8 JSON with everything else (labels, counts, the
generator's ``bit_generator.state``, callback states, histories, epoch records). No pickle
anywhere. A file whose length, magic or checksum is wrong, or whose finished layers' model
files are missing or differ from the SHA-256 recorded for them, is skipped by
:meth:`CheckpointStore.load_latest`, which falls back to the next older one.

This module imports neither TensorFlow nor Keras.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import struct
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

# TEMP_SUFFIX: temporary files are ``.<final name>.<random>.tmp``, hidden, and removed by the next writer.
from bridge.atomic import TEMP_SUFFIX as TEMP_SUFFIX
from bridge.atomic import atomic_file

log = logging.getLogger(__name__)

MAGIC = b"HPCCKPT1"
HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256(payload)
FORMAT_VERSION = 1
CHECKPOINT_PREFIX = "checkpoint-"
CHECKPOINT_SUFFIX = ".ckpt"
#: Finished layers' models in the checkpoint directory: ``model-<file name from model_file_names>``.
MODEL_PREFIX = "model-"
#: Checkpoints kept in a directory: the newest and the one before it.
KEEP = 2
#: Bytes written per ``write`` call (and between two calls of a throttle).
CHUNK = 1 << 20
_CHECKPOINT_NAME = re.compile(rf"^{re.escape(CHECKPOINT_PREFIX)}(\d+){re.escape(CHECKPOINT_SUFFIX)}$")

Array = npt.NDArray[Any]
#: Called after every chunk written with its size in bytes (benchmarks slow writes down with it).
Throttle = Callable[[int], None]


class TrainingInterrupted(Exception):
    """Training stopped on request (``stop_requested``) after saving a checkpoint.

    ``str()`` says where, e.g. ``layer 'Layer 1' epoch 3 batch 12 of 40``: ``epoch`` is the
    1-based epoch in progress, ``batch`` how many of its ``batches`` were trained (0 when it
    stopped at an epoch's or a layer's start). ``checkpoint`` is the file saved last. A later
    ``train_page`` with the same checkpoints resumes from there.
    """

    def __init__(self, label: str, epoch: int, batch: int, batches: int, checkpoint: Path | None = None) -> None:
        self.label = label
        self.epoch = epoch
        self.batch = batch
        self.batches = batches
        self.checkpoint = checkpoint
        super().__init__(self.where)

    @property
    def where(self) -> str:
        return f"layer {self.label!r} epoch {self.epoch} batch {self.batch} of {self.batches}"

    def __reduce__(self) -> tuple[type[TrainingInterrupted], tuple[str, int, int, int, Path | None]]:
        return (type(self), (self.label, self.epoch, self.batch, self.batches, self.checkpoint))


class CorruptCheckpoint(ValueError):
    """A checkpoint file that is torn, truncated, not a checkpoint, or refers to missing files."""


# ----------------------------------------------------------------------------- the state


@dataclass
class LayerState:
    """Where the layer in progress stands, and everything needed to continue it.

    ``epoch`` epochs are complete; of the next (0-based index ``epoch``) the first
    ``sample_offset`` samples of ``permutation`` are trained (``batch`` of ``batches``
    batches of ``batch_size``, the global batch). At an epoch's end ``sample_offset`` and
    ``batch`` are 0 and ``permutation`` is None: the next epoch draws a new one from the
    generator whose state is ``rng_state`` (``np.random.Generator.bit_generator.state``).

    ``optimizer_variables`` are ``model.optimizer.variables`` in order (Adam's iteration
    count first); ``metric_variables`` the variables of ``model.metrics`` (the running
    sums of the epoch's loss and accuracy). ``early_stopping`` is
    :meth:`worker.trainer.callbacks.EarlyStopper.state`, ``best`` is
    :meth:`worker.trainer.callbacks.BestEpoch.state` with its weights in ``best_weights``
    and ``best_optimizer_variables``. ``history`` maps each Keras log key to one value per
    complete epoch.
    """

    label: str
    epoch: int
    sample_offset: int
    batch: int
    batches: int
    batch_size: int
    weights: list[Array]
    optimizer_variables: list[Array]
    metric_variables: list[Array]
    early_stopping: dict[str, Any]
    best: dict[str, Any]
    best_weights: list[Array] | None
    best_optimizer_variables: list[Array] | None
    rng_state: dict[str, Any]
    permutation: npt.NDArray[np.int64] | None
    history: dict[str, list[float]] = field(default_factory=dict)
    fresh_starts: int = 0  # how often the layer started again from new weights (FirstEpochGuard)


@dataclass
class FinishedLayer:
    """A trained layer: its model is the file ``file`` of the checkpoint directory."""

    label: str
    file: str
    sha256: str
    best_epoch: int
    best_val_accuracy: float
    epochs_run: int
    history: dict[str, list[float]] = field(default_factory=dict)
    one_class: str | None = None  # the model's answer when it marks every pixel alike (callbacks.one_class)
    fresh_starts: int = 0


@dataclass
class TrainingState:
    """A whole run's state (see the module docstring).

    ``run`` identifies the run (page shape and digest, labels, the settings that change
    what is trained; see :func:`worker.trainer.train.run_identity`); ``seed`` is the seed
    in use (drawn at the first start when the settings have none); ``centres`` the sampled
    centres per label, in training order; ``records`` the epoch records given to
    ``on_epoch`` so far (what the run directory's history holds). ``sequence`` is set by
    :class:`CheckpointStore` (the file's number).
    """

    run: dict[str, Any]
    seed: int
    centres: dict[str, npt.NDArray[np.int64]]
    finished: list[FinishedLayer] = field(default_factory=list)
    current: LayerState | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    sequence: int = 0


def _put_list(arrays: dict[str, Array], prefix: str, values: Sequence[Array] | None) -> int | None:
    if values is None:
        return None
    for index, value in enumerate(values):
        arrays[f"{prefix}/{index}"] = np.asarray(value)
    return len(values)


def _get_list(arrays: Mapping[str, Array], prefix: str, count: int | None) -> list[Array] | None:
    if count is None:
        return None
    return [arrays[f"{prefix}/{index}"] for index in range(count)]


def encode_state(state: TrainingState) -> bytes:
    """The ``.ckpt`` bytes of ``state`` (header and npz payload)."""
    labels = list(state.centres)
    arrays: dict[str, Array] = {}
    for index, label in enumerate(labels):
        arrays[f"centres/{index}"] = np.asarray(state.centres[label], dtype=np.int64)
    current: dict[str, Any] | None = None
    layer = state.current
    if layer is not None:
        current = {
            "label": layer.label,
            "epoch": layer.epoch,
            "sample_offset": layer.sample_offset,
            "batch": layer.batch,
            "batches": layer.batches,
            "batch_size": layer.batch_size,
            "weights": _put_list(arrays, "current/weights", layer.weights),
            "optimizer": _put_list(arrays, "current/optimizer", layer.optimizer_variables),
            "metrics": _put_list(arrays, "current/metrics", layer.metric_variables),
            "best_weights": _put_list(arrays, "current/best_weights", layer.best_weights),
            "best_optimizer": _put_list(arrays, "current/best_optimizer", layer.best_optimizer_variables),
            "early_stopping": layer.early_stopping,
            "best": layer.best,
            "rng_state": layer.rng_state,
            "permutation": layer.permutation is not None,
            "history": layer.history,
            "fresh_starts": layer.fresh_starts,
        }
        if layer.permutation is not None:
            arrays["current/permutation"] = np.asarray(layer.permutation, dtype=np.int64)
    meta = {
        "format": FORMAT_VERSION,
        "run": state.run,
        "seed": int(state.seed),
        "labels": labels,
        "finished": [dataclasses.asdict(f) for f in state.finished],
        "current": current,
        "records": state.records,
    }
    arrays["meta.json"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    payload = buffer.getvalue()
    return HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest()) + payload


def decode_state(data: bytes | memoryview) -> TrainingState:
    """The state in ``.ckpt`` bytes; CorruptCheckpoint if they are not a whole, intact checkpoint."""
    view = memoryview(data)
    if len(view) < HEADER.size:
        raise CorruptCheckpoint(f"{len(view)} bytes: shorter than the header")
    magic, length, digest = HEADER.unpack(view[: HEADER.size])
    if magic != MAGIC:
        raise CorruptCheckpoint(f"not a checkpoint of this format (magic {bytes(magic)!r})")
    payload = view[HEADER.size :]
    if len(payload) != length:
        raise CorruptCheckpoint(f"payload of {len(payload)} bytes, the header says {length}: torn or truncated")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptCheckpoint("checksum mismatch")
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
        meta = json.loads(bytes(arrays.pop("meta.json")).decode())
        if meta.get("format") != FORMAT_VERSION:
            raise CorruptCheckpoint(f"format {meta.get('format')!r}, not {FORMAT_VERSION}")
        labels = list(meta["labels"])
        centres = {label: arrays[f"centres/{index}"] for index, label in enumerate(labels)}
        current = None
        c = meta["current"]
        if c is not None:
            current = LayerState(
                label=c["label"],
                epoch=int(c["epoch"]),
                sample_offset=int(c["sample_offset"]),
                batch=int(c["batch"]),
                batches=int(c["batches"]),
                batch_size=int(c["batch_size"]),
                weights=_get_list(arrays, "current/weights", c["weights"]) or [],
                optimizer_variables=_get_list(arrays, "current/optimizer", c["optimizer"]) or [],
                metric_variables=_get_list(arrays, "current/metrics", c["metrics"]) or [],
                early_stopping=dict(c["early_stopping"]),
                best=dict(c["best"]),
                best_weights=_get_list(arrays, "current/best_weights", c["best_weights"]),
                best_optimizer_variables=_get_list(arrays, "current/best_optimizer", c["best_optimizer"]),
                rng_state=dict(c["rng_state"]),
                permutation=arrays["current/permutation"] if c["permutation"] else None,
                history={k: [float(v) for v in series] for k, series in c["history"].items()},
                fresh_starts=int(c.get("fresh_starts", 0)),
            )
        return TrainingState(
            run=dict(meta["run"]),
            seed=int(meta["seed"]),
            centres=centres,
            finished=[FinishedLayer(**f) for f in meta["finished"]],
            current=current,
            records=list(meta["records"]),
        )
    except CorruptCheckpoint:
        raise
    except (KeyError, TypeError, ValueError, OSError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        # Cannot happen to a file whose checksum matched unless a writer of another version wrote it.
        raise CorruptCheckpoint(f"unreadable content: {type(exc).__name__}: {exc}") from exc


def generator_from_state(state: Mapping[str, Any]) -> np.random.Generator:
    """A Generator whose bit generator has ``state`` (a ``bit_generator.state`` dict)."""
    kind = getattr(np.random, str(state["bit_generator"]))
    bits = kind()
    bits.state = dict(state)
    return np.random.Generator(bits)


# ----------------------------------------------------------------------------- files


def write_atomic(path: Path, data: bytes | memoryview, throttle: Throttle | None = None) -> Path:
    """Write ``data`` to ``path`` atomically and durably (see :func:`bridge.atomic.atomic_file`)."""
    view = memoryview(data)
    with atomic_file(path) as handle:
        for start in range(0, len(view), CHUNK):
            chunk = view[start : start + CHUNK]
            handle.write(chunk)
            if throttle is not None:
                throttle(len(chunk))
    return Path(path)


def remove_temporary_files(directory: Path) -> int:
    """Remove the temporary files a killed writer left in ``directory``; returns how many."""
    removed = 0
    for path in Path(directory).glob(f".*{TEMP_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    return removed


def checkpoint_sequence(name: str) -> int | None:
    """The sequence number in a checkpoint file name, or None for any other name."""
    match = _CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


def checkpoint_name(sequence: int) -> str:
    return f"{CHECKPOINT_PREFIX}{sequence:010d}{CHECKPOINT_SUFFIX}"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """``(sequence, path)`` of the checkpoint files in ``directory``, oldest first."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            sequence = checkpoint_sequence(entry.name)
            if sequence is not None and entry.is_file(follow_symlinks=False):
                found.append((sequence, Path(entry.path)))
    return sorted(found)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_checkpoint(path: Path) -> TrainingState:
    """The state in the checkpoint file ``path``, checked as :meth:`CheckpointStore.load_latest` does.

    Raises CorruptCheckpoint for a torn or foreign file, or one whose finished layers'
    model files (beside it) are missing or differ, and FileNotFoundError if it is gone.
    """
    path = Path(path)
    state = decode_state(path.read_bytes())
    for finished in state.finished:
        model = path.parent / finished.file
        try:
            digest = sha256_file(model)
        except FileNotFoundError:
            raise CorruptCheckpoint(f"the model file {finished.file} of layer {finished.label!r} is missing") from None
        if digest != finished.sha256:
            raise CorruptCheckpoint(f"the model file {finished.file} of layer {finished.label!r} differs")
    state.sequence = checkpoint_sequence(path.name) or 0
    return state


class CheckpointStore:
    """Checkpoints in ``directory`` (made if missing), written atomically; one writer per directory.

    :meth:`save` writes a new checkpoint and removes those older than the ``keep`` newest;
    :meth:`load_latest` returns the newest intact state. :meth:`write_file` and
    :meth:`read_file` keep other files (finished layers' models) beside them. A new store
    removes the temporary files a killed writer left behind.

    :meth:`flush` makes what was saved durable on persistent storage: a no-op here (saves go
    straight to ``directory``); a store opened with a node-local directory by
    :func:`worker.trainer.sync.open_checkpoints` syncs to the persistent one (it passes
    ``flush``). ``throttle`` is called after every MiB written (benchmarks use it to
    simulate a slow filesystem).
    """

    def __init__(
        self,
        directory: Path,
        *,
        keep: int = KEEP,
        flush: Callable[[], None] | None = None,
        throttle: Throttle | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._flush = flush
        self._throttle = throttle
        removed = remove_temporary_files(self.directory)
        if removed:
            log.info("removed %d unfinished temporary file(s) from %s", removed, self.directory)
        existing = list_checkpoints(self.directory)
        self._next = existing[-1][0] + 1 if existing else 1

    def __repr__(self) -> str:
        return f"CheckpointStore({str(self.directory)!r})"

    def checkpoints(self) -> list[Path]:
        """The checkpoint files, oldest first (intact or not)."""
        return [path for _, path in list_checkpoints(self.directory)]

    def save(self, state: TrainingState) -> Path:
        """Write ``state`` as the newest checkpoint (durable when this returns); returns its path.

        Sets ``state.sequence``. Then removes the checkpoints older than the ``keep`` newest
        (there are never more than ``keep + 1``, whenever a writer is killed).
        """
        existing = list_checkpoints(self.directory)
        for _, old in existing[: -self.keep]:  # left by a writer killed before it removed them
            old.unlink(missing_ok=True)
        sequence = max(self._next, existing[-1][0] + 1 if existing else 1)
        state.sequence = sequence
        path = write_atomic(self.directory / checkpoint_name(sequence), encode_state(state), self._throttle)
        self._next = sequence + 1
        for old_sequence, old in existing[-self.keep :]:
            if old_sequence <= sequence - self.keep:
                old.unlink(missing_ok=True)
        return path

    def load_latest(self) -> TrainingState | None:
        """The newest checkpoint that is intact (see :func:`read_checkpoint`), or None if there is none."""
        for _, path in reversed(list_checkpoints(self.directory)):
            try:
                return read_checkpoint(path)
            except FileNotFoundError:
                continue  # removed since it was listed
            except CorruptCheckpoint as exc:
                log.warning("skipping checkpoint %s: %s", path, exc)
        return None

    def write_file(self, name: str, data: bytes | memoryview) -> Path:
        """Keep ``data`` as ``name`` in the directory (atomically, durably)."""
        if Path(name).name != name or name.startswith(".") or checkpoint_sequence(name) is not None:
            raise ValueError(f"not a name for a file kept with the checkpoints: {name!r}")
        return write_atomic(self.directory / name, data, self._throttle)

    def read_file(self, name: str) -> bytes:
        return (self.directory / name).read_bytes()

    def flush(self) -> None:
        """Block until everything saved so far is on persistent storage (see the class docstring)."""
        if self._flush is not None:
            self._flush()
