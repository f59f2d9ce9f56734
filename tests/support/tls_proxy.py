"""A TLS-terminating proxy on loopback with a fresh self-signed certificate, for tests that need
a real TLS server in front of a plain one (the broker for amqps://, the Rodan stand-in for https)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def tls_proxy(workdir: Path, upstream_host: str, upstream_port: int, name: str = "proxy") -> Iterator[tuple[int, Path]]:
    """Forward TLS connections on a free 127.0.0.1 port to ``upstream``; yields (port, certificate).

    The certificate names ``localhost`` and ``127.0.0.1`` and is valid for a day."""
    cert, key = workdir / f"{name}-cert.pem", workdir / f"{name}-key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)),
            *("-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ],
        check=True,
        capture_output=True,
    )
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
        up_reader, up_writer = await asyncio.open_connection(upstream_host, upstream_port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def run() -> None:
        server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0, ssl=context))
        port.append(server.sockets[0].getsockname()[1])
        ready.set()
        loop.run_forever()
        server.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10), "the TLS proxy did not start"
    try:
        yield port[0], cert
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
