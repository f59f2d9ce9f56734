"""Rodan 3's side of the broker, as our job package (rodan_job/) behaves, for the tests.

A run declares a reply queue of its own (durable, ``x-expires``) before it publishes its request
(docs/protocol.md §2.5), and takes the reply's parts from it and joins them by index (§3.5).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pika
from pika.adapters.blocking_connection import BlockingChannel

from bridge.amqp import connect
from bridge.replies import PART_HEADER, PARTS_HEADER
from tests.support.broker import Queues, Rodan
from tests.support.harness import Harness

#: A run queue's x-expires in the tests: long past any test, short enough to vanish if one is left.
EXPIRES_MS = 10 * 60 * 1000
#: RabbitMQ 4.x's default max_message_size.
LIMIT_16_MIB = 16 * 1024 * 1024

Message = tuple[pika.BasicProperties, bytes]


def per_run_queue(channel: BlockingChannel, name: str) -> None:
    """Declare a run's reply queue as the Rodan 3 job does: durable, with ``x-expires``."""
    channel.queue_declare(name, durable=True, arguments={"x-expires": EXPIRES_MS})


@contextmanager
def broker_channel(broker_url: str) -> Iterator[BlockingChannel]:
    """A confirm-mode channel on a connection of its own (closed on leaving the block)."""
    connection = connect(broker_url)
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        yield channel
    finally:
        if connection.is_open:
            connection.close()


def delete_queue(broker_url: str, name: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        connection.channel().queue_delete(name)
    finally:
        connection.close()


def take_all(broker_url: str, queue: str) -> list[Message]:
    """Every message now in ``queue``, in order, with its properties (taken off the queue)."""
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        channel = connection.channel()
        out: list[Message] = []
        while True:
            method, props, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                return out
            out.append((props, body))
    finally:
        if connection.is_open:
            connection.close()


def complete(messages: list[Message]) -> bool:
    """Whether ``messages`` hold every part of one reply."""
    indices = {(props.headers or {}).get(PART_HEADER) for props, _ in messages}
    return bool(messages) and len(indices) >= int((messages[0][0].headers or {})[PARTS_HEADER])


def joined(messages: list[Message], correlation_id: str) -> bytes:
    """The parts of one reply put together as the Rodan 3 job does (by index), checking each."""
    parts: dict[int, bytes] = {}
    count = None
    for props, body in messages:
        assert props.correlation_id == correlation_id
        assert props.delivery_mode == 2 and props.expiration is None
        headers: dict[str, Any] = props.headers or {}
        index, total = headers[PART_HEADER], headers[PARTS_HEADER]
        assert isinstance(index, int) and isinstance(total, int) and 1 <= index <= total
        assert count in (None, total)
        count = total
        assert parts.get(index, body) == body  # a part that came twice is the same bytes
        parts[index] = body
    assert count is not None and sorted(parts) == list(range(1, count + 1))
    return b"".join(parts[i] for i in range(1, count + 1))


def wait_for_reply(harness: Harness, broker_url: str, queue: str, timeout: float) -> list[Message]:
    """Cron passes of ``harness`` until a whole reply in parts is in ``queue``; its messages."""
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        harness.check()
        got += take_all(broker_url, queue)
        if complete(got):
            return got
        time.sleep(2)
    raise AssertionError(f"no whole reply in {queue} within {timeout} s; log tail:\n{harness.log_tail()}")


class Rodan3Job:
    """Publishes requests as the Rodan 3 job does, each with its run's own reply queue; deletes
    those queues at :meth:`delete`."""

    def __init__(self, broker_url: str, queues: Queues, *, id_prefix: str = "") -> None:
        self.broker_url = broker_url
        self.queues = queues
        self.rodan = Rodan(broker_url, queues)
        self.run_queues: list[str] = []
        # tests/stub_worker.py leaves the reply of a "0..." id to the bridge: "f" keeps it the worker's
        self.id_prefix = id_prefix

    def publish(self, inputs: dict[str, str], settings: dict[str, Any]) -> tuple[str, str]:
        """Publish one request; returns its correlation id and its run's reply queue."""
        corr = str(uuid.uuid4())
        corr = self.id_prefix + corr[len(self.id_prefix) :]
        reply_to = f"{self.queues.reply}.{corr}"
        connection = pika.BlockingConnection(pika.URLParameters(self.broker_url))
        try:
            per_run_queue(connection.channel(), reply_to)
        finally:
            connection.close()
        self.run_queues.append(reply_to)
        self.rodan.publish_request(inputs, settings, correlation_id=corr, reply_to=reply_to)
        return corr, reply_to

    def delete(self) -> None:
        connection = pika.BlockingConnection(pika.URLParameters(self.broker_url))
        try:
            channel = connection.channel()
            for name in self.run_queues:
                channel.queue_delete(name)
        finally:
            connection.close()
