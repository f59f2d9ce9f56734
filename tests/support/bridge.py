"""The bridge as the tests run it: its settings for a test's queues, spool and stand-in, one
``hpc-bridge`` command as cron runs it, and small requests that train in seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bridge.testing.rodan import RodanStandin
from tests.support.broker import Queues

REPO = Path(__file__).resolve().parents[2]
RODAN_EMAIL = "hpc@example.org"
RODAN_PASSWORD = "standin-password-9f2c"
#: Settings for a training request that finishes in seconds on 2 cores: one epoch (the protocol's
#: fewest samples per label, 100, and patches of the older generations' least side, 64). What the
#: tests check of a training (files, replies, events) does not depend on its length, while its cost
#: grows with every epoch: each layer's first epoch may run three times
#: (worker.trainer.settings.MAX_FRESH_STARTS), and several tests train at once. Tests whose subject is
#: not the trainer add :data:`NO_FRESH_STARTS` to the job's prologue.
FAST_SETTINGS: dict[str, Any] = {
    "Maximum number of training epochs": 1,
    "Maximum number of samples per label": 100,
    "Patch height": 64,
    "Patch width": 64,
    "Maximum time (D-HH:MM)": "0-00:15",
    "Maximum memory (MB)": 4096,
    "CPUs": 1,
}
#: HPC_JOB_PROLOGUE for a test that trains for real but is not about the trainer: no layer starts
#: again from new weights (the test hook worker.job.TEST_FRESH_STARTS), so each layer trains its
#: epoch once instead of up to three times.
NO_FRESH_STARTS = "export HPC_TEST_FRESH_STARTS=0"


def bridge_environ(broker_url: str, standin: RodanStandin, queues: Queues, spool: Path, **extra: str) -> dict[str, str]:
    """The settings of one test's bridge (``extra`` adds or overrides)."""
    env = {
        "RABBITMQ_URL": broker_url,
        "RODAN_HOST": standin.host_port,
        "RODAN_SCHEME": "http",
        "RODAN_USER": RODAN_EMAIL,
        "RODAN_PASSWORD": RODAN_PASSWORD,
        "HPC_REQUEST_QUEUE": queues.request,
        "HPC_REPLY_QUEUE": queues.reply,
        "HPC_DEAD_LETTER_QUEUE": queues.dead,
        "HPC_SPOOL_DIR": str(spool),
        "HPC_WORKER_PYTHON": sys.executable,
        "HPC_GPU_RULES": "gpu:1",
        "HPC_RECONCILE_INTERVAL": "1",
        "HPC_RODAN_RETRIES": "2",
    }
    env.update(extra)
    return env


def clean_environ(env: dict[str, str]) -> dict[str, str]:
    """This process's environment without any bridge setting of its own, plus ``env``."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "RODAN_", "HPC_"))}
    full.update(env)
    return full


def run_bridge(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``hpc-bridge`` as cron runs it: a fresh process with only the given settings."""
    return subprocess.run(
        [sys.executable, "-m", "bridge", *args],
        env=clean_environ(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def job_parameters_json(**overrides: Any) -> dict[str, Any]:
    """A complete parameter file (``bridge.handoff.JobParameters.to_json``) for request ``c``, the
    bridge's defaults in it, with ``overrides``: a group's (``rodan={"token": ...}``, ``settings``)
    merged into the group, anything else replaced."""
    from bridge.handoff import BrokerAccess, JobParameters, RodanAccess, SchedulerAccess
    from bridge.protocol import Generation, RequestSettings
    from bridge.schedulers import JobSpec
    from bridge.version import package_version

    spool = Path(overrides.get("spool", "spool"))
    job_dir = spool / "jobs" / "c"
    spec = JobSpec(
        name="rodan-c",
        comment="c",
        time_minutes=60,
        memory_mb=4096,
        cpus=1,
        command=(sys.executable, "-m", "worker", "run", str(spool / "params" / "c.json")),
        log_dir=job_dir,
        workdir=job_dir,
    )
    raw = JobParameters(
        correlation_id="c",
        reply_to="q",
        generation=Generation.NEW,
        inputs={},
        layers=(),
        settings=RequestSettings(),
        rodan=RodanAccess(base_url="http://rodan", token=""),
        broker=BrokerAccess(url="amqp://x"),
        spool=spool,
        runs_dir=spool / "runs",
        job=SchedulerAccess(scheduler="slurm", options={}, script=job_dir / "job.sh", spec=spec),
        created_at=0.0,
        bridge_pid=0,
        bridge_version=package_version(),
    ).to_json()
    return _merged(raw, overrides)


def _merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for name, value in overrides.items():
        group = merged.get(name)
        both = isinstance(value, dict) and isinstance(group, dict) and name != "inputs"
        merged[name] = _merged(group, value) if both else value
    return merged


def fake_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, body: str) -> None:
    """Put a ``/bin/sh`` script named ``command`` first on PATH for this test."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    script = bindir / command
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")


def settled(spool: Path, corrs: list[str]) -> bool:
    """Whether the bridge has settled every one of these requests: its ledger record says replied
    or rejected, and no reply waits in the outbox. After that no reply can come for them."""
    for corr in corrs:
        path = spool / "ledger" / f"{corr}.json"
        if not path.exists() or json.loads(path.read_text()).get("state") not in ("replied", "rejected"):
            return False
    return not list((spool / "outbox").glob("*.json"))
