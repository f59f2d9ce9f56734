"""A timestamped run directory: settings, TensorBoard summaries, per-epoch statistics, curves.

One training run writes everything that explains it under one directory, so a finished or
killed job can be looked at afterwards (``tensorboard --logdir <run>/tensorboard``, NumPy,
a spreadsheet, or the PNG)::

    <root>/<YYYYmmdd-HHMMSS>-<name>/       (mode 0700, shared: 0750; the timestamp is UTC)
        settings.json                      the resolved TrainSettings
        job.log                            the worker's JSON log lines (the worker tees them here)
        tensorboard/<label>/train/...      one TensorBoard log directory per layer
        tensorboard/<label>/validation/...
        history.npz                        per-epoch statistics as arrays (see below)
        history.csv                        the same, one row per layer and epoch
        training_curves.png                loss and accuracy per layer, training and validation

``history.npz`` holds one float64 array per layer and statistic, keyed
``"<label>/<statistic>"`` for every statistic in :data:`HISTORY_COLUMNS` (``epoch``,
``loss``, ``accuracy``, ``val_loss``, ``val_accuracy``, ``seconds``,
``samples_per_second``); element ``i`` is epoch ``i + 1`` (``<label>/epoch`` says so
explicitly), a metric Keras did not report is NaN. The label is the layer's name as
given, so split a key at its *last* ``/``. The key ``labels`` (no ``/``) is a unicode
array of the labels in training order. Read it with
``np.load(path)`` (no pickling needed).

``history.csv`` has the header ``label,epoch,loss,accuracy,val_loss,val_accuracy,seconds,
samples_per_second`` and one row per layer and epoch, in training order (floats written
in full precision, ``nan`` where missing).

The history files and the plot are rewritten whole (temporary file, fsync, then ``os.replace``:
:func:`bridge.atomic.atomic_file`), so a reader never sees a half-written one. A RunDirectory
is meant for one thread.

Who may read it: a private run directory (the default, ``HPC_RUNS_SHARED=private``) is 0700
with 0600 files. A shared one (``group``) is 0750 with 0640 files, so that the group of the
directory (the lab's Unix group: give the runs folder that group and the setgid bit, and every
run directory inherits it) can open the log, the history, the curves and TensorBoard. The
job runs under ``umask 077``, so the modes are set here: every file this class writes gets
them at once, and :meth:`RunDirectory.share` gives them to what others wrote (TensorBoard's
event files, the log, ``gpu.csv``) after every epoch. The folders in
:data:`PRIVATE_FOLDERS` (``inputs/``: Rodan's pages; ``checkpoints/``: the weights) stay
0700 with 0600 files in every mode.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

import numpy as np

from bridge.atomic import atomic_file
from worker.trainer.callbacks import EPOCH_KEYS

log = logging.getLogger(__name__)

#: The columns of history.csv (the keys of every epoch record, see EpochReporter).
HISTORY_COLUMNS = EPOCH_KEYS
#: The per-layer arrays of history.npz: every column but the label.
HISTORY_STATISTICS = tuple(key for key in EPOCH_KEYS if key != "label")
TIMESTAMP_FORMAT = "%Y%m%d-%H%M%S"
SETTINGS_FILE = "settings.json"
LOG_FILE = "job.log"
HISTORY_NPZ = "history.npz"
HISTORY_CSV = "history.csv"
CURVES_PNG = "training_curves.png"
TENSORBOARD_DIR = "tensorboard"
#: The npz key that lists the labels in order.
LABELS_KEY = "labels"
#: Folders of a run directory that stay private (0700, files 0600) in every mode.
PRIVATE_FOLDERS = ("inputs", "checkpoints")
#: (folder mode, file mode) of a private run directory and of one shared with its group.
PRIVATE_MODES = (0o700, 0o600)
GROUP_MODES = (0o750, 0o640)


def safe_name(name: str, default: str = "run", limit: int = 80) -> str:
    """A portable file-name part: "Layer 0/ä" -> "Layer_0"."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._-")[:limit] or default


def _write_atomic(path: Path, write: Callable[[IO[bytes]], object], mode: int = 0o600) -> Path:
    """Call ``write`` on a temporary file (``mode``) beside ``path``, then put it in place atomically
    and durably (:func:`bridge.atomic.atomic_file`)."""
    with atomic_file(path, mode) as handle:
        write(handle)
    return path


def set_mode(path: Path, mode: int) -> None:
    """``chmod`` ``path`` to ``mode`` unless it is a symbolic link or gone; a folder keeps its
    setgid bit (the group its new files get)."""
    try:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            return
        if stat.S_ISDIR(info.st_mode):
            mode |= info.st_mode & stat.S_ISGID
        if stat.S_IMODE(info.st_mode) != mode:
            os.chmod(path, mode)
    except FileNotFoundError:  # a temporary file renamed meanwhile
        pass


def let_group_in(path: Path, bits: int = 0o050) -> None:
    """Add the group permission ``bits`` to a folder of this user's (others' are left alone);
    a failure is logged, never raised: the training goes on, only less visible."""
    try:
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and (info.st_mode & bits) != bits:
            os.chmod(path, stat.S_IMODE(info.st_mode) | bits)
    except OSError as exc:
        log.warning("could not open %s to its group: %s", path, exc)


class RunDirectory:
    """One training run's directory; make one with :meth:`create`."""

    def __init__(self, path: Path, *, shared: bool = False) -> None:
        self.path = Path(path)
        self.shared = shared  # HPC_RUNS_SHARED=group
        self.dir_mode, self.file_mode = GROUP_MODES if shared else PRIVATE_MODES
        self._records: dict[str, list[dict[str, Any]]] = {}
        self._tensorboard_names: dict[str, str] = {}

    @classmethod
    def create(cls, root: Path, name: str, *, now: datetime | None = None, shared: bool = False) -> RunDirectory:
        """Make ``root/<UTC YYYYmmdd-HHMMSS>-<safe name>/`` with mode 0700 (``shared``: 0750).

        ``root`` is made if missing (``shared``: and opened to its group, g+rx, if it is this
        user's). A second run with the same name in the same second gets ``-2``, ``-3``, ...
        appended, never someone else's directory.
        """
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        if shared:
            let_group_in(root)
        moment = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
        stem = f"{moment.strftime(TIMESTAMP_FORMAT)}-{safe_name(name)}"
        candidate, number = root / stem, 2
        while True:
            try:
                candidate.mkdir(mode=0o700)
                break
            except FileExistsError:
                candidate, number = root / f"{stem}-{number}", number + 1
        if shared:
            set_mode(candidate, GROUP_MODES[0])  # keeps the setgid bit inherited from root
        else:
            candidate.chmod(0o700)  # mkdir's mode is filtered by the umask
        return cls(candidate, shared=shared)

    # ----------------------------------------------------------------------------- paths

    @property
    def log_path(self) -> Path:
        """Where the worker tees its JSON log lines (``job.log``); nothing here writes it."""
        return self.path / LOG_FILE

    @property
    def settings_path(self) -> Path:
        return self.path / SETTINGS_FILE

    @property
    def history_npz_path(self) -> Path:
        return self.path / HISTORY_NPZ

    @property
    def history_csv_path(self) -> Path:
        return self.path / HISTORY_CSV

    @property
    def curves_path(self) -> Path:
        return self.path / CURVES_PNG

    def _tensorboard_name(self, label: str) -> str:
        name = self._tensorboard_names.get(label)
        if name is None:
            stem = safe_name(label, default="layer", limit=100)
            taken = {n.lower() for n in self._tensorboard_names.values()}
            name, number = stem, 2
            while name.lower() in taken:
                name, number = f"{stem}_{number}", number + 1
            self._tensorboard_names[label] = name
        return name

    def reserve_tensorboard_names(self, labels: Iterable[str]) -> None:
        """Name the TensorBoard directories of ``labels`` in this order (nothing is created).

        Names depend on the order labels are first seen (``layer_0`` after ``Layer 0`` is
        ``layer_0_2``), so a run resumed past its first layers reserves all of them first.
        """
        for label in labels:
            self._tensorboard_name(label)

    def tensorboard_dir(self, label: str) -> Path:
        """``tensorboard/<safe label>/``, distinct per label (also on case-insensitive file systems)."""
        directory = self.path / TENSORBOARD_DIR / self._tensorboard_name(label)
        directory.mkdir(parents=True, exist_ok=True)
        if self.shared:
            set_mode(directory.parent, self.dir_mode)
            set_mode(directory, self.dir_mode)
        return directory

    def tensorboard_callback(self, label: str) -> Any:
        """A Keras callback writing epoch scalars for ``label`` as Keras' TensorBoard callback does
        (no graph, no histograms), on any backend: :class:`~worker.trainer.tensorboard_events.EpochTensorBoard`.

        Its event files go to ``tensorboard_dir(label)/train`` and ``.../validation``, with the
        tags ``epoch_loss`` and ``epoch_accuracy`` (and the learning rate) at steps 0, 1, ...;
        no TensorFlow or ``tensorboard`` package is needed to write them.
        """
        from worker.trainer.tensorboard_events import EpochTensorBoard

        return EpochTensorBoard(self.tensorboard_dir(label))

    def keras_callbacks(self, label: str) -> list[Any]:
        """The callbacks for ``label``'s fit: its TensorBoard callback."""
        return [self.tensorboard_callback(label)]

    # ----------------------------------------------------------------------------- writing

    def write_settings(self, settings: Mapping[str, Any]) -> Path:
        """Write ``settings`` to settings.json (a value JSON has no type for is written as its str())."""
        text = json.dumps(dict(settings), indent=2, sort_keys=True, default=str) + "\n"
        return _write_atomic(self.settings_path, lambda handle: handle.write(text.encode()), self.file_mode)

    def record_epoch(self, label: str, epoch_metrics: Mapping[str, Any]) -> None:
        """Keep one epoch's statistics (a dict as EpochReporter gives; missing keys become NaN)."""
        record: dict[str, Any] = {"label": label}
        for key in HISTORY_STATISTICS:
            value = epoch_metrics.get(key)
            record[key] = math.nan if value is None else float(value)
        self._records.setdefault(label, []).append(record)

    def restore_records(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Replace every epoch record with ``records`` (epoch dicts with a ``label``, in order).

        A run resumed from a checkpoint puts back the records saved with it, so that the
        history files go on from there: each epoch once, none lost, none twice.
        """
        self._records = {}
        for record in records:
            self.record_epoch(str(record["label"]), record)

    @property
    def history(self) -> dict[str, list[dict[str, Any]]]:
        """label -> its epoch records, in the order recorded (copies)."""
        return {label: [dict(r) for r in records] for label, records in self._records.items()}

    def history_arrays(self) -> dict[str, np.ndarray[Any, Any]]:
        """What history.npz holds: ``labels`` and ``"<label>/<statistic>"`` float64 arrays."""
        arrays: dict[str, np.ndarray[Any, Any]] = {LABELS_KEY: np.array(list(self._records), dtype=np.str_)}
        for label, records in self._records.items():
            for key in HISTORY_STATISTICS:
                arrays[f"{label}/{key}"] = np.array([r[key] for r in records], dtype=np.float64)
        return arrays

    def write_history(self) -> tuple[Path, Path]:
        """Rewrite history.npz and history.csv from every epoch recorded so far."""
        arrays = self.history_arrays()
        _write_atomic(self.history_npz_path, lambda handle: np.savez(handle, **arrays), self.file_mode)  # type: ignore[arg-type]
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(HISTORY_COLUMNS)
        for records in self._records.values():
            for record in records:
                writer.writerow(
                    [record["label"], int(record["epoch"]) if math.isfinite(record["epoch"]) else "nan"]
                    + [repr(record[key]) for key in HISTORY_STATISTICS if key != "epoch"]
                )
        data = text.getvalue().encode()
        _write_atomic(self.history_csv_path, lambda handle: handle.write(data), self.file_mode)
        return self.history_npz_path, self.history_csv_path

    def plot_curves(self) -> Path:
        """Draw training_curves.png: per layer, loss and accuracy by epoch, training and validation."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg, without pyplot's global state
        from matplotlib.figure import Figure

        labels = list(self._records) or [""]
        figure = Figure(figsize=(10, 2.8 * len(labels) + 0.6), dpi=100, layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.subplots(len(labels), 2, squeeze=False)
        for row, label in enumerate(labels):
            records = self._records.get(label, [])
            epochs = [r["epoch"] for r in records]
            for column, metric in enumerate(("loss", "accuracy")):
                ax = axes[row][column]
                if records:
                    ax.plot(epochs, [r[metric] for r in records], "o-", label="training")
                    ax.plot(epochs, [r[f"val_{metric}"] for r in records], "s--", label="validation")
                    ax.legend(loc="best", fontsize="small")
                    ax.set_title(f"{label}: {metric}")
                else:
                    ax.text(0.5, 0.5, "no epochs recorded", ha="center", va="center", transform=ax.transAxes)
                ax.set_xlabel("epoch")
                ax.set_ylabel(metric)
                ax.grid(True, alpha=0.3)
                ax.xaxis.get_major_locator().set_params(integer=True)
        return _write_atomic(self.curves_path, lambda handle: figure.savefig(handle, format="png"), self.file_mode)

    def write_artifacts(self) -> None:
        """Rewrite the history files and the plot; a failing plot is logged, never raised."""
        self.write_history()
        try:
            self.plot_curves()
        except Exception:
            log.warning("could not draw %s", self.curves_path, exc_info=True)
        self.share()

    def share(self) -> None:
        """Give everything in the run directory now the modes of its mode (see the module's
        docstring): with ``shared``, folders 0750 and files 0640, but 0700/0600 in and for
        :data:`PRIVATE_FOLDERS`; symbolic links are left alone. Private: nothing to do (the
        job's ``umask 077`` made everything 0700/0600)."""
        if not self.shared:
            return
        try:
            set_mode(self.path, self.dir_mode)
            for top, folders, files in os.walk(self.path):
                inside = Path(top).relative_to(self.path).parts
                private = bool(inside) and inside[0] in PRIVATE_FOLDERS
                for folder in folders:
                    closed = private or (not inside and folder in PRIVATE_FOLDERS)
                    set_mode(Path(top, folder), PRIVATE_MODES[0] if closed else self.dir_mode)
                for file in files:
                    set_mode(Path(top, file), PRIVATE_MODES[1] if private else self.file_mode)
        except OSError as exc:  # the training goes on; its run is only less visible
            log.warning("could not share %s with its group: %s", self.path, exc)

    def epoch_callback(
        self, on_epoch: Callable[[dict[str, Any]], None] | None = None
    ) -> Callable[[dict[str, Any]], None]:
        """An EpochCallback that records every epoch here, then passes it on to ``on_epoch``."""

        def record(event: dict[str, Any]) -> None:
            self.record_epoch(str(event["label"]), event)
            self.share()  # the epoch's TensorBoard events: readable by the group as they come
            if on_epoch is not None:
                on_epoch(event)

        return record
