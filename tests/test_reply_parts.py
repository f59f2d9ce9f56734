"""Replies in parts (generation 3, docs/protocol.md §3.5), against the real broker.

A reply staged with a part size goes to the run's own reply queue (durable, ``x-expires``, declared
by the Rodan 3 job, never by the bridge) as consecutive persistent messages with the request's
correlation id and the headers ``x-hpc-part`` / ``x-hpc-parts``; the marker follows the last
confirm; a republish sends every part again, never with an expiry. The older generations' replies
stay one message. And the reason for all this: under RabbitMQ 4.x's 16 MiB ``max_message_size``
a 9-layer page's reply of about 78 MB is refused as one message but passes in parts. That test
runs on a private RabbitMQ node booted with that limit (tests/support/private_broker.py), never on
the shared broker, whose settings no test changes (other tests publish replies over 16 MiB there).
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bridge.amqp import publish
from bridge.errors import PermanentError
from bridge.protocol import error_reply, success_reply
from bridge.replies import PART_HEADER, UNCERTAIN_REPLY_TTL_MS, ReplyBox, split_parts
from bridge.spool import Spool, atomic_write
from tests.stub_worker import rodan3_models
from tests.support.private_broker import PrivateBroker, private_node
from tests.support.rodan3 import LIMIT_16_MIB, broker_channel, delete_queue, joined, per_run_queue, take_all

#: RabbitMQ 4.x's default max_message_size.


@pytest.fixture
def run_queue(broker_url: str, queues: Any) -> Iterator[str]:
    """A run's own reply queue, ``<reply queue>.<correlation id>`` (deleted afterwards)."""
    name = f"{queues.reply}.{uuid.uuid4()}"
    yield name
    delete_queue(broker_url, name)


@pytest.fixture
def private_run_queue(node: PrivateBroker) -> Iterator[str]:
    """A run's own reply queue on the private node (deleted afterwards)."""
    name = f"parts-{uuid.uuid4().hex[:10]}-hpc-results.{uuid.uuid4()}"
    yield name
    if node.answers():
        delete_queue(node.url, name)


# --- the tests -------------------------------------------------------------------------------------


def test_split_parts_cuts_consecutive_parts_of_at_most_the_size() -> None:
    body = bytes(range(256)) * 41  # 10496 bytes
    parts = split_parts(body, 4096)
    assert [len(p) for p in parts] == [4096, 4096, 2304] and b"".join(parts) == body
    assert split_parts(body, len(body)) == [body]
    assert split_parts(b"", 10) == [b""]


def test_a_reply_in_parts_reaches_the_runs_queue_whole_and_is_marked_after_the_last(
    tmp_path: Path, broker_url: str, run_queue: str
) -> None:
    box = ReplyBox(Spool(tmp_path).ensure())
    body = success_reply({"Background Model": bytes(range(256)) * 9000, "Log File": b"log\n"})
    with broker_channel(broker_url) as channel:
        per_run_queue(channel, run_queue)
        entry = box.stage("corr-parts", run_queue, body, origin="worker", part_bytes=1 << 20)
        meta = json.loads(entry.meta_path.read_text())
        assert meta["part_bytes"] == 1 << 20 and entry.body_path.read_bytes() == body  # staged whole, once
        assert box.publish_staged(channel, entry) is True
    messages = take_all(broker_url, run_queue)
    expected = -(-len(body) // (1 << 20))
    assert len(messages) == expected == 4
    assert [m[0].headers[PART_HEADER] for m in messages] == [1, 2, 3, 4]
    assert all(len(m[1]) <= 1 << 20 for m in messages)
    assert joined(messages, "corr-parts") == body
    marker = box.marker("corr-parts")
    assert marker is not None and marker["parts"] == 4 and marker["outcome"] == "ok" and marker["bytes"] == len(body)
    assert box.staged() == []


def test_older_generations_reply_in_one_message_without_part_headers(
    tmp_path: Path, broker_url: str, queues: Any
) -> None:
    box = ReplyBox(Spool(tmp_path).ensure())
    body = success_reply({"Model 0": bytes(3 << 20)})  # over the default part size would not matter
    with broker_channel(broker_url) as channel:
        channel.queue_declare(queues.reply)
        entry = box.stage("corr-one", queues.reply, body, origin="worker")
        assert json.loads(entry.meta_path.read_text())["part_bytes"] is None
        assert box.publish_staged(channel, entry) is True
    messages = take_all(broker_url, queues.reply)
    assert len(messages) == 1
    props, got = messages[0]
    assert got == body and props.headers is None and props.delivery_mode == 2
    assert box.marker("corr-one")["parts"] is None  # type: ignore[index]


def test_a_republish_after_a_crash_sends_every_part_again_without_expiry(
    tmp_path: Path, broker_url: str, run_queue: str, queues: Any
) -> None:
    """A process killed between the broker's confirms and the marker leaves ``.sending``: the next
    publish sends all parts again (the job keeps parts by index) and, unlike a one-message reply,
    with no expiry."""
    spool = Spool(tmp_path).ensure()
    box = ReplyBox(spool)
    body = error_reply("x" * 900)
    with broker_channel(broker_url) as channel:
        per_run_queue(channel, run_queue)
        channel.queue_declare(queues.reply)
        entry = box.stage("corr-again", run_queue, body, origin="worker", part_bytes=300)
        atomic_write(spool.reply_marker(entry.key).with_suffix(".sending"), b"")  # as a killed publisher leaves
        assert box.publish_staged(channel, entry) is True
        # The same situation for a one-message reply: that copy carries the expiry.
        one = box.stage("corr-one-again", queues.reply, body, origin="worker")
        atomic_write(spool.reply_marker(one.key).with_suffix(".sending"), b"")
        assert box.publish_staged(channel, one) is True
    messages = take_all(broker_url, run_queue)
    assert len(messages) == 4 and joined(messages, "corr-again") == body
    (props, _body), *_ = take_all(broker_url, queues.reply)
    assert props.expiration == str(UNCERTAIN_REPLY_TTL_MS)


def test_a_missing_run_queue_leaves_the_parts_staged_until_it_exists(
    tmp_path: Path, broker_url: str, run_queue: str
) -> None:
    """The bridge never declares a run's queue: with none there, the reply waits in the outbox
    (as today), then goes out in the same parts once the job has declared it."""
    box = ReplyBox(Spool(tmp_path).ensure())
    body = success_reply({"Background Model": b"m" * 5000})
    box.stage("corr-wait", run_queue, body, origin="reconcile", part_bytes=2048)
    with broker_channel(broker_url) as channel:
        assert box.flush(channel) == 0
        assert [e.correlation_id for e in box.staged()] == ["corr-wait"] and box.marker("corr-wait") is None
        assert box.staged()[0].part_bytes == 2048  # read back from the entry's metadata
        per_run_queue(channel, run_queue)
        assert box.flush(channel) == 1
    messages = take_all(broker_url, run_queue)
    assert len(messages) == 4 and joined(messages, "corr-wait") == body


def test_the_whole_body_is_still_bounded_by_hpc_max_reply_bytes(tmp_path: Path) -> None:
    box = ReplyBox(Spool(tmp_path).ensure(), max_bytes=10_000)
    entry = box.stage("corr-big", "q", success_reply({"Model 1": bytes(20_000)}), origin="worker", part_bytes=4096)
    staged = json.loads(entry.body_path.read_bytes())
    assert "larger than the broker's message limit of 10000 bytes" in staged["error"]
    assert entry.part_bytes == 4096  # the error reply goes in parts too: the job joins parts only


@pytest.mark.slow
@private_node(max_message_size=LIMIT_16_MIB)
def test_under_a_16_mib_broker_limit_a_78_mb_reply_is_refused_whole_but_passes_in_parts(
    tmp_path: Path, node: PrivateBroker, private_run_queue: str
) -> None:
    url, run_queue = node.url, private_run_queue
    corr = run_queue.rsplit(".", 1)[-1]
    models = rodan3_models(corr)
    body = success_reply(models)
    assert 76_000_000 < len(body) < 80_000_000  # 10 models of 5.8 MB and a log, in base64
    box = ReplyBox(Spool(tmp_path).ensure())
    with broker_channel(url) as channel:
        per_run_queue(channel, run_queue)
        with pytest.raises(PermanentError, match="larger than configured max size 16777216"):
            publish(channel, run_queue, body, correlation_id=corr, persistent=True)
    assert take_all(url, run_queue) == []
    with broker_channel(url) as channel:
        entry = box.stage(corr, run_queue, body, origin="worker", part_bytes=8 << 20)
        assert box.publish_staged(channel, entry, body) is True
    messages = take_all(url, run_queue)
    assert len(messages) == 10 and max(len(m[1]) for m in messages) == 8 << 20
    reply = json.loads(joined(messages, corr))
    assert set(reply) == {"Background Model", *(f"Model {i}" for i in range(1, 10)), "Log File"}
    assert all(base64.decodebytes(reply[k].encode()) == v for k, v in models.items())  # byte-exact
    assert box.marker(corr)["parts"] == 10  # type: ignore[index]
