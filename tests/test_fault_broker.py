"""Broker outages while ``hpc-bridge run`` consumes and workers publish (fault suite item 2: docs/reliability.md).

Every test here runs against a PRIVATE RabbitMQ node (its own node name, ports, data and log
directories, Erlang cookie, and a ``max_message_size`` of 1 MiB: tests/support/private_broker.py),
started once per session, so that stopping and restarting it never disturbs the shared broker on
5672. Requests go through real Slurm jobs; the jobs run a light stub worker that uses the real
worker's delivery (``worker.job.deliver``: stage in the outbox, publish with confirms), and waits
for a gate file so that the test decides when the replies are published.

What a restart of the node preserves, ``rabbitmqctl stop_app``/``start_app`` as much as a full stop
and start: both drop non-durable queues (Rodan declares ``hpc-jobs`` and ``hpc-results``
non-durable, and publishes transient requests):

* preserved: every request the bridge had taken (ledger + job), every reply staged in the outbox
  (the worker's, or the bridge's, while the broker was down), the durable dead-letter queue;
  the bridge re-declares the request queue itself on reconnecting;
* not preserved: requests still waiting in ``hpc-jobs`` (or held unacked by the bridge) when the
  node stopped, and replies already confirmed into ``hpc-results`` but not yet consumed: the broker
  drops the non-durable queues with their messages. ``hpc-results`` exists again only once Rodan
  declares it; until then the bridge keeps the replies in its outbox (``reply_left_in_outbox``)
  instead of failing the pass.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pika
import pytest
from pika.adapters.blocking_connection import BlockingChannel

from bridge.testing.rodan import RodanStandin
from tests.support.bridge import bridge_environ, job_parameters_json, settled
from tests.support.broker import Queues, Rodan
from tests.support.cluster import Cluster, jobs_named
from tests.support.harness import Harness
from tests.support.private_broker import PrivateBroker, private_node
from tests.support.wait import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.broker]

STUB_SETTINGS = {
    "Maximum number of training epochs": 1,
    "Maximum number of samples per label": 100,
    "Patch height": 64,
    "Patch width": 64,
    "Maximum time (D-HH:MM)": "0-00:10",
    "Maximum memory (MB)": 1024,
    "CPUs": 1,
}


#: The private node's max_message_size: far below HPC_MAX_REPLY_BYTES, the operator's mistake that
#: makes the broker itself refuse a models reply.
PRIVATE_MAX_MESSAGE = 1024 * 1024
#: Every test here on one private node (tests/support/private_broker.py), booted with that limit.
on_the_node = private_node(max_message_size=PRIVATE_MAX_MESSAGE)


@contextmanager
def confirm_channel(url: str) -> Iterator[BlockingChannel]:
    """A confirm-mode channel on a connection of its own, closed on leaving the block."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        yield channel
    finally:
        connection.close()


STUB = """
import sys, time
from pathlib import Path

from bridge.logs import configure_logging

configure_logging(stream=sys.stdout, component="worker")

from bridge.handoff import JobParameters
from bridge.protocol import success_reply
from bridge.replies import ReplyBox
from bridge.spool import Spool, read_json
from worker.job import deliver

params_path = Path(sys.argv[-1])
params = JobParameters.from_json(read_json(params_path))
gate = Path({gate!r})
deadline = time.monotonic() + 300
while not gate.exists() and time.monotonic() < deadline:
    time.sleep(0.2)
body = success_reply({{key: f"stub {{key}} {{params.correlation_id}}".encode() for _, key in params.layers}})
deliver(ReplyBox(Spool(params.spool), max_bytes=params.max_reply_bytes), params, body)
params_path.unlink(missing_ok=True)
"""


class Scene(Harness):
    """One test's bridge on the private broker, its stub workers' gate, Rodan's side, and what came back."""

    def __init__(self, tmp: Path, node: PrivateBroker, standin: RodanStandin) -> None:
        tag = uuid.uuid4().hex[:10]
        self.queues = Queues(f"fault-{tag}-hpc-jobs", f"fault-{tag}-hpc-results", f"fault-{tag}-dead")
        self.node = node
        self.gate = tmp / "gate"
        stub = tmp / "stub_worker.py"
        stub.write_text(textwrap.dedent(STUB.format(gate=str(self.gate))))
        wrapper = tmp / "stub-python"
        wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {stub} "$@"\n')  # called as: -m worker run PARAMS
        wrapper.chmod(0o755)
        env = bridge_environ(
            node.url,
            standin,
            self.queues,
            tmp / "spool",
            HPC_LOG_FILE=str(tmp / "bridge.log"),
            HPC_WORKER_PYTHON=str(wrapper),
            HPC_GPU_RULES="none",
            HPC_METRICS_FILE=str(tmp / "metrics.prom"),
        )
        super().__init__(env, tmp / "spool", Rodan(node.url, self.queues), Cluster("slurm"))
        self.consumed: list[str] = []

    def outbox(self) -> list[str]:
        return sorted(p.stem for p in (self.spool / "outbox").glob("*.json"))

    def jobs_over(self, corrs: list[str]) -> bool:
        """Every request's job has left the Slurm queue."""
        out = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True).stdout.split()
        return not any(f"rodan-{c}" in out for c in corrs)

    def events(self, name: str) -> list[dict[str, Any]]:
        assert self.daemon is not None
        return self.daemon.events(name)

    def teardown(self) -> None:
        super().teardown()
        if self.node.answers():
            connection = pika.BlockingConnection(pika.URLParameters(self.node.url))
            channel = connection.channel()
            for name in self.queues.all():
                channel.queue_delete(name)
            connection.close()


@pytest.fixture
def scene(tmp_path: Path, node: PrivateBroker, standin: RodanStandin, slurm: None) -> Iterator[Scene]:
    s = Scene(tmp_path, node, standin)
    yield s
    s.teardown()


def assert_one_stub_reply_each(scene: Scene, corrs: list[str]) -> None:
    scene.collect()
    assert {c: len(scene.replies.get(c, [])) for c in corrs} == {c: 1 for c in corrs}, "exactly one reply per request"
    assert set(scene.replies) == set(corrs), "no reply for a request nobody sent"
    for corr in corrs:
        reply = scene.reply(corr)
        assert "error" not in reply, reply
        assert base64.decodebytes(reply["Background Model"].encode()) == f"stub Background Model {corr}".encode()


def _queue_exists(url: str, name: str) -> bool:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        connection.channel().queue_declare(name, passive=True)
        return True
    except pika.exceptions.ChannelClosedByBroker:
        return False
    finally:
        if connection.is_open:
            connection.close()


class RodanConsumer:
    """Rodan's waiting side as a robust task would be: consume ``hpc-results``, and after a broker
    restart connect again and declare the queue again (the restart dropped it: it is non-durable)."""

    def __init__(self, url: str, queue: str) -> None:
        self.url, self.queue = url, queue
        self.received: list[tuple[str, bytes]] = []
        self.marks: set[str] = set()  # correlation ids of catch_up's own messages, never counted
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RodanConsumer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                connection = pika.BlockingConnection(pika.URLParameters(self.url))
            except pika.exceptions.AMQPError:
                self._stop.wait(0.2)
                continue
            try:
                channel = connection.channel()
                channel.queue_declare(self.queue)
                channel.basic_consume(self.queue, self._on_message, auto_ack=True)
                self.connections += 1
                while not self._stop.is_set():
                    connection.process_data_events(time_limit=0.2)
            except pika.exceptions.AMQPError:
                self._stop.wait(0.2)
            finally:
                if connection.is_open:
                    try:
                        connection.close()
                    except pika.exceptions.AMQPError:
                        pass

    def _on_message(self, _channel: Any, _method: Any, props: pika.BasicProperties, body: bytes) -> None:
        self.received.append((props.correlation_id or "", body))

    def catch_up(self, timeout: float = 60) -> None:
        """Return once every message queued before this call has reached the consumer: a mark
        published now queues behind them, and the queue's one consumer gets it in order."""
        mark = f"catch-up-{uuid.uuid4()}"
        self.marks.add(mark)
        with confirm_channel(self.url) as channel:
            channel.basic_publish("", self.queue, b"", pika.BasicProperties(correlation_id=mark))
        wait_until(lambda: any(corr == mark for corr, _body in list(self.received)), timeout, 0.1, "the mark")

    def got(self, scene: Scene, corrs: list[str]) -> bool:
        for corr, body in self.received[len(scene.consumed) :]:
            scene.consumed.append(corr)
            if corr in self.marks:
                continue
            scene.replies[corr].append(body)
        return all(scene.replies.get(c) for c in corrs)


@on_the_node
def test_stop_app_while_consuming_and_while_workers_publish(scene: Scene, node: PrivateBroker, sample_inputs) -> None:
    daemon = scene.start_daemon()
    page = sample_inputs("new", n_layers=1, seed=21)
    # 1. The broker goes away while jobs run; they finish and publish while it is away: outbox.
    first = [scene.rodan.publish_request(page, STUB_SETTINGS) for _ in range(4)]
    wait_until(lambda: all(daemon.state(c) == "submitted" for c in first), 120, 0.2, "the requests to be submitted")
    node.stop_app()
    scene.gate.touch()
    wait_until(lambda: len(scene.outbox()) == len(first) and scene.jobs_over(first), 300, 0.5, "the workers' outbox")
    wait_until(lambda: daemon.events("broker_lost"), 60, 0.2, "the daemon to notice the outage")
    assert daemon.proc.poll() is None, "the daemon survives the outage"
    node.start_app()
    wait_until(lambda: len(daemon.events("broker_connected")) >= 2, 120, 0.5, "the daemon to reconnect")
    # stop_app drops Rodan's non-durable queues too: the replies wait until Rodan declares hpc-results.
    assert _queue_exists(node.url, scene.queues.request), "the bridge re-declared the request queue"
    wait_until(
        lambda: {e.get("correlation_id") for e in daemon.events("reply_left_in_outbox")} >= set(first),
        120,
        0.5,
        "the daemon to find the reply queue missing",
    )
    assert daemon.proc.poll() is None and sorted(scene.outbox()) == sorted(first)
    with RodanConsumer(node.url, scene.queues.reply) as consumer:
        wait_until(lambda: consumer.got(scene, first), 120, 0.5, "every reply once Rodan listens again")
        wait_until(lambda: not scene.outbox(), 60, 0.5, "the outbox to empty")
        assert_one_stub_reply_each(scene, first)
        reconnects_after_first = len(daemon.events("broker_connected"))

        # 2. Bounce the broker (stop_app/start_app, three times) while the next jobs are publishing.
        scene.gate.unlink()
        second = [scene.rodan.publish_request(page, STUB_SETTINGS) for _ in range(6)]
        wait_until(lambda: all(daemon.state(c) == "submitted" for c in second), 120, 0.2, "the next submissions")
        scene.gate.touch()
        for bounce in range(3):
            node.stop_app()
            node.start_app()
            wait_until(
                lambda b=bounce: len(daemon.events("broker_connected")) >= reconnects_after_first + b + 1,
                120,
                0.2,
                "the daemon to reconnect",
            )
        wait_until(lambda: consumer.got(scene, second), 300, 0.5, "every reply of the second batch")
        everything = first + second
        wait_until(
            lambda: scene.jobs_over(second) and settled(scene.spool, everything),
            180,
            0.5,
            "the jobs to end and the bridge to settle every request",
        )
        consumer.catch_up()  # nothing publishes any more: every reply there is has reached Rodan
        consumer.got(scene, [])
        assert_one_stub_reply_each(scene, everything)
        rodan_connections = consumer.connections
    assert daemon.proc.poll() is None
    lost, connected = daemon.events("broker_lost"), daemon.events("broker_connected")
    assert len(connected) >= reconnects_after_first + 3 and len(lost) >= len(connected) - 1
    assert all(e["level"] == "warning" and "retry_in_s" in e for e in lost)
    for corr in first + second:
        assert daemon.state(corr) == "replied"
    assert daemon.stop() == 0
    print(
        f"\nstop_app: {len(first) + len(second)} requests, 4 outages, {sum(map(len, scene.replies.values()))} replies, "
        f"{len(lost)} broker_lost, {len(connected)} broker_connected, Rodan reconnected {rodan_connections} times"
    )


@on_the_node
def test_full_node_restart_redeclares_and_keeps_replies_until_the_reply_queue_exists(
    scene: Scene, node: PrivateBroker, sample_inputs
) -> None:
    daemon = scene.start_daemon()
    page = sample_inputs("new", n_layers=1, seed=22)
    corrs = [scene.rodan.publish_request(page, STUB_SETTINGS) for _ in range(3)]
    wait_until(lambda: all(daemon.state(c) == "submitted" for c in corrs), 120, 0.2, "the requests to be submitted")
    malformed = scene.rodan.publish(b"{not json")  # answered at once, and dead-lettered (durable, persistent)
    wait_until(lambda: scene.all_replied([malformed]), 60, 0.2, "the malformed request's error reply")
    node.stop()  # the whole node: Rodan's non-durable queues are gone when it comes back
    scene.gate.touch()
    wait_until(lambda: len(scene.outbox()) == len(corrs) and scene.jobs_over(corrs), 180, 0.5, "the workers' outbox")
    node.start()
    wait_until(lambda: len(daemon.events("broker_connected")) >= 2, 120, 0.5, "the daemon to reconnect")
    assert _queue_exists(node.url, scene.queues.request), "the bridge re-declared the request queue"
    assert not _queue_exists(node.url, scene.queues.reply), "hpc-results waits for Rodan to declare it"
    dead = scene.rodan.drain(scene.queues.dead)
    assert [(c, b) for c, b, _h in dead] == [(malformed, b"{not json")], "the dead-letter queue survives"
    # The reply queue is gone: the replies stay in the outbox, and the daemon carries on.
    wait_until(
        lambda: {e.get("correlation_id") for e in daemon.events("reply_left_in_outbox")} >= set(corrs),
        120,
        0.5,
        "the daemon to find the reply queue missing",
    )
    assert daemon.proc.poll() is None, "an unroutable reply must not end the daemon"
    assert sorted(scene.outbox()) == sorted(corrs)
    # Rodan declares hpc-results again (its next task does): every reply goes out, once.
    connection = pika.BlockingConnection(pika.URLParameters(node.url))
    connection.channel().queue_declare(scene.queues.reply)
    connection.close()
    wait_until(lambda: scene.all_replied(corrs), 120, 1, "the replies once the reply queue exists")
    wait_until(lambda: not scene.outbox(), 60, 0.5, "the outbox to empty")
    # A request published after the restart is consumed from the re-declared queue and answered.
    after = scene.rodan.publish_request(page, STUB_SETTINGS)
    wait_until(lambda: scene.all_replied([after]), 180, 1, "the request published after the restart")
    wait_until(
        lambda: scene.jobs_over([after]) and settled(scene.spool, [malformed, *corrs, after]),
        120,
        0.5,
        "the last job to end and the bridge to settle every request",
    )
    scene.collect()  # nothing publishes any more: every reply there is
    assert "not valid JSON" in scene.error(malformed)
    del scene.replies[malformed]
    assert_one_stub_reply_each(scene, [*corrs, after])
    assert len(jobs_named(f"rodan-{after}")) == 1
    assert daemon.proc.poll() is None
    lost, connected = daemon.events("broker_lost"), daemon.events("broker_connected")
    assert daemon.stop() == 0
    print(f"\nfull restart: {len(corrs) + 1} requests, {len(lost)} broker_lost, {len(connected)} broker_connected")


@on_the_node
def test_a_missing_reply_queue_leaves_the_reply_staged_and_the_pass_goes_on(
    tmp_path: Path, node: PrivateBroker
) -> None:
    """Regression: an unroutable reply used to raise out of ``flush`` and end the pass (and the daemon)."""
    from bridge.replies import ReplyBox
    from bridge.spool import Spool

    box = ReplyBox(Spool(tmp_path / "spool").ensure())
    gone, present = f"gone-{uuid.uuid4().hex[:8]}", f"here-{uuid.uuid4().hex[:8]}"
    box.stage("corr-gone", gone, b'{"Model 0": "AAAA"}', origin="worker")
    box.stage("corr-here", present, b'{"error": "x"}', origin="reconcile")
    with confirm_channel(node.url) as channel:
        channel.queue_declare(present)
        assert box.flush(channel) == 1
        assert [e.correlation_id for e in box.staged()] == ["corr-gone"]
        assert not box.already_replied("corr-gone") and box.already_replied("corr-here")
        assert channel.is_open
        channel.queue_declare(gone)
        assert box.flush(channel) == 1 and not box.staged()
        method, props, body = channel.basic_get(gone, auto_ack=True)
        assert method is not None and props.correlation_id == "corr-gone" and body == b'{"Model 0": "AAAA"}'
        channel.queue_delete(gone)
        channel.queue_delete(present)


@on_the_node
def test_models_the_broker_refuses_for_size_become_one_error_reply_and_are_never_tried_again(
    tmp_path: Path, node: PrivateBroker
) -> None:
    """The broker closes the channel on an oversized message: the error reply replaces the models in
    the outbox and goes on a fresh channel; the next staged reply waits for the owner's new channel."""
    from bridge.errors import BrokerUnavailable
    from bridge.replies import ReplyBox
    from bridge.spool import Spool

    box = ReplyBox(Spool(tmp_path / "spool").ensure())  # HPC_MAX_REPLY_BYTES' default, 128 MiB
    queue = f"size-{uuid.uuid4().hex[:8]}"
    models = json.dumps({"Model 0": "A" * (PRIVATE_MAX_MESSAGE + 4096)}).encode()
    big = box.stage("corr-big", queue, models, origin="worker")
    box.stage("corr-next", queue, b'{"error": "x"}', origin="reconcile")
    with confirm_channel(node.url) as channel:
        connection = channel.connection
        channel.queue_declare(queue)
        with pytest.raises(BrokerUnavailable, match="closed the channel"):
            box.flush(channel)
        assert not channel.is_open and connection.is_open
        marker = box.marker("corr-big")
        assert marker is not None and marker["outcome"] == "error"
        assert not big.body_path.exists() and [e.correlation_id for e in box.staged()] == ["corr-next"]
        assert not box.spool.reply_marker("corr-next").with_suffix(".sending").exists(), "corr-next was not tried"
        channel = connection.channel()
        channel.confirm_delivery()
        assert box.flush(channel) == 1 and not box.staged()
        got = {}
        while (message := channel.basic_get(queue, auto_ack=True))[0] is not None:
            got[message[1].correlation_id] = json.loads(message[2])
        assert set(got) == {"corr-big", "corr-next"}, "one reply each"
        reason = got["corr-big"]["error"]
        assert reason.startswith("the models could not be delivered: broker refused the message: ")
        assert str(PRIVATE_MAX_MESSAGE) in reason, reason
        assert box.flush(channel) == 0
        channel.queue_delete(queue)


def test_worker_leaves_the_reply_staged_when_the_broker_goes_between_connect_and_publish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: pika's own errors from ``channel()`` escaped ``deliver`` and crashed the worker."""
    import worker.job as job
    from bridge.handoff import JobParameters
    from bridge.replies import ReplyBox
    from bridge.spool import Spool

    class Broken:
        is_open = True

        def channel(self) -> Any:
            raise pika.exceptions.StreamLostError("Transport indicated EOF")

        def close(self) -> None:
            raise pika.exceptions.StreamLostError("Transport indicated EOF")

    monkeypatch.setattr(job, "connect", lambda *a, **kw: Broken())
    box = ReplyBox(Spool(tmp_path / "spool").ensure())
    params = JobParameters.from_json(
        job_parameters_json(
            correlation_id="corr-eof",
            reply_to="hpc-results",
            rodan={"base_url": "http://127.0.0.1:9"},
            broker={"url": "amqp://guest:guest@127.0.0.1:9/%2F"},
            spool=str(tmp_path / "spool"),
        )
    )
    job.deliver(box, params, b'{"error": "x"}')
    assert [e.correlation_id for e in box.staged()] == ["corr-eof"] and not box.already_replied("corr-eof")
