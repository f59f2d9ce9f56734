"""``hpc-bridge enqueue``: publish a request exactly as Rodan's task does, and wait like it.

Rodan declares both queues with default arguments, publishes the JSON body to
``hpc-jobs`` with ``reply_to`` and a uuid4 ``correlation_id`` (no content type,
transient), then consumes ``hpc-results``, nacking (requeueing) every reply
that is not its own. Operators use this to test a deployment end to end.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import structlog

from bridge.amqp import connect, declare_rodan_queue
from bridge.protocol import build_request_body

log = structlog.get_logger(__name__)


@dataclass
class ReplyResult:
    correlation_id: str
    body: bytes
    seconds: float
    foreign_nacked: int

    @property
    def data(self) -> dict[str, Any]:
        parsed = json.loads(self.body)
        return parsed if isinstance(parsed, dict) else {"error": f"unexpected reply: {parsed!r}"}

    @property
    def is_error(self) -> bool:
        return "error" in self.data


def publish_request(
    broker_url: str,
    inputs: Mapping[str, str],
    settings: Mapping[str, Any],
    *,
    request_queue: str = "hpc-jobs",
    reply_queue: str = "hpc-results",
    correlation_id: str | None = None,
) -> str:
    correlation_id = correlation_id or str(uuid.uuid4())
    connection = connect(broker_url, name="hpc-bridge-enqueue")
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        declare_rodan_queue(channel, request_queue)
        declare_rodan_queue(channel, reply_queue)
        channel.basic_publish(
            exchange="",
            routing_key=request_queue,
            body=build_request_body(inputs, settings),
            properties=pika.BasicProperties(reply_to=reply_queue, correlation_id=correlation_id),
        )
    finally:
        connection.close()
    log.info("request_enqueued", correlation_id=correlation_id, queue=request_queue)
    return correlation_id


def wait_for_reply(
    broker_url: str,
    correlation_id: str,
    *,
    reply_queue: str = "hpc-results",
    timeout_s: float | None = None,
    progress_every_s: float = 15.0,
) -> ReplyResult | None:
    """Consume the reply queue like Rodan: ack our reply, nack (requeue) the others."""
    started = time.monotonic()
    connection = connect(broker_url, heartbeat=60, name="hpc-bridge-enqueue")
    foreign = 0
    next_progress = started + progress_every_s
    try:
        channel = connection.channel()
        declare_rodan_queue(channel, reply_queue)
        for method, properties, body in channel.consume(reply_queue, inactivity_timeout=0.5):
            now = time.monotonic()
            if timeout_s is not None and now - started > timeout_s:
                return None
            if now >= next_progress:
                log.info("waiting_for_reply", correlation_id=correlation_id, waited_s=round(now - started))
                next_progress = now + progress_every_s
            if method is None:
                continue
            if properties.correlation_id == correlation_id:
                channel.basic_ack(method.delivery_tag)
                return ReplyResult(correlation_id, body, now - started, foreign)
            channel.basic_nack(method.delivery_tag, requeue=True)
            foreign += 1
            time.sleep(0.05)  # kinder than Rodan, which spins on a foreign reply
        return None
    finally:
        if connection.is_open:
            connection.close()


def save_models(reply: ReplyResult, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    saved: dict[str, Path] = {}
    for key, value in reply.data.items():
        path = out_dir / f"{key.replace(' ', '_')}.hdf5"
        path.write_bytes(base64.decodebytes(str(value).encode("ascii")))
        saved[key] = path
    return saved
