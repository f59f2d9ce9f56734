"""Versions: the commands, the records that carry one, doctor's comparison, the licence, and the
upgrade that switches the worker environment without moving jobs already queued (docs/upgrade.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path

import pytest
import structlog
import tomllib

from bridge import cli as bridge_cli
from bridge import version as bridge_version
from bridge.config import BridgeConfig, load_config
from bridge.ledger import RequestRecord
from bridge.ops.doctor import check_worker
from bridge.spool import Spool, safe_key
from bridge.version import pinned_worker_python
from tests import stub_worker
from tests.support.bridge import FAST_SETTINGS, REPO, bridge_environ, job_parameters_json, run_bridge
from tests.support.cluster import Cluster, cancel_ledger_jobs
from tests.support.wait import wait_until
from worker import cli as worker_cli
from worker.job import warn_on_version_mismatch

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
INSTALLED = version("hpc-bridge")
BIN = Path(sys.executable).parent


def test_the_installed_version_is_pyprojects() -> None:
    assert INSTALLED == PYPROJECT["version"], "reinstall the project: pip install -e '.[worker,dev]'"
    assert bridge_version.package_version() == INSTALLED


@pytest.mark.parametrize(
    "command,name",
    [
        ([str(BIN / "hpc-bridge"), "--version"], "hpc-bridge"),
        ([str(BIN / "hpc-worker"), "--version"], "hpc-worker"),
        ([sys.executable, "-m", "bridge", "--version"], "hpc-bridge"),
        ([sys.executable, "-m", "worker", "--version"], "hpc-worker"),
    ],
    ids=["hpc-bridge", "hpc-worker", "python-m-bridge", "python-m-worker"],
)
def test_version_commands_print_the_installed_version(command: list[str], name: str, tmp_path: Path) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{name} {INSTALLED}"


@pytest.mark.parametrize("main,name", [(bridge_cli.main, "hpc-bridge"), (worker_cli.main, "hpc-worker")])
def test_version_comes_from_the_package_metadata_not_a_literal(
    main, name, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bridge_version.package_version.cache_clear()
    monkeypatch.setattr(bridge_version, "version", lambda dist: {"hpc-bridge": "9.8.7"}[dist])
    try:
        with pytest.raises(SystemExit) as exc:
            main(["--version"])
    finally:
        bridge_version.package_version.cache_clear()
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"{name} 9.8.7"


def test_license_file_matches_pyproject() -> None:
    declared = PYPROJECT["license"]
    declared = declared["text"] if isinstance(declared, dict) else declared
    assert declared == "MIT"
    text = (REPO / "LICENSE").read_text()
    assert text.splitlines()[0] == "MIT License"
    assert "Permission is hereby granted, free of charge, to any person obtaining a copy" in text
    assert 'THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND' in text


def test_changelog_has_an_unreleased_section_and_one_for_the_current_version() -> None:
    headings = re.findall(r"^## \[([^\]]+)\]", (REPO / "CHANGELOG.md").read_text(), flags=re.M)
    assert headings[0] == "Unreleased"
    assert PYPROJECT["version"] in headings


# --- the records that carry the version ---------------------------------------------------------


def test_a_new_ledger_record_carries_the_version_and_an_old_one_still_loads() -> None:
    record = RequestRecord(correlation_id="c", key="c", reply_to="q")
    assert record.bridge_version == INSTALLED
    assert RequestRecord.from_json(record.to_json()).bridge_version == INSTALLED
    old = record.to_json()
    del old["bridge_version"]  # written by a bridge from before versions were recorded
    assert RequestRecord.from_json(old).bridge_version == ""


def test_the_parameter_file_and_the_ledger_record_name_the_bridge_version(
    broker_url, standin, queues, rodan, sample_inputs, slurm, tmp_path
) -> None:
    spool = tmp_path / "spool"
    env = bridge_environ(broker_url, standin, queues, spool, HPC_SCHEDULER_ARGS="--hold", HPC_WORKER_PYTHON="/bin/true")
    corr = rodan.publish_request(sample_inputs("new", n_layers=1), FAST_SETTINGS)
    try:
        done = run_bridge(env, "check")
        assert done.returncode == 0, done.stderr[-2000:]
        key = safe_key(corr)
        record = json.loads((spool / "ledger" / f"{key}.json").read_text())
        assert record["state"] == "submitted"
        assert record["bridge_version"] == INSTALLED
        params = json.loads((spool / "params" / f"{key}.json").read_text())
        assert params["bridge_version"] == INSTALLED
    finally:
        cancel_ledger_jobs(spool, Cluster("slurm"))


# --- the worker and doctor compare --------------------------------------------------------------


def test_warn_on_version_mismatch() -> None:
    with structlog.testing.capture_logs() as logs:
        assert warn_on_version_mismatch({"bridge_version": INSTALLED}) is False
        assert warn_on_version_mismatch({"bridge_version": "0.0.1"}) is True
        assert warn_on_version_mismatch({}) is True  # a bridge from before versions were recorded
    assert [(e["event"], e["log_level"], e["bridge_version"]) for e in logs] == [
        ("worker_version_mismatch", "warning", "0.0.1"),
        ("worker_version_mismatch", "warning", None),
    ]
    assert all(e["worker_version"] == INSTALLED and "docs/upgrade.md" in e["fix"] for e in logs)


@pytest.mark.parametrize("written_by", ["0.0.1", INSTALLED])
def test_the_worker_logs_a_mismatch_with_the_bridge_that_wrote_its_parameters(written_by: str, tmp_path: Path) -> None:
    """``hpc-worker run`` on a request answered before (it stops right after reading the file)."""
    spool = Spool(tmp_path / "spool").ensure()
    spool.reply_marker(safe_key("c")).write_text("{}")
    params = tmp_path / "params.json"
    params.write_text(json.dumps(job_parameters_json(spool=str(spool.root), bridge_version=written_by)))
    done = subprocess.run(
        [sys.executable, "-m", "worker", "run", str(params)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    names = [e["event"] for e in events]
    assert "already_replied" in names
    mismatches = [e for e in events if e["event"] == "worker_version_mismatch"]
    if written_by == INSTALLED:
        assert mismatches == []
    else:
        assert len(mismatches) == 1
        assert mismatches[0]["bridge_version"] == "0.0.1" and mismatches[0]["worker_version"] == INSTALLED


@pytest.fixture
def config(tmp_path: Path) -> BridgeConfig:
    return load_config(
        environ={
            "RABBITMQ_URL": "amqp://guest:guest@127.0.0.1:5672/%2F",
            "RODAN_HOST": "rodan.example.org",
            "RODAN_USER": "hpc@example.org",
            "RODAN_PASSWORD": "a-password-for-the-version-tests",
            "HPC_SPOOL_DIR": str(tmp_path / "spool"),
        }
    )


def fake_worker_python(directory: Path, prints: str) -> Path:
    """A worker interpreter that answers doctor's probe with ``prints`` (after some noise)."""
    directory.mkdir(parents=True, exist_ok=True)
    python = directory / "python"
    python.write_text(f'#!/bin/sh\necho "some warning TensorFlow prints first"\necho "{prints}"\n')
    python.chmod(0o755)
    return python


def test_doctor_fails_when_the_worker_environment_has_another_version(config: BridgeConfig, tmp_path: Path) -> None:
    python = fake_worker_python(tmp_path / "old", "0.0.1 2.16.1 0")
    check = check_worker(replace(config, worker_python=str(python)))
    assert check.status == "FAIL"
    assert check.found == f"{python} has hpc-bridge 0.0.1, this bridge is {INSTALLED}"
    assert check.fix.startswith("install the same version in the worker environment")
    assert f"'hpc-bridge[worker]=={INSTALLED}'" in check.fix


def test_doctor_passes_the_same_version(config: BridgeConfig, tmp_path: Path) -> None:
    python = fake_worker_python(tmp_path / "same", f"{INSTALLED} 2.16.1 2")
    check = check_worker(replace(config, worker_python=str(python)))
    assert check.status == "ok", check
    assert f"hpc-bridge {INSTALLED}" in check.found and "TensorFlow 2.16.1, 2 GPU(s)" in check.found


# --- jobs keep the environment they were submitted with -----------------------------------------


def test_pinned_worker_python_resolves_the_directories_not_the_interpreter(tmp_path: Path) -> None:
    env = tmp_path / "envs" / "worker-1"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").symlink_to(sys.executable)  # as in a virtual environment
    (tmp_path / "envs" / "current").symlink_to("worker-1")
    pinned = pinned_worker_python(str(tmp_path / "envs" / "current" / "bin" / "python"))
    assert pinned == str(env / "bin" / "python")
    assert pinned_worker_python(str(env / "bin" / "python")) == str(env / "bin" / "python")


def upgrade_guide_switch() -> str:
    """The two lines of docs/upgrade.md that switch ``current`` to the new environment."""
    lines = (REPO / "docs" / "upgrade.md").read_text().splitlines()
    switch = [ln.strip() for ln in lines if ln.strip().startswith(("ln -sfn ", "mv -T "))]
    assert len(switch) == 2, switch
    return " && ".join(switch)


def test_an_upgrade_leaves_a_queued_job_on_the_environment_it_was_submitted_with(
    cluster: Cluster, broker_url, standin, queues, rodan, sample_inputs, tmp_path
) -> None:
    """Two worker environments and a ``current`` symlink as docs/upgrade.md lays them out; a request
    is submitted held through ``current``, the guide's commands switch ``current`` to the new one,
    the job is released: it runs the old environment, as its batch script says."""
    home = tmp_path / "home"
    envs = home / "hpc-bridge" / "envs"
    stub = stub_worker.install(tmp_path / "stub")
    for name in ("worker-old", "worker-new"):
        (envs / name / "bin").mkdir(parents=True)
        python = envs / name / "bin" / "python"
        python.write_text(f'#!/bin/sh\necho "worker environment: {name}"\nexec {stub} "$@"\n')
        python.chmod(0o755)
    (envs / "current").symlink_to("worker-old")
    spool = tmp_path / "spool"
    env = bridge_environ(
        broker_url,
        standin,
        queues,
        spool,
        HPC_SCHEDULER=cluster.name,
        HPC_SCHEDULER_ARGS={"slurm": "--hold", "gridengine": "-h"}[cluster.name],
        HPC_WORKER_PYTHON=str(envs / "current" / "bin" / "python"),
    )
    corr = "f" + str(uuid.uuid4())[1:]  # tests/stub_worker.py publishes a reply itself for this one
    rodan.publish_request(sample_inputs("new", n_layers=1), FAST_SETTINGS, correlation_id=corr)
    try:
        done = run_bridge(env, "check")
        assert done.returncode == 0, done.stderr[-2000:]
        key = safe_key(corr)
        record = json.loads((spool / "ledger" / f"{key}.json").read_text())
        assert record["state"] == "submitted", record
        old_python = str(envs / "worker-old" / "bin" / "python")
        script = (spool / "jobs" / key / "job.sh").read_text()
        assert old_python in script and "envs/current" not in script
        params = json.loads((spool / "params" / f"{key}.json").read_text())
        assert params["job"]["spec"]["command"][0] == old_python  # what a continuation submits

        switched = subprocess.run(
            ["bash", "-c", upgrade_guide_switch()],
            env={**os.environ, "HOME": str(home), "version": "new"},
            capture_output=True,
            text=True,
        )
        assert switched.returncode == 0, switched.stderr
        assert os.readlink(envs / "current") == "worker-new"

        release = {"slurm": ["scontrol", "release"], "gridengine": ["qrls"]}[cluster.name]
        subprocess.run([*release, record["job_id"]], check=True, capture_output=True, timeout=30)
        replies = wait_until(rodan.drain, 180, 1, "the job's reply")
        assert [c for c, _b, _h in replies] == [corr]
        output = "".join(p.read_text() for p in (spool / "jobs" / key).iterdir() if p.name != "job.sh")
        assert "worker environment: worker-old" in output
        assert "worker environment: worker-new" not in output
    finally:
        cancel_ledger_jobs(spool, cluster)
