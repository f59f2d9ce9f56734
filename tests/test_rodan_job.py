"""The Rodan 3.x job package (rodan_job/) in the interpreter it runs in: Rodan's Python 3.7 with
pika 1.1.0 (rodan_job/requirements-tests.txt). This builds that environment once under
~/.cache/hpc-bridge/rodan-job-tests/<fingerprint>/ and runs rodan_job/tests in it against the real
broker: reply assembly, the silence bound, publish and poll, broker down, TLS, secrets in logs.
rodan_job/README.md says what each proves. A missing Python 3.7 fails the test (never a skip)."""

from __future__ import annotations

import base64
import fcntl
import hashlib
import io
import json
import os
import signal
import struct
import subprocess
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest

from consumers import find_python
from tests.support.rodan_job import (
    GROUP,
    JOB_NAME,
    POLL_SECONDS,
    Api,
    RodanWithJob,
    Upload,
    output_files,
    publish_parts,
    run_job,
    start_workflow,
    take_request,
    wait_run,
)

# One worker under --dist loadgroup runs this module and tests/test_rodan3_e2e.py: one Rodan.
pytestmark = [pytest.mark.broker, pytest.mark.heavy, pytest.mark.xdist_group(GROUP)]

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rodan_job"
REQUIREMENTS = PACKAGE / "requirements-tests.txt"


def job_test_env() -> Path:
    """The Python 3.7 virtualenv of rodan_job/tests (built once per requirements file)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpc-bridge" / "rodan-job-tests"
    venv = base / hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]
    python = venv / "bin" / "python"
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / ".complete").exists():
            subprocess.run([str(find_python("3.7")), "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
            subprocess.run(
                [str(python), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)],
                check=True,
                timeout=600,
            )
            (venv / ".complete").write_text("ok\n")
    return python


def test_the_job_package_tests_pass_in_rodans_python(broker_url: str) -> None:
    python = job_test_env()
    version = subprocess.run(
        [str(python), "-c", "import sys, pika; print('%d.%d' % sys.version_info[:2], pika.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert version == ["3.7", "1.1.0"]
    env = {**os.environ, "RABBITMQ_URL": broker_url}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:logging", "-rfE"],
        cwd=PACKAGE,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary


# --- the job inside a real Rodan 3.1.0 (deploy/dev/rodan.sh with this package) -------------------
# The session's Rodan with the job package and the REST helpers: tests/support/rodan_job.py.


def sample_zip(layers: int, seed: int) -> bytes:
    """A Pixel.js sample: image, selected regions, background and ``layers`` layers (PNG)."""
    names = ["Image.png", "rgba PNG - Selected regions.png", "rgba PNG - Layer 0 (Background).png"]
    names += [f"rgba PNG - Layer {n}.png" for n in range(1, layers + 1)]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for index, name in enumerate(names):
            archive.writestr(name, make_png(4 + seed, 3, (seed, index, 9, 255)))
    return out.getvalue()


def make_png(width: int, height: int, rgba: tuple[int, int, int, int]) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0)
    rows = (b"\x00" + bytes(rgba) * width) * height
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def start_run(rodan: RodanWithJob, session: Api, settings: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """Upload two samples, build a workflow of the job alone (Sample 1, Sample 2 -> Log File,
    Background Model, Model 1, Model 2, Multi-Sample Zip) and start it; (workflow run URL, the
    samples' /uploads/ paths by port)."""
    inputs = {f"Sample {n}": Upload(f"sample{n}.zip", sample_zip(2, n)) for n in (1, 2)}
    outputs = ["Log File", "Background Model", "Model 1", "Model 2", "Multi-Sample Zip"]
    return start_workflow(rodan, session, inputs, outputs, settings)


SETTINGS = {
    "Batch Size": 8,
    "Maximum number of training epochs": 2,
    "Maximum number of samples per label": 100,
    "Patience": 15,
    "Patch height": 64,
    "Patch width": 64,
    "Maximum time (D-HH:MM)": "0-00:10",
    "Maximum memory (MB)": 2000,
    "CPUs": 1,
    "Slurm Notification Email": "",
}


@pytest.mark.slow
@pytest.mark.rodan
def test_a_workflow_run_waits_through_a_worker_restart_and_gets_its_models(
    rodan_with_job: RodanWithJob, broker_url: str
) -> None:
    """Rodan's own worker runs the job: one request with the RunJob's uuid and the samples'
    /uploads/ paths; the RunJob stays PROCESSING while it polls; the Celery worker is stopped and
    started again in the middle of the wait; the reply (parts out of order) then finishes the
    workflow run with exactly the files the reply carried."""
    rodan = rodan_with_job
    session = rodan.session()
    run_url, paths = start_run(rodan, session, SETTINGS)
    properties, request = take_request(broker_url, rodan.request_queue, 180)
    rodan.reply_queues.append(properties.reply_to)
    run = session.get(run_url).json()
    runjob = run_job(session, rodan, run)
    assert properties.correlation_id == runjob["uuid"]
    assert properties.reply_to == f"hpc-results.{runjob['uuid']}" and properties.delivery_mode == 2
    assert request == {"inputs": paths, "settings": SETTINGS}
    time.sleep(3 * POLL_SECONDS)
    assert session.get(runjob["url"]).json()["status"] == 1  # PROCESSING: waiting, not failed

    os.killpg(rodan.worker_pid(), signal.SIGTERM)  # Celery's warm shutdown; the retry message goes back
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and Path(f"/proc/{rodan.worker_pid()}").exists():
        time.sleep(0.5)
    rodan.up()  # the worker again (rodan.sh restarts what is not running)

    files = {
        "Background Model": b"\x89HDF\r\n\x1a\n" + os.urandom(4000),
        "Model 1": b"\x89HDF\r\n\x1a\n" + os.urandom(4000),
        "Model 2": b"\x89HDF\r\n\x1a\n" + os.urandom(4000),
        "Log File": b"epoch 1 loss 0.5\nepoch 2 loss 0.4\n",
    }
    body = json.dumps({k: base64.encodebytes(v).decode() for k, v in files.items()}).encode()
    publish_parts(broker_url, properties.reply_to, properties.correlation_id, body, [3, 1, 2])
    ended = wait_run(session, run_url, 180)
    runjob = session.get(runjob["url"]).json()
    assert ended["status"] == 4, (runjob["error_summary"], runjob["error_details"])
    got = output_files(session, runjob)
    assert {k: got[k] for k in files} == files
    with zipfile.ZipFile(io.BytesIO(got["Multi-Sample Zip"])) as archive:
        assert sorted({n.split("/")[0] for n in archive.namelist()}) == ["Sample 1", "Sample 2"]
        assert len(archive.namelist()) == 2 * 5
    # Exactly one request for the run, whatever the restart did.
    with pytest.raises(AssertionError, match="no request"):
        take_request(broker_url, rodan.request_queue, 3)


@pytest.mark.slow
@pytest.mark.rodan
def test_an_error_reply_fails_the_run_with_its_reason(rodan_with_job: RodanWithJob, broker_url: str) -> None:
    rodan = rodan_with_job
    session = rodan.session()
    run_url, _ = start_run(rodan, session, SETTINGS)
    properties, _request = take_request(broker_url, rodan.request_queue, 180)
    rodan.reply_queues.append(properties.reply_to)
    reason = "Slurm job 61 ended without a result: OUT_OF_MEMORY: raise 'Maximum memory (MB)'"
    publish_parts(
        broker_url, properties.reply_to, properties.correlation_id, json.dumps({"error": reason}).encode(), [1]
    )
    ended = wait_run(session, run_url, 180)
    runjob = run_job(session, rodan, ended)
    assert ended["status"] == -1 and runjob["status"] == -1
    assert runjob["error_summary"] == f"The HPC training failed: {reason}"
    assert "guest:guest" not in (runjob["error_details"] or "")


@pytest.mark.slow
@pytest.mark.rodan
def test_rodans_own_job_tests_pass_for_the_job(rodan_with_job: RodanWithJob) -> None:
    """``manage.py test rodan.test.test_all_jobs`` (Rodan's runner, which calls every job's
    ``test_my_task``) in the worker's own environment: our job's line says it passed. (Two of the
    archive's own jobs fail there: their test files are not in the archive.)"""
    pid = rodan_with_job.worker_pid()
    environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
    python = Path(f"/proc/{pid}/cmdline").read_text().split("\0")[0]
    done = subprocess.run(
        [python, "manage.py", "test", "rodan.test.test_all_jobs", "--noinput"],
        cwd=rodan_with_job.state_dir / "code",
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = (done.stdout + done.stderr).splitlines()
    ours = [i for i, line in enumerate(lines) if f": {JOB_NAME} ..." in line]
    assert len(ours) == 1, "\n".join(lines[-80:])
    assert lines[ours[0] + 1].strip() == "p", "\n".join(lines[ours[0] :][:80])
    assert f"{JOB_NAME} <class" not in done.stdout + done.stderr  # not among the failures listed
