"""A real Rodan 3.1.0 with our job package (rodan_job/hpc_paco_trainer) for the tests; what they do
with it through Rodan's REST API is ``bridge.testing.rodan_api`` (as the demo does).

One Rodan per test process: the session fixture ``rodan_with_job`` (registered by tests/conftest.py,
which gives its tests the ``rodan`` marker) brings it up with ``deploy/dev/rodan.sh up --job-package``
in a state directory, database, vhost and Redis db of its own, and takes it down at the end of the
session. The HPC traffic has a vhost of the session's own too, with the accounts the guides give
(tests/support/broker_rights.py: the job's and the bridge's, with exactly the rights read from
rodan_job/README.md) and the guides' queue names (``hpc-jobs``, ``hpc-results.<RunJob uuid>``,
``hpc-bridge.*``); it is deleted at the end. Its Python3 worker reads the job's settings from its
environment (:data:`WORKER_SETTINGS`): the broker as the job's account, a short poll, and a silence
bound short enough that a run whose ``Maximum time`` is ``0-00:01`` fails within minutes when no
bridge answers (continuations 0, pending and slack seconds), while a run with a longer
``Maximum time`` keeps a long bound.

Every module that uses it is in the xdist group :data:`GROUP`, so under ``--dist loadgroup`` they run
in one worker, one after another, against the same Rodan.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pika
import pytest

from bridge.testing.rodan_api import Api
from tests.support.broker import Queues, Rodan
from tests.support.broker_rights import BRIDGE_USER, JOB_USER, RightsVhost, documented_rights, rights_vhost
from tests.support.cluster import Cluster
from tests.support.harness import Harness

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "rodan_job" / "hpc_paco_trainer"
RODAN_SH = REPO / "deploy" / "dev" / "rodan.sh"
JOB_NAME = "Training model for Patchwise Analysis of Music Document, HPC"
#: The guide whose broker rights the job's and the bridge's accounts get.
JOB_GUIDE = REPO / "rodan_job" / "README.md"
#: The request queue, as the guides name it (in the session's own vhost).
REQUEST_QUEUE = "hpc-jobs"
#: The xdist group of every module that uses the shared Rodan (one worker runs them all).
GROUP = "rodan-with-job"
#: The Python3 worker's HPC_POLL_SECONDS: seconds between two polls of a waiting run.
POLL_SECONDS = 5
#: The job's settings in the Python3 worker's environment (besides the broker and the queue). The
#: silence bound is ``Maximum time`` x (1 + continuations) + pending + slack: 90 s for 0-00:01.
WORKER_SETTINGS = {
    "HPC_POLL_SECONDS": str(POLL_SECONDS),
    "HPC_BRIDGE_MAX_CONTINUATIONS": "0",
    "HPC_BRIDGE_MAX_PENDING": "20",
    "HPC_SILENCE_SLACK": "10",
}


@dataclass
class RodanWithJob:
    """A Rodan 3.1.0 of the session's own (state directory, database, vhost, port) with the job
    package installed, its Python3 worker reading the job's settings from its environment."""

    url: str
    email: str
    password: str = field(repr=False)
    state_dir: Path
    request_queue: str
    env: dict[str, str] = field(repr=False)
    reply_queues: list[str] = field(default_factory=list)
    #: The HPC traffic's vhost (the session's own; deleted at the end).
    hpc_vhost: str = ""
    #: The Rodan job's account (the worker's HPC_RABBITMQ_URL), with the guides' rights on hpc_vhost.
    job_broker_url: str = field(default="", repr=False)
    #: The bridge's account, with the guides' rights on hpc_vhost: a test's bridge uses it.
    bridge_broker_url: str = field(default="", repr=False)
    #: The tests' own account, with every right on hpc_vhost: for inspection and cleanup only.
    admin_broker_url: str = field(default="", repr=False)

    @property
    def host_port(self) -> str:
        """``host:port`` of the server (a bridge's RODAN_HOST)."""
        return urlsplit(self.url).netloc

    def session(self) -> Api:
        """Rodan's REST API as the test account (a fresh token)."""
        return Api.login(self.url, self.email, self.password)

    def bridge(self, folder: Path, **settings: str) -> Harness:
        """A bridge of the test's own for this Rodan, set up as the guides say: the guides' bridge
        account on the session's HPC vhost, the guides' queue names (the bridge's defaults), the test
        account on Rodan, cron passes with Slurm; the test looks at the broker with the admin's
        account. ``settings`` add to (or override) its settings; its spool and log are in ``folder``."""
        queues = Queues(self.request_queue, "hpc-results", "hpc-bridge.dead-letter")
        env = {
            "RABBITMQ_URL": self.bridge_broker_url,
            "RODAN_HOST": self.host_port,
            "RODAN_SCHEME": "http",
            "RODAN_EMAIL": self.email,
            "RODAN_PASSWORD": self.password,
            "HPC_SPOOL_DIR": str(folder / "spool"),
            "HPC_WORKER_PYTHON": sys.executable,
            "HPC_SCHEDULER": "slurm",
            "HPC_GPU_RULES": "none",
            "HPC_RECONCILE_INTERVAL": "1",
            "HPC_RODAN_RETRIES": "2",
            "HPC_LOG_FILE": str(folder / "bridge.log"),
            **settings,
        }
        return Harness(env, folder / "spool", Rodan(self.admin_broker_url, queues), Cluster("slurm"))

    def forget_bridge(self, harness: Harness) -> None:
        """After a module's bridge: its jobs cancelled, and its dead-letter and status queues deleted,
        so that the next module's bridge starts afresh on the session's vhost."""
        harness.teardown()
        with contextlib.suppress(pika.exceptions.AMQPError):
            connection = pika.BlockingConnection(pika.URLParameters(self.admin_broker_url))
            for name in (harness.rodan.queues.dead, "hpc-bridge.status"):
                with contextlib.suppress(pika.exceptions.ChannelClosedByBroker):
                    connection.channel().queue_delete(queue=name)
            connection.close()

    def up(self) -> None:
        done = subprocess.run(
            ["bash", str(RODAN_SH), "up", "--job-package", str(PACKAGE)],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    def worker_pid(self) -> int:
        return int((self.state_dir / "run" / "worker.pid").read_text().strip())

    def tasks_in_flight(self, task: str = "rodan.core.master_task") -> set[str]:
        """Ids of the Celery tasks named ``task`` that the worker received and has not finished,
        from its log (STATE/logs/worker.log). Rodan's ``master_task`` (which starts a workflow
        run's RunJobs and ends the run) is acknowledged when it starts: a worker killed while one
        runs loses it, and that workflow run with it (Rodan's own behaviour, not the job's)."""
        log = self.state_dir / "logs" / "worker.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        received = set(re.findall(rf"Received task: {re.escape(task)}\[([0-9a-f-]+)\]", text))
        ended = set(re.findall(rf"Task {re.escape(task)}\[([0-9a-f-]+)\] (?:succeeded|raised|failed)", text))
        return received - ended

    def kill_and_restart_worker(self, sig: signal.Signals = signal.SIGKILL, timeout_s: float = 120) -> int:
        """Kill the Celery worker's session with ``sig`` and start the same worker again (its command
        line, environment and folder, as a service manager restarts it), leaving the server alone
        (``rodan.sh up`` would restart the server too); the new worker's pid once it is ready."""
        pid = self.worker_pid()
        proc = Path(f"/proc/{pid}")
        command = (proc / "cmdline").read_bytes().decode().split("\0")[:-1]
        environ = dict(
            item.split("=", 1) for item in (proc / "environ").read_bytes().decode().split("\0") if "=" in item
        )
        cwd = os.readlink(proc / "cwd")
        self.stop_worker(sig)
        log = self.state_dir / "logs" / "worker.log"
        start = log.stat().st_size
        # As rodan.sh starts it: in a session of its own, a child of nobody here (no zombie to reap).
        started = subprocess.run(
            ["bash", "-c", 'setsid "$@" >>"$WORKER_LOG" 2>&1 </dev/null & echo $!', "worker", *command],
            cwd=cwd, env={**environ, "WORKER_LOG": str(log)}, capture_output=True, text=True, check=True,
        )  # fmt: skip
        new_pid = int(started.stdout.strip())
        (self.state_dir / "run" / "worker.pid").write_text(f"{new_pid}\n")  # rodan.sh down stops it
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with open(log, "rb") as text:
                text.seek(start)
                if re.search(rb"@\S+ ready\.$", text.read(), re.MULTILINE):
                    return new_pid
            assert Path(f"/proc/{new_pid}").exists(), f"the restarted Celery worker exited; see {log}"
            time.sleep(0.5)
        raise AssertionError(f"the restarted Celery worker was not ready within {timeout_s} s; see {log}")

    def stop_worker(self, sig: signal.Signals, timeout_s: float = 60) -> None:
        """Send ``sig`` to the Celery worker's session (its main process and pool) and wait until
        the main process is gone."""
        pid = self.worker_pid()
        os.killpg(pid, sig)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.5)
        assert not Path(f"/proc/{pid}").exists(), f"the Celery worker {pid} is still there after {sig.name}"


def rodan_env(state: Path, broker_url: str, request_queue: str) -> dict[str, str]:
    """``rodan.sh``'s environment for a Rodan of its own in ``state``, with the job's settings."""
    env = {
        **os.environ,
        "HPC_DEV_RODAN_DIR": str(state),
        # Busy (another session's Rodan): rodan.sh takes a free port. Two test runs at once on one
        # machine give each its own Redis db with HPC_TEST_RODAN_REDIS_DB.
        "HPC_DEV_RODAN_PORT": "8795",
        "HPC_DEV_RODAN_REDIS_DB": os.environ.get("HPC_TEST_RODAN_REDIS_DB", "12"),
        "HPC_RABBITMQ_URL": broker_url,
        "HPC_REQUEST_QUEUE": request_queue,
        **WORKER_SETTINGS,
    }
    env.pop("HPC_DEV_RODAN_JOB_PACKAGES", None)
    return env


@pytest.fixture(scope="session")
def rodan_with_job(tmp_path_factory: pytest.TempPathFactory, broker_url: str) -> Iterator[RodanWithJob]:
    """The session's Rodan with the job package, its worker on the HPC vhost as the job's account
    (``down`` at the end; then the vhost, with every queue in it, and the accounts are deleted)."""
    if os.geteuid() != 0:
        pytest.fail("the real Rodan (deploy/dev/rodan.sh) needs root on the dev machine", pytrace=False)
    state = tmp_path_factory.mktemp("rodan-job") / "rodan"
    rights = documented_rights(JOB_GUIDE).rights
    with rights_vhost(broker_url, rights[BRIDGE_USER], rights[JOB_USER], tag="rodan-hpc") as accounts:
        yield from _rodan_with_job(state, accounts)


def _rodan_with_job(state: Path, accounts: RightsVhost) -> Iterator[RodanWithJob]:
    queue = REQUEST_QUEUE
    env = rodan_env(state, accounts.job_url, queue)
    rodan = RodanWithJob(
        "", "", "", state, queue, env,
        hpc_vhost=accounts.vhost,
        job_broker_url=accounts.job_url,
        bridge_broker_url=accounts.bridge_url,
        admin_broker_url=accounts.admin_url,
    )  # fmt: skip
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


# --- the broker's side -------------------------------------------------------------------------------


def take_request(broker_url: str, queue: str, timeout_s: float) -> tuple[Any, dict[str, Any]]:
    """Take the next request off ``queue`` (waiting up to ``timeout_s``): (properties, body)."""
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
