"""The Rodan stand-in (bridge.testing): a real HTTP server on loopback, and its sample pages."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from PIL import Image

from bridge.testing.rodan import PNG_SIGNATURE, RodanStandin, User, token_for_email
from bridge.testing.samples import (
    EINSIEDELN_DIR,
    make_sample_page,
    synthesize_page_from_masks,
)

EMAIL, USERNAME, PASSWORD = "ana@example.org", "ana", "s3cret pass"
TOKEN_RE = re.compile(r"^[0-9a-f]{40}$")
RESOURCE_RE = re.compile(r"^/uploads/projects/[0-9a-f]{32}/resources/[0-9a-f]{32}/original_file$")

OLD_NAMES = ["Image", "Background", "Music Layer", "Staff Layer", "Text", "Selected Regions"]


def new_names(n: int) -> list[str]:
    return ["Image", "Background", "Selected Regions"] + [f"rgba PNG - Layer {i}" for i in range(n)]


def users() -> list[User]:
    return [
        User(EMAIL, USERNAME, PASSWORD),
        User("off@example.org", "off", "pw-off", active=False),
    ]


@pytest.fixture
def make_srv(tmp_path: Path) -> Iterator[Callable[..., RodanStandin]]:
    started: list[RodanStandin] = []

    def make(**kwargs: Any) -> RodanStandin:
        uploads = tmp_path / "uploads"
        uploads.mkdir(exist_ok=True)
        kwargs.setdefault("users", users())
        srv = RodanStandin(uploads, **kwargs).start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture
def srv(make_srv: Callable[..., RodanStandin]) -> RodanStandin:
    return make_srv()


def post_token(srv: RodanStandin, fields: dict[str, str], kind: str = "form", **kw: Any) -> requests.Response:
    url = srv.url + "/api/auth/token/"
    if kind == "form":
        return requests.post(url, data=fields, timeout=5, **kw)
    if kind == "multipart":
        return requests.post(url, files={k: (None, v) for k, v in fields.items()}, timeout=5, **kw)
    return requests.post(url, json=fields, timeout=5, **kw)


def raw_get(srv: RodanStandin, target: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """GET with the request target sent byte for byte (requests/urllib3 would normalise '..')."""
    conn = http.client.HTTPConnection(srv.host_port, timeout=5)
    try:
        conn.putrequest("GET", target, skip_accept_encoding=True)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


# ------------------------------------------------------------------------------------------------
# POST /api/auth/token/


@pytest.mark.parametrize("kind", ["form", "multipart", "json"])
@pytest.mark.parametrize("token_field", ["email", "username"])
def test_token_success_each_generation_and_body(make_srv, token_field, kind):
    srv = make_srv(token_field=token_field)
    ident = {"email": EMAIL} if token_field == "email" else {"username": USERNAME}
    r = post_token(srv, {**ident, "password": PASSWORD}, kind)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"] == "application/json"
    body = r.json()
    assert TOKEN_RE.match(body["token"])
    assert body["token"] == token_for_email(EMAIL)
    assert body["username"] == USERNAME and body["email"] == EMAIL
    assert body["first_name"] == "" and body["last_name"] == "" and body["is_active"] is True
    assert body["url"].startswith(srv.url + "/api/user/")


@pytest.mark.parametrize("kind", ["form", "multipart", "json"])
@pytest.mark.parametrize("token_field", ["email", "username", "both"])
def test_token_username_email_and_password_together_work_everywhere(make_srv, token_field, kind):
    srv = make_srv(token_field=token_field)
    r = post_token(srv, {"username": USERNAME, "email": EMAIL, "password": PASSWORD}, kind)
    assert r.status_code == 200
    assert r.json()["token"] == token_for_email(EMAIL)


@pytest.mark.parametrize("kind", ["form", "multipart", "json"])
def test_token_errors_email_generation(make_srv, kind):
    srv = make_srv(token_field="email")
    cases = [
        ({"username": USERNAME, "password": PASSWORD}, 401, "You must supply an email."),
        ({"email": EMAIL}, 401, "You must supply a password."),
        ({"email": EMAIL, "password": "wrong"}, 401, "Invalid email or password."),
        ({"email": "nobody@example.org", "password": PASSWORD}, 401, "Invalid email or password."),
        ({"email": "off@example.org", "password": "pw-off"}, 403, "Account is not activated."),
    ]
    for fields, status, detail in cases:
        r = post_token(srv, fields, kind)
        assert (r.status_code, r.json()) == (status, {"detail": detail}), fields
        assert r.headers["Content-Type"] == "application/json"


@pytest.mark.parametrize("kind", ["form", "multipart", "json"])
def test_token_errors_username_generation(make_srv, kind):
    srv = make_srv(token_field="username")
    cases = [
        ({"email": EMAIL, "password": PASSWORD}, 401, "You must supply a username."),
        ({"username": USERNAME, "password": ""}, 401, "You must supply a password."),
        ({"username": USERNAME, "password": "wrong"}, 401, "Invalid username or password."),
        ({"username": "off", "password": "pw-off"}, 403, "Account is not activated."),
    ]
    for fields, status, detail in cases:
        r = post_token(srv, fields, kind)
        assert (r.status_code, r.json()) == (status, {"detail": detail}), fields


def test_token_rodan_detail_style(make_srv):
    srv = make_srv(detail_style="rodan")
    r = post_token(srv, {"email": EMAIL, "password": "wrong"})
    assert (r.status_code, r.json()) == (401, {"is_logged_in": False})
    r = post_token(srv, {"email": "off@example.org", "password": "pw-off"})
    assert (r.status_code, r.json()) == (403, {"is_logged_in": False})
    r = post_token(srv, {"password": PASSWORD})
    assert (r.status_code, r.json()) == (401, {"detail": "You must supply a email"})


def test_token_url_shape_methods_and_media_types(srv):
    r = requests.post(
        srv.url + "/api/auth/token", data={"email": EMAIL, "password": PASSWORD}, allow_redirects=False, timeout=5
    )
    assert r.status_code == 301 and r.headers["Location"] == "/api/auth/token/"
    r = requests.get(srv.url + "/api/auth/token/", timeout=5)
    assert r.status_code == 405 and r.json() == {"detail": 'Method "GET" not allowed.'}
    r = requests.post(srv.url + "/api/auth/token/", data=b"email=x", timeout=5, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    r = requests.post(
        srv.url + "/api/auth/token/", data=b"{nope", timeout=5, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["detail"].startswith("JSON parse error")
    assert requests.get(srv.url + "/api/nothing/", timeout=5).status_code == 404


# ------------------------------------------------------------------------------------------------
# GET /api/auth/me/


def test_auth_me(srv):
    url = srv.url + "/api/auth/me/"
    token = token_for_email(EMAIL)
    r = requests.get(url, headers={"Authorization": f"Token {token}"}, timeout=5)
    assert r.status_code == 200 and r.json()["email"] == EMAIL and "token" not in r.json()
    r = requests.get(url, headers={"Authorization": "Token " + "0" * 40}, timeout=5)
    assert (r.status_code, r.json()) == (401, {"detail": "Invalid token."})
    r = requests.get(url, timeout=5)
    assert (r.status_code, r.json()) == (401, {"detail": "Authentication credentials were not provided."})
    assert r.headers["WWW-Authenticate"] == "Token"
    off = token_for_email("off@example.org")
    r = requests.get(url, headers={"Authorization": f"Token {off}"}, timeout=5)
    assert r.status_code == 401


def test_changed_credentials_and_rotated_token(srv):
    token = post_token(srv, {"email": EMAIL, "password": PASSWORD}).json()["token"]
    srv.set_password(EMAIL, "new password")
    assert post_token(srv, {"email": EMAIL, "password": PASSWORD}).status_code == 401
    r = post_token(srv, {"email": EMAIL, "password": "new password"})
    assert r.status_code == 200 and r.json()["token"] == token  # like DRF: the token survives
    new = srv.rotate_token(EMAIL)
    me = srv.url + "/api/auth/me/"
    assert requests.get(me, headers={"Authorization": f"Token {token}"}, timeout=5).status_code == 401
    assert requests.get(me, headers={"Authorization": f"Token {new}"}, timeout=5).status_code == 200
    srv.token_field = "username"  # an upgrade/downgrade of Rodan under a running client
    r = post_token(srv, {"email": EMAIL, "password": "new password"})
    assert r.json() == {"detail": "You must supply a username."}


# ------------------------------------------------------------------------------------------------
# /uploads/


@pytest.fixture
def payload(srv) -> tuple[str, bytes]:
    data = os.urandom(300_000)
    file = srv.uploads_dir / "projects" / ("a" * 32) / "resources" / ("b" * 32) / "original_file"
    file.parent.mkdir(parents=True)
    file.write_bytes(data)
    (srv.uploads_dir.parent / "secret.txt").write_text("outside")
    return "/uploads/" + file.relative_to(srv.uploads_dir).as_posix(), data


def test_uploads_served(srv, payload):
    path, data = payload
    r = requests.get(srv.url_for(path), timeout=5)
    assert r.status_code == 200 and r.content == data
    assert r.headers["Content-Length"] == str(len(data))
    h = requests.head(srv.url_for(path), timeout=5)
    assert h.status_code == 200 and h.headers["Content-Length"] == str(len(data)) and h.content == b""
    r = requests.get(srv.url + "/uploads/projects/nothing/original_file", timeout=5)
    assert r.status_code == 404 and r.headers["Content-Type"] == "application/json" and "detail" in r.json()
    assert requests.get(srv.url + "/uploads/projects/", timeout=5).status_code == 404  # no listings
    assert requests.post(srv.url_for(path), timeout=5).status_code == 405


def test_uploads_traversal_refused(srv, payload):
    (srv.uploads_dir / "link").symlink_to(srv.uploads_dir.parent / "secret.txt")
    for target in (
        "/uploads/../secret.txt",
        "/uploads/%2e%2e/secret.txt",
        "/uploads/projects/..%2f..%2fsecret.txt",
        "/uploads/" + str(srv.uploads_dir.parent / "secret.txt"),
        "/uploads/link",
        "/uploads/%00",
    ):
        status, body = raw_get(srv, target)
        assert status == 404, target
        assert b"outside" not in body


def test_uploads_behind_auth(make_srv):
    srv = make_srv(require_auth_for_uploads=True)
    (srv.uploads_dir / "f").write_bytes(b"x" * 10)
    r = requests.get(srv.url + "/uploads/f", timeout=5)
    assert r.status_code == 401
    r = requests.get(srv.url + "/uploads/f", headers={"Authorization": "Token " + "1" * 40}, timeout=5)
    assert (r.status_code, r.json()) == (401, {"detail": "Invalid token."})
    r = requests.get(srv.url + "/uploads/f", headers={"Authorization": f"Token {token_for_email(EMAIL)}"}, timeout=5)
    assert r.status_code == 200 and r.content == b"x" * 10


# ------------------------------------------------------------------------------------------------
# fault injection


def test_fail_next_burst_then_normal(srv, payload):
    path, data = payload
    srv.fail_next(2, 503, paths="/uploads/", retry_after=1)
    # a request elsewhere is not affected and does not use up the burst
    assert post_token(srv, {"email": EMAIL, "password": PASSWORD}).status_code == 200
    for _ in range(2):
        r = requests.get(srv.url_for(path), timeout=5)
        assert (r.status_code, r.json()) == (503, {"detail": "Service Unavailable"})
        assert r.headers["Retry-After"] == "1"
    assert requests.get(srv.url_for(path), timeout=5).content == data
    srv.fail_next(1, 502, html=True)
    r = requests.get(srv.url_for(path), timeout=5)
    assert r.status_code == 502 and r.headers["Content-Type"].startswith("text/html") and b"502" in r.content
    assert requests.get(srv.url_for(path), timeout=5).status_code == 200


def test_reset_next(srv, payload):
    path, data = payload
    srv.reset_next(1, paths="/api/auth/token/")
    with pytest.raises(requests.ConnectionError):
        post_token(srv, {"email": EMAIL, "password": PASSWORD})
    assert post_token(srv, {"email": EMAIL, "password": PASSWORD}).status_code == 200
    srv.reset_next(1)
    with pytest.raises(requests.ConnectionError):
        requests.get(srv.url_for(path), timeout=5)
    assert requests.get(srv.url_for(path), timeout=5).content == data
    assert [r.fault for r in srv.requests].count("reset") == 2
    assert srv.requests[0].status is None


def test_truncate_next(srv, payload):
    path, data = payload
    srv.truncate_next(2, paths="/uploads/")
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        requests.get(srv.url_for(path), timeout=5)
    conn = http.client.HTTPConnection(srv.host_port, timeout=5)
    conn.request("GET", path)
    resp = conn.getresponse()
    assert int(resp.getheader("Content-Length")) == len(data)
    with pytest.raises(http.client.IncompleteRead) as excinfo:
        resp.read()
    assert len(excinfo.value.partial) == len(data) // 2
    assert excinfo.value.partial == data[: len(data) // 2]
    conn.close()
    assert requests.get(srv.url_for(path), timeout=5).content == data


def test_delay(srv):
    me = srv.url + "/api/auth/me/"
    srv.delay(0.3, paths="/api/auth/me/")
    t0 = time.monotonic()
    requests.get(me, timeout=30)
    assert time.monotonic() - t0 >= 0.3  # a lower bound: a busy machine only makes it longer
    # An hour's delay tells a delayed request from one that is not by what happens, not by a
    # stopwatch: the delayed one cannot be answered within a read timeout, the others are answered.
    srv.delay(3600, paths="/api/auth/me/")
    token = requests.post(srv.url + "/api/auth/token/", data={"email": EMAIL, "password": PASSWORD}, timeout=60)
    assert token.status_code == 200  # another path: not delayed
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.get(me, timeout=0.5)
    srv.clear_faults()  # the delay goes with the faults
    srv.fail_next(5)
    srv.clear_faults()
    assert requests.get(me, timeout=60).status_code == 401  # neither delayed nor failed


def test_faults_apply_in_order(srv):
    srv.reset_next(1)
    srv.fail_next(1, 500)
    url = srv.url + "/api/auth/me/"
    with pytest.raises(requests.ConnectionError):
        requests.get(url, timeout=5)
    assert requests.get(url, timeout=5).status_code == 500
    assert requests.get(url, timeout=5).status_code == 401


def test_fail_next_with_a_body_and_retry_after(srv, payload):
    path, data = payload
    srv.fail_next(1, 403, paths="/uploads/", detail="Ask the admin (bob) for access.")
    srv.fail_next(1, 429, paths="/uploads/", retry_after=30)
    srv.fail_next(1, 408, paths="/uploads/", html=True, detail="too slow")
    r = requests.get(srv.url_for(path), timeout=5)
    assert (r.status_code, r.json()) == (403, {"detail": "Ask the admin (bob) for access."})
    r = requests.get(srv.url_for(path), timeout=5)
    assert (r.status_code, r.json(), r.headers["Retry-After"]) == (429, {"detail": "Too Many Requests"}, "30")
    r = requests.get(srv.url_for(path), timeout=5)
    assert r.status_code == 408 and b"<p>too slow</p>" in r.content and b"408 Request Timeout" in r.content
    assert requests.get(srv.url_for(path), timeout=5).content == data


def test_redirect_next(srv, payload):
    path, data = payload
    srv.redirect_next(1, "/uploads/elsewhere", paths="/uploads/", status=307)
    r = requests.get(srv.url_for(path), timeout=5, allow_redirects=False)
    assert (r.status_code, r.headers["Location"]) == (307, "/uploads/elsewhere")
    assert srv.requests[-1].fault == "redirect"
    assert requests.get(srv.url_for(path), timeout=5).content == data
    with pytest.raises(ValueError, match="redirect"):
        srv.redirect_next(1, "/x", status=200)


def test_downloads_only_faults_spare_ranged_gets_and_heads(srv, payload):
    """The intake checks an input with a ranged GET (or a HEAD); the worker downloads it whole."""
    path, data = payload
    srv.fail_next(1, 502, paths="/uploads/", downloads_only=True)
    srv.reset_next(1, paths="/uploads/", downloads_only=True)
    srv.delay(0.2, paths="/uploads/", downloads_only=True)
    assert requests.get(srv.url_for(path), headers={"Range": "bytes=0-15"}, timeout=5).status_code == 206
    assert requests.head(srv.url_for(path), timeout=5).status_code == 200
    assert [r.fault for r in srv.requests] == [None, None], "neither matched nor consumed the faults"
    assert requests.get(srv.url_for(path), timeout=5).status_code == 502
    with pytest.raises(requests.ConnectionError):
        requests.get(srv.url_for(path), timeout=5)
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.get(srv.url_for(path), timeout=0.1)  # the delay holds for whole GETs only
    srv.clear_faults()
    assert requests.get(srv.url_for(path), timeout=5).content == data


# ------------------------------------------------------------------------------------------------
# ranges, HEAD, generated resources (what the intake's check and the download cap are tested with)


def ranged(srv: RodanStandin, path: str, value: str) -> requests.Response:
    return requests.get(srv.url_for(path), headers={"Range": value}, timeout=5)


def test_ranges_like_nginx(srv, payload):
    path, data = payload
    size = len(data)
    whole = requests.get(srv.url_for(path), timeout=5)
    assert whole.headers["Accept-Ranges"] == "bytes" and "Content-Range" not in whole.headers
    for value, first, last in [
        ("bytes=0-15", 0, 15),
        ("bytes=100-", 100, size - 1),
        ("bytes=-10", size - 10, size - 1),
        ("bytes=0-999999999", 0, size - 1),  # past the end: clamped
        (f"bytes=-{size + 5}", 0, size - 1),
    ]:
        r = ranged(srv, path, value)
        assert r.status_code == 206, value
        assert r.headers["Content-Range"] == f"bytes {first}-{last}/{size}", value
        assert r.headers["Content-Length"] == str(last - first + 1) and r.content == data[first : last + 1], value
    for value in (f"bytes={size}-", f"bytes={size + 10}-{size + 20}", "bytes=-0"):
        r = ranged(srv, path, value)
        assert (r.status_code, r.headers["Content-Range"]) == (416, f"bytes */{size}"), value
        assert r.json() == {"detail": "Requested Range Not Satisfiable"}
    for value in ("bytes=0-1,5-9", "bytes=9-2", "items=0-5", "bytes=x-"):  # ignored: the whole file
        r = ranged(srv, path, value)
        assert (r.status_code, r.content) == (200, data), value
    h = requests.head(srv.url_for(path), headers={"Range": "bytes=0-15"}, timeout=5)
    assert (h.status_code, h.headers["Content-Length"], h.content) == (200, str(size), b"")
    assert h.headers["Accept-Ranges"] == "bytes"
    assert [r.sent for r in srv.requests][:2] == [size, 16], "the log counts the body bytes sent"
    (srv.uploads_dir / "empty").write_bytes(b"")
    r = ranged(srv, "/uploads/empty", "bytes=0-15")
    assert (r.status_code, r.headers["Content-Range"]) == (416, "bytes */0")


def test_ignore_range(srv, payload):
    path, data = payload
    srv.ignore_range(paths="/uploads/projects/")
    r = ranged(srv, path, "bytes=0-15")
    assert (r.status_code, r.content) == (200, data) and "Accept-Ranges" not in r.headers
    srv.clear_faults()
    assert ranged(srv, path, "bytes=0-15").status_code == 206


def test_serve_generated_chunked_without_end(srv):
    srv.serve_generated("/uploads/endless")
    conn = http.client.HTTPConnection(srv.host_port, timeout=5)
    conn.request("GET", "/uploads/endless", headers={"Range": "bytes=0-15"})
    resp = conn.getresponse()
    assert resp.status == 200, "a streamed response ignores ranges"
    assert resp.getheader("Transfer-Encoding") == "chunked" and resp.getheader("Content-Length") is None
    body = b""
    while len(body) < 3 << 20:
        body += resp.read(1 << 16)
    assert body.startswith(PNG_SIGNATURE) and body[len(PNG_SIGNATURE) :].count(0) == len(body) - len(PNG_SIGNATURE)
    conn.close()
    assert srv.requests[0].sent >= 3 << 20
    h = requests.head(srv.url + "/uploads/endless", timeout=5)
    assert h.status_code == 200 and h.headers["Transfer-Encoding"] == "chunked" and h.content == b""


def test_serve_generated_with_a_size(srv):
    srv.serve_generated("/uploads/chunked", 100_000, head=b"GIF89a")
    r = requests.get(srv.url + "/uploads/chunked", timeout=5)
    assert "Content-Length" not in r.headers and len(r.content) == 100_000 and r.content.startswith(b"GIF89a")
    srv.serve_generated("/uploads/declared", 5 << 30, chunked=False)  # 5 GiB, never stored
    with requests.get(srv.url + "/uploads/declared", stream=True, timeout=5) as r:
        assert r.headers["Content-Length"] == str(5 << 30)
        assert r.raw.read(8) == PNG_SIGNATURE
    assert requests.head(srv.url + "/uploads/declared", timeout=5).headers["Content-Length"] == str(5 << 30)
    srv.clear_faults()
    assert requests.get(srv.url + "/uploads/declared", timeout=5).status_code == 404
    with pytest.raises(ValueError, match="chunked"):
        srv.serve_generated("/uploads/x", None, chunked=False)
    with pytest.raises(ValueError, match="/uploads/"):
        srv.serve_generated("/api/auth/me/")


def test_serve_gzip_bomb(srv):
    srv.serve_gzip_bomb("/uploads/bomb", 32 << 20)
    with requests.get(srv.url + "/uploads/bomb", headers={"Accept-Encoding": "identity"}, stream=True, timeout=5) as r:
        assert r.headers["Content-Encoding"] == "gzip", "whatever the client asked for"
        wire = r.raw.read(decode_content=False)
    assert int(r.headers["Content-Length"]) == len(wire) < (32 << 20) // 500
    inflated = gzip.decompress(wire)
    assert len(inflated) == 32 << 20 and inflated.startswith(PNG_SIGNATURE)


def test_stop_while_streaming_without_end(tmp_path):
    srv = RodanStandin(tmp_path).start()
    srv.serve_generated("/uploads/endless")
    conn = http.client.HTTPConnection(srv.host_port, timeout=5)
    conn.request("GET", "/uploads/endless")
    resp = conn.getresponse()
    resp.read(1 << 16)
    t0 = time.monotonic()
    srv.stop()  # the handler writing the endless body ends too
    # Generous: what it guards against is a stop that waits for an endless body, i.e. for ever.
    assert time.monotonic() - t0 < 30
    conn.close()


# ------------------------------------------------------------------------------------------------
# request log, lifecycle


def test_request_log_records_authorization(srv, payload):
    path, _ = payload
    token = post_token(srv, {"email": EMAIL, "password": PASSWORD}).json()["token"]
    with requests.Session() as s:
        s.get(srv.url_for(path), headers={"Authorization": f"Token {token}"}, timeout=5)
        s.get(srv.url + "/api/auth/me/?x=1", timeout=5)
    log = srv.requests
    assert [(r.method, r.path, r.status) for r in log] == [
        ("POST", "/api/auth/token/", 200),
        ("GET", path, 200),
        ("GET", "/api/auth/me/", 401),
    ]
    assert log[0].authorization is None and log[0].body_length > 0
    assert log[1].headers["Authorization"] == f"Token {token}"
    assert log[1].header("authorization") == f"Token {token}"
    assert log[2].query == "x=1" and log[2].client[0] == "127.0.0.1" and log[2].time >= log[0].time
    assert token not in repr(log[1]) and token not in repr(srv.user(EMAIL))
    assert PASSWORD not in repr(srv.users)
    srv.clear_requests()
    assert srv.requests == []


def test_stop_with_open_keepalive_connection(tmp_path):
    srv = RodanStandin(tmp_path).start()
    s = requests.Session()
    s.get(srv.url + "/api/auth/me/", timeout=5)  # leaves a kept-alive connection open
    t0 = time.monotonic()
    srv.stop()
    # Generous: what it guards against is a stop that waits for the idle connection to be closed
    # (after the handler's 60 s timeout); half of that is still far above a working stop.
    assert time.monotonic() - t0 < 30
    with pytest.raises(requests.ConnectionError):
        s.get(srv.url + "/api/auth/me/", timeout=2)
    srv.start()  # a restart serves the same URL again
    assert s.get(srv.url + "/api/auth/me/", timeout=2).status_code == 401
    srv.stop()
    s.close()
    with RodanStandin(tmp_path, users=[User("a@b.c", "a", "p", token="f" * 40)]) as again:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", again.url)
        assert again.host_port == again.url[len("http://") :]
        assert post_token(again, {"email": "a@b.c", "password": "p"}).json()["token"] == "f" * 40


def test_server_import_is_light_and_cli_serves(tmp_path):
    code = "import sys, bridge.testing.rodan; sys.exit('numpy' in sys.modules or 'PIL' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0

    out_json = tmp_path / "req.json"
    env = {**os.environ, "STANDIN_PASSWORD": PASSWORD}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bridge.testing",
            "serve",
            "--uploads",
            str(tmp_path / "up"),
            "--email",
            EMAIL,
            "--username",
            USERNAME,
            "--token-field",
            "username",
            "--sample-page",
            str(out_json),
            "--generation",
            "old",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        line = json.loads(proc.stdout.readline())
        r = requests.post(
            line["url"] + "/api/auth/token/",
            data={"username": USERNAME, "email": EMAIL, "password": PASSWORD},
            timeout=5,
        )
        assert r.status_code == 200
        request = json.loads(out_json.read_text())
        assert list(request["inputs"]) == OLD_NAMES and request["settings"] == {}
        image = requests.get(line["url"] + request["inputs"]["Image"], timeout=5)
        assert image.status_code == 200 and image.content.startswith(b"\x89PNG")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0
    assert r.json()["token"] not in out + err and PASSWORD not in out + err


# ------------------------------------------------------------------------------------------------
# samples


def load(uploads: Path, path: str) -> Image.Image:
    assert RESOURCE_RE.match(path), path
    image = Image.open(uploads / path[len("/uploads/") :])
    image.load()
    return image


def alpha_masks(uploads: Path, inputs: dict[str, str]) -> dict[str, np.ndarray]:
    masks = {}
    for name, path in inputs.items():
        if name == "Image":
            continue
        image = load(uploads, path)
        assert image.mode == "RGBA", name
        alpha = np.asarray(image)[..., 3]
        assert set(np.unique(alpha)) <= {0, 255}, name
        masks[name] = alpha == 255
    return masks


@pytest.mark.parametrize(
    ("generation", "n_layers", "names"),
    [("old", 2, OLD_NAMES)] + [("new", n, new_names(n)) for n in (1, 2, 3, 4, 10)],
)
def test_sample_page_layers(tmp_path, generation, n_layers, names):
    inputs = make_sample_page(tmp_path, generation=generation, n_layers=n_layers)
    assert list(inputs) == names
    image = load(tmp_path, inputs["Image"])
    assert image.mode == "RGB" and image.size == (192, 160)
    masks = alpha_masks(tmp_path, inputs)
    assert all(m.shape == (160, 192) for m in masks.values())
    layers = {k: m for k, m in masks.items() if k != "Selected Regions"}
    for name, m in layers.items():
        assert m.sum() >= 250, (name, int(m.sum()))
    stack = np.stack(list(layers.values())).astype(int)
    assert (stack.sum(axis=0) <= 1).all(), "layers overlap"
    assert np.array_equal(stack.sum(axis=0) == 1, masks["Selected Regions"]), "layers do not cover the page"
    assert masks["Selected Regions"].all()
    # the ink is where the symbols are: a model can learn this
    grey = np.asarray(image.convert("L"), dtype=float)
    for name, m in layers.items():
        if name != "Background":
            assert grey[m].mean() < grey[masks["Background"]].mean() - 40, name


def test_sample_page_deterministic_and_distinct(tmp_path):
    a = make_sample_page(tmp_path / "a", generation="new", n_layers=3, seed=7)
    b = make_sample_page(tmp_path / "b", generation="new", n_layers=3, seed=7)
    c = make_sample_page(tmp_path / "c", generation="new", n_layers=3, seed=8)
    assert a == b and a != c
    for name in a:
        fa = (tmp_path / "a" / a[name][9:]).read_bytes()
        assert fa == (tmp_path / "b" / b[name][9:]).read_bytes(), name
        if name != "Selected Regions":
            assert fa != (tmp_path / "c" / c[name][9:]).read_bytes(), name
    # different configurations in one uploads directory never overwrite each other
    old = make_sample_page(tmp_path / "a", generation="old", seed=7)
    assert not set(old.values()) & set(a.values())


def test_sample_page_selected_box_and_jpeg(tmp_path):
    inputs = make_sample_page(
        tmp_path, generation="old", height=120, width=100, selected_box=(10, 20, 90, 110), image_format="jpeg"
    )
    image = load(tmp_path, inputs["Image"])
    assert image.format == "JPEG" and image.mode == "RGB" and image.size == (100, 120)
    masks = alpha_masks(tmp_path, inputs)
    sel = masks["Selected Regions"]
    assert sel.sum() == 80 * 90 and sel[20:110, 10:90].all()
    for name, m in masks.items():
        assert not (m & ~sel).any(), name
    with pytest.raises(ValueError):
        make_sample_page(tmp_path, generation="new", n_layers=11)


@pytest.mark.parametrize("generation", ["old", "new"])
def test_synthesize_page_from_masks_crop(tmp_path, generation):
    crop = (512, 1024, 1024, 1536)
    inputs = synthesize_page_from_masks(EINSIEDELN_DIR, tmp_path, crop, generation=generation, seed=3)
    assert list(inputs) == (OLD_NAMES if generation == "old" else new_names(2))
    image = load(tmp_path, inputs["Image"])
    assert image.mode == "RGB" and image.size == (512, 512)
    layers = {}
    for name, path in inputs.items():
        if name == "Image":
            continue
        im = load(tmp_path, path)
        assert im.mode == "RGBA" and im.size == (512, 512)
        layers[name] = np.asarray(im)[..., 3] == 255
    music = layers["Music Layer" if generation == "old" else "rgba PNG - Layer 0"]
    staff = layers["Staff Layer" if generation == "old" else "rgba PNG - Layer 1"]
    assert music.sum() > 5000 and staff.sum() > 10000 and layers["Selected Regions"].all()
    if generation == "new":  # the layer is exactly that part of the real mask (a full decode, once)
        real = np.asarray(Image.open(EINSIEDELN_DIR / "Neumes.png").crop(crop))[..., 3] == 255
        assert np.array_equal(music, real)
    grey = np.asarray(image.convert("L"), dtype=float)
    bg = layers["Background"]
    assert grey[music].mean() < 80 and grey[bg].mean() > 180
    if generation == "old":
        text = layers["Text"]
        assert text.sum() > 1000
        assert not (text & (bg | music | staff)).any()
        assert grey[text].mean() < 100
        again = synthesize_page_from_masks(EINSIEDELN_DIR, tmp_path / "again", crop, generation=generation, seed=3)
        for name in inputs:
            first = (tmp_path / inputs[name][9:]).read_bytes()
            assert first == (tmp_path / "again" / again[name][9:]).read_bytes(), name
