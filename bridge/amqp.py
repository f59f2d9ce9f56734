"""RabbitMQ plumbing shared by the bridge, the worker and ``enqueue``.

Rules this module keeps:
* Rodan's queues are declared exactly as Rodan declares them (server defaults),
  so a declaration never fails with 406 PRECONDITION_FAILED.
* Our own topology (the dead-letter and status queues) uses other names and is durable.
* Every publish waits for the broker's confirm, with ``mandatory`` set, so an
  unroutable or refused message is an exception, never a silent loss.
* A connection is used by one thread only (pika is not thread-safe).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from urllib.parse import urlsplit

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from bridge.errors import BrokerUnavailable, NoRoute, PermanentError

# Anything pika raises when the broker is gone or the connection broke.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    pika.exceptions.AMQPConnectionError,
    pika.exceptions.ConnectionClosed,
    pika.exceptions.StreamLostError,
    pika.exceptions.ChannelWrongStateError,
    pika.exceptions.ChannelClosed,
    ConnectionError,
    OSError,
)


def connection_parameters(
    url: str, *, heartbeat: int = 30, ca_file: str | None = None, name: str = "hpc-bridge"
) -> pika.URLParameters:
    params = pika.URLParameters(url)
    params.heartbeat = heartbeat
    # Shown as user_provided_name by `rabbitmqctl list_connections`: operators see who is who.
    params.client_properties = {"connection_name": f"{name}/{os.getpid()}"}
    params.blocked_connection_timeout = 60
    params.connection_attempts = 1
    params.socket_timeout = 10
    if urlsplit(url).scheme == "amqps":
        context = ssl.create_default_context(cafile=ca_file)
        params.ssl_options = pika.SSLOptions(context, server_hostname=urlsplit(url).hostname)
    return params


def connect(
    url: str, *, heartbeat: int = 30, ca_file: str | None = None, name: str = "hpc-bridge"
) -> pika.BlockingConnection:
    try:
        return pika.BlockingConnection(connection_parameters(url, heartbeat=heartbeat, ca_file=ca_file, name=name))
    except pika.exceptions.ProbableAuthenticationError as exc:
        raise BrokerUnavailable(f"broker refused the credentials: {exc}") from exc
    except CONNECTION_ERRORS as exc:
        raise BrokerUnavailable(f"broker unreachable at {describe_url(url)}: {type(exc).__name__}") from exc


def describe_url(url: str) -> str:
    """The broker URL without its password, for messages."""
    parts = urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{user}{parts.hostname}{port}{parts.path or '/'}"


def declare_rodan_queue(channel: BlockingChannel, name: str) -> int:
    """Declare a queue exactly as Rodan does (``queue_declare(name)``); return its depth."""
    frame = channel.queue_declare(queue=name, durable=False, exclusive=False, auto_delete=False, arguments=None)
    return int(frame.method.message_count)


def declare_own_queue(channel: BlockingChannel, name: str, arguments: Mapping[str, object] | None = None) -> int:
    """A durable queue of our own (dead letters, status); return its depth."""
    frame = channel.queue_declare(queue=name, durable=True, arguments=dict(arguments) if arguments else None)
    return int(frame.method.message_count)


def queue_counts(channel: BlockingChannel, name: str) -> tuple[int, int]:
    """(ready messages, consumers) of an existing queue (a passive declare: 404 closes the channel)."""
    frame = channel.queue_declare(queue=name, passive=True)
    return int(frame.method.message_count), int(frame.method.consumer_count)


def publish(
    channel: BlockingChannel,
    routing_key: str,
    body: bytes,
    *,
    correlation_id: str | None = None,
    reply_to: str | None = None,
    headers: Mapping[str, object] | None = None,
    persistent: bool = False,
    expiration_ms: int | None = None,
    content_type: str | None = None,
    message_type: str | None = None,
) -> None:
    """Publish to the default exchange and wait for the broker's confirm.

    The channel must be in confirm mode (``channel.confirm_delivery()``).
    Raises NoRoute when no queue has that name, PermanentError when the broker
    refuses the message itself (too large; the broker then closes the channel)
    and BrokerUnavailable when the connection broke.
    """
    properties = pika.BasicProperties(
        correlation_id=correlation_id,
        reply_to=reply_to,
        headers=dict(headers) if headers else None,
        delivery_mode=pika.DeliveryMode.Persistent if persistent else None,
        expiration=str(expiration_ms) if expiration_ms is not None else None,
        content_type=content_type,
        type=message_type,
    )
    try:
        channel.basic_publish(exchange="", routing_key=routing_key, body=body, properties=properties, mandatory=True)
    except pika.exceptions.UnroutableError as exc:
        raise NoRoute(f"no queue {routing_key!r} to route the message to") from exc
    except pika.exceptions.NackError as exc:
        raise BrokerUnavailable(f"broker nacked the message to {routing_key!r}") from exc
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == 406 and "message size" in str(exc.reply_text):
            raise PermanentError(f"broker refused the message: {exc.reply_text}") from exc
        raise BrokerUnavailable(f"channel closed by broker: {exc.reply_text}") from exc
    except CONNECTION_ERRORS as exc:
        raise BrokerUnavailable(f"publish to {routing_key!r} failed: {type(exc).__name__}") from exc
