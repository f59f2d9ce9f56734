"""The oneDNN choice: measured in real TensorFlow children by ``hpc-worker tune`` (what doctor --job's
probe runs on a node), kept per kind of node and environment, read by jobs that never measure."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

pytest.importorskip("keras")  # the measurement trains the SAE

from worker import cli, onednn

pytestmark = pytest.mark.training


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(onednn.VARIABLE, "unset")  # so that teardown removes what choose() sets
    monkeypatch.delenv(onednn.VARIABLE)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # as on a CPU node, whatever this machine has
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")


@pytest.fixture
def measurements(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Counts measurements (each a fake one choosing oneDNN on) instead of running them."""
    calls: list[float] = []

    def fake(timeout_s: float = onednn.MEASURE_TIMEOUT_S) -> dict[str, Any]:
        calls.append(timeout_s)
        versions = {"tensorflow": onednn.tensorflow_version(), "python": onednn.python_version()}
        return {"setting": "1", "step_s": {"0": 2.0, "1": 1.0}, "measured": 1.0, **versions}

    monkeypatch.setattr(onednn, "measure", fake)
    return calls


def ours(events: list[dict[str, object]]) -> list[object]:
    return [e["event"] for e in events if str(e["event"]).startswith("onednn")]


def test_tune_measures_once_per_kind_of_node_and_jobs_read_it_without_measuring(
    tmp_path: Path, clean_environment: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real measurement (two TensorFlow children), by the operator's command; then a second tune and
    two job starts: none measures (catches a cache that is not reused, or a job start that measures)."""
    monkeypatch.setenv("HPC_TUNING_DIR", str(tmp_path))
    assert cli.main(["tune"]) == 0
    out, err = capsys.readouterr()
    first_events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]  # its JSON log
    files = list(tmp_path.glob("onednn-*.json"))
    assert len(files) == 1 and files[0] == onednn.record_path(tmp_path)
    decision = json.loads(files[0].read_text())
    step_s = decision["step_s"]
    assert set(step_s) == {"0", "1"} and all(0 < value < 60 for value in step_s.values())
    assert decision["setting"] == ("1" if step_s["1"] <= onednn.MARGIN * step_s["0"] else "0")
    assert decision["tensorflow"] == onednn.tensorflow_version() and decision["python"] == onednn.python_version()
    assert ours(first_events) == ["onednn_measured"] and "measured now" in err
    assert onednn.VARIABLE not in os.environ  # tune sets nothing for itself

    counted: list[object] = []
    monkeypatch.setattr(onednn, "measure", lambda *a, **k: counted.append(a) or None)
    again = onednn.remember(tmp_path)
    assert (again.outcome, again.setting, counted) == ("recorded", decision["setting"], [])
    assert "measured before" in again.describe()
    for _job in range(2):
        os.environ.pop(onednn.VARIABLE, None)
        with capture_logs() as job_events:
            assert onednn.choose(tmp_path) == decision["setting"]
        assert ours(job_events) == ["onednn_chosen"] and counted == []
        assert os.environ[onednn.VARIABLE] == decision["setting"]  # what the job's TensorFlow will read
    assert json.loads(files[0].read_text()) == decision


def test_a_job_without_a_record_keeps_tensorflows_default_and_says_so(
    tmp_path: Path, clean_environment: None, measurements: list[float]
) -> None:
    """Catches a job start that measures when no record exists (the 20-50 s before training)."""
    with capture_logs() as events:
        assert onednn.choose(tmp_path) is None
    assert ours(events) == ["onednn_default"] and measurements == []
    assert "no measurement for this kind of node" in str(events[-1]["reason"])
    assert "hpc-bridge doctor --job" in str(events[-1]["note"])
    assert onednn.VARIABLE not in os.environ and list(tmp_path.iterdir()) == []


def test_jax_never_measures_nor_sets_anything(
    tmp_path: Path, clean_environment: None, measurements: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """KERAS_BACKEND=jax: neither tune nor a job measures, and a record of the node is not applied
    (catches a JAX worker that pays for TensorFlow's measurement)."""
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    with capture_logs() as events:
        tuning = onednn.remember(tmp_path)
    assert tuning.outcome == "skipped" and "jax" in tuning.detail and measurements == []
    assert ours(events) == ["onednn_skipped"] and list(tmp_path.iterdir()) == []
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    assert onednn.remember(tmp_path).outcome == "measured" and len(measurements) == 1  # a record now exists
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    with capture_logs() as events:
        assert onednn.choose(tmp_path) is None
    assert ours(events) == ["onednn_skipped"] and onednn.VARIABLE not in os.environ and len(measurements) == 1


def test_a_stale_record_is_never_used(
    tmp_path: Path, clean_environment: None, measurements: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record measured with another TensorFlow (or Python) is not applied by a job, and tune measures
    again (catches a record trusted by its name alone)."""
    assert onednn.remember(tmp_path).outcome == "measured"
    record = onednn.record_path(tmp_path)
    # The same name, another TensorFlow inside (e.g. a record copied between environments).
    record.write_text(json.dumps({**json.loads(record.read_text()), "tensorflow": "2.15.0"}))
    with capture_logs() as events:
        assert onednn.choose(tmp_path) is None
    assert ours(events) == ["onednn_default"] and "stale: measured with tensorflow 2.15.0" in str(events[-1]["reason"])
    assert onednn.VARIABLE not in os.environ
    assert onednn.remember(tmp_path).outcome == "measured" and len(measurements) == 2
    # After an upgrade to another TensorFlow: the record of the old one is not this environment's.
    monkeypatch.setattr(onednn, "tensorflow_version", lambda: "9.9.0")
    assert onednn.record_path(tmp_path) != record
    with capture_logs() as events:
        assert onednn.choose(tmp_path) is None
    assert ours(events) == ["onednn_default"] and onednn.VARIABLE not in os.environ


def test_an_operators_setting_and_gpu_nodes_are_left_alone(
    tmp_path: Path, clean_environment: None, measurements: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(onednn.VARIABLE, "0")
    assert onednn.choose(tmp_path) == "0"
    assert onednn.remember(tmp_path).outcome == "skipped"
    monkeypatch.delenv(onednn.VARIABLE)
    monkeypatch.setattr(onednn, "has_nvidia_gpu", lambda: True)
    assert onednn.choose(tmp_path) is None
    assert onednn.remember(tmp_path).outcome == "skipped"
    assert onednn.VARIABLE not in os.environ and not list(tmp_path.iterdir()) and measurements == []


def test_a_corrupt_record_or_an_unwritable_directory_keeps_tensorflows_default(
    tmp_path: Path, clean_environment: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    onednn.record_path(tmp_path).write_text('{"setting": "maybe"}')
    with capture_logs() as events:
        assert onednn.choose(tmp_path) is None
    assert ours(events) == ["onednn_default"] and "holds no setting" in str(events[-1]["reason"])
    monkeypatch.setattr(onednn, "measure", lambda *a, **k: None)  # a failed measurement
    failed = onednn.remember(tmp_path)
    assert failed.outcome == "failed" and "jobs keep TensorFlow's default" in failed.describe()
    assert onednn.VARIABLE not in os.environ
    blocked = tmp_path / "file"
    blocked.write_text("")
    with capture_logs() as events:
        assert onednn.remember(blocked / "tuning").outcome == "failed"
    assert ours(events) == ["onednn_not_recorded"]
