"""The probe job's hand-off (``hpc-bridge doctor --job``): typed records of bridge/handoff.py, both ways.

The login side (bridge/ops/probe.py) writes a ProbeParameters and reads a ProbeResult; the node
(worker/probe.py) reads the one and writes the other. These tests write each with one side's code
and read it with the other's, check that neither side keeps a copy of a name or a default of its
own (the copies had drifted: the import timeout was 180 s on one side and 240 s on the other), and
that a file of another layout is refused with a message saying what to do. No scheduler runs here.
"""

from __future__ import annotations

import ast
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from bridge import handoff
from bridge.config import load_config
from bridge.handoff import (
    DEFAULT_PROBE_IMPORT_TIMEOUT_S,
    DEFAULT_PROBE_MIN_SCRATCH_BYTES,
    PROBE_CHECKS,
    PROBE_FILE,
    PROBE_MODULE,
    PROBE_RESULT_FILE,
    PROBE_RESULT_MARKER,
    PROBE_VERSION,
    ProbeContinueState,
    ProbeFinding,
    ProbeParameters,
    ProbeRerun,
    ProbeResult,
)
from bridge.ops import probe as login
from bridge.schedulers import get_scheduler
from bridge.spool import Spool, atomic_write_json, read_json
from worker import probe as node

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {
    "RABBITMQ_URL": "amqp://hpc:broker-secret@mq.example.org:5672/%2F",
    "RODAN_HOST": "rodan.example.org",
    "RODAN_USER": "hpc@example.org",
    "RODAN_PASSWORD": "rodan-secret",
    "HPC_WORKER_PYTHON": sys.executable,
    "HPC_GPU_RULES": "gpu:1",
}


def login_side_parameters(tmp_path: Path, scheduler: str = "slurm", **extra: str) -> ProbeParameters:
    """What run_probe writes to the probe file, built by the login side's own code."""
    config = load_config(environ={**SETTINGS, "HPC_SPOOL_DIR": str(tmp_path / "spool"), **extra})
    backend = get_scheduler(scheduler, options=config.scheduler_options)
    spool = Spool(config.spool_dir).ensure()
    key = f"{login.KEY_PREFIX}test"
    probe_dir = spool.job_dir(key)
    probe_dir.mkdir(parents=True)
    spec = login.probe_spec(config, spool, key, 2048)
    return login.probe_parameters(config, backend, spool, probe_dir, spec, login.ProbeOptions())


@pytest.mark.parametrize("scheduler", ["slurm", "gridengine"])
def test_the_probe_file_the_login_side_writes_is_what_the_node_reads(tmp_path: Path, scheduler: str) -> None:
    written = login_side_parameters(tmp_path, scheduler)
    path = written.path(PROBE_FILE)
    atomic_write_json(path, written.to_json())  # as run_probe writes it
    read = ProbeParameters.from_json(read_json(path))  # as the node's run_probe reads it
    assert read == written
    assert read.version == PROBE_VERSION and read.dir == path.parent
    assert read.import_timeout_s == DEFAULT_PROBE_IMPORT_TIMEOUT_S
    assert read.min_scratch_bytes == DEFAULT_PROBE_MIN_SCRATCH_BYTES
    assert (read.broker.host, read.broker.port) == ("mq.example.org", 5672)
    assert read.gpus_asked == 1 and read.gres == "gpu:1"
    assert read.continuation is not None and read.continuation.job.scheduler == scheduler
    assert read.continuation.mode == ("requeue" if scheduler == "slurm" else "successor")
    assert read.continuation.job.script == path.parent / "job.sh"
    text = path.read_text()
    assert "rodan-secret" not in text and "broker-secret" not in text  # nothing secret in the probe file


def test_a_probe_file_without_continuation_says_why(tmp_path: Path) -> None:
    written = login_side_parameters(tmp_path, HPC_WARN_SECONDS="0")
    read = ProbeParameters.from_json(json.loads(json.dumps(written.to_json())))
    assert read.continuation is None and read.continuation_skipped.startswith("HPC_WARN_SECONDS=0")
    assert node.check_continue(read, result(), lambda: None).status == "skip"


def result(**changes: object) -> ProbeResult:
    found = ProbeResult(host="n1", job_id="7", restart="0", python=sys.executable, started_at=1.5, token="t")
    return replace(found, **changes)  # type: ignore[arg-type]


def test_the_findings_the_node_writes_are_what_the_login_side_reads(tmp_path: Path) -> None:
    findings = result(
        checks={
            "spool": node.ok("wrote"),
            "worker": node.fail("no TensorFlow", "install it"),
            "scratch": node.warn("small"),
            "continue": node.skip("HPC_WARN_SECONDS=0"),
        },
        backend={"backend": "tensorflow", "gpus": 0, "devices": ["CPU:0"]},
        continuation=ProbeContinueState(mode="successor", state="submitted", job_id="7", successor="8"),
        reran=ProbeRerun(job_id="7", restart="1", at=2.5),
        finished=True,
        finished_at=3.0,
    )
    node._save(tmp_path / PROBE_RESULT_FILE, findings)  # the node's own writer
    assert login.read_result(tmp_path, None) == findings  # the login side's own reader
    # When the node cannot write the file, the same record comes through the job's output.
    output = tmp_path / "job-7.out"
    output.write_text("noise\n" + PROBE_RESULT_MARKER + json.dumps(findings.to_json()) + "\n")
    assert login.read_result(tmp_path / "elsewhere", output) == findings
    assert login.read_result(tmp_path / "elsewhere", None) is None  # nothing yet


def test_the_login_side_turns_findings_into_doctor_lines() -> None:
    checks = {n: node.ok(f"{n} fine") for n in PROBE_CHECKS}
    lines = login.judge(login.Outcome("7", result(checks=checks, finished=True)), "t", "Slurm", None)
    assert [c.name for c in lines] == ["probe-job", *(f"node-{n}" for n in PROBE_CHECKS)]
    assert all(c.status == "ok" for c in lines), lines
    assert lines[1].found == "the login node reads what the node wrote; spool fine"


def test_findings_of_another_version_fail_the_probe_job_line(tmp_path: Path) -> None:
    (tmp_path / PROBE_RESULT_FILE).write_text(json.dumps({**result().to_json(), "version": PROBE_VERSION + 1}))
    with pytest.raises(ValueError, match="newer hpc-bridge"):
        login.read_result(tmp_path, None)
    outcome = login.Outcome("7")
    login._read(tmp_path, None, outcome)
    first, *rest = login.judge(outcome, "t", "Slurm", None)
    assert first.status == "FAIL" and "cannot read" in first.found and "same hpc-bridge version" in first.fix
    assert [c.status for c in rest] == ["skip"] * len(PROBE_CHECKS)


def test_the_node_refuses_a_probe_file_of_another_version(tmp_path: Path) -> None:
    written = login_side_parameters(tmp_path)
    older = {**written.to_json(), "version": PROBE_VERSION - 1}
    with pytest.raises(ValueError, match=r"probe file: version .* an older hpc-bridge .*docs/upgrade.md"):
        ProbeParameters.from_json(older)
    path = written.path(PROBE_FILE)
    atomic_write_json(path, older)
    assert node.run_probe(path) == node.EXIT_UNREADABLE
    assert not written.path(PROBE_RESULT_FILE).exists()  # it checked nothing


@pytest.mark.parametrize("field", ["import_timeout_s", "min_scratch_bytes", "rodan_timeout_s", "continuation"])
def test_the_node_takes_no_default_of_its_own(tmp_path: Path, field: str) -> None:
    """A field the login side left out is an error naming it, never a default the node keeps."""
    data = login_side_parameters(tmp_path).to_json()
    del data[field]
    with pytest.raises(ValueError, match=f"missing field '{field}'"):
        ProbeParameters.from_json(data)
    with pytest.raises(ValueError, match="unknown field 'tf_timeout_s'"):
        ProbeParameters.from_json({**login_side_parameters(tmp_path / "again").to_json(), "tf_timeout_s": 240})


def test_a_finding_must_have_a_known_status() -> None:
    data = result(checks={"spool": ProbeFinding(status="ok", found="x")}).to_json()
    data["checks"]["spool"]["status"] = "fine"
    with pytest.raises(ValueError, match=r"'checks\.spool\.status' must be one of"):
        ProbeResult.from_json(data)
    data["checks"] = {"spool": {"status": "ok", "found": "x", "fix": ""}, "gpu-burn": {}}
    with pytest.raises(ValueError, match="field 'checks' must be an object of"):
        ProbeResult.from_json(data)


# --- no drift: one copy of each name and default ---------------------------------------------------


def test_both_sides_run_and_print_the_same_checks() -> None:
    ran = [name for name, _check in node.CHECKS] + [node.CONTINUE_CHECK]  # the node's order: continue last
    assert sorted(ran) == sorted(PROBE_CHECKS)  # each once, none the login side does not print
    assert login.DEFAULT_MIN_SCRATCH_GB * 2**30 == DEFAULT_PROBE_MIN_SCRATCH_BYTES  # doctor --min-scratch's default
    assert PROBE_MODULE == node.__name__  # what the probe job runs is this module


def test_the_probe_job_runs_the_node_side_on_the_probe_file(tmp_path: Path) -> None:
    config = load_config(environ={**SETTINGS, "HPC_SPOOL_DIR": str(tmp_path / "spool")})
    spool = Spool(config.spool_dir)
    spec = login.probe_spec(config, spool, "doctor-probe-x", 2048)
    assert spec.command[1:] == ("-m", PROBE_MODULE, str(spool.job_dir("doctor-probe-x") / PROBE_FILE))


#: The literal values of the hand-off's shared names: only bridge/handoff.py may spell them.
SHARED = {
    name: getattr(handoff, name)
    for name in dir(handoff)
    if name.startswith(("PROBE_", "DEFAULT_PROBE_")) and isinstance(getattr(handoff, name), (str, int, float))
}


@pytest.mark.parametrize("side", ["bridge/ops/probe.py", "worker/probe.py"])
def test_neither_side_spells_a_shared_name_or_default_itself(side: str) -> None:
    assert {"PROBE_FILE", "PROBE_RESULT_FILE", "PROBE_TOKEN_FILE", "DEFAULT_PROBE_IMPORT_TIMEOUT_S"} <= set(SHARED)
    tree = ast.parse((REPO / side).read_text())
    literals = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)}
    strings = {v for v in SHARED.values() if isinstance(v, str)}
    numbers = {v for v in SHARED.values() if isinstance(v, float) or (isinstance(v, int) and v > 100)}
    assert not literals & (strings | numbers), f"{side} spells a value of bridge/handoff.py's: import the name"
    for old in ("RESULT_NAME", "TOKEN_NAME", "HELD_LOCK_NAME", "RESULT_MARKER", "TF_TIMEOUT_S", "NODE_CHECKS"):
        assert old not in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}, old
