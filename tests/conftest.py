"""Shared fixtures: the real broker, the Rodan stand-in, per-test queues and spools, the schedulers.

Integration tests talk to real services. The broker comes from RABBITMQ_URL,
else the local one on 127.0.0.1:5672, else a testcontainers RabbitMQ when a
Docker engine runs; otherwise the run fails with a message (never a silent skip).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import pytest

from bridge.config import BridgeConfig, load_config
from bridge.standin.samples import make_sample_page
from bridge.standin.server import RodanStandin, User

REPO = Path(__file__).resolve().parent.parent
LOCAL_BROKER = "amqp://guest:guest@127.0.0.1:5672/%2F"
RODAN_EMAIL = "hpc@example.org"
RODAN_PASSWORD = "standin-password-9f2c"
# Settings for a training request that finishes in seconds on 2 cores.
FAST_SETTINGS = {
    "Maximum number of training epochs": 2,
    "Maximum number of samples per label": 100,
    "Patch height": 64,
    "Patch width": 64,
    "Maximum time (D-HH:MM)": "0-00:15",
    "Maximum memory (MB)": 4096,
    "CPUs": 1,
}


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def broker_url() -> Iterator[str]:
    if os.environ.get("RABBITMQ_URL"):
        yield os.environ["RABBITMQ_URL"]
        return
    if _answers("127.0.0.1", 5672):
        yield LOCAL_BROKER
        return
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        from testcontainers.rabbitmq import RabbitMqContainer  # only needed where a Docker engine runs

        with RabbitMqContainer("rabbitmq:3.13") as container:
            host = container.get_container_host_ip()
            port = container.get_exposed_port(5672)
            yield f"amqp://guest:guest@{host}:{port}/%2F"
        return
    pytest.fail(
        "no RabbitMQ broker: set RABBITMQ_URL, start the local one (rabbitmq-server -detached), "
        "or run a Docker engine for testcontainers"
    )


@dataclass
class Queues:
    request: str
    reply: str
    dead: str

    def all(self) -> list[str]:
        return [self.request, self.reply, self.dead]


@pytest.fixture
def queues(broker_url: str) -> Iterator[Queues]:
    tag = uuid.uuid4().hex[:10]
    q = Queues(f"test-{tag}-hpc-jobs", f"test-{tag}-hpc-results", f"test-{tag}-dead")
    yield q
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    channel = connection.channel()
    for name in q.all():
        channel.queue_delete(name)
    connection.close()


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[RodanStandin]:
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    with RodanStandin(uploads, users=[User(RODAN_EMAIL, "hpc", RODAN_PASSWORD)], token_field="email") as server:
        yield server


def bridge_environ(broker_url: str, standin: RodanStandin, queues: Queues, spool: Path, **extra: str) -> dict[str, str]:
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


@pytest.fixture
def make_config(broker_url: str, standin: RodanStandin, queues: Queues, tmp_path: Path) -> Callable[..., BridgeConfig]:
    def build(**extra: str) -> BridgeConfig:
        return load_config(environ=bridge_environ(broker_url, standin, queues, tmp_path / "spool", **extra))

    return build


@dataclass
class Rodan:
    """Rodan's side of the broker, as its task behaves (publish, then wait for the reply)."""

    broker_url: str
    queues: Queues
    sent: list[str] = field(default_factory=list)

    def publish(
        self,
        body: bytes,
        *,
        correlation_id: str | None = None,
        reply_to: str | None = "default",
        declare: bool = True,
    ) -> str:
        corr = correlation_id if correlation_id is not None else str(uuid.uuid4())
        connection = pika.BlockingConnection(pika.URLParameters(self.broker_url))
        channel = connection.channel()
        channel.confirm_delivery()
        if declare:
            channel.queue_declare(self.queues.request)
            channel.queue_declare(self.queues.reply)
        props = pika.BasicProperties(
            reply_to=self.queues.reply if reply_to == "default" else reply_to,
            correlation_id=corr or None,
        )
        channel.basic_publish("", self.queues.request, body, props)
        connection.close()
        self.sent.append(corr)
        return corr

    def publish_request(self, inputs: dict[str, str], settings: dict[str, Any], **kw: Any) -> str:
        return self.publish(json.dumps({"inputs": inputs, "settings": settings}).encode(), **kw)

    def drain(self, queue: str | None = None) -> list[tuple[str | None, bytes, dict[str, Any]]]:
        """Every message now in a queue: (correlation_id, body, headers)."""
        connection = pika.BlockingConnection(pika.URLParameters(self.broker_url))
        channel = connection.channel()
        out = []
        try:
            while True:
                method, props, body = channel.basic_get(queue or self.queues.reply, auto_ack=True)
                if method is None:
                    break
                out.append((props.correlation_id, body, dict(props.headers or {})))
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code != 404:  # a queue nobody declared yet holds nothing
                raise
        if connection.is_open:
            connection.close()
        return out

    def depth(self, queue: str) -> int:
        connection = pika.BlockingConnection(pika.URLParameters(self.broker_url))
        try:
            channel = connection.channel()
            return int(channel.queue_declare(queue, passive=True).method.message_count)
        except pika.exceptions.ChannelClosedByBroker:
            return 0
        finally:
            if connection.is_open:
                connection.close()


@pytest.fixture
def rodan(broker_url: str, queues: Queues) -> Rodan:
    return Rodan(broker_url, queues)


@pytest.fixture
def sample_inputs(standin: RodanStandin) -> Callable[..., dict[str, str]]:
    def build(generation: str = "new", **kw: Any) -> dict[str, str]:
        return make_sample_page(standin.uploads_dir, generation=generation, **kw)  # type: ignore[arg-type]

    return build


# --- Slurm -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def slurm() -> None:
    """The local Slurm cluster (deploy/dev/slurm.sh up). Fails, never skips, when it is down."""
    if not shutil.which("sbatch"):
        pytest.fail("Slurm is not installed: run 'bash deploy/dev/slurm.sh up' (the test command does)")
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    if ping.returncode != 0 or "UP" not in ping.stdout:
        pytest.fail(
            f"slurmctld is not answering ({ping.stdout.strip()} {ping.stderr.strip()}): "
            "run 'bash deploy/dev/slurm.sh up'"
        )


def cancel_spool_jobs(spool: Path) -> None:
    """Cancel every Slurm job a test's bridge submitted (found through its ledger)."""
    cancel_ledger_jobs(spool, Cluster("slurm"))


def jobs_named(name: str) -> list[str]:
    """Every Slurm job with this name, live or in accounting."""
    ids: set[str] = set()
    out = subprocess.run(["squeue", "-h", "-t", "all", "--name", name, "-o", "%i"], capture_output=True, text=True)
    ids.update(x.strip() for x in out.stdout.split() if x.strip())
    acct = subprocess.run(
        ["sacct", "-n", "-X", "-P", "--name", name, "-S", "now-1days", "-o", "JobIDRaw"], capture_output=True, text=True
    )
    ids.update(x.strip() for x in acct.stdout.split() if x.strip())
    return sorted(ids)


def jobs_started(name: str) -> list[str]:
    """Jobs with this name whose batch script ran. A submit-time rejection is still recorded by
    slurmdbd (FAILED, sometimes even with a start time), but it never has a ``.batch`` step."""
    acct = subprocess.run(
        ["sacct", "-n", "-P", "--name", name, "-S", "now-1days", "-o", "JobIDRaw"],
        capture_output=True,
        text=True,
    )
    steps = acct.stdout.split()
    return sorted(s.removesuffix(".batch") for s in steps if s.endswith(".batch"))


# --- Grid Engine, and both schedulers behind one test helper ---------------------------------


@pytest.fixture(scope="session")
def gridengine() -> None:
    """The local Grid Engine cluster (deploy/dev/gridengine.sh up). Fails, never skips, when it is down."""
    if not shutil.which("qsub"):
        pytest.fail("Grid Engine is not installed: run 'bash deploy/dev/gridengine.sh up' (the test command does)")
    ping = subprocess.run(["qstat", "-g", "c"], capture_output=True, text=True, timeout=30)
    if ping.returncode != 0:
        pytest.fail(f"sge_qmaster is not answering ({ping.stderr.strip()}): run 'bash deploy/dev/gridengine.sh up'")


def _sge_live(name: str) -> dict[str, str]:
    """Live Grid Engine jobs with this name: id -> state letters."""
    import xml.etree.ElementTree as ET

    out = subprocess.run(["qstat", "-xml", "-u", "*"], capture_output=True, text=True, timeout=30).stdout
    if not out.strip():
        return {}
    jobs = {}
    for job in ET.fromstring(out).iter("job_list"):  # qstat's own output
        if job.findtext("JB_name") == name:
            jobs[job.findtext("JB_job_number", "")] = job.findtext("state", "")
    return jobs


def _sge_accounted(name: str) -> list[str]:
    out = subprocess.run(["qacct", "-j", name], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[1] for line in out.splitlines() if line.startswith("jobnumber")]


@dataclass(frozen=True)
class Cluster:
    """One real scheduler, as the end-to-end tests need it (``HPC_SCHEDULER`` = ``name``)."""

    name: str

    @property
    def label(self) -> str:
        return {"slurm": "Slurm", "gridengine": "Gridengine"}[self.name]

    @property
    def submit_command(self) -> str:
        return {"slurm": "sbatch", "gridengine": "qsub"}[self.name]

    def jobs_named(self, name: str) -> list[str]:
        """Every job with this name, live or in accounting."""
        if self.name == "slurm":
            return jobs_named(name)
        return sorted({*_sge_live(name), *_sge_accounted(name)}, key=int)

    def jobs_started(self, name: str) -> list[str]:
        """Jobs with this name whose batch script ran."""
        if self.name == "slurm":
            return jobs_started(name)
        return sorted(set(_sge_accounted(name)), key=int)  # a refused or never-started job has no record

    def is_running(self, job_id: str) -> bool:
        if self.name == "slurm":
            out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
            return out.stdout.strip() == "RUNNING"
        out = subprocess.run(["qstat", "-u", "*"], capture_output=True, text=True).stdout
        return any(line.split()[:1] == [job_id] and line.split()[4] == "r" for line in out.splitlines())

    def cancel(self, job_id: str) -> None:
        subprocess.run(["scancel" if self.name == "slurm" else "qdel", job_id], capture_output=True, timeout=30)

    def cancel_named(self, name: str) -> None:
        if self.name == "slurm":
            subprocess.run(["scancel", "--name", name], capture_output=True, timeout=30)
        else:
            for job_id in _sge_live(name):
                self.cancel(job_id)


@pytest.fixture(params=["slurm", "gridengine"])
def cluster(request: pytest.FixtureRequest) -> Cluster:
    """Each test that uses this runs once on Slurm and once on Grid Engine."""
    request.getfixturevalue(request.param)  # the session fixture that checks the cluster is up
    return Cluster(request.param)


def cancel_ledger_jobs(spool: Path, cluster: Cluster) -> None:
    """Cancel every job a test's bridge submitted (found through its ledger)."""
    ledger = spool / "ledger"
    if not ledger.exists():
        return
    for path in ledger.glob("*.json"):
        record = json.loads(path.read_text())
        if record.get("job_name"):
            cluster.cancel_named(record["job_name"])


def run_bridge(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``hpc-bridge`` as cron runs it: a fresh process with only the given settings."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "RODAN_", "HPC_"))}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-m", "bridge", *args], env=full, capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.5, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


# --- a second user, for "only our jobs" -------------------------------------------------------------

#: A unix user who may submit on both dev clusters (deploy/dev/setup.sh creates it).
OTHER_USER = os.environ.get("HPC_DEV_OTHER_USER", "hpcother")


def require_other_user(script: str) -> str:
    """OTHER_USER, or a failure naming the script that creates it (never a skip)."""
    import pwd

    try:
        pwd.getpwnam(OTHER_USER)
    except KeyError:
        pytest.fail(
            f"no unix user {OTHER_USER!r} to submit another user's jobs: run 'bash deploy/dev/setup.sh' "
            f"(or 'bash deploy/dev/{script} up'), which creates it"
        )
    return OTHER_USER


def job_parameters_json(**overrides: Any) -> dict[str, Any]:
    """The smallest parameter file ``worker.job.JobParameters.from_json`` reads."""
    raw: dict[str, Any] = {
        "correlation_id": "c",
        "reply_to": "q",
        "inputs": {},
        "layers": [],
        "settings": {},
        "rodan": {"base_url": "http://rodan"},
        "broker": {"url": "amqp://x"},
        "spool": "spool",
    }
    raw.update(overrides)
    return raw


def fake_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, body: str) -> None:
    """Put a ``/bin/sh`` script named ``command`` first on PATH for this test."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    script = bindir / command
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
