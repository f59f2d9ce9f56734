"""The broker as the tests use it: one test's queues, and Rodan's side of them."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.exceptions

LOCAL_BROKER = "amqp://guest:guest@127.0.0.1:5672/%2F"


@dataclass
class Queues:
    """One test's request, reply and dead-letter queues (unique names, deleted afterwards)."""

    request: str
    reply: str
    dead: str

    @classmethod
    def fresh(cls) -> Queues:
        tag = uuid.uuid4().hex[:10]
        return cls(f"test-{tag}-hpc-jobs", f"test-{tag}-hpc-results", f"test-{tag}-dead")

    def all(self) -> list[str]:
        return [self.request, self.reply, self.dead]


def queue_exists(broker_url: str, name: str) -> bool:
    """Whether the broker has queue ``name`` (a passive declare: 404 means no)."""
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        connection.channel().queue_declare(name, passive=True)
        return True
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code != 404:
            raise
        return False
    finally:
        if connection.is_open:
            connection.close()


def delete_queues(broker_url: str, names: list[str]) -> None:
    """Delete these queues (a missing one is no error)."""
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    channel = connection.channel()
    for name in names:
        channel.queue_delete(name)
    connection.close()


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
