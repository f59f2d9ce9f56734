"""The Log File: the training's story as a person reads it (Rodan 3.x's ``Log File`` output).

Kept in the run directory as ``training-log.txt`` and appended to by every job of a request, so
that a training continued over several jobs tells one story: which job ran where, the pages and
settings, each layer's epochs with loss and accuracy, each layer's best epoch, where a job
stopped and was continued, and the time taken. The reply to a Rodan 3.x request carries it.

It is written from what the worker already knows: the job's start, the trainer's epoch records
(``worker.trainer.callbacks.EPOCH_KEYS``) and the job's end. A layer's summary (best epoch, epochs
run) is worked out from its epoch records the way the trainer keeps its best model: the first
epoch with the highest ``val_accuracy``.

Every line is appended and flushed at once (``O_APPEND``), so a job killed at any moment leaves a
log that is complete up to its last line. The file's small companion ``training-log.json`` keeps
what the next job needs to go on (when the request started, how many jobs it used, the epoch
records of the layer in progress).
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bridge.atomic import atomic_write_json

LOG_NAME = "training-log.txt"
STATE_NAME = "training-log.json"


def format_seconds(seconds: float) -> str:
    """``3725`` -> ``1 h 2 min 5 s``; under a minute with one decimal."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{hours} h"] if hours else []
    parts.append(f"{minutes} min")
    if not hours:
        parts.append(f"{secs} s")
    return " ".join(parts)


def _number(value: Any, digits: int = 4) -> str:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "?"
    return f"{number:.{digits}f}" if math.isfinite(number) else "-"


def best_epoch(records: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The first record with the highest finite ``val_accuracy`` (how the trainer keeps its model)."""
    best: Mapping[str, Any] | None = None
    for record in records:
        value = float(record.get("val_accuracy", math.nan))
        if math.isfinite(value) and (best is None or value > float(best["val_accuracy"])):
            best = record
    return best


@dataclass
class _State:
    started_at: float
    jobs: int = 0
    current_label: str | None = None
    current_records: list[dict[str, Any]] = field(default_factory=list)
    finished_labels: list[str] = field(default_factory=list)
    learned_nothing: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "started_at": self.started_at,
            "jobs": self.jobs,
            "current_label": self.current_label,
            "current_records": self.current_records,
            "finished_labels": self.finished_labels,
            "learned_nothing": self.learned_nothing,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> _State:
        return cls(
            started_at=float(data["started_at"]),
            jobs=int(data.get("jobs", 0)),
            current_label=data.get("current_label"),
            current_records=[dict(r) for r in data.get("current_records", [])],
            finished_labels=[str(x) for x in data.get("finished_labels", [])],
            learned_nothing=[str(x) for x in data.get("learned_nothing", [])],
        )


class TrainingLog:
    """Appends the story of one request's training to ``folder/training-log.txt``.

    Make one per job with :meth:`open`; call :meth:`job_started` first, :meth:`epoch` for every
    epoch record, and one of :meth:`finished`, :meth:`stopped` (the job goes on in another) or
    :meth:`failed` at the end. :meth:`text` is the file's content for the reply.
    """

    def __init__(self, folder: Path, state: _State, *, clock: Any = time.time) -> None:
        self.path = Path(folder) / LOG_NAME
        self._state_path = Path(folder) / STATE_NAME
        self._state = state
        self._clock = clock
        self._job_started = clock()
        self._continuation = 0

    @classmethod
    def open(cls, folder: Path, *, clock: Any = time.time) -> TrainingLog:
        """The log of the run in ``folder``: a new one, or the one earlier jobs of the request wrote."""
        state_path = Path(folder) / STATE_NAME
        try:
            state = _State.from_json(json.loads(state_path.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError):
            state = _State(started_at=clock())
        return cls(folder, state, clock=clock)

    # -- writing -------------------------------------------------------------------------

    def _stamp(self) -> str:
        return datetime.fromtimestamp(self._clock(), tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")

    def _write(self, lines: Iterable[str]) -> None:
        data = "".join(f"{line}\n" for line in lines).encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def _save_state(self) -> None:
        # Replaced whole on every save: it keeps the mode the run directory gave the log (group-readable
        # runs: worker/trainer/rundir.py), not the new file's 0600.
        try:
            mode = stat.S_IMODE(os.stat(self.path).st_mode)
        except FileNotFoundError:
            mode = 0o600
        atomic_write_json(self._state_path, self._state.to_json(), mode=mode)

    def job_started(
        self,
        *,
        request: str,
        job: str,
        host: str,
        continuation: int,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        """A job of the request began (the first, or a continuation)."""
        self._state.jobs += 1
        self._continuation = continuation
        lines: list[str] = []
        if continuation == 0 and self._state.jobs == 1:
            lines.append(f"HPC training of request {request}")
            lines.append("")
        what = "started" if continuation == 0 else f"continued the training (continuation {continuation})"
        lines.append(f"{self._stamp()}  job {job or '?'} on {host}: {what}")
        if continuation == 0 and settings:
            lines.append("  settings: " + ", ".join(f"{key} = {value}" for key, value in settings.items()))
        self._write(lines)
        self._save_state()

    def inputs(self, pages: Sequence[str], starting_models: Sequence[str] = ()) -> None:
        """What the training reads (told by the first job only: a continuation reads the same)."""
        if self._continuation != 0:
            return
        lines = [f"  pages ({len(pages)}): " + "; ".join(pages)]
        if starting_models:
            lines.append("  training starts from: " + ", ".join(starting_models))
        self._write(lines)

    def _enter_layer(self, label: str) -> list[str]:
        if label == self._state.current_label:
            return []
        lines = self._close_layer()
        self._state.current_label = label
        self._state.current_records = []
        return [*lines, f"{self._stamp()}  layer {label}"]

    def epoch(self, record: Mapping[str, Any]) -> None:
        """One epoch of a layer (a trainer epoch record)."""
        label = str(record.get("label", "?"))
        lines = self._enter_layer(label)
        again = any(r.get("epoch") == record.get("epoch") for r in self._state.current_records)
        self._state.current_records = [r for r in self._state.current_records if r.get("epoch") != record.get("epoch")]
        self._state.current_records.append({k: _plain(v) for k, v in record.items()})
        note = " (again: the job was restarted after it)" if again else ""
        lines.append(
            f"  epoch {record.get('epoch', '?')}{note}: loss {_number(record.get('loss'))}, "
            f"accuracy {_number(record.get('accuracy'))}, val_loss {_number(record.get('val_loss'))}, "
            f"val_accuracy {_number(record.get('val_accuracy'))} "
            f"({format_seconds(float(record.get('seconds', math.nan)))}, "
            f"{_number(record.get('samples_per_second'), 1)} samples/s)"
        )
        self._write(lines)
        self._save_state()

    def fresh_start(self, event: Mapping[str, Any]) -> None:
        """The trainer's ``fresh_start`` event: the layer's first epoch was rejected and it starts again."""
        label = str(event.get("label", "?"))
        lines = self._enter_layer(label)
        lines.append(
            f"  its first epoch ended no better than a model that knows nothing (val_loss "
            f"{_number(event.get('val_loss'))}, the constant answer's {_number(event.get('start_loss'))}; it marks "
            f"{event.get('answer', '?')}): the model could not move from its starting weights. It starts again "
            f"from new weights (fresh start {event.get('fresh_start', '?')} of {event.get('of', '?')}); that epoch "
            "is not counted"
        )
        self._write(lines)
        self._save_state()

    def layer_trained(self, event: Mapping[str, Any], model: str) -> None:
        """The trainer's ``layer_trained`` event: the layer's summary, and in plain words whether its
        model (``model``: the name the user sees, e.g. ``Model 2``) learned anything."""
        label = str(event.get("label", "?"))
        lines = self._enter_layer(label)
        if label not in self._state.finished_labels:
            self._state.finished_labels.append(label)
            starts = int(event.get("fresh_starts") or 0)
            again = f", after {starts} fresh start{'s' if starts != 1 else ''}" if starts else ""
            lines.append(
                f"  layer {label}: best val_accuracy {_number(event.get('best_val_accuracy'))} at epoch "
                f"{event.get('best_epoch', '?')} of {event.get('epochs_run', '?')} run{again}; "
                f"its model is the one returned as {model}"
            )
            answer = event.get("one_class")
            if answer:
                self._state.learned_nothing.append(model)
                every = "almost every" if str(answer).startswith("almost") else "every"
                lines += [
                    f"  WARNING: {model} (layer {label}) learned nothing: it marks {answer} on the validation "
                    f"patches, so in a classified page it will give {every} pixel the same answer for this layer.",
                    "  Do not rely on it. Train again with more of this layer: paint more of it in Pixel.js or "
                    "raise 'Maximum number of samples per label', raise 'Maximum number of training epochs', "
                    "or choose a larger patch.",
                ]
        self._write(lines)
        self._save_state()

    def _close_layer(self) -> list[str]:
        label, records = self._state.current_label, self._state.current_records
        if label is None or label in self._state.finished_labels:
            return []
        self._state.finished_labels.append(label)
        best = best_epoch(records)
        if best is None:
            return [f"  layer {label}: {len(records)} epochs, no validation accuracy reported"]
        return [
            f"  layer {label}: best val_accuracy {_number(best['val_accuracy'])} at epoch {best['epoch']} "
            f"of {len(records)} run; its model is the one returned"
        ]

    def stopped(self, *, where: str, reason: str) -> None:
        """The job stopped before its time limit; another job continues."""
        elapsed = self._clock() - self._job_started
        self._write(
            [
                f"{self._stamp()}  job stopped by {reason} at {where} after {format_seconds(elapsed)}; "
                "a new job continues from the checkpoint"
            ]
        )
        self._save_state()

    def finished(self, models: Sequence[str]) -> None:
        """Training ended with every model."""
        lines = self._close_layer()
        total = self._clock() - self._state.started_at
        jobs = self._state.jobs
        lines.append(
            f"{self._stamp()}  finished: {len(models)} models ({', '.join(models)}) in {format_seconds(total)}"
            f" over {jobs} job{'s' if jobs != 1 else ''}"
        )
        useless = self._state.learned_nothing
        if useless:
            lines.append(
                f"  {len(useless)} of the {len(models)} models learned nothing ({', '.join(useless)}): see the "
                "WARNING above"
            )
        self._write(lines)
        self._save_state()

    def failed(self, reason: str) -> None:
        """The request ends in an error reply."""
        self._write([f"{self._stamp()}  failed: {reason}"])
        self._save_state()

    def text(self) -> str:
        try:
            return self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return ""


def _plain(value: Any) -> Any:
    """A JSON-safe copy of an epoch record's value (NaN kept as None)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (int, float, str)) or value is None:
        return value
    return str(value)
