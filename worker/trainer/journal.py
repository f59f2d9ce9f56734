"""Where a training run's state goes: its checkpoints and its run directory, or nowhere.

:func:`worker.trainer.train.train_page` resolves its optional collaborators once, into one
object each, so that its loop over the layers never asks whether they are there:

* a :class:`Journal` keeps the run's seed, samples, finished layers and epoch records, and
  is either :class:`CheckpointJournal` (saved to a :class:`CheckpointStore` and resumed from
  it) or :class:`NoCheckpoints` (kept in memory only, as a run without checkpoints has them);
* :class:`RunOutputs` is what the trainer writes to a run directory:
  :class:`~worker.trainer.rundir.RunDirectory`, or :class:`NoRunDirectory`, which writes nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from worker.trainer.callbacks import EpochCallback
from worker.trainer.checkpoint import (
    MODEL_PREFIX,
    CheckpointStore,
    FinishedLayer,
    LayerState,
    TrainingState,
    generator_from_state,
    write_atomic,
)
from worker.trainer.sampling import Centres
from worker.trainer.saving import LabelResult

#: Called with a layer's state to checkpoint it; returns the checkpoint's path.
SaveLayer = Callable[[LayerState], Path]


class RunOutputs(Protocol):
    """What the trainer writes to a run directory (see :class:`~worker.trainer.rundir.RunDirectory`)."""

    def write_settings(self, settings: Mapping[str, Any]) -> object: ...

    def reserve_tensorboard_names(self, labels: Iterable[str]) -> None: ...

    def restore_records(self, records: Iterable[Mapping[str, Any]]) -> None: ...

    def epoch_callback(self, on_epoch: EpochCallback | None = None) -> EpochCallback: ...

    def keras_callbacks(self, label: str) -> list[Any]: ...

    def write_artifacts(self) -> None: ...


def _ignore(event: dict[str, Any]) -> None:
    """An EpochCallback that does nothing."""


class NoRunDirectory:
    """A run without a run directory: nothing is written, ``on_epoch`` is passed on as it is."""

    def write_settings(self, settings: Mapping[str, Any]) -> object:
        return None

    def reserve_tensorboard_names(self, labels: Iterable[str]) -> None:
        pass

    def restore_records(self, records: Iterable[Mapping[str, Any]]) -> None:
        pass

    def epoch_callback(self, on_epoch: EpochCallback | None = None) -> EpochCallback:
        return on_epoch if on_epoch is not None else _ignore

    def keras_callbacks(self, label: str) -> list[Any]:
        return []

    def write_artifacts(self) -> None:
        pass


class Journal:
    """A run's seed, samples, finished layers and epoch records: what its checkpoints hold.

    ``seed`` is None only for a run without checkpoints and without a seed (then nothing is
    reproducible). ``save`` is the ``save`` of :func:`~worker.trainer.train.train_label`
    (None: the layers' states are not saved). The base class keeps all of it in memory.
    """

    save: SaveLayer | None = None

    def __init__(self, seed: int | None, centres: dict[str, Centres]) -> None:
        self.seed = seed
        #: ``{"backend": ..., "mixed_precision": ...}``: what the run trains on (a resumed run: what it started on).
        self.trained_on: dict[str, str] = {}
        self.centres = centres
        self.finished: dict[str, FinishedLayer] = {}
        self.current: LayerState | None = None  # the layer a resumed run was in
        self.records: list[dict[str, Any]] = []

    @property
    def where(self) -> object:
        """Where the state is kept, for messages."""
        return "memory"

    def begin(self) -> None:
        """Called once the samples are checked, before any training."""

    def restore_records(self, outputs: RunOutputs) -> None:
        """Put the epoch records of the training before this call back into ``outputs``."""

    def recording(self, on_epoch: EpochCallback) -> EpochCallback:
        """An EpochCallback that keeps every epoch's record, then passes it on to ``on_epoch``."""

        def record(event: dict[str, Any]) -> None:
            self.records.append(dict(event))
            on_epoch(event)

        return record

    def is_finished(self, label: str) -> bool:
        """Whether ``label`` was trained before (its model is kept with the state)."""
        return label in self.finished

    def restore_finished(self, label: str, path: Path) -> tuple[Path, FinishedLayer]:
        """Write the model of a finished layer to ``path``; returns the path and what was kept of the layer."""
        raise KeyError(f"layer {label!r} was not trained before")

    def resume(self, label: str) -> LayerState | None:
        """The state to continue ``label`` from, None to train it from the start."""
        current = self.current
        return current if current is not None and current.label == label else None

    def shuffle_rng(self, label: str, seed: np.random.SeedSequence) -> np.random.Generator:
        """The generator that shuffles ``label``'s samples: the saved one when it is resumed, else new from ``seed``."""
        resume = self.resume(label)
        return generator_from_state(resume.rng_state) if resume else np.random.default_rng(seed)

    def layer_finished(self, result: LabelResult, path: Path) -> None:
        """Called when a layer's model has been saved to ``path``."""


class NoCheckpoints(Journal):
    """A run without checkpoints: it starts from the beginning and saves nothing."""


class CheckpointJournal(Journal):
    """A run checkpointed to ``store``: a new one (``state`` None) or one resumed from ``state``.

    ``run`` identifies the run in its checkpoints (:func:`~worker.trainer.train.run_identity`).
    """

    def __init__(
        self,
        store: CheckpointStore,
        run: dict[str, Any],
        seed: int,
        centres: dict[str, Centres],
        state: TrainingState | None,
    ) -> None:
        super().__init__(seed, centres)
        self.store = store
        self.run = run
        self.known_seed = seed  # never None here: drawn at the first start when not set
        self.resumed = state is not None
        if state is not None:
            self.finished = {f.label: f for f in state.finished}
            self.current = state.current
            self.records = [dict(r) for r in state.records]
        self.save = self.save_layer

    @property
    def where(self) -> object:
        return self.store.directory

    def snapshot(self, layer: LayerState | None) -> TrainingState:
        """The run's state now, with ``layer`` the state of the layer in progress (None: between layers)."""
        return TrainingState(
            run=self.run,
            seed=self.known_seed,
            centres=self.centres,
            finished=list(self.finished.values()),
            current=layer,
            records=[dict(r) for r in self.records],
        )

    def save_layer(self, layer: LayerState) -> Path:
        return self.store.save(self.snapshot(layer))

    def begin(self) -> None:
        if not self.resumed:
            self.store.save(self.snapshot(None))  # the run's seed and samples, before any training

    def restore_records(self, outputs: RunOutputs) -> None:
        if self.resumed:
            outputs.restore_records(self.records)

    def restore_finished(self, label: str, path: Path) -> tuple[Path, FinishedLayer]:
        done = self.finished[label]
        return write_atomic(path, self.store.read_file(done.file)), done

    def layer_finished(self, result: LabelResult, path: Path) -> None:
        data = path.read_bytes()
        kept = self.store.write_file(MODEL_PREFIX + path.name, data)
        self.finished[result.label] = FinishedLayer(
            label=result.label,
            file=kept.name,
            sha256=hashlib.sha256(data).hexdigest(),
            best_epoch=result.best_epoch,
            best_val_accuracy=result.best_val_accuracy,
            epochs_run=result.epochs_run,
            history=result.history,
            one_class=result.one_class,
            fresh_starts=result.fresh_starts,
        )
        self.store.save(self.snapshot(None))
