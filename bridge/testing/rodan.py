"""A stand-in for Rodan's REST API (docs/protocol.md §4), served for real on loopback.

Standard library only, so tests and the demo can start it anywhere. It implements what the HPC side
uses of Rodan:

- ``POST /api/auth/token/`` (form-urlencoded, multipart/form-data or JSON body) in both generations:
  Rodan <= 2.0.14 authenticates ``username`` + ``password``, Rodan >= 2.0.15 ``email`` + ``password``;
- ``GET /api/auth/me/`` with ``Authorization: Token <key>`` (Django REST framework's token auth);
- ``GET``/``HEAD /uploads/<path>``, the static files, optionally behind the token, as Rodan's nginx
  serves them: ``Accept-Ranges: bytes``, and a GET with ``Range: bytes=A-B`` (or ``A-``, ``-N``) gets
  206 with ``Content-Range`` (416 with ``Content-Range: bytes */SIZE`` when unsatisfiable; several
  ranges or a malformed header get the whole file, as the RFC allows);

``server="runserver"`` serves as Rodan 3.1.0's ``manage.py runserver`` does (what
deploy/dev/rodan.sh runs, and what ``tests/test_rodan_real.py`` compares this stand-in with): uploads
ignore ``Range`` (200 with the whole file, no ``Accept-Ranges``), every connection is closed after its
answer without a ``Connection: close`` header, and a POST to the token URL without its trailing slash
gets 500 (Django's APPEND_SLASH cannot redirect a POST). :meth:`RodanStandin.like_rodan_3_1` gives
that with 3.1.0's token answers (``detail_style="rodan3"``).

plus fault injection (error bursts with a chosen body or ``Retry-After``, redirects, delays,
connection resets, truncated bodies, changed credentials, resources that ignore ranges, generated
resources: endless chunked bodies, huge declared lengths, gzip bombs) and a log of every request
(with the body bytes sent), for assertions.

Tokens and passwords are never printed or logged; ``repr()`` of users and request records hides them.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import logging
import re
import secrets
import socket
import struct
import threading
import time
import urllib.parse
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from email import policy
from email.message import Message
from email.parser import BytesParser
from http import HTTPStatus
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

__all__ = [
    "DetailStyle",
    "ReceivedRequest",
    "RodanStandin",
    "ServerStyle",
    "TokenField",
    "User",
    "token_for_email",
]

log = logging.getLogger(__name__)

TokenField = Literal["email", "username", "both"]
DetailStyle = Literal["protocol", "rodan", "rodan3"]
ServerStyle = Literal["nginx", "runserver"]

TOKEN_PATH = "/api/auth/token/"
ME_PATH = "/api/auth/me/"
UPLOADS_PREFIX = "/uploads/"

_CHUNK = 64 * 1024
_MAX_BODY = 64 * 1024 * 1024
_REDACTED_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})
#: What generated resources start with by default, so that they pass a check of the file type.
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def token_for_email(email: str) -> str:
    """The deterministic 40-hex token a :class:`User` gets when none is given."""
    return hashlib.sha256(b"rodan-standin-token:" + email.encode("utf-8")).hexdigest()[:40]


def _is_token(value: str) -> bool:
    return len(value) == 40 and all(c in "0123456789abcdef" for c in value)


@dataclass
class User:
    """A Rodan account. ``token`` defaults to :func:`token_for_email` (deterministic)."""

    email: str
    username: str
    password: str = field(repr=False)
    active: bool = True
    token: str = field(default="", repr=False)
    is_staff: bool = False
    is_superuser: bool = False

    def __post_init__(self) -> None:
        if not self.token:
            self.token = token_for_email(self.email)
        if not _is_token(self.token):
            raise ValueError("a Rodan token is 40 lower-case hex digits")


@dataclass
class ReceivedRequest:
    """One request as the stand-in received it (``status`` is None when the connection was reset)."""

    method: str
    path: str  # the request path, still percent-encoded, without the query string
    query: str
    headers: dict[str, str]
    body_length: int
    client: tuple[str, int]
    time: float  # time.time() when the request line had been read
    status: int | None = None
    fault: str | None = None  # "fail", "reset", "truncate" or "redirect" when one was injected
    sent: int = 0  # bytes of the response body written to the socket (so far)

    def header(self, name: str) -> str | None:
        """The value of header ``name``, looked up case-insensitively."""
        lname = name.lower()
        for key, value in self.headers.items():
            if key.lower() == lname:
                return value
        return None

    @property
    def authorization(self) -> str | None:
        return self.header("Authorization")

    def __repr__(self) -> str:
        shown = {k: ("<redacted>" if k.lower() in _REDACTED_HEADERS else v) for k, v in self.headers.items()}
        return (
            f"ReceivedRequest(method={self.method!r}, path={self.path!r}, query={self.query!r}, "
            f"headers={shown!r}, body_length={self.body_length}, client={self.client!r}, "
            f"time={self.time:.3f}, status={self.status!r}, fault={self.fault!r}, sent={self.sent})"
        )


@dataclass
class _Fault:
    kind: Literal["fail", "reset", "truncate", "redirect"]
    remaining: int
    paths: str | None
    status: int = 503
    html: bool = False
    retry_after: int | None = None
    detail: str | None = None
    location: str = ""
    downloads_only: bool = False  # only whole-file GETs (no Range header): not the intake's check


@dataclass
class _Generated:
    """A resource made up on request instead of read from the uploads (see ``serve_generated``)."""

    size: int | None  # None: without end
    head: bytes
    chunked: bool
    gzip_body: bytes | None = None  # set: the whole (compressed) body, sent with Content-Encoding: gzip


@dataclass
class _Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)
    file: Path | None = None
    file_size: int = 0
    offset: int = 0  # where in ``file`` the body starts (a range)
    stream: Callable[[], Iterator[bytes]] | None = None  # a generated body
    stream_length: int | None = None  # its length, if declared; None: sent chunked

    @property
    def length(self) -> int:
        if self.stream is not None:
            return self.stream_length or 0
        return self.file_size if self.file is not None else len(self.body)

    @property
    def chunked(self) -> bool:
        return self.stream is not None and self.stream_length is None


def _json(status: int, payload: Any, headers: Iterable[tuple[str, str]] = ()) -> _Response:
    body = json.dumps(payload).encode("utf-8")
    return _Response(status=status, body=body, headers=list(headers))


def _detail(status: int, detail: str, headers: Iterable[tuple[str, str]] = ()) -> _Response:
    return _json(status, {"detail": detail}, headers)


class _BodyError(Exception):
    def __init__(self, response: _Response) -> None:
        super().__init__(response.status)
        self.response = response


def _parse_credentials(content_type: str, body: bytes) -> dict[str, Any]:
    """``request.data`` as Django REST framework's Form/MultiPart/JSON parsers would give it."""
    media = content_type.split(";", 1)[0].strip().lower()
    if not media:
        return {}
    if media == "application/x-www-form-urlencoded":
        text = body.decode("utf-8", "replace")
        return dict(urllib.parse.parse_qsl(text, keep_blank_values=True))
    if media == "multipart/form-data":
        return _parse_multipart(content_type, body)
    if media == "application/json" or media.endswith("+json"):
        try:
            data = json.loads(body.decode("utf-8")) if body.strip() else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _BodyError(_detail(400, f"JSON parse error - {exc}")) from None
        if not isinstance(data, dict):
            raise _BodyError(_detail(400, "JSON parse error - expected an object"))
        return data
    raise _BodyError(_detail(415, f'Unsupported media type "{content_type}" in request.'))


def _parse_multipart(content_type: str, body: bytes) -> dict[str, Any]:
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1", "replace")
    message = BytesParser(policy=policy.HTTP).parsebytes(head + body)
    if not message.is_multipart() or message.get_boundary() is None:
        raise _BodyError(_detail(400, "Multipart form parse error - Invalid boundary in multipart: None"))
    fields: dict[str, Any] = {}
    parts = message.get_payload()
    if not isinstance(parts, list):
        return fields
    for part in parts:
        if not isinstance(part, Message):
            continue
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str) or part.get_filename() is not None:
            continue  # only plain fields can carry credentials; uploaded files are ignored
        payload = part.get_payload(decode=True)
        if isinstance(payload, bytes):
            charset = part.get_content_charset() or "utf-8"
            fields[name] = payload.decode(charset, "replace")
    return fields


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], app: RodanStandin) -> None:
        self.app = app
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that goes away mid-request is routine here (fault injection); keep stderr quiet.
        log.debug("error while serving %s", client_address, exc_info=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "RodanStandin/1.0"
    timeout = 60.0  # an idle keep-alive connection is closed after this

    def setup(self) -> None:
        super().setup()
        self._app().track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self._app().track(self.connection, add=False)

    def _app(self) -> RodanStandin:
        server = self.server
        assert isinstance(server, _Server)
        return server.app

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        self._dispatch()

    do_POST = do_GET
    do_HEAD = do_GET
    do_PUT = do_GET
    do_PATCH = do_GET
    do_DELETE = do_GET
    do_OPTIONS = do_GET

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks: list[bytes] = []
            total = 0
            while True:
                size_line = self.rfile.readline(1024)
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                total += size
                if total > _MAX_BODY:
                    raise ValueError("body too large")
                chunks.append(self.rfile.read(size))
                self.rfile.readline(1024)
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        if length < 0 or length > _MAX_BODY:
            raise ValueError("bad Content-Length")
        return self.rfile.read(length) if length else b""

    def _dispatch(self) -> None:
        app = self._app()
        received = time.time()
        split = urllib.parse.urlsplit(self.path)
        path, query = split.path, split.query
        try:
            body = self._read_body()
        except ValueError:
            self.close_connection = True
            self._send(_detail(413, "Request body too large or malformed."), truncate=False)
            return
        client = self.client_address
        record = ReceivedRequest(
            method=self.command,
            path=path,
            query=query,
            headers=dict(self.headers.items()),
            body_length=len(body),
            client=(str(client[0]), int(client[1])),
            time=received,
        )
        app.log_request(record)

        download = self.command == "GET" and "Range" not in self.headers
        fault = app.take_fault(path, download=download)
        wait = app.delay_for(path, download=download)
        if wait > 0:
            app.sleep(wait)
        if fault is not None:
            record.fault = fault.kind
        if fault is not None and fault.kind == "reset":
            self._reset()
            return
        if fault is not None and fault.kind == "fail":
            response = _failure_response(fault)
        elif fault is not None and fault.kind == "redirect":
            response = _Response(fault.status, b"", "text/html; charset=utf-8", [("Location", fault.location)])
        else:
            response = app.route(self.command, path, query, self.headers, body)
        record.status = response.status
        self._send(response, truncate=fault is not None and fault.kind == "truncate", record=record)

    def _reset(self) -> None:
        """Close the connection abruptly: no response, and an RST rather than a FIN."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.rfile.close()  # drop the makefile() reference so that close() below is the real one
        self.connection.close()

    def _send(self, response: _Response, *, truncate: bool, record: ReceivedRequest | None = None) -> None:
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        if response.chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(response.length))
        for name, value in response.headers:
            self.send_header(name, value)
        if truncate or self.close_connection:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self._app().server_style == "runserver":
            self.close_connection = True  # runserver closes after every answer, without saying so
        if self.command == "HEAD":
            return
        limit = response.length // 2 if truncate else response.length

        def write(data: bytes) -> None:
            self.wfile.write(data)
            if record is not None:
                record.sent += len(data)

        if response.stream is not None:
            self._send_stream(response, limit, write)
            return
        if response.file is None:
            write(response.body[:limit])
            return
        remaining = limit
        with response.file.open("rb") as fh:
            fh.seek(response.offset)
            while remaining > 0:
                chunk = fh.read(min(_CHUNK, remaining))
                if not chunk:
                    self.close_connection = True  # the file shrank under us; the length is now a lie
                    break
                write(chunk)
                remaining -= len(chunk)

    def _send_stream(self, response: _Response, limit: int, write: Callable[[bytes], None]) -> None:
        """A generated body: chunked (until the generator ends or the client hangs up), or raw up to
        its declared length (``limit``: half of it for a truncate fault)."""
        assert response.stream is not None
        if response.chunked:
            for chunk in response.stream():
                self.wfile.write(f"{len(chunk):x}\r\n".encode())
                write(chunk)
                self.wfile.write(b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
            return
        remaining = limit
        for chunk in response.stream():
            if remaining <= 0:
                break
            write(chunk[:remaining])
            remaining -= len(chunk[:remaining])
        if remaining > 0:
            self.close_connection = True  # the generator gave less than it declared


def _failure_response(fault: _Fault) -> _Response:
    try:
        phrase = HTTPStatus(fault.status).phrase
    except ValueError:
        phrase = "Error"
    headers: list[tuple[str, str]] = []
    if fault.retry_after is not None:
        headers.append(("Retry-After", str(fault.retry_after)))
    if fault.html:
        extra = f"<p>{fault.detail}</p>\r\n" if fault.detail is not None else ""
        html = (
            f"<html>\r\n<head><title>{fault.status} {phrase}</title></head>\r\n<body>\r\n"
            f"<center><h1>{fault.status} {phrase}</h1></center>\r\n{extra}<hr><center>nginx</center>\r\n"
            "</body>\r\n</html>\r\n"
        )
        return _Response(fault.status, html.encode(), "text/html; charset=utf-8", headers)
    return _detail(fault.status, fault.detail if fault.detail is not None else phrase, headers)


def _zeros(head: bytes, size: int | None, stopping: threading.Event) -> Iterator[bytes]:
    """``head``, then zero bytes: ``size`` bytes in all, or without end (until the server stops)."""
    sent = 0
    first = head[:size] if size is not None else head
    if first:
        yield first
        sent = len(first)
    zeros = bytes(_CHUNK)
    while (size is None or sent < size) and not stopping.is_set():
        chunk = zeros if size is None else zeros[: size - sent]
        yield chunk
        sent += len(chunk)


def _gzip_of_zeros(head: bytes, size: int) -> bytes:
    """A gzip member that inflates to ``head`` and zeros, ``size`` bytes in all (a "gzip bomb")."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [packer.compress(head[:size])]
    left = size - len(head[:size])
    zeros = bytes(1 << 20)
    while left > 0:
        parts.append(packer.compress(zeros[: min(left, len(zeros))]))
        left -= min(left, len(zeros))
    parts.append(packer.flush())
    return b"".join(parts)


def _byte_range(header: str | None, size: int) -> tuple[int, int] | Literal["unsatisfiable"] | None:
    """The one range of a ``Range`` header as (first, last), clamped to ``size``; None to ignore the
    header (absent, malformed, several ranges); "unsatisfiable" for a 416."""
    if not header:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None:
        return None
    first_text, last_text = match.groups()
    if not first_text and not last_text:
        return None
    if not first_text:  # the last N bytes
        suffix = int(last_text)
        if suffix == 0 or size == 0:
            return "unsatisfiable"
        return max(size - suffix, 0), size - 1
    first = int(first_text)
    if last_text and int(last_text) < first:
        return None
    if first >= size:
        return "unsatisfiable"
    last = int(last_text) if last_text else size - 1
    return first, min(last, size - 1)


class RodanStandin:
    """Rodan's REST API on a real loopback socket, with fault injection and a request log.

    Use as a context manager (``with RodanStandin(tmp) as rodan: ... rodan.url``) or call
    :meth:`start` / :meth:`stop`. All setters are thread-safe and take effect for the next request.

    ``token_field`` picks the Rodan generation of the token endpoint: ``"email"`` (Rodan >= 2.0.15),
    ``"username"`` (Rodan <= 2.0.14) or ``"both"`` (either identifies the user; the e-mail wins when
    both are sent). ``detail_style="rodan"`` answers failures with the bodies Rodan's own code sends
    (``{"is_logged_in": false}``, ``"You must supply a email"``) instead of the documented
    ``{"detail": ...}`` strings of docs/protocol.md §4.1; ``detail_style="rodan3"`` answers as Rodan
    3.1.0 does: ``{"is_logged_in": false, "detail": ...}`` with the documented strings, and a refused
    token gets ``WWW-Authenticate: Basic realm="api"``. ``server`` is ``"nginx"`` (ranges honoured,
    keep-alive) or ``"runserver"`` (see the module's doc). When ``users`` is None there is one account,
    ``hpc@example.org`` / ``hpc`` / ``standin-password``.
    """

    def __init__(
        self,
        uploads_dir: Path | str,
        users: list[User] | None = None,
        token_field: TokenField = "email",
        require_auth_for_uploads: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        detail_style: DetailStyle = "protocol",
        server: ServerStyle = "nginx",
    ) -> None:
        if token_field not in ("email", "username", "both"):
            raise ValueError(f"token_field must be email, username or both, not {token_field!r}")
        self._uploads = Path(uploads_dir).resolve()
        self._lock = threading.Lock()
        self._users: list[User] = []
        for user in users if users is not None else [User("hpc@example.org", "hpc", "standin-password")]:
            self.add_user(user)
        self._token_field: TokenField = token_field
        self._require_auth_for_uploads = require_auth_for_uploads
        self._detail_style: DetailStyle = detail_style
        if server not in ("nginx", "runserver"):
            raise ValueError(f"server must be nginx or runserver, not {server!r}")
        self._server_style: ServerStyle = server
        self._host = host
        self._port = port
        self._faults: list[_Fault] = []
        self._delays: dict[tuple[str | None, bool], float] = {}  # (paths, downloads_only) -> seconds
        self._generated: dict[str, _Generated] = {}
        self._ignore_ranges: set[str | None] = set()
        self._log: list[ReceivedRequest] = []
        self._connections: set[socket.socket] = set()
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._bound_port = 0
        self._thread: threading.Thread | None = None

    @classmethod
    def like_rodan_3_1(cls, uploads_dir: Path | str, users: list[User] | None = None, **kwargs: Any) -> RodanStandin:
        """A stand-in that answers as Rodan 3.1.0 under ``runserver`` (deploy/dev/rodan.sh) does."""
        return cls(uploads_dir, users, token_field="email", detail_style="rodan3", server="runserver", **kwargs)

    @property
    def server_style(self) -> ServerStyle:
        return self._server_style

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> RodanStandin:
        if self._server is not None:
            return self
        self._stopping.clear()
        # A restart binds the port of the first start again: the same URL, as when Rodan restarts.
        server = _Server((self._host, self._bound_port or self._port), self)
        self._server = server
        self._bound_port = int(server.server_address[1])
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="rodan-standin", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, thread = self._server, self._thread
        if server is None:
            return
        self._stopping.set()  # wakes handlers sleeping in an injected delay
        server.shutdown()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)
        self._server = None
        self._thread = None

    def __enter__(self) -> RodanStandin:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def port(self) -> int:
        """The bound port (still known after :meth:`stop`; a restart binds it again)."""
        if not self._bound_port:
            raise RuntimeError("the stand-in was never started")
        return self._bound_port

    @property
    def host_port(self) -> str:
        """``"127.0.0.1:PORT"``, what the HPC side configures as RODAN_HOST."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host_port}"

    def url_for(self, path: str) -> str:
        """The absolute URL of a resource path such as ``/uploads/projects/.../original_file``."""
        return self.url + (path if path.startswith("/") else "/" + path)

    @property
    def uploads_dir(self) -> Path:
        return self._uploads

    # -- accounts ---------------------------------------------------------------------------------

    @property
    def users(self) -> list[User]:
        with self._lock:
            return list(self._users)

    def add_user(self, user: User) -> None:
        with self._lock:
            for other in self._users:
                if other.email == user.email or other.username == user.username or other.token == user.token:
                    raise ValueError("users must have distinct e-mails, usernames and tokens")
            self._users.append(user)

    def user(self, email: str) -> User:
        with self._lock:
            return self._find(email)

    def _find(self, email: str) -> User:
        for user in self._users:
            if user.email == email:
                return user
        raise KeyError(email)

    def set_password(self, email: str, new: str) -> None:
        """Change a password (simulates credentials changed on the Rodan side). The token stays valid."""
        with self._lock:
            self._find(email).password = new

    def set_active(self, email: str, active: bool) -> None:
        with self._lock:
            self._find(email).active = active

    def rotate_token(self, email: str) -> str:
        """Give the user a new random token; the old one gets 401 from now on. Returns the new one."""
        with self._lock:
            user = self._find(email)
            user.token = secrets.token_hex(20)
            return user.token

    @property
    def token_field(self) -> TokenField:
        return self._token_field

    @token_field.setter
    def token_field(self, value: TokenField) -> None:
        if value not in ("email", "username", "both"):
            raise ValueError(value)
        with self._lock:
            self._token_field = value

    @property
    def require_auth_for_uploads(self) -> bool:
        return self._require_auth_for_uploads

    @require_auth_for_uploads.setter
    def require_auth_for_uploads(self, value: bool) -> None:
        with self._lock:
            self._require_auth_for_uploads = value

    # -- fault injection --------------------------------------------------------------------------

    def fail_next(
        self,
        n: int,
        status: int = 503,
        paths: str | None = None,
        *,
        html: bool = False,
        retry_after: int | None = None,
        detail: str | None = None,
        downloads_only: bool = False,
    ) -> None:
        """Answer the next ``n`` requests (whose path starts with ``paths``, if given) with ``status``.

        The body is ``{"detail": "<reason phrase>"}`` (``detail`` replaces the phrase) or, with
        ``html=True``, an nginx-style HTML page (showing ``detail`` too). ``retry_after`` adds a
        ``Retry-After: <seconds>`` header (what nginx or Django send with 429 or 503).

        ``downloads_only=True`` (here and in the other faults) matches only GETs of a whole file (no
        ``Range`` header): the worker's download, not the bridge's ranged check of the input at intake.
        """
        if not 100 <= status <= 599:
            raise ValueError("status must be an HTTP status code")
        fault = _Fault(
            "fail",
            n,
            paths,
            status=status,
            html=html,
            retry_after=retry_after,
            detail=detail,
            downloads_only=downloads_only,
        )
        self._add_fault(fault)

    def redirect_next(
        self, n: int, location: str, paths: str | None = None, *, status: int = 302, downloads_only: bool = False
    ) -> None:
        """Answer the next ``n`` matching requests with a redirect (``status``) to ``location``."""
        if status not in (301, 302, 303, 307, 308):
            raise ValueError("status must be a redirect")
        self._add_fault(_Fault("redirect", n, paths, status=status, location=location, downloads_only=downloads_only))

    def reset_next(self, n: int, paths: str | None = None, *, downloads_only: bool = False) -> None:
        """Close the next ``n`` matching connections abruptly (RST), without any response."""
        self._add_fault(_Fault("reset", n, paths, downloads_only=downloads_only))

    def truncate_next(self, n: int, paths: str | None = None, *, downloads_only: bool = False) -> None:
        """Send the full ``Content-Length`` but only half of the body, then close, ``n`` times."""
        self._add_fault(_Fault("truncate", n, paths, downloads_only=downloads_only))

    def delay(self, seconds: float, paths: str | None = None, *, downloads_only: bool = False) -> None:
        """Sleep ``seconds`` before answering every matching request, until cleared (``seconds=0``)."""
        with self._lock:
            if seconds > 0:
                self._delays[(paths, downloads_only)] = float(seconds)
            else:
                self._delays.pop((paths, downloads_only), None)

    def serve_generated(
        self, path: str, size: int | None = None, *, head: bytes = PNG_SIGNATURE, chunked: bool = True
    ) -> None:
        """Serve ``path`` (under ``/uploads/``) from a generator instead of a file, until cleared.

        The body is ``head`` (by default a PNG signature, so it passes a check of the file type),
        then zero bytes: ``size`` bytes in all, or without end when ``size`` is None (until the
        client hangs up or the server stops). ``chunked=True`` sends it with
        ``Transfer-Encoding: chunked`` and no length (a streamed Django response); ``chunked=False``
        declares ``Content-Length: size``. Nothing is stored, so the size can be anything. Ranges are
        ignored (200, the whole body); HEAD gets the same headers.
        """
        if not path.startswith(UPLOADS_PREFIX):
            raise ValueError(f"a generated resource lives under {UPLOADS_PREFIX}")
        if size is None and not chunked:
            raise ValueError("a body without end can only be sent chunked")
        if size is not None and size < 0:
            raise ValueError("size must be >= 0")
        with self._lock:
            self._generated[path] = _Generated(size, head, chunked)

    def serve_gzip_bomb(self, path: str, inflated_size: int, *, head: bytes = PNG_SIGNATURE) -> None:
        """Serve ``path`` gzip-compressed (``Content-Encoding: gzip``, whatever ``Accept-Encoding``
        asked for), inflating to ``inflated_size`` bytes (``head`` then zeros) from about a
        thousandth of that on the wire. Until cleared."""
        if not path.startswith(UPLOADS_PREFIX):
            raise ValueError(f"a generated resource lives under {UPLOADS_PREFIX}")
        body = _gzip_of_zeros(head, inflated_size)
        with self._lock:
            self._generated[path] = _Generated(inflated_size, head, chunked=False, gzip_body=body)

    def ignore_range(self, paths: str | None = None) -> None:
        """Answer ranged GETs of matching paths with 200 and the whole file, until cleared (as a
        server without range support, or nginx with ``max_ranges 0``, does)."""
        with self._lock:
            self._ignore_ranges.add(paths)

    def clear_faults(self) -> None:
        """Forget every injected fault, delay, generated resource and ignored range."""
        with self._lock:
            self._faults.clear()
            self._delays.clear()
            self._generated.clear()
            self._ignore_ranges.clear()

    def _add_fault(self, fault: _Fault) -> None:
        if fault.remaining < 0:
            raise ValueError("n must be >= 0")
        if fault.remaining:
            with self._lock:
                self._faults.append(fault)

    def take_fault(self, path: str, *, download: bool = True) -> _Fault | None:
        """The first pending fault (in the order they were set) that matches ``path``, consumed.

        ``download``: the request is a GET of the whole file (faults set ``downloads_only`` match
        only those)."""
        with self._lock:
            for fault in self._faults:
                if (fault.paths is None or path.startswith(fault.paths)) and (download or not fault.downloads_only):
                    fault.remaining -= 1
                    if fault.remaining <= 0:
                        self._faults.remove(fault)
                    return fault
        return None

    def delay_for(self, path: str, *, download: bool = True) -> float:
        with self._lock:
            matching = [
                s
                for (p, only), s in self._delays.items()
                if (p is None or path.startswith(p)) and (download or not only)
            ]
        return max(matching, default=0.0)

    def sleep(self, seconds: float) -> None:
        self._stopping.wait(seconds)

    # -- request log ------------------------------------------------------------------------------

    @property
    def requests(self) -> list[ReceivedRequest]:
        """Every request received so far, oldest first (a copy of the list)."""
        with self._lock:
            return list(self._log)

    def clear_requests(self) -> None:
        with self._lock:
            self._log.clear()

    def log_request(self, record: ReceivedRequest) -> None:
        with self._lock:
            self._log.append(record)

    def track(self, conn: socket.socket, *, add: bool) -> None:
        with self._lock:
            if add:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)

    # -- the API ----------------------------------------------------------------------------------

    def route(self, method: str, path: str, query: str, headers: Any, body: bytes) -> _Response:
        if method == "OPTIONS" and path in (TOKEN_PATH, ME_PATH):
            allow = "POST, OPTIONS" if path == TOKEN_PATH else "GET, HEAD, OPTIONS"
            parses = ["application/json", "application/x-www-form-urlencoded", "multipart/form-data"]
            return _json(200, {"renders": ["application/json"], "parses": parses}, [("Allow", allow)])
        if path == TOKEN_PATH:
            if method != "POST":
                return _not_allowed(method, "POST, OPTIONS")
            try:
                data = _parse_credentials(headers.get("Content-Type", ""), body)
            except _BodyError as exc:
                return exc.response
            return self._token(data, headers)
        if path == ME_PATH:
            if method not in ("GET", "HEAD"):
                return _not_allowed(method, "GET, HEAD, OPTIONS")
            user, failure = self._authenticate(headers)
            if user is None:
                challenge = 'Basic realm="api"' if self._detail_style == "rodan3" else "Token"
                return failure or _unauthenticated(challenge=challenge)
            return _json(200, self._user_json(user, headers))
        if path + "/" in (TOKEN_PATH, ME_PATH):
            if method == "POST" and self._server_style == "runserver":
                # DEBUG's APPEND_SLASH cannot redirect a POST: RuntimeError, a 500 page.
                return _Response(500, b"<h1>Server Error (500)</h1>", "text/html")
            # Django's APPEND_SLASH: a permanent redirect to the slashed URL.
            location = path + "/" + (f"?{query}" if query else "")
            return _Response(301, b"", "text/html; charset=utf-8", [("Location", location)])
        if path.startswith(UPLOADS_PREFIX):
            if method not in ("GET", "HEAD"):
                return _not_allowed(method, "GET, HEAD")
            if self._require_auth_for_uploads:
                user, failure = self._authenticate(headers)
                if user is None:
                    return failure or _unauthenticated()
            with self._lock:
                generated = self._generated.get(path)
            if generated is not None:
                return self._generate(generated)
            return self._upload(path, None if method == "HEAD" else headers.get("Range"))
        return _detail(404, "Not found.")

    def _user_json(self, user: User, headers: Any) -> dict[str, Any]:
        host = headers.get("Host") or self.host_port
        with self._lock:
            index = self._users.index(user) + 1 if user in self._users else 0
        return {
            "url": f"http://{host}/api/user/{index}/",
            "username": user.username,
            "first_name": "",
            "last_name": "",
            "email": user.email,
            "is_staff": user.is_staff,
            "is_active": user.active,
            "is_superuser": user.is_superuser,
            "projects": [],
            "workflows": [],
            "workflow_runs": [],
            "user_preference": None,
        }

    def _token(self, data: dict[str, Any], headers: Any) -> _Response:
        with self._lock:
            mode = self._token_field
            style = self._detail_style
        email = data.get("email")
        username = data.get("username")
        password = data.get("password")
        field_name: Literal["email", "username"]
        if mode == "email" or (mode == "both" and email):
            field_name, ident = "email", email
        else:
            field_name, ident = "username", username
        article = "an" if field_name == "email" else "a"
        if not ident:
            if mode == "both":
                return self._refuse(401, "You must supply an email or a username.", style)
            text = f"You must supply {article} {field_name}."
            return self._refuse(401, text if style != "rodan" else f"You must supply a {field_name}", style)
        if not password:
            text = "You must supply a password."
            return self._refuse(401, text if style != "rodan" else "You must supply a password", style)
        with self._lock:
            user = next(
                (
                    u
                    for u in self._users
                    if isinstance(ident, str)
                    and (u.email if field_name == "email" else u.username) == ident
                    and isinstance(password, str)
                    and secrets.compare_digest(u.password.encode(), password.encode())
                ),
                None,
            )
        if user is None:
            return self._refuse(401, f"Invalid {field_name} or password.", style)
        if not user.active:
            return self._refuse(403, "Account is not activated.", style)
        payload = self._user_json(user, headers)
        payload["token"] = user.token
        return _json(200, payload)

    @staticmethod
    def _refuse(status: int, detail: str, style: DetailStyle) -> _Response:
        if style == "rodan" and not detail.startswith("You must supply"):
            return _json(status, {"is_logged_in": False})
        if style == "rodan3":
            return _json(status, {"is_logged_in": False, "detail": detail})
        return _detail(status, detail)

    def _authenticate(self, headers: Any) -> tuple[User | None, _Response | None]:
        """Django REST framework's TokenAuthentication. (None, None) means no credentials at all."""
        value = headers.get("Authorization", "")
        parts = value.split()
        challenge = 'Basic realm="api"' if self._detail_style == "rodan3" else "Token"
        if not parts or parts[0].lower() != "token":
            return None, None
        if len(parts) == 1:
            return None, _unauthenticated("Invalid token header. No credentials provided.", challenge)
        if len(parts) > 2:
            return None, _unauthenticated("Invalid token header. Token string should not contain spaces.", challenge)
        with self._lock:
            user = next((u for u in self._users if secrets.compare_digest(u.token, parts[1])), None)
        if user is None:
            return None, _unauthenticated("Invalid token.", challenge)
        if not user.active:
            return None, _unauthenticated("User inactive or deleted.", challenge)
        return user, None

    def _generate(self, spec: _Generated) -> _Response:
        if spec.gzip_body is not None:
            return _Response(
                200,
                spec.gzip_body,
                "application/octet-stream",
                [("Content-Encoding", "gzip"), ("Vary", "Accept-Encoding")],
            )
        return _Response(
            200,
            content_type="application/octet-stream",
            stream=lambda: _zeros(spec.head, spec.size, self._stopping),
            stream_length=None if spec.chunked else spec.size,
        )

    def _upload(self, path: str, range_header: str | None = None) -> _Response:
        relative = urllib.parse.unquote(path[len(UPLOADS_PREFIX) :])
        if not relative or "\x00" in relative:
            return _detail(404, "Not found.")
        try:
            target = (self._uploads / relative).resolve()
        except (OSError, RuntimeError):
            return _detail(404, "Not found.")
        if not target.is_relative_to(self._uploads) or not target.is_file():
            return _detail(404, "Not found.")
        try:
            size = target.stat().st_size
        except OSError:
            return _detail(404, "Not found.")
        with self._lock:
            ignore = self._server_style == "runserver" or any(
                p is None or path.startswith(p) for p in self._ignore_ranges
            )
        accept = [] if ignore else [("Accept-Ranges", "bytes")]
        wanted = None if ignore else _byte_range(range_header, size)
        if wanted == "unsatisfiable":
            phrase = HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE.phrase
            return _detail(416, phrase, [("Content-Range", f"bytes */{size}")])
        if wanted is not None:
            first, last = wanted
            return _Response(
                206,
                content_type="application/octet-stream",
                headers=[*accept, ("Content-Range", f"bytes {first}-{last}/{size}")],
                file=target,
                file_size=last - first + 1,
                offset=first,
            )
        return _Response(200, content_type="application/octet-stream", headers=accept, file=target, file_size=size)


def _not_allowed(method: str, allow: str) -> _Response:
    return _detail(405, f'Method "{method}" not allowed.', [("Allow", allow)])


def _unauthenticated(
    detail: str = "Authentication credentials were not provided.", challenge: str = "Token"
) -> _Response:
    return _detail(401, detail, [("WWW-Authenticate", challenge)])
