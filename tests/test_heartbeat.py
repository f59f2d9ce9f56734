"""The status (heartbeat) message Rodan's admins read on ``HPC_STATUS_QUEUE``: real broker, real Slurm."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest

from bridge.config import load_config
from bridge.ops.heartbeat import MESSAGE_TYPE, STATUS_QUEUE_LENGTH, status_line
from tests.support.bridge import RODAN_EMAIL, bridge_environ, run_bridge
from tests.support.cluster import cancel_spool_jobs
from tests.support.daemon import DAEMON_SETTINGS, Daemon
from tests.support.wait import wait_until

pytestmark = [pytest.mark.broker, pytest.mark.slurm]

FIELDS = {
    "type", "schema", "version", "host", "pid", "mode", "scheduler", "at", "at_utc", "interval_s",
    "started_at_utc", "last_pass_utc", "last_pass_ok", "passes", "broker_connected", "request_queue",
    "requests_waiting", "request_queue_consumers", "requests_held", "requests_in_flight",
    "requests_by_state", "jobs_by_state", "dead_letters", "outbox_replies", "totals",
}  # fmt: skip


class StatusQueue:
    """Reads the status queue as an admin does: look, and put back (nothing is taken away)."""

    def __init__(self, broker_url: str, name: str) -> None:
        self.broker_url, self.name = broker_url, name

    def _channel(self) -> tuple[pika.BlockingConnection, Any]:
        connection = pika.BlockingConnection(pika.URLParameters(self.broker_url))
        return connection, connection.channel()

    def depth(self) -> int | None:
        """Messages in the queue; None when it does not exist."""
        connection, channel = self._channel()
        try:
            return int(channel.queue_declare(self.name, passive=True).method.message_count)
        except pika.exceptions.ChannelClosedByBroker as exc:
            assert exc.reply_code == 404
            return None
        finally:
            if connection.is_open:
                connection.close()

    def peek(self) -> list[tuple[pika.BasicProperties, dict[str, Any], bytes]]:
        """Every message, oldest first, requeued afterwards (``ackmode=reject_requeue_true``)."""
        connection, channel = self._channel()
        out = []
        try:
            while True:
                method, props, body = channel.basic_get(self.name, auto_ack=False)
                if method is None:
                    break
                out.append((props, json.loads(body), body))
            # Closing without acking gives them all back, in their order.
        except pika.exceptions.ChannelClosedByBroker as exc:
            assert exc.reply_code == 404
        finally:
            if connection.is_open:
                connection.close()
        return out

    def delete(self) -> None:
        connection, channel = self._channel()
        channel.queue_delete(self.name)
        connection.close()


@pytest.fixture
def status_queue(broker_url: str) -> Iterator[StatusQueue]:
    queue = StatusQueue(broker_url, f"test-{uuid.uuid4().hex[:10]}-status")
    yield queue
    queue.delete()


@pytest.fixture
def env(broker_url, standin, queues, tmp_path, slurm, status_queue) -> Iterator[dict[str, str]]:
    spool = tmp_path / "spool"
    environ = bridge_environ(
        broker_url,
        standin,
        queues,
        spool,
        HPC_LOG_FILE=str(tmp_path / "bridge.log"),
        HPC_STATUS_QUEUE=status_queue.name,
        HPC_STATUS_INTERVAL="0.5",
        HPC_SCHEDULER_ARGS="--hold",  # the job stays pending: one request in flight
    )
    yield environ
    cancel_spool_jobs(spool)


def assert_nothing_secret(body: bytes, environ: dict[str, str]) -> None:
    config = load_config(environ=environ)
    text = body.decode()
    for secret in config.secrets:
        assert secret not in text, "a password in the status message"
    for private in (str(config.spool_dir), config.broker_url, RODAN_EMAIL, config.rodan_host, "/"):
        assert private not in text, f"{private!r} in the status message"


def test_the_daemon_publishes_a_bounded_status_an_admin_can_read(env, status_queue, rodan, sample_inputs, queues):
    spool = load_config(environ=env).spool_dir
    daemon = Daemon(env, spool.parent / "bridge.log", spool)
    try:
        corr = rodan.publish_request(sample_inputs("new", n_layers=1), DAEMON_SETTINGS)
        wait_until(lambda: daemon.state(corr) == "submitted", 30, 0.1, "the request to be submitted")

        def fresh() -> list[dict[str, Any]]:
            return [s for _p, s, _b in status_queue.peek() if s["requests_in_flight"] == 1]

        first_at = wait_until(fresh, 30, 0.2, "a status message counting the request")[0]["at"]

        messages: list[tuple[pika.BasicProperties, dict[str, Any], bytes]] = []

        def oldest_dropped() -> bool:
            messages[:] = status_queue.peek()
            return len(messages) == STATUS_QUEUE_LENGTH and messages[0][1]["at"] > first_at

        # More than STATUS_QUEUE_LENGTH publications: the broker dropped the oldest and kept the
        # latest STATUS_QUEUE_LENGTH. (One reading, while the daemon goes on: a message published
        # while the reader holds the others unacked is not counted by the queue's length limit,
        # so a second reading could see one more.)
        wait_until(oldest_dropped, 60, 0.5, "the status queue to keep only its latest messages")
    finally:
        assert daemon.stop() == 0
    props, status, body = messages[-1]
    assert props.type == MESSAGE_TYPE and props.content_type == "application/json"
    assert props.delivery_mode != pika.DeliveryMode.Persistent.value, "status messages are transient"
    assert set(status) == FIELDS
    assert status["version"] == version("hpc-bridge")
    assert status["mode"] == "daemon" and status["pid"] == daemon.proc.pid and status["scheduler"] == "slurm"
    assert status["interval_s"] == 0.5 and status["last_pass_ok"] is True and status["broker_connected"]
    assert status["request_queue"] == queues.request and status["request_queue_consumers"] == 1
    assert status["requests_in_flight"] == 1 and status["requests_waiting"] == 0
    assert sum(status["jobs_by_state"].values()) == 1
    assert status["dead_letters"] == 0 and status["outbox_replies"] == 0
    assert status["totals"]["received"] == 1 and status["totals"]["submitted"] == 1
    assert [s["at"] for _p, s, _b in messages] == sorted(s["at"] for _p, s, _b in messages), "oldest first"
    assert_nothing_secret(body, env)
    assert "requests in flight" in status_line(status)


def test_check_publishes_one_status_at_the_end_of_its_pass(env, status_queue, rodan, sample_inputs):
    corr = rodan.publish_request(sample_inputs("new", n_layers=1), DAEMON_SETTINGS)
    rodan.publish(b"not json")  # rejected: dead-lettered
    assert run_bridge(env, "check").returncode == 0
    messages = status_queue.peek()
    assert len(messages) == 1
    _props, status, body = messages[0]
    assert status["mode"] == "check" and status["interval_s"] is None and status["passes"] == 1
    assert status["requests_in_flight"] == 1 and status["requests_by_state"]["rejected"] == 1
    assert status["dead_letters"] == 1 and status["request_queue_consumers"] == 0
    assert load_config(environ=env).spool_dir.joinpath("ledger", f"{corr}.json").exists()
    assert_nothing_secret(body, env)
    assert run_bridge(env, "check").returncode == 0
    assert len(status_queue.peek()) == 2


def test_no_status_queue_when_turned_off(env, status_queue):
    assert run_bridge({**env, "HPC_STATUS_QUEUE": "none"}, "check").returncode == 0
    assert status_queue.depth() is None, "HPC_STATUS_QUEUE=none declares nothing"


def test_a_status_queue_declared_otherwise_costs_only_the_status(env, status_queue, rodan, sample_inputs, broker_url):
    """Someone declared the queue without our arguments: the broker refuses our declaration (406).
    That is logged, and the requests go on as if nothing had happened."""
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    connection.channel().queue_declare(status_queue.name, durable=False)
    connection.close()
    corr = rodan.publish_request(sample_inputs("new", n_layers=1), DAEMON_SETTINGS)
    result = run_bridge(env, "check")
    assert result.returncode == 0
    assert load_config(environ=env).spool_dir.joinpath("ledger", f"{corr}.json").exists()
    lines = Path(env["HPC_LOG_FILE"]).read_text().splitlines()
    events = [json.loads(line)["event"] for line in lines if line.startswith("{")]
    assert "status_publish_failed" in events and "check_done" in events
    assert status_queue.peek() == []
