"""Sample the GPUs' utilisation and memory in the background while a job trains.

``GpuMonitor`` is a context manager: on entry it finds a backend, NVML through ``pynvml``
(the ``nvidia-ml-py`` package) first, else the ``nvidia-smi`` command when it is on PATH;
with either it appends one CSV row per GPU every ``interval_s`` seconds from a daemon
thread, and on exit it logs the event ``gpu_summary``. With neither (no driver, no GPU,
or none that ``CUDA_VISIBLE_DEVICES`` leaves to the job) it logs ``gpu_monitor_unavailable``
once and does nothing else: no thread, no file.

The CSV (header included; appended and flushed after every sample, so a killed job keeps
what was sampled) has the columns in :data:`CSV_COLUMNS`::

    timestamp        UTC, ISO 8601 with milliseconds
    gpu              the device index as NVML / nvidia-smi number it
    name             the product name
    utilization_percent, memory_used_mib, memory_total_mib, power_w, temperature_c

A value the GPU does not report (power on some boards, utilisation under MIG) is empty.
Only the GPUs that ``CUDA_VISIBLE_DEVICES`` names (indices or ``GPU-`` UUIDs) are
sampled when it is set and names any the driver knows; otherwise all of them.

The thread never raises into training: the first error it meets is logged
(``gpu_monitor_failed``) and sampling stops. Stopping is prompt whatever the interval.
"""

from __future__ import annotations

import csv
import importlib
import math
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import structlog

from bridge.shell import CommandInterrupted, run_command

CSV_COLUMNS = (
    "timestamp",
    "gpu",
    "name",
    "utilization_percent",
    "memory_used_mib",
    "memory_total_mib",
    "power_w",
    "temperature_c",
)
#: What ``nvidia-smi --query-gpu`` is asked for, in this order.
SMI_FIELDS = (
    "index",
    "uuid",
    "name",
    "utilization.gpu",
    "memory.used",
    "memory.total",
    "power.draw",
    "temperature.gpu",
)
SMI_TIMEOUT_S = 20.0
MIB = 1024 * 1024


class MonitorUnavailable(Exception):
    """No backend can see a GPU here."""


@dataclass(frozen=True)
class GpuSample:
    """One GPU's reading; None where the GPU does not report the value."""

    index: int
    name: str
    utilization_percent: float | None
    memory_used_mib: float | None
    memory_total_mib: float | None
    power_w: float | None = None
    temperature_c: float | None = None


def visible_devices(environ: dict[str, str] | None = None) -> list[str] | None:
    """The entries of CUDA_VISIBLE_DEVICES, or None when it is unset."""
    value = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def select_devices(devices: Sequence[tuple[int, str]], visible: list[str] | None) -> list[int]:
    """The indices of ``devices`` ((index, uuid) pairs) that ``visible`` names, else all of them.

    An entry names a device by its index or by (a prefix of) its UUID. When ``visible``
    is None or names none of the devices (a cgroup may renumber them), all are kept.
    """
    indices = [index for index, _ in devices]
    if not visible:
        return indices
    chosen: list[int] = []
    for entry in visible:
        for index, uuid in devices:
            matches = entry == str(index) if entry.isdigit() else bool(uuid) and uuid.startswith(entry)
            if matches and index not in chosen:
                chosen.append(index)
    return chosen or indices


# --------------------------------------------------------------------------- backends


class NvmlBackend:
    """Readings through NVML (``pynvml``)."""

    name = "nvml"

    def __init__(self, visible: list[str] | None) -> None:
        try:
            self.nvml: Any = importlib.import_module("pynvml")
        except ImportError as exc:
            raise MonitorUnavailable(f"pynvml is not installed ({exc})") from exc
        try:
            self.nvml.nvmlInit()
        except Exception as exc:  # pynvml.NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            raise MonitorUnavailable(f"NVML: {exc}") from exc
        try:
            count = int(self.nvml.nvmlDeviceGetCount())
            devices = []
            for index in range(count):
                handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
                devices.append((index, _text(self._optional(self.nvml.nvmlDeviceGetUUID, handle) or "")))
            self.indices = select_devices(devices, visible)
            if not self.indices:
                raise MonitorUnavailable("NVML sees no GPU")
            self.handles = {index: self.nvml.nvmlDeviceGetHandleByIndex(index) for index in self.indices}
            self.memory_version = self._memory_version(next(iter(self.handles.values())))
            self.names = {
                index: _text(self._optional(self.nvml.nvmlDeviceGetName, handle) or "")
                for index, handle in self.handles.items()
            }
        except BaseException:
            self.close()
            raise

    def _memory_version(self, handle: Any) -> int | None:
        """NVML's v2 memory query where it works: its ``used`` leaves out the memory the driver
        reserves, as nvidia-smi does (v1 counts it, some 600 MiB on an idle H200)."""
        version = getattr(self.nvml, "nvmlMemory_v2", None)
        if version is None:
            return None
        try:
            self.nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
        except Exception:  # an older driver or pynvml
            return None
        return int(version)

    def _memory(self, handle: Any) -> Any:
        if self.memory_version is None:
            return self._optional(self.nvml.nvmlDeviceGetMemoryInfo, handle)
        try:
            return self.nvml.nvmlDeviceGetMemoryInfo(handle, version=self.memory_version)
        except self.nvml.NVMLError:
            return None

    def _optional(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)``, or None where the GPU does not support the query."""
        try:
            return function(*args)
        except self.nvml.NVMLError:
            return None

    def sample(self) -> list[GpuSample]:
        samples = []
        for index, handle in self.handles.items():
            rates = self._optional(self.nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = self._memory(handle)
            power_mw = self._optional(self.nvml.nvmlDeviceGetPowerUsage, handle)
            temperature = self._optional(self.nvml.nvmlDeviceGetTemperature, handle, self.nvml.NVML_TEMPERATURE_GPU)
            samples.append(
                GpuSample(
                    index=index,
                    name=self.names[index],
                    utilization_percent=None if rates is None else float(rates.gpu),
                    memory_used_mib=None if memory is None else memory.used / MIB,
                    memory_total_mib=None if memory is None else memory.total / MIB,
                    power_w=None if power_mw is None else power_mw / 1000.0,
                    temperature_c=None if temperature is None else float(temperature),
                )
            )
        return samples

    def interrupt(self) -> None:
        """Nothing to interrupt: an NVML query does not block."""

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:  # noqa: S110 - closing is best effort
            pass


class SmiBackend:
    """Readings from ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits``, run once per sample."""

    name = "nvidia-smi"

    def __init__(self, visible: list[str] | None, executable: str | None = None) -> None:
        found = executable or shutil.which("nvidia-smi")
        if found is None:
            raise MonitorUnavailable("nvidia-smi is not on PATH")
        self.executable = found
        self.visible = visible
        self._interrupted = threading.Event()
        try:
            self.first = self.sample()
        except MonitorUnavailable:
            raise
        except Exception as exc:
            raise MonitorUnavailable(f"nvidia-smi: {exc}") from exc
        if not self.first:
            raise MonitorUnavailable("nvidia-smi lists no GPU")

    def _query(self) -> str:
        """One query's output; "" once interrupted (a query under way is killed)."""
        command = [self.executable, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"]
        try:
            result = run_command(command, timeout=SMI_TIMEOUT_S, check=False, stop=self._interrupted.is_set)
        except CommandInterrupted:
            return ""
        if result.returncode != 0:
            message = (
                result.stdout.strip() or result.stderr.strip() or f"exit status {result.returncode}"
            ).splitlines()[0]
            raise MonitorUnavailable(f"nvidia-smi failed: {message}")
        return result.stdout

    def sample(self) -> list[GpuSample]:
        rows = [parse_smi_line(line) for line in self._query().splitlines() if line.strip()]
        keep = set(select_devices([(index, uuid) for index, uuid, _ in rows], self.visible))
        return [sample for index, _, sample in rows if index in keep]

    def interrupt(self) -> None:
        """Kill a query under way (within ``run_command``'s poll interval), so that stopping never
        waits for nvidia-smi; no query starts after this."""
        self._interrupted.set()

    def close(self) -> None:
        self.interrupt()


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _cell(value: float | None) -> str:
    """A CSV cell: "" for None, "80" for 80.0, "123.46" for 123.456."""
    if value is None:
        return ""
    return str(int(value)) if float(value).is_integer() else repr(round(value, 2))


def _number(text: str) -> float | None:
    """A number from nvidia-smi's CSV ("[N/A]", "[Not Supported]", "" -> None)."""
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_smi_line(line: str) -> tuple[int, str, GpuSample]:
    """Parse one line of the query in :data:`SMI_FIELDS` order: (index, uuid, sample)."""
    fields = [field.strip() for field in next(csv.reader([line], skipinitialspace=True))]
    if len(fields) != len(SMI_FIELDS):
        raise ValueError(f"nvidia-smi printed {len(fields)} fields, expected {len(SMI_FIELDS)}: {line!r}")
    index, uuid, name, utilization, used, total, power, temperature = fields
    sample = GpuSample(
        index=int(index),
        name=name,
        utilization_percent=_number(utilization),
        memory_used_mib=_number(used),
        memory_total_mib=_number(total),
        power_w=_number(power),
        temperature_c=_number(temperature),
    )
    return int(index), uuid, sample


# --------------------------------------------------------------------------- the monitor


@dataclass
class _Stats:
    name: str
    samples: int = 0
    utilization_samples: int = 0
    utilization_sum: float = 0.0
    utilization_max: float | None = None
    memory_max: float | None = None
    memory_total: float | None = None

    def add(self, sample: GpuSample) -> None:
        self.samples += 1
        if sample.utilization_percent is not None:
            self.utilization_samples += 1
            self.utilization_sum += sample.utilization_percent
            self.utilization_max = max(self.utilization_max or 0.0, sample.utilization_percent)
        if sample.memory_used_mib is not None:
            self.memory_max = max(self.memory_max or 0.0, sample.memory_used_mib)
        if sample.memory_total_mib is not None:
            self.memory_total = sample.memory_total_mib

    def as_dict(self) -> dict[str, Any]:
        mean = self.utilization_sum / self.utilization_samples if self.utilization_samples else None
        return {
            "name": self.name,
            "samples": self.samples,
            "mean_utilization_percent": None if mean is None else round(mean, 2),
            "max_utilization_percent": self.utilization_max,
            "max_memory_used_mib": None if self.memory_max is None else round(self.memory_max, 1),
            "memory_total_mib": None if self.memory_total is None else round(self.memory_total, 1),
        }


Backend = NvmlBackend | SmiBackend


class GpuMonitor:
    """Sample every GPU every ``interval_s`` seconds into ``out_csv`` while in a ``with`` block.

    ``backend`` after entry is "nvml", "nvidia-smi" or None (unavailable). ``summary()``
    is, per GPU index, ``name``, ``samples``, ``mean_utilization_percent``,
    ``max_utilization_percent``, ``max_memory_used_mib`` and ``memory_total_mib`` (None
    where never reported); it is empty without a backend.
    """

    def __init__(self, out_csv: Path, interval_s: float = 5.0) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, not {interval_s}")
        self.out_csv = Path(out_csv)
        self.interval_s = float(interval_s)
        self.backend: str | None = None
        self.error: str | None = None
        self._log = structlog.get_logger("worker")
        self._backend: Backend | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats: dict[int, _Stats] = {}
        self._stats_lock = threading.Lock()
        self._file: IO[str] | None = None
        self._writer: Any = None
        self._started = False

    # ------------------------------------------------------------------------ life cycle

    def __enter__(self) -> GpuMonitor:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> GpuMonitor:
        """Find a backend and start sampling; without one, log so once and return."""
        if self._started:
            raise RuntimeError("a GpuMonitor starts once")
        self._started = True
        visible = visible_devices()
        reasons = []
        for make in (NvmlBackend, SmiBackend):
            try:
                self._backend = make(visible)
                break
            except MonitorUnavailable as exc:
                reasons.append(str(exc))
        if self._backend is None:
            self._log.info("gpu_monitor_unavailable", reasons=reasons)
            return self
        self.backend = self._backend.name
        try:
            first = self._backend.first if isinstance(self._backend, SmiBackend) else self._backend.sample()
            self.out_csv.parent.mkdir(parents=True, exist_ok=True)
            new = not self.out_csv.exists() or self.out_csv.stat().st_size == 0
            self._file = self.out_csv.open("a", newline="", encoding="utf-8")
            self._writer = csv.writer(self._file, lineterminator="\n")
            if new:
                self._writer.writerow(CSV_COLUMNS)
            self._record(first)
        except Exception as exc:
            self._fail(exc)
            return self
        self._log.info(
            "gpu_monitor_started",
            backend=self.backend,
            gpus={sample.index: sample.name for sample in first},
            interval_s=self.interval_s,
            csv=str(self.out_csv),
        )
        self._thread = threading.Thread(target=self._run, name="gpu-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop sampling (promptly), close the CSV and log ``gpu_summary`` once."""
        if self._backend is None or self._stop.is_set():
            return
        self._stop.set()
        self._backend.interrupt()
        if self._thread is not None:
            self._thread.join(timeout)
        self._close()
        self._log.info("gpu_summary", backend=self.backend, gpus=self.summary(), error=self.error)

    def summary(self) -> dict[int, dict[str, Any]]:
        with self._stats_lock:
            return {index: stats.as_dict() for index, stats in sorted(self._stats.items())}

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------------ sampling

    def _run(self) -> None:
        assert self._backend is not None
        while not self._stop.wait(self.interval_s):
            try:
                samples = self._backend.sample()
                if self._stop.is_set():
                    return
                self._record(samples)
            except Exception as exc:
                if not self._stop.is_set():
                    self._fail(exc)
                return

    def _record(self, samples: list[GpuSample]) -> None:
        stamp = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        with self._stats_lock:
            if self._writer is None or self._file is None:
                return
            for sample in samples:
                self._writer.writerow(
                    [
                        stamp,
                        sample.index,
                        sample.name,
                        *(
                            _cell(value)
                            for value in (
                                sample.utilization_percent,
                                sample.memory_used_mib,
                                sample.memory_total_mib,
                                sample.power_w,
                                sample.temperature_c,
                            )
                        ),
                    ]
                )
                self._stats.setdefault(sample.index, _Stats(sample.name)).add(sample)
            self._file.flush()

    def _fail(self, exc: BaseException) -> None:
        """Log the first error, stop sampling; never raises."""
        if self.error is None:
            self.error = f"{type(exc).__name__}: {exc}"
            self._log.warning("gpu_monitor_failed", backend=self.backend, error=self.error)

    def _close(self) -> None:
        with self._stats_lock:
            if self._file is not None:
                self._file.close()
            self._file, self._writer = None, None
        if self._backend is not None:
            self._backend.close()
