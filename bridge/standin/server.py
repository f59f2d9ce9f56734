"""A stand-in for Rodan's REST API (PROTOCOL.md section 4), served for real on loopback.

Standard library only, so tests and the demo can start it anywhere. It implements what the HPC side
uses of Rodan:

- ``POST /api/auth/token/`` (form-urlencoded, multipart/form-data or JSON body) in both generations:
  Rodan <= 2.0.14 authenticates ``username`` + ``password``, Rodan >= 2.0.15 ``email`` + ``password``;
- ``GET /api/auth/me/`` with ``Authorization: Token <key>`` (Django REST framework's token auth);
- ``GET``/``HEAD /uploads/<path>``, the static files, optionally behind the token;

plus fault injection (error bursts, delays, connection resets, truncated bodies, changed credentials)
and a log of every request, for assertions.

Tokens and passwords are never printed or logged; ``repr()`` of users and request records hides them.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import logging
import secrets
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Iterable
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
    "RequestRecord",
    "RodanStandin",
    "TokenField",
    "User",
    "token_for_email",
]

log = logging.getLogger("bridge.standin")

TokenField = Literal["email", "username", "both"]
DetailStyle = Literal["protocol", "rodan"]

TOKEN_PATH = "/api/auth/token/"
ME_PATH = "/api/auth/me/"
UPLOADS_PREFIX = "/uploads/"

_CHUNK = 64 * 1024
_MAX_BODY = 64 * 1024 * 1024
_REDACTED_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})


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
class RequestRecord:
    """One request as the stand-in received it (``status`` is None when the connection was reset)."""

    method: str
    path: str  # the request path, still percent-encoded, without the query string
    query: str
    headers: dict[str, str]
    body_length: int
    client: tuple[str, int]
    time: float  # time.time() when the request line had been read
    status: int | None = None
    fault: str | None = None  # "fail", "reset" or "truncate" when one was injected

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
            f"RequestRecord(method={self.method!r}, path={self.path!r}, query={self.query!r}, "
            f"headers={shown!r}, body_length={self.body_length}, client={self.client!r}, "
            f"time={self.time:.3f}, status={self.status!r}, fault={self.fault!r})"
        )


@dataclass
class _Fault:
    kind: Literal["fail", "reset", "truncate"]
    remaining: int
    paths: str | None
    status: int = 503
    html: bool = False
    retry_after: int | None = None


@dataclass
class _Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)
    file: Path | None = None
    file_size: int = 0

    @property
    def length(self) -> int:
        return self.file_size if self.file is not None else len(self.body)


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
        record = RequestRecord(
            method=self.command,
            path=path,
            query=query,
            headers=dict(self.headers.items()),
            body_length=len(body),
            client=(str(client[0]), int(client[1])),
            time=received,
        )
        app.log_request(record)

        fault = app.take_fault(path)
        wait = app.delay_for(path)
        if wait > 0:
            app.sleep(wait)
        if fault is not None:
            record.fault = fault.kind
        if fault is not None and fault.kind == "reset":
            self._reset()
            return
        if fault is not None and fault.kind == "fail":
            response = _failure_response(fault)
        else:
            response = app.route(self.command, path, query, self.headers, body)
        record.status = response.status
        self._send(response, truncate=fault is not None and fault.kind == "truncate")

    def _reset(self) -> None:
        """Close the connection abruptly: no response, and an RST rather than a FIN."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.rfile.close()  # drop the makefile() reference so that close() below is the real one
        self.connection.close()

    def _send(self, response: _Response, *, truncate: bool) -> None:
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(response.length))
        for name, value in response.headers:
            self.send_header(name, value)
        if truncate or self.close_connection:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command == "HEAD":
            return
        limit = response.length // 2 if truncate else response.length
        if response.file is None:
            self.wfile.write(response.body[:limit])
            return
        remaining = limit
        with response.file.open("rb") as fh:
            while remaining > 0:
                chunk = fh.read(min(_CHUNK, remaining))
                if not chunk:
                    self.close_connection = True  # the file shrank under us; the length is now a lie
                    break
                self.wfile.write(chunk)
                remaining -= len(chunk)


def _failure_response(fault: _Fault) -> _Response:
    try:
        phrase = HTTPStatus(fault.status).phrase
    except ValueError:
        phrase = "Error"
    headers: list[tuple[str, str]] = []
    if fault.retry_after is not None:
        headers.append(("Retry-After", str(fault.retry_after)))
    if fault.html:
        html = (
            f"<html>\r\n<head><title>{fault.status} {phrase}</title></head>\r\n<body>\r\n"
            f"<center><h1>{fault.status} {phrase}</h1></center>\r\n<hr><center>nginx</center>\r\n"
            "</body>\r\n</html>\r\n"
        )
        return _Response(fault.status, html.encode(), "text/html; charset=utf-8", headers)
    return _detail(fault.status, phrase, headers)


class RodanStandin:
    """Rodan's REST API on a real loopback socket, with fault injection and a request log.

    Use as a context manager (``with RodanStandin(tmp) as rodan: ... rodan.url``) or call
    :meth:`start` / :meth:`stop`. All setters are thread-safe and take effect for the next request.

    ``token_field`` picks the Rodan generation of the token endpoint: ``"email"`` (Rodan >= 2.0.15),
    ``"username"`` (Rodan <= 2.0.14) or ``"both"`` (either identifies the user; the e-mail wins when
    both are sent). ``detail_style="rodan"`` answers failures with the bodies Rodan's own code sends
    (``{"is_logged_in": false}``, ``"You must supply a email"``) instead of the documented
    ``{"detail": ...}`` strings of PROTOCOL.md. When ``users`` is None there is one account,
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
        self._host = host
        self._port = port
        self._faults: list[_Fault] = []
        self._delays: dict[str | None, float] = {}
        self._log: list[RequestRecord] = []
        self._connections: set[socket.socket] = set()
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._bound_port = 0
        self._thread: threading.Thread | None = None

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
    ) -> None:
        """Answer the next ``n`` requests (whose path starts with ``paths``, if given) with ``status``.

        The body is ``{"detail": "<reason phrase>"}`` or, with ``html=True``, an nginx-style HTML page.
        """
        if not 100 <= status <= 599:
            raise ValueError("status must be an HTTP status code")
        self._add_fault(_Fault("fail", n, paths, status=status, html=html, retry_after=retry_after))

    def reset_next(self, n: int, paths: str | None = None) -> None:
        """Close the next ``n`` matching connections abruptly (RST), without any response."""
        self._add_fault(_Fault("reset", n, paths))

    def truncate_next(self, n: int, paths: str | None = None) -> None:
        """Send the full ``Content-Length`` but only half of the body, then close, ``n`` times."""
        self._add_fault(_Fault("truncate", n, paths))

    def delay(self, seconds: float, paths: str | None = None) -> None:
        """Sleep ``seconds`` before answering every matching request, until cleared (``seconds=0``)."""
        with self._lock:
            if seconds > 0:
                self._delays[paths] = float(seconds)
            else:
                self._delays.pop(paths, None)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()
            self._delays.clear()

    def _add_fault(self, fault: _Fault) -> None:
        if fault.remaining < 0:
            raise ValueError("n must be >= 0")
        if fault.remaining:
            with self._lock:
                self._faults.append(fault)

    def take_fault(self, path: str) -> _Fault | None:
        """The first pending fault (in the order they were set) that matches ``path``, consumed."""
        with self._lock:
            for fault in self._faults:
                if fault.paths is None or path.startswith(fault.paths):
                    fault.remaining -= 1
                    if fault.remaining <= 0:
                        self._faults.remove(fault)
                    return fault
        return None

    def delay_for(self, path: str) -> float:
        with self._lock:
            matching = [s for p, s in self._delays.items() if p is None or path.startswith(p)]
        return max(matching, default=0.0)

    def sleep(self, seconds: float) -> None:
        self._stopping.wait(seconds)

    # -- request log ------------------------------------------------------------------------------

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request received so far, oldest first (a copy of the list)."""
        with self._lock:
            return list(self._log)

    def clear_requests(self) -> None:
        with self._lock:
            self._log.clear()

    def log_request(self, record: RequestRecord) -> None:
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
                return failure or _unauthenticated()
            return _json(200, self._user_json(user, headers))
        if path + "/" in (TOKEN_PATH, ME_PATH):
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
            return self._upload(path)
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
            return self._refuse(401, text if style == "protocol" else f"You must supply a {field_name}", style)
        if not password:
            text = "You must supply a password."
            return self._refuse(401, text if style == "protocol" else "You must supply a password", style)
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
        return _detail(status, detail)

    def _authenticate(self, headers: Any) -> tuple[User | None, _Response | None]:
        """Django REST framework's TokenAuthentication. (None, None) means no credentials at all."""
        value = headers.get("Authorization", "")
        parts = value.split()
        if not parts or parts[0].lower() != "token":
            return None, None
        if len(parts) == 1:
            return None, _unauthenticated("Invalid token header. No credentials provided.")
        if len(parts) > 2:
            return None, _unauthenticated("Invalid token header. Token string should not contain spaces.")
        with self._lock:
            user = next((u for u in self._users if secrets.compare_digest(u.token, parts[1])), None)
        if user is None:
            return None, _unauthenticated("Invalid token.")
        if not user.active:
            return None, _unauthenticated("User inactive or deleted.")
        return user, None

    def _upload(self, path: str) -> _Response:
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
        return _Response(200, content_type="application/octet-stream", file=target, file_size=size)


def _not_allowed(method: str, allow: str) -> _Response:
    return _detail(405, f'Method "{method}" not allowed.', [("Allow", allow)])


def _unauthenticated(detail: str = "Authentication credentials were not provided.") -> _Response:
    return _detail(401, detail, [("WWW-Authenticate", "Token")])
