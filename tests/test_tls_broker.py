"""amqps:// through a TLS-terminating proxy in front of the real broker (as the historic site had)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pika
import pytest

from bridge.amqp import connect, declare_rodan_queue, publish
from bridge.errors import BrokerUnavailable

pytestmark = [pytest.mark.broker]  # tls_proxy (conftest) stands in front of the real broker


def test_amqps_with_the_site_ca_publishes_and_consumes(tls_proxy: tuple[int, Path], broker_url: str) -> None:
    port, cert = tls_proxy
    creds = pika.URLParameters(broker_url).credentials
    url = f"amqps://{creds.username}:{creds.password}@127.0.0.1:{port}/%2F"
    queue = f"test-tls-{uuid.uuid4().hex[:8]}"
    connection = connect(url, ca_file=str(cert))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        declare_rodan_queue(channel, queue)
        publish(channel, queue, b"over tls", correlation_id="c1")
        method, props, body = channel.basic_get(queue, auto_ack=True)
        assert body == b"over tls" and props.correlation_id == "c1"
        channel.queue_delete(queue)
    finally:
        connection.close()


def test_amqps_refuses_an_unknown_certificate(tls_proxy: tuple[int, Path], broker_url: str) -> None:
    port, _cert = tls_proxy
    creds = pika.URLParameters(broker_url).credentials
    with pytest.raises(BrokerUnavailable):
        connect(f"amqps://{creds.username}:{creds.password}@127.0.0.1:{port}/%2F")  # system CAs only
