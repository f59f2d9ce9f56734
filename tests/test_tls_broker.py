"""amqps:// through a TLS-terminating proxy in front of the real broker (as the historic site had)."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from bridge.amqp import connect, declare_rodan_queue, publish
from bridge.errors import BrokerUnavailable

pytestmark = [pytest.mark.broker]


@pytest.fixture
def tls_proxy(tmp_path: Path, broker_url: str) -> Iterator[tuple[int, Path]]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    upstream = pika.URLParameters(broker_url)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    port: list[int] = []

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(upstream.host, upstream.port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def run() -> None:
        server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0, ssl=context))
        port.append(server.sockets[0].getsockname()[1])
        ready.set()
        loop.run_forever()
        server.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(10)
    yield port[0], cert
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


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
