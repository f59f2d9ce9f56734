"""The Rodan 3.x job package (rodan_job/) in the interpreter it runs in: Rodan's Python 3.7 with
pika 1.1.0 (rodan_job/requirements-tests.txt). This builds that environment once under
~/.cache/hpc-bridge/rodan-job-tests/<fingerprint>/ and runs rodan_job/tests in it against the real
broker: reply assembly, the silence bound, publish and poll, broker down, TLS, secrets in logs.
rodan_job/README.md says what each proves. A missing Python 3.7 fails the test (never a skip)."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import io
import json
import os
import signal
import struct
import subprocess
import time
import uuid
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pika
import pytest
import requests

from consumers import find_python

pytestmark = [pytest.mark.broker]

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


@dataclass
class RodanWithJob:
    """A Rodan 3.1.0 of this module's own (state directory, database, vhost, port) with the job
    package installed, its Python3 worker reading the job's settings from its environment."""

    url: str
    email: str
    password: str = field(repr=False)
    state_dir: Path
    request_queue: str
    env: dict[str, str] = field(repr=False)
    reply_queues: list[str] = field(default_factory=list)

    def session(self) -> Api:
        with requests.Session() as session:
            session.headers.update({"Accept": "application/json", "Connection": "close"})
            token = session.post(f"{self.url}/api/auth/token/", data={"email": self.email, "password": self.password})
        token.raise_for_status()
        return Api(str(token.json()["token"]))

    def up(self) -> None:
        done = subprocess.run(
            ["bash", str(RODAN_SH), "up", "--job-package", str(PACKAGE / "hpc_paco_trainer")],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    def worker_pid(self) -> int:
        return int((self.state_dir / "run" / "worker.pid").read_text().strip())


class Api:
    """Rodan's REST API with a token, one connection per request (runserver closes each
    connection after its answer without saying so)."""

    def __init__(self, token: str) -> None:
        self.token = token

    def request(self, method: str, url: str, **kwargs: Any) -> requests.Response:
        with requests.Session() as session:
            session.headers.update(
                {"Accept": "application/json", "Connection": "close", "Authorization": f"Token {self.token}"}
            )
            return session.request(method, url, timeout=60, **kwargs)

    def get(self, url: str, **kwargs: Any) -> requests.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> requests.Response:
        return self.request("POST", url, **kwargs)

    def patch(self, url: str, **kwargs: Any) -> requests.Response:
        return self.request("PATCH", url, **kwargs)


RODAN_SH = ROOT / "deploy" / "dev" / "rodan.sh"
JOB_NAME = "Training model for Patchwise Analysis of Music Document, HPC"
POLL_SECONDS = 2


@pytest.fixture(scope="module")
def rodan_with_job(tmp_path_factory: pytest.TempPathFactory, broker_url: str) -> Iterator[RodanWithJob]:
    state = tmp_path_factory.mktemp("rodan-job") / "rodan"
    queue = f"hpc-jobs.rodan-job-e2e-{uuid.uuid4().hex}"
    env = {
        **os.environ,
        "HPC_DEV_RODAN_DIR": str(state),
        "HPC_DEV_RODAN_PORT": "8795",
        "HPC_DEV_RODAN_REDIS_DB": "12",
        "HPC_RABBITMQ_URL": broker_url,
        "HPC_REQUEST_QUEUE": queue,
        "HPC_POLL_SECONDS": str(POLL_SECONDS),
    }
    env.pop("HPC_DEV_RODAN_JOB_PACKAGES", None)
    rodan = RodanWithJob("", "", "", state, queue, env)
    try:
        rodan.up()
        values = dict(
            line.split("=", 1)
            for line in subprocess.run(
                ["bash", str(RODAN_SH), "env"], env=env, capture_output=True, text=True, check=True
            ).stdout.splitlines()
            if "=" in line
        )
        rodan.url, rodan.email, rodan.password = values["RODAN_URL"], values["RODAN_EMAIL"], values["RODAN_PASSWORD"]
        yield rodan
    finally:
        subprocess.run(["bash", str(RODAN_SH), "down"], env=env, capture_output=True, timeout=300)
        with contextlib.suppress(pika.exceptions.AMQPError):
            connection = pika.BlockingConnection(pika.URLParameters(broker_url))
            for name in [queue, *rodan.reply_queues]:  # a run that failed leaves its queue until x-expires
                with contextlib.suppress(pika.exceptions.ChannelClosedByBroker):
                    connection.channel().queue_delete(queue=name)
            connection.close()


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


def created(response: requests.Response) -> dict[str, Any]:
    assert response.status_code == 201, (
        f"{response.request.method} {response.url}: {response.status_code} {response.text[:500]}"
    )
    body = response.json()
    return dict(body[0] if isinstance(body, list) else body)


def start_run(rodan: RodanWithJob, session: Api, settings: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """Upload two samples, build a workflow of the job alone (Sample 1, Sample 2 -> Log File,
    Background Model, Model 1, Model 2, Multi-Sample Zip) and start it; (workflow run URL, the
    samples' /uploads/ paths by port)."""
    project = created(session.post(f"{rodan.url}/api/projects/", data={"name": f"hpc-job-{uuid.uuid4().hex[:8]}"}))
    jobs = session.get(f"{rodan.url}/api/jobs/", params={"name": JOB_NAME}).json()["results"]
    job = next(j for j in jobs if j["name"] == JOB_NAME)
    inputs = {p["name"]: p["url"] for p in job["input_port_types"]}
    outputs = {p["name"]: p["url"] for p in job["output_port_types"]}
    workflow = created(session.post(f"{rodan.url}/api/workflows/", data={"project": project["url"], "name": "hpc"}))
    wfjob = created(
        session.post(
            f"{rodan.url}/api/workflowjobs/",
            json={"workflow": workflow["url"], "job": job["url"], "job_settings": settings},
        )
    )
    assignments: dict[str, list[str]] = {}
    paths: dict[str, str] = {}
    for n in (1, 2):
        resource = created(
            session.post(
                f"{rodan.url}/api/resources/",
                data={"project": project["url"], "type": "application/zip"},
                files={"files": (f"sample{n}.zip", sample_zip(2, n), "application/zip")},
            )
        )
        port = created(
            session.post(
                f"{rodan.url}/api/inputports/",
                data={"workflow_job": wfjob["url"], "input_port_type": inputs[f"Sample {n}"]},
            )
        )
        assignments[port["url"]] = [resource["url"]]
        paths[f"Sample {n}"] = urlsplit(resource["resource_file"]).path
    for name in ("Log File", "Background Model", "Model 1", "Model 2", "Multi-Sample Zip"):
        created(
            session.post(
                f"{rodan.url}/api/outputports/", data={"workflow_job": wfjob["url"], "output_port_type": outputs[name]}
            )
        )
    valid = session.patch(workflow["url"], json={"valid": True})
    assert valid.status_code == 200, valid.text[:500]
    run = created(
        session.post(
            f"{rodan.url}/api/workflowruns/",
            json={"workflow": workflow["url"], "resource_assignments": assignments, "name": "hpc run"},
        )
    )
    return str(run["url"]), paths


def take_request(broker_url: str, queue: str, timeout_s: float) -> tuple[Any, dict[str, Any]]:
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        channel = connection.channel()
        channel.queue_declare(queue=queue, durable=False)  # as the job (and Rodan, and the bridge) declare it
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            method, properties, body = channel.basic_get(queue=queue, auto_ack=True)
            if method is not None:
                return properties, json.loads(body)
            time.sleep(0.5)
        raise AssertionError(f"no request in {queue} within {timeout_s} s")
    finally:
        connection.close()


def publish_parts(broker_url: str, reply_to: str, correlation_id: str, body: bytes, order: list[int]) -> None:
    parts = len(set(order))
    size = -(-len(body) // parts)
    pieces = [body[i * size : (i + 1) * size] for i in range(parts)]
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for number in order:
            channel.basic_publish(
                exchange="",
                routing_key=reply_to,
                body=pieces[number - 1],
                properties=pika.BasicProperties(
                    correlation_id=correlation_id,
                    delivery_mode=2,
                    headers={"x-hpc-part": number, "x-hpc-parts": parts},
                ),
                mandatory=True,
            )
    finally:
        connection.close()


def wait_run(session: Api, run_url: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = session.get(run_url).json()
        if run["status"] in (4, -1):
            return dict(run)
        time.sleep(1)
    raise AssertionError(f"the workflow run did not end within {timeout_s} s: {run}")


def run_job(session: Api, rodan: RodanWithJob, run: dict[str, Any]) -> dict[str, Any]:
    runjobs = session.get(f"{rodan.url}/api/runjobs/", params={"workflow_run": run["uuid"]}).json()["results"]
    assert len(runjobs) == 1
    return dict(runjobs[0])


def output_files(session: Api, runjob: dict[str, Any]) -> dict[str, bytes]:
    files = {}
    for output_url in runjob["outputs"]:
        output = session.get(output_url).json()
        resource = session.get(output["resource"]).json()
        download = session.get(resource["resource_file"])
        download.raise_for_status()
        files[output["output_port_type_name"]] = download.content
    return files


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
