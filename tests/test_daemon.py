"""``hpc-bridge run``: the daemon against the real broker, Slurm and the stand-in."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from typing import Any

import pika
import pytest

from tests.support.bridge import bridge_environ
from tests.support.cluster import cancel_spool_jobs, jobs_named
from tests.support.daemon import DAEMON_SETTINGS, Daemon, connection_named
from tests.support.wait import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.broker]


@pytest.fixture
def daemon_env(broker_url, standin, queues, tmp_path, slurm):
    spool = tmp_path / "spool"
    env = bridge_environ(
        broker_url,
        standin,
        queues,
        spool,
        HPC_LOG_FILE=str(tmp_path / "bridge.log"),
        HPC_WORKER_PYTHON="/bin/true",  # the job ends at once without replying: reconciliation must answer
    )
    yield env, tmp_path / "bridge.log", spool
    cancel_spool_jobs(spool)


def test_daemon_picks_up_reconciles_and_stops_on_sigterm(daemon_env, rodan, sample_inputs):
    env, log, spool = daemon_env
    daemon = Daemon(env, log, spool)
    try:
        corr = rodan.publish_request(sample_inputs("new", n_layers=1), DAEMON_SETTINGS)
        wait_until(lambda: daemon.state(corr) in ("submitted", "replied"), 15, 0.05, "pickup")
        replies: list[tuple[Any, bytes, dict[str, Any]]] = []
        wait_until(lambda: replies.extend(rodan.drain()) or replies, 120, 1, "the reconciliation reply")
        assert [c for c, _b, _h in replies] == [corr]
        error = json.loads(replies[0][1])["error"]
        assert "COMPLETED" in error and "without sending its models" in error
        wait_until(lambda: daemon.state(corr) == "replied", 30, 0.2, "the ledger to settle")
    finally:
        assert daemon.stop() == 0
    assert daemon.events("daemon_stop")


def test_sigterm_finishes_the_message_in_hand(daemon_env, rodan, sample_inputs, standin, queues):
    env, log, spool = daemon_env
    standin.delay(4, paths="/api/auth/token/")
    daemon = Daemon(env, log, spool)
    corr = rodan.publish_request(sample_inputs("new", n_layers=1), DAEMON_SETTINGS)
    wait_until(lambda: daemon.events("request_received"), 15, 0.05, "the daemon to take the request")
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=60) == 0
    assert daemon.state(corr) == "submitted", "the request in hand was finished before exiting"
    assert len(jobs_named(f"rodan-{corr}")) == 1
    assert rodan.depth(queues.request) == 0, "and acked"
    assert daemon.events("request_acked") and daemon.events("daemon_stop")


@pytest.mark.skipif(
    subprocess.run(["which", "rabbitmqctl"], capture_output=True).returncode != 0
    or bool(os.environ.get("RABBITMQ_URL")),
    reason="closing a connection needs rabbitmqctl on the broker's own machine",
)
def test_daemon_reconnects_after_the_broker_drops_it(daemon_env, rodan, sample_inputs):
    env, log, spool = daemon_env
    daemon = Daemon(env, log, spool)
    try:
        mine = connection_named(f"hpc-bridge/{daemon.proc.pid}")
        assert len(mine) == 1
        subprocess.run(["rabbitmqctl", "-q", "close_connection", mine[0], "test: simulated broker loss"], check=True)
        wait_until(lambda: daemon.events("broker_lost"), 15, 0.1, "the daemon to notice")
        wait_until(lambda: len(daemon.events("broker_connected")) >= 2, 30, 0.1, "the daemon to reconnect")
        corr = rodan.publish_request(sample_inputs("new", n_layers=1), DAEMON_SETTINGS)
        wait_until(lambda: daemon.state(corr) in ("submitted", "replied"), 15, 0.1, "pickup after reconnecting")
    finally:
        assert daemon.stop() == 0


def test_heartbeats_are_serviced_while_rodan_is_slow(daemon_env, rodan, sample_inputs, standin, queues):
    env, log, spool = daemon_env
    standin.delay(12, paths="/api/auth/token/")  # six heartbeat intervals
    daemon = Daemon({**env, "HPC_BROKER_HEARTBEAT": "2"}, log, spool)
    try:
        corr = rodan.publish_request(sample_inputs("new", n_layers=1), DAEMON_SETTINGS)
        wait_until(lambda: daemon.state(corr) in ("submitted", "replied"), 60, 0.2, "the slow submission")
        wait_until(lambda: daemon.events("request_acked"), 10, 0.1, "the ack")
        assert not daemon.events("broker_lost"), "the connection dropped while the token was fetched"
        assert rodan.depth(queues.request) == 0
        assert len(jobs_named(f"rodan-{corr}")) == 1
    finally:
        assert daemon.stop() == 0


def _consumers(broker_url: str, queue: str) -> int:
    """How many consumers the broker counts on ``queue`` (what its management page shows)."""
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.consumer_count)
    finally:
        connection.close()


def test_the_daemon_is_a_consumer_on_the_request_queue(daemon_env, broker_url, queues, rodan, sample_inputs):
    env, log, spool = daemon_env
    daemon = Daemon(env, log, spool)
    try:
        assert _consumers(broker_url, queues.request) == 1, "RabbitMQ shows the daemon as a consumer"
        corr = rodan.publish_request(sample_inputs("new", n_layers=1), DAEMON_SETTINGS)
        wait_until(lambda: daemon.state(corr) in ("submitted", "replied"), 15, 0.05, "pickup")
        assert rodan.depth(queues.request) == 0
        assert _consumers(broker_url, queues.request) == 1
    finally:
        assert daemon.stop() == 0
    assert _consumers(broker_url, queues.request) == 0, "and none once it has stopped"


def test_a_deferred_request_does_not_hold_up_the_ones_behind_it(
    daemon_env, broker_url, queues, rodan, sample_inputs, standin
):
    """A deferred request is held unacked until its retry time; with a prefetch of 1 it would stop
    every later delivery, so the consumer is restarted: the next request is taken at once."""
    env, log, spool = daemon_env
    stuck_page = sample_inputs("new", n_layers=1, seed=11)
    standin.fail_next(100000, status=503, paths=stuck_page["Image"])  # this request's input check fails
    daemon = Daemon({**env, "HPC_RODAN_RETRIES": "0"}, log, spool)
    try:
        stuck = rodan.publish_request(stuck_page, DAEMON_SETTINGS)
        wait_until(lambda: daemon.events("request_deferred"), 30, 0.05, "the first request to be deferred")
        behind = rodan.publish_request(sample_inputs("new", n_layers=1, seed=12), DAEMON_SETTINGS)
        wait_until(lambda: daemon.state(behind) in ("submitted", "replied"), 30, 0.1, "the request behind it")
        assert daemon.state(stuck) == "received", "the first one is still waiting for its retry"
        assert _consumers(broker_url, queues.request) == 1
        standin.clear_faults()
        wait_until(lambda: daemon.state(stuck) in ("submitted", "replied"), 60, 0.2, "the retry")
        assert len(jobs_named(f"rodan-{stuck}")) == 1 and len(jobs_named(f"rodan-{behind}")) == 1
        wait_until(lambda: rodan.depth(queues.request) == 0, 10, 0.1, "the queue to be empty")
    finally:
        standin.clear_faults()
        assert daemon.stop() == 0
