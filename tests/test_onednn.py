"""The worker's per-CPU oneDNN choice: measured in real TensorFlow children, then remembered."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

pytest.importorskip("keras")  # the measurement trains the SAE

from worker import onednn

pytestmark = pytest.mark.training


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(onednn.VARIABLE, "unset")  # so that teardown removes what choose() sets
    monkeypatch.delenv(onednn.VARIABLE)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # as on a CPU node, whatever this machine has


def ours(events: list[dict[str, object]]) -> list[object]:
    return [e["event"] for e in events if str(e["event"]).startswith("onednn")]


def test_measures_once_per_cpu_then_reads_the_decision(tmp_path: Path, clean_environment: None) -> None:
    with capture_logs() as first_events:
        setting = onednn.choose(tmp_path)
    files = list(tmp_path.glob("onednn-*.json"))
    assert len(files) == 1 and files[0].name == f"onednn-{onednn.cpu_key()}.json"
    decision = json.loads(files[0].read_text())
    step_s = decision["step_s"]
    assert set(step_s) == {"0", "1"} and all(0 < value < 60 for value in step_s.values())
    assert setting == decision["setting"] == ("1" if step_s["1"] <= onednn.MARGIN * step_s["0"] else "0")
    assert os.environ[onednn.VARIABLE] == setting  # what this process's TensorFlow will read
    assert ours(first_events) == ["onednn_measured", "onednn_chosen"]

    del os.environ[onednn.VARIABLE]
    with capture_logs() as second_events:
        assert onednn.choose(tmp_path) == setting
    assert ours(second_events) == ["onednn_chosen"]  # read, not measured again
    assert json.loads(files[0].read_text()) == decision


def test_an_operators_setting_and_gpu_nodes_are_left_alone(
    tmp_path: Path, clean_environment: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(onednn.VARIABLE, "0")
    assert onednn.choose(tmp_path) == "0"
    monkeypatch.delenv(onednn.VARIABLE)
    monkeypatch.setattr(onednn, "has_nvidia_gpu", lambda: True)
    assert onednn.choose(tmp_path) is None
    assert onednn.VARIABLE not in os.environ and not list(tmp_path.iterdir())


def test_a_corrupt_or_unwritable_cache_keeps_tensorflows_default(
    tmp_path: Path, clean_environment: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / f"onednn-{onednn.cpu_key()}.json").write_text('{"setting": "maybe"}')
    monkeypatch.setattr(onednn, "measure", lambda: None)  # a failed measurement
    with capture_logs():
        assert onednn.choose(tmp_path) is None
    assert onednn.VARIABLE not in os.environ
    blocked = tmp_path / "file"
    blocked.write_text("")
    with capture_logs() as events:
        assert onednn.choose(blocked / "tuning") is None
    assert ours(events) == ["onednn_not_chosen"]
