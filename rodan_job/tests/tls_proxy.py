"""A TLS-terminating proxy on loopback with a fresh self-signed certificate, in front of the real
broker, for the amqps:// tests (Python 3.7: the project's tests/support/tls_proxy.py needs 3.8)."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import ssl
import subprocess
import threading
from typing import Iterator


def _relay(tls: ssl.SSLSocket, plain: socket.socket, stop: threading.Event) -> None:
    try:
        while not stop.is_set():
            wait = 0.0 if tls.pending() else 0.5
            readable = select.select([tls, plain], [], [], wait)[0]
            if tls in readable or tls.pending():
                data = tls.recv(65536)
                if not data:
                    return
                plain.sendall(data)
            if plain in readable:
                data = plain.recv(65536)
                if not data:
                    return
                tls.sendall(data)
    except (OSError, ssl.SSLError):
        return
    finally:
        tls.close()
        plain.close()


@contextlib.contextmanager
def tls_proxy(workdir: str, upstream_host: str, upstream_port: int) -> Iterator[tuple[int, str]]:
    """Yields (port, certificate file); the certificate names localhost and 127.0.0.1."""
    cert, key = os.path.join(workdir, "proxy-cert.pem"), os.path.join(workdir, "proxy-key.pem")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            key,
            "-out",
            cert,
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
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    stop = threading.Event()

    def handshake(conn: socket.socket) -> None:
        try:
            conn.settimeout(10)
            tls = context.wrap_socket(conn, server_side=True)
            tls.settimeout(None)
            plain = socket.create_connection((upstream_host, upstream_port))
        except (OSError, ssl.SSLError):
            conn.close()
            return
        _relay(tls, plain, stop)

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=handshake, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], cert
    finally:
        stop.set()
        thread.join(5)
        server.close()
