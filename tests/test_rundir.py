"""Tests of worker.trainer.rundir, and of train_page writing a run directory (real TensorFlow, CPU)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import stat
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("keras")  # the worker extra is not installed on login nodes

from PIL import Image

from tests.pages import striped_page
from worker.trainer import Page, TrainSettings, train_page
from worker.trainer import train as train_module
from worker.trainer.callbacks import EPOCH_KEYS
from worker.trainer.rundir import HISTORY_STATISTICS, RunDirectory

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)

#: No fresh starts (``max_fresh_starts=0``): the first-epoch guard is tests/test_fresh_start.py's subject;
#: here it would train each tiny layer's first epoch up to three times.
SETTINGS = TrainSettings(
    epochs=2,
    max_samples_per_label=40,
    patch_height=64,
    patch_width=64,
    batch_size=16,
    patience=3,
    seed=11,
    max_fresh_starts=0,
)
CSV_HEADER = ["label", "epoch", "loss", "accuracy", "val_loss", "val_accuracy", "seconds", "samples_per_second"]


def epoch(label: str, number: int, **values: float) -> dict[str, Any]:
    record: dict[str, Any] = {"label": label, "epoch": number}
    for key in EPOCH_KEYS[2:]:
        record[key] = values.get(key, 0.1 * number)
    return record


def event_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} from every TensorBoard event file under ``directory``."""
    import tensorflow as tf

    files = sorted(directory.glob("events.out.tfevents.*"))
    assert files, f"no event file in {directory}"
    scalars: dict[str, dict[int, float]] = {}
    for path in files:
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.HasField("tensor"):
                    number = float(tf.make_ndarray(value.tensor))
                elif value.HasField("simple_value"):
                    number = float(value.simple_value)
                else:
                    continue
                scalars.setdefault(value.tag, {})[int(event.step)] = number
    return scalars


# --------------------------------------------------------------------------- the directory alone


def test_create_names_and_protects_the_directory(tmp_path: Path) -> None:
    moment = datetime(2024, 3, 5, 7, 8, 9, tzinfo=timezone.utc)
    first = RunDirectory.create(tmp_path / "runs", "job 42/ä Layer", now=moment)
    assert first.path == tmp_path / "runs" / "20240305-070809-job_42_Layer"
    assert stat.S_IMODE(first.path.stat().st_mode) == 0o700
    second = RunDirectory.create(tmp_path / "runs", "job 42/ä Layer", now=moment)  # same second, same name
    assert second.path.name == "20240305-070809-job_42_Layer-2"
    assert RunDirectory.create(tmp_path / "runs", "///").path.name.endswith("-run")
    name = RunDirectory.create(tmp_path, "x").path.name
    stamp = datetime.strptime(name[:15], "%Y%m%d-%H%M%S").replace(tzinfo=timezone.utc)
    assert abs((datetime.now(timezone.utc) - stamp).total_seconds()) < 60  # UTC, not local time
    assert first.log_path == first.path / "job.log"
    assert not first.log_path.exists()  # exposed, not written


def test_tensorboard_dirs_are_distinct_per_label(tmp_path: Path) -> None:
    run = RunDirectory.create(tmp_path, "r")
    a, b, c = run.tensorboard_dir("Layer 0"), run.tensorboard_dir("layer_0"), run.tensorboard_dir("../x")
    assert len({a.name.lower(), b.name.lower(), c.name.lower()}) == 3
    assert a.is_dir() and b.is_dir() and c.parent == run.path / "tensorboard"
    assert run.tensorboard_dir("Layer 0") == a  # stable


def test_history_files_from_recorded_epochs(tmp_path: Path) -> None:
    run = RunDirectory.create(tmp_path, "r")
    run.write_settings({"epochs": 3, "seed": None})
    assert json.loads(run.settings_path.read_text()) == {"epochs": 3, "seed": None}
    for n in (1, 2, 3):
        run.record_epoch("A/b", epoch("A/b", n, loss=1.0 / n))
    run.record_epoch("C", {"epoch": 1, "loss": 0.5})  # the rest missing: NaN
    npz, csv_path = run.write_history()
    with np.load(npz) as data:
        assert list(data["labels"]) == ["A/b", "C"]
        assert set(data.files) == {"labels"} | {f"{lab}/{k}" for lab in ("A/b", "C") for k in HISTORY_STATISTICS}
        assert data["A/b/loss"].dtype == np.float64
        np.testing.assert_allclose(data["A/b/loss"], [1.0, 0.5, 1 / 3])
        np.testing.assert_array_equal(data["A/b/epoch"], [1, 2, 3])
        assert math.isnan(data["C/val_accuracy"][0])
    with csv_path.open(newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == CSV_HEADER
    assert [r[:2] for r in rows[1:]] == [["A/b", "1"], ["A/b", "2"], ["A/b", "3"], ["C", "1"]]
    assert float(rows[3][2]) == pytest.approx(1 / 3, rel=1e-12) and rows[4][5] == "nan"
    assert not list(run.path.glob(".*.tmp")), "no temporary file left"
    run.plot_curves()
    with Image.open(run.curves_path) as png:
        assert png.format == "PNG" and png.width >= 600 and png.height >= 400


@pytest.mark.parametrize(("shared", "file_mode"), [(False, 0o600), (True, 0o640)])
def test_every_file_written_is_fsynced_with_its_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool, file_mode: int
) -> None:
    """Settings, history and curves reach the disk (file and directory fsync) with the run's file mode."""
    run = RunDirectory.create(tmp_path, "r", shared=shared)
    synced: list[tuple[str, int]] = []
    real = os.fsync

    def record(fd: int) -> None:
        info = os.fstat(fd)
        synced.append(("directory" if stat.S_ISDIR(info.st_mode) else "file", stat.S_IMODE(info.st_mode)))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    run.write_settings({"epochs": 1})
    run.record_epoch("A", epoch("A", 1, loss=0.5))
    run.write_history()
    run.plot_curves()
    assert [kind for kind, _ in synced] == ["file", "directory"] * 4  # settings, npz, csv, png
    assert {mode for kind, mode in synced if kind == "file"} == {file_mode}
    for path in (run.settings_path, run.history_npz_path, run.history_csv_path, run.curves_path):
        assert stat.S_IMODE(path.stat().st_mode) == file_mode
    assert not list(run.path.glob(".*.tmp"))


def test_plot_without_epochs(tmp_path: Path) -> None:
    run = RunDirectory.create(tmp_path, "r")
    with Image.open(run.plot_curves()) as png:
        assert png.format == "PNG"


# --------------------------------------------------------------------------- train_page(..., run_dir=...)


@pytest.mark.training
def test_train_page_writes_the_run_directory(tmp_path: Path) -> None:
    run = RunDirectory.create(tmp_path / "runs", "test page")
    seen: list[dict[str, Any]] = []
    paths = train_page(striped_page(), SETTINGS, tmp_path / "models", on_epoch=seen.append, run_dir=run)
    labels = ["Background", "Layer 0"]
    assert list(paths) == labels and all(p.exists() for p in paths.values())
    assert len(seen) == 2 * SETTINGS.epochs  # the caller's on_epoch still gets every epoch

    assert json.loads(run.settings_path.read_text()) == dataclasses.asdict(SETTINGS)

    with np.load(run.history_npz_path) as data:
        assert list(data["labels"]) == labels
        for label in labels:
            for key in HISTORY_STATISTICS:
                assert data[f"{label}/{key}"].shape == (SETTINGS.epochs,)
            np.testing.assert_array_equal(data[f"{label}/epoch"], [1, 2])
            ours = [r for r in seen if r["label"] == label]
            np.testing.assert_allclose(data[f"{label}/val_accuracy"], [r["val_accuracy"] for r in ours])
            assert np.all(np.isfinite(data[f"{label}/loss"])) and np.all(data[f"{label}/samples_per_second"] > 0)

    with run.history_csv_path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == CSV_HEADER
    assert [(r["label"], r["epoch"]) for r in rows] == [(lab, str(n)) for lab in labels for n in (1, 2)]

    with Image.open(run.curves_path) as png:
        png.load()
        assert png.format == "PNG" and 600 <= png.width <= 2000 and 400 <= png.height <= 2000

    for label in labels:
        board = run.tensorboard_dir(label)
        train, validation = event_scalars(board / "train"), event_scalars(board / "validation")
        ours = [r for r in seen if r["label"] == label]
        for scalars, prefix in ((train, ""), (validation, "val_")):
            for metric in ("loss", "accuracy"):
                assert sorted(scalars[f"epoch_{metric}"]) == [0, 1], (label, prefix, scalars.keys())
                logged = [scalars[f"epoch_{metric}"][step] for step in (0, 1)]
                np.testing.assert_allclose(logged, [r[prefix + metric] for r in ours], rtol=1e-5)


@pytest.mark.training
def test_a_failed_run_keeps_the_finished_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that dies in the second layer leaves the first layer's history, CSV and curves."""
    run = RunDirectory.create(tmp_path, "dies")
    settings = dataclasses.replace(SETTINGS, epochs=1)
    real_train_label = train_module.train_label

    def die_in_layer_0(page: Page, label: str, *args: Any, **kwargs: Any) -> Any:
        if label == "Layer 0":
            raise KeyboardInterrupt("scancel")
        return real_train_label(page, label, *args, **kwargs)

    monkeypatch.setattr(train_module, "train_label", die_in_layer_0)
    with pytest.raises(KeyboardInterrupt):
        train_page(striped_page(), settings, tmp_path / "models", run_dir=run)
    with np.load(run.history_npz_path) as data:
        assert list(data["labels"]) == ["Background"]
        assert data["Background/loss"].shape == (1,)
    assert len(run.history_csv_path.read_text().splitlines()) == 2
    assert run.curves_path.exists() and json.loads(run.settings_path.read_text())["epochs"] == 1
