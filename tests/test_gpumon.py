"""Tests of worker.gpumon: no GPU here, so a fake nvidia-smi on PATH and a fake pynvml module."""

from __future__ import annotations

import contextlib
import csv
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from worker import gpumon
from worker.gpumon import CSV_COLUMNS, SMI_FIELDS, GpuMonitor, parse_smi_line

MIB = 1024 * 1024


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def monitor_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gpu-monitor"]


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def without_command_trace(logger: Any, method: str, event: Any) -> Any:
    """Drop bridge.shell's debug line for each nvidia-smi run: it is no event of the monitor's."""
    if event.get("event") == "command_ran":
        raise structlog.DropEvent
    return event


@pytest.fixture
def logs() -> Iterator[list[dict[str, Any]]]:
    with capture_logs(processors=[without_command_trace]) as captured:
        yield captured


@pytest.fixture
def no_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PATH without nvidia-smi (but with sh and sleep, for the fake ones)."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", f"{empty}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if any((Path(d) / "nvidia-smi").exists() for d in ("/usr/bin", "/bin")):
        pytest.skip("this machine has nvidia-smi")


def fake_smi(directory: Path, script: str) -> Path:
    directory.mkdir(exist_ok=True)
    path = directory / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return path


def put_first_on_path(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")


def fake_pynvml(
    utilization: tuple[int, ...] = (37, 80),
    fail_after: int | None = None,
    init_error: bool = False,
    memory_v2: bool = False,
) -> types.ModuleType:
    """A pynvml with two GPUs and fixed readings; GPU 1 cannot report power.

    Without ``memory_v2`` it is an old pynvml: no ``version`` argument to the memory query.
    With it, the v2 query reports 500 MiB less used (what the driver reserves).
    """
    nvml = types.ModuleType("pynvml")
    calls = {"utilization": 0, "shutdown": 0}

    class NVMLError(Exception):
        pass

    def init() -> None:
        if init_error:
            raise NVMLError("NVML Shared Library Not Found")

    def rates(handle: int) -> types.SimpleNamespace:
        calls["utilization"] += 1
        if fail_after is not None and calls["utilization"] > fail_after:
            raise RuntimeError("the driver went away")
        return types.SimpleNamespace(gpu=utilization[handle], memory=5)

    def power(handle: int) -> int:
        if handle == 1:
            raise NVMLError("Not Supported")
        return 123_456  # mW

    def shutdown() -> None:
        calls["shutdown"] += 1

    nvml.NVMLError = NVMLError  # type: ignore[attr-defined]
    nvml.NVML_TEMPERATURE_GPU = 0  # type: ignore[attr-defined]
    nvml.nvmlInit = init  # type: ignore[attr-defined]
    nvml.nvmlShutdown = shutdown  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetCount = lambda: 2  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = lambda index: index  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetUUID = lambda handle: f"GPU-aaaa{handle}-fake"  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetName = lambda handle: b"Fake H100"  # type: ignore[attr-defined]  # old pynvml: bytes
    nvml.nvmlDeviceGetUtilizationRates = rates  # type: ignore[attr-defined]

    def memory(handle: int, **kwargs: Any) -> types.SimpleNamespace:
        if kwargs and not memory_v2:
            raise TypeError("nvmlDeviceGetMemoryInfo() got an unexpected keyword argument 'version'")
        reserved = 500 if kwargs.get("version") == 0x02000028 else 0
        return types.SimpleNamespace(used=(1000 + handle - reserved) * MIB, total=81559 * MIB, free=0)

    if memory_v2:
        nvml.nvmlMemory_v2 = 0x02000028  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetMemoryInfo = memory  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetPowerUsage = power  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetTemperature = lambda handle, sensor: 55 + handle  # type: ignore[attr-defined]
    nvml.calls = calls  # type: ignore[attr-defined]
    return nvml


# --------------------------------------------------------------------------- no GPU


def test_this_machine_has_no_gpu(tmp_path: Path, no_smi: None, logs: list[dict[str, Any]]) -> None:
    """The real environment (pynvml installed or not, no driver, no nvidia-smi): one line, nothing else."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("NVML works on this machine")
    out = tmp_path / "gpu.csv"
    with GpuMonitor(out, interval_s=0.01) as monitor:
        assert monitor.backend is None and not monitor.running and not monitor_threads()
        time.sleep(0.05)
    assert [entry["event"] for entry in logs] == ["gpu_monitor_unavailable"]
    assert monitor.summary() == {}
    assert not out.exists()


def test_no_pynvml_and_no_smi(tmp_path: Path, no_smi: None, monkeypatch: pytest.MonkeyPatch, logs: list) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    with GpuMonitor(tmp_path / "gpu.csv") as monitor:
        pass
    assert monitor.backend is None and monitor._thread is None
    assert len(logs) == 1 and logs[0]["event"] == "gpu_monitor_unavailable"
    assert "pynvml is not installed" in logs[0]["reasons"][0] and "not on PATH" in logs[0]["reasons"][1]


def test_smi_without_devices_is_unavailable(
    tmp_path: Path, no_smi: None, monkeypatch: pytest.MonkeyPatch, logs: list
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=True))
    put_first_on_path(monkeypatch, tmp_path / "bin")
    fake_smi(tmp_path / "bin", 'echo "No devices were found"\nexit 6\n')
    with GpuMonitor(tmp_path / "gpu.csv") as monitor:
        pass
    assert monitor.backend is None
    assert [e["event"] for e in logs] == ["gpu_monitor_unavailable"]
    assert "No devices were found" in logs[0]["reasons"][1] and "NVML" in logs[0]["reasons"][0]


# --------------------------------------------------------------------------- nvidia-smi


def test_parse_smi_line() -> None:
    index, uuid, sample = parse_smi_line("1, GPU-1234, NVIDIA A100-SXM4-40GB, [N/A], 1024, 40960, [Not Supported], 41")
    assert (index, uuid, sample.name) == (1, "GPU-1234", "NVIDIA A100-SXM4-40GB")
    assert sample.utilization_percent is None and sample.power_w is None
    assert (sample.memory_used_mib, sample.memory_total_mib, sample.temperature_c) == (1024, 40960, 41)
    with pytest.raises(ValueError):
        parse_smi_line("0, GPU-1, too few")


def test_smi_backend(tmp_path: Path, no_smi: None, monkeypatch: pytest.MonkeyPatch, logs: list) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    put_first_on_path(monkeypatch, tmp_path / "bin")
    fake_smi(
        tmp_path / "bin",
        f'echo "$@" > "{tmp_path}/args"\n'
        'echo "0, GPU-aaaa, NVIDIA H100 80GB HBM3, 40, 1000, 81559, 250.5, 50"\n'
        'echo "1, GPU-bbbb, NVIDIA H100 80GB HBM3, 60, 3000, 81559, [N/A], 52"\n',
    )
    out = tmp_path / "logs" / "gpu.csv"
    with GpuMonitor(out, interval_s=0.05) as monitor:
        assert monitor.backend == "nvidia-smi" and monitor.running
        wait_for(lambda: monitor.summary()[0]["samples"] >= 3)
    assert not monitor.running and not monitor_threads()
    args = (tmp_path / "args").read_text().split()
    assert f"--query-gpu={','.join(SMI_FIELDS)}" in args and "--format=csv,noheader,nounits" in args

    table = rows(out)
    assert list(table[0]) == list(CSV_COLUMNS)
    assert {r["gpu"] for r in table} == {"0", "1"} and len(table) % 2 == 0
    first, second = table[0], table[1]
    assert (first["utilization_percent"], first["memory_used_mib"], first["memory_total_mib"]) == (
        "40",
        "1000",
        "81559",
    )
    assert (first["power_w"], first["temperature_c"], first["name"]) == ("250.5", "50", "NVIDIA H100 80GB HBM3")
    assert second["power_w"] == "" and second["utilization_percent"] == "60"
    assert first["timestamp"].endswith("+00:00")

    summary = monitor.summary()
    assert summary[1] == {
        "name": "NVIDIA H100 80GB HBM3",
        "samples": len(table) // 2,
        "mean_utilization_percent": 60.0,
        "max_utilization_percent": 60.0,
        "max_memory_used_mib": 3000.0,
        "memory_total_mib": 81559.0,
    }
    events = [e["event"] for e in logs]
    assert events == ["gpu_monitor_started", "gpu_summary"]
    assert logs[-1]["gpus"] == summary and logs[-1]["backend"] == "nvidia-smi" and logs[-1]["error"] is None


def test_smi_respects_cuda_visible_devices(tmp_path: Path, no_smi: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")
    put_first_on_path(monkeypatch, tmp_path / "bin")
    fake_smi(
        tmp_path / "bin",
        'echo "0, GPU-aaaa, A, 40, 1000, 8000, 1, 50"\necho "1, GPU-bbbb, B, 60, 3000, 8000, 1, 52"\n',
    )
    with capture_logs(), GpuMonitor(tmp_path / "gpu.csv", interval_s=60) as monitor:
        pass
    assert list(monitor.summary()) == [1]


def test_stop_interrupts_a_hanging_nvidia_smi(tmp_path: Path, no_smi: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    put_first_on_path(monkeypatch, tmp_path / "bin")
    marker = tmp_path / "called"
    hanging = tmp_path / "hanging"  # written by the hanging call: its pid, once it is inside the hang
    # The hang outlasts both nvidia-smi's own time limit and stop's wait for the thread, so that a
    # stop which does not interrupt the query leaves the thread running and nvidia-smi alive: the
    # outcome says whether it was interrupted, not a stopwatch (a busy machine only takes longer).
    monkeypatch.setattr(gpumon, "SMI_TIMEOUT_S", 3600.0)
    fake_smi(  # the first call answers, the next hang
        tmp_path / "bin",
        f'if [ -e "{marker}" ]; then echo $$ > "{hanging}.tmp" && mv "{hanging}.tmp" "{hanging}"; exec sleep 600; fi\n'
        f'touch "{marker}"\n'
        'echo "0, GPU-aaaa, A, 40, 1000, 8000, 1, 50"\n',
    )
    pid = 0
    try:
        with capture_logs(processors=[without_command_trace]) as logs:
            monitor = GpuMonitor(tmp_path / "gpu.csv", interval_s=0.05).start()
            wait_for(hanging.exists)  # the thread now waits on the hanging nvidia-smi
            pid = int(hanging.read_text())
            monitor.stop(timeout=120)  # returns when the thread ends, or gives up after 120 s
        assert not monitor.running
        with pytest.raises(ProcessLookupError):  # the hanging nvidia-smi was killed (and reaped)
            os.kill(pid, 0)
    finally:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert [e["event"] for e in logs] == ["gpu_monitor_started", "gpu_summary"]  # an interrupt is no failure


# --------------------------------------------------------------------------- NVML


def test_nvml_backend(tmp_path: Path, no_smi: None, monkeypatch: pytest.MonkeyPatch, logs: list) -> None:
    nvml = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    out = tmp_path / "gpu.csv"
    with GpuMonitor(out, interval_s=0.05) as monitor:
        assert monitor.backend == "nvml"
        wait_for(lambda: monitor.summary()[1]["samples"] >= 3)
    assert nvml.calls["shutdown"] == 1  # type: ignore[attr-defined]
    table = rows(out)
    gpu0 = [r for r in table if r["gpu"] == "0"]
    gpu1 = [r for r in table if r["gpu"] == "1"]
    assert len(gpu0) == len(gpu1) >= 3
    assert gpu0[0] | {"timestamp": ""} == {
        "timestamp": "",
        "gpu": "0",
        "name": "Fake H100",
        "utilization_percent": "37",
        "memory_used_mib": "1000",
        "memory_total_mib": "81559",
        "power_w": "123.46",
        "temperature_c": "55",
    }
    assert gpu1[0]["power_w"] == "" and gpu1[0]["utilization_percent"] == "80"
    summary = monitor.summary()
    assert summary[0]["mean_utilization_percent"] == 37.0 and summary[1]["max_utilization_percent"] == 80.0
    assert summary[1]["max_memory_used_mib"] == 1001.0 and summary[0]["samples"] == len(gpu0)
    assert [e["event"] for e in logs] == ["gpu_monitor_started", "gpu_summary"]
    assert logs[0]["gpus"] == {0: "Fake H100", 1: "Fake H100"}


def test_nvml_memory_v2_leaves_out_the_reserved_memory(
    tmp_path: Path, no_smi: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(memory_v2=True))
    with capture_logs(), GpuMonitor(tmp_path / "gpu.csv", interval_s=60) as monitor:
        pass
    assert monitor.summary()[0]["max_memory_used_mib"] == 500.0  # like nvidia-smi; v1 says 1000
    assert rows(tmp_path / "gpu.csv")[0]["memory_used_mib"] == "500"


def test_nvml_respects_cuda_visible_devices(tmp_path: Path, no_smi: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    for visible, expected in (("1", [1]), ("GPU-aaaa0", [0]), ("0,1", [0, 1]), ("7", [0, 1])):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        with capture_logs(), GpuMonitor(tmp_path / f"gpu-{visible}.csv", interval_s=60) as monitor:
            pass
        assert list(monitor.summary()) == expected, visible


def test_stop_is_prompt(tmp_path: Path, no_smi: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop wakes the thread out of its wait for the next sample: with an hour between samples and
    stop waiting at most two minutes for the thread, a stop that did not wake it leaves it running."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    with capture_logs():
        monitor = GpuMonitor(tmp_path / "gpu.csv", interval_s=3600).start()
        assert monitor.running
        monitor.stop(timeout=120)
    assert not monitor.running and not monitor_threads()
    assert monitor.summary()[0]["samples"] == 1  # the one taken at start


def test_a_failing_sampler_never_raises(
    tmp_path: Path, no_smi: None, monkeypatch: pytest.MonkeyPatch, logs: list
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(fail_after=4))  # start + one round, then fails
    errors: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    with GpuMonitor(tmp_path / "gpu.csv", interval_s=0.02) as monitor:
        wait_for(lambda: not monitor.running)
        time.sleep(0.1)
    assert not errors
    events = [e["event"] for e in logs]
    assert events == ["gpu_monitor_started", "gpu_monitor_failed", "gpu_summary"]
    assert "the driver went away" in logs[1]["error"] and logs[2]["error"] == logs[1]["error"]
    assert monitor.summary()[0]["samples"] == 2
