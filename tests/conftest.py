"""Fixtures and hooks: the real broker, the Rodan stand-in, per-test queues and spools, the schedulers,
and the service markers. Helpers that tests import live in tests/support/.

Integration tests talk to real services. The broker comes from RABBITMQ_URL,
else the local one on 127.0.0.1:5672, else a testcontainers RabbitMQ when a
Docker engine runs; otherwise the run fails with a message (never a silent skip).

Every test that needs a service carries its marker (``broker``, ``slurm``, ``gridengine``): added
here from the fixtures it uses and the scheduler a ``cluster`` parameter names, or written on the
test where it reaches a service some other way. So
``pytest -m "not broker and not slurm and not gridengine and not rodan and not training"`` runs only tests that
need none, and that is checked: a test that uses a service fixture without its marker fails, and a
test with no service marker that runs a scheduler or RabbitMQ command, or connects to the broker,
fails too (the commands are replaced on its PATH, the broker's port refused in this process).
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import subprocess
import sys
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from bridge import logs
from bridge.config import BridgeConfig, load_config
from bridge.testing.rodan import RodanStandin, User
from bridge.testing.samples import make_sample_page
from tests.support.bridge import RODAN_EMAIL, RODAN_PASSWORD, bridge_environ
from tests.support.broker import LOCAL_BROKER, Queues, Rodan
from tests.support.cluster import Cluster
from tests.support.private_broker import GROUP as PRIVATE_BROKER_GROUP
from tests.support.private_broker import PrivateBroker, private_broker_running
from tests.support.tls_proxy import tls_proxy as start_tls_proxy

pytest_plugins = [
    "pytester",  # tests/test_service_markers.py, tests/test_xdist_groups.py
    "tests.support.rodan_real",  # the rodan_real fixture: a real Rodan 3.1.0 (deploy/dev/rodan.sh)
    "tests.support.rodan_job",  # rodan_with_job: one Rodan 3.1.0 with our job package per test process
]

# --- service markers ---------------------------------------------------------------------------------

SERVICES = ("broker", "slurm", "gridengine", "rodan")
#: The fixture that stands for each service: a test whose fixtures include it needs the service.
#: (``private_broker``: a RabbitMQ node of the test's own, tests/support/private_broker.py.)
SERVICE_FIXTURES = {
    "broker_url": "broker",
    "private_broker": "broker",
    "slurm": "slurm",
    "gridengine": "gridengine",
    "rodan_real": "rodan",
    "rodan_with_job": "rodan",
}
#: Fixtures whose parameter names the scheduler a test runs on.
SCHEDULER_PARAMS = ("cluster", "crash_cluster")
#: The commands that talk to each service, replaced for a test that has no service marker.
SERVICE_COMMANDS = {
    "broker": ("rabbitmqctl", "rabbitmq-diagnostics", "rabbitmq-plugins"),
    "slurm": ("sbatch", "squeue", "sacct", "scontrol", "scancel", "sinfo", "srun", "salloc", "sacctmgr"),
    "gridengine": ("qsub", "qstat", "qacct", "qdel", "qconf", "qhost", "qalter", "qhold", "qrls", "qmod"),
}
TRIPWIRE_LOG = "SERVICE_TRIPWIRE_LOG"


def services_of(item: pytest.Item) -> set[str]:
    """The services a test reaches through its fixtures and its scheduler parameter."""
    used = {SERVICE_FIXTURES[name] for name in getattr(item, "fixturenames", ()) if name in SERVICE_FIXTURES}
    callspec = getattr(item, "callspec", None)
    for name in SCHEDULER_PARAMS if callspec is not None else ():
        if callspec.params.get(name) in SERVICES:
            used.add(callspec.params[name])
    return used


def expected_length(item: pytest.Item) -> int:
    """A rank of how long a test takes, from its markers (0 longest): the sweeps and waits marked
    ``slow``, then real trainings in scheduler jobs, other trainings, other service tests, the rest."""
    marked = {mark.name for mark in item.iter_markers()}
    if "slow" in marked:
        return 0
    if "training" in marked and marked & {"slurm", "gridengine"}:
        return 1
    if "training" in marked:
        return 2
    return 3 if marked & set(SERVICES) else 4


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    """Before ``-m`` deselects by marker: each test gets the markers of the services it reaches.
    After: the phase's tests in the order the workers should take them. Longest first (a stable sort:
    file order within a rank), and among the longest (rank 0) those that mostly wait on a scheduler's
    clock (marker ``waits``) in turn with those that compute. Under pytest-xdist (deploy/dev/test.sh,
    --no-loadscope-reorder) the workers take tests in this order, one each at first: no five-minute
    test starts near the end and keeps the run waiting for it alone, and the six waits, which came
    first in file order, no longer leave both cores nearly idle for the phase's first minute
    (``/proc/stat``, AMD EPYC)."""
    for item in items:
        for service in sorted(services_of(item)):
            if item.get_closest_marker(service) is None:
                item.add_marker(service)
        if "private_broker" in getattr(item, "fixturenames", ()):  # one worker for every private node
            item.add_marker(pytest.mark.xdist_group(PRIVATE_BROKER_GROUP))
    yield
    items[:] = waits_in_turn(sorted(items, key=expected_length))


def waits_in_turn(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` (sorted longest first) with the waits of rank 0 in turn with the tests that
    compute, by the units the workers take (an xdist group is one unit, where its first test is)."""
    longest = [item for item in items if expected_length(item) == 0]
    units: dict[str, list[pytest.Item]] = {}
    for item in longest:
        group = item.get_closest_marker("xdist_group")
        units.setdefault(f"group {group.args[0]}" if group else item.nodeid, []).append(item)
    waits = [unit for unit in units.values() if any(item.get_closest_marker("waits") for item in unit)]
    computes = [unit for unit in units.values() if unit not in waits]
    turns = [item for pair in itertools.zip_longest(computes, waits) for unit in pair if unit for item in unit]
    return turns + items[len(longest) :]


@pytest.fixture(scope="session")
def _tripwire_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stand-ins for every service command: each notes that it ran, says why it refuses, fails."""
    bindir = tmp_path_factory.mktemp("service-tripwire")
    for service, commands in SERVICE_COMMANDS.items():
        for command in commands:
            script = bindir / command
            script.write_text(
                "#!/bin/sh\n"
                f'[ -n "${TRIPWIRE_LOG}" ] && echo "{service}: {command} $*" >> "${TRIPWIRE_LOG}"\n'
                f"echo '{command}: refused: a test without the {service!r} marker runs it' >&2\n"
                "exit 97\n"
            )
            script.chmod(0o755)
    return bindir


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Every test starts with the environment its worker process started with. Product code run
    in-process may set variables for its own process and children (worker/onednn.py's
    ``choose()`` sets ``TF_ENABLE_ONEDNN_OPTS``); left set, they would reach every later test of
    that pytest worker and the programs it starts (a TensorFlow 2.5.1 consumer dies with it)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """A test that runs a command in-process (``bridge.cli.main``) configures the JSON log to its
    captured standard error, which pytest closes when the test ends; every later test of that worker
    that logs would then fail with "I/O operation on closed file". Such a log goes back to the
    process's real standard error."""
    yield
    out = logs._settings.get("out")
    if getattr(out, "closed", False):
        logs.configure_logging(
            level=logs._settings.get("level", "INFO"),
            component=logs._settings.get("component", "bridge"),
            stream=sys.__stderr__,
        )


def _broker_address() -> tuple[str, int]:
    url = urllib.parse.urlsplit(os.environ.get("RABBITMQ_URL") or LOCAL_BROKER)
    return url.hostname or "127.0.0.1", url.port or (5671 if url.scheme == "amqps" else 5672)


@pytest.fixture(autouse=True)
def _services_declared(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, _tripwire_bin: Path
) -> Iterator[None]:
    """A test without any service marker cannot reach a service; one that uses a service fixture
    (also through ``request.getfixturevalue``) must carry that service's marker."""
    marked = {service for service in SERVICES if request.node.get_closest_marker(service) is not None}
    touched: list[str] = []
    log: Path | None = None
    if not marked:
        log = _tripwire_bin.parent / f"{_tripwire_bin.name}-{uuid.uuid4().hex}.log"
        monkeypatch.setenv(TRIPWIRE_LOG, str(log))
        monkeypatch.setenv("PATH", f"{_tripwire_bin}{os.pathsep}{os.environ.get('PATH', '')}")
        host, port = _broker_address()
        broker_hosts = {host, "127.0.0.1", "localhost", "::1"}
        real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

        def refused(address: Any) -> bool:
            if isinstance(address, tuple) and len(address) >= 2 and address[1] == port and address[0] in broker_hosts:
                touched.append(f"broker: connect to {address[0]}:{address[1]}")
                return True
            return False

        def connect(self: socket.socket, address: Any) -> None:
            if refused(address):
                raise ConnectionRefusedError(f"refused: a test without the 'broker' marker connects to {address}")
            real_connect(self, address)

        def connect_ex(self: socket.socket, address: Any) -> int:
            return 111 if refused(address) else real_connect_ex(self, address)

        monkeypatch.setattr(socket.socket, "connect", connect)
        monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    yield
    if log is not None and log.exists():
        touched += log.read_text().splitlines()
        log.unlink()
    if touched:
        pytest.fail(f"this test has no service marker but reached a service: {touched[:5]}", pytrace=False)
    used = {SERVICE_FIXTURES[name] for name in request.fixturenames if name in SERVICE_FIXTURES}
    if used - marked:
        pytest.fail(f"this test used {sorted(used - marked)} without the marker(s): add them", pytrace=False)


# --- the broker, and Rodan ------------------------------------------------------------------------


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


@pytest.fixture
def queues(broker_url: str) -> Iterator[Queues]:
    q = Queues.fresh()
    yield q
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    channel = connection.channel()
    for name in q.all():
        channel.queue_delete(name)
    connection.close()


@pytest.fixture
def tls_proxy(tmp_path: Path, broker_url: str) -> Iterator[tuple[int, Path]]:
    """amqps:// on a free port in front of the real broker: (port, the certificate to trust)."""
    upstream = pika.URLParameters(broker_url)
    with start_tls_proxy(tmp_path, upstream.host, upstream.port, name="broker") as proxy:
        yield proxy


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[RodanStandin]:
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    with RodanStandin(uploads, users=[User(RODAN_EMAIL, "hpc", RODAN_PASSWORD)], token_field="email") as server:
        yield server


@pytest.fixture
def make_config(broker_url: str, standin: RodanStandin, queues: Queues, tmp_path: Path) -> Callable[..., BridgeConfig]:
    def build(**extra: str) -> BridgeConfig:
        return load_config(environ=bridge_environ(broker_url, standin, queues, tmp_path / "spool", **extra))

    return build


@pytest.fixture
def rodan(broker_url: str, queues: Queues) -> Rodan:
    return Rodan(broker_url, queues)


@pytest.fixture
def sample_inputs(standin: RodanStandin) -> Callable[..., dict[str, str]]:
    def build(generation: str = "new", **kw: Any) -> dict[str, str]:
        return make_sample_page(standin.uploads_dir, generation=generation, **kw)  # type: ignore[arg-type]

    return build


# --- a private RabbitMQ node (tests/support/private_broker.py) -------------------------------------


@pytest.fixture(scope="session")
def private_broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateBroker]:
    """A RabbitMQ node of its own, booted with the ``max_message_size`` the test names with
    ``@private_node(max_message_size=...)``: one per limit, pytest stops it before the next."""
    limit = getattr(request, "param", None)
    if not isinstance(limit, int):
        pytest.fail("a private node needs its limit: @private_node(max_message_size=...) on the test", pytrace=False)
    with private_broker_running(Path(tmp_path_factory.mktemp("rmq")), limit) as broker:
        yield broker


@pytest.fixture
def node(private_broker: PrivateBroker) -> PrivateBroker:
    """The private node, running (a test that failed half-way may have left it stopped)."""
    return private_broker.running()


# --- the schedulers ------------------------------------------------------------------------------


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


@pytest.fixture(scope="session")
def gridengine() -> None:
    """The local Grid Engine cluster (deploy/dev/gridengine.sh up). Fails, never skips, when it is down."""
    if not shutil.which("qsub"):
        pytest.fail("Grid Engine is not installed: run 'bash deploy/dev/gridengine.sh up' (the test command does)")
    ping = subprocess.run(["qstat", "-g", "c"], capture_output=True, text=True, timeout=30)
    if ping.returncode != 0:
        pytest.fail(f"sge_qmaster is not answering ({ping.stderr.strip()}): run 'bash deploy/dev/gridengine.sh up'")


@pytest.fixture(params=["slurm", "gridengine"])
def cluster(request: pytest.FixtureRequest) -> Cluster:
    """Each test that uses this runs once on Slurm and once on Grid Engine."""
    request.getfixturevalue(request.param)  # the session fixture that checks the cluster is up
    return Cluster(request.param)
