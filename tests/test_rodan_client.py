"""The Rodan client against the real stand-in server: token, retries, downloads, token scoping.

Caps, other origins, compressed bodies and the intake's input check: tests/test_inputs_bounded.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bridge.errors import PermanentError, RodanAuthError, TransientError
from bridge.rodan import RodanClient
from bridge.testing.rodan import RodanStandin, User

EMAIL, PASSWORD = "hpc@example.org", "pw-for-tests"
CAP = 64 << 20  # max_bytes of the downloads here: far above their files


@pytest.fixture
def server(tmp_path: Path):
    (tmp_path / "projects").mkdir()
    (tmp_path / "projects" / "f.bin").write_bytes(bytes(range(256)) * 8192)  # 2 MiB
    with RodanStandin(tmp_path, users=[User(EMAIL, "hpc", PASSWORD)]) as s:
        yield s


def client(server: RodanStandin, **kw: object) -> RodanClient:
    values: dict[str, object] = {"user": "hpc", "email": EMAIL, "password": PASSWORD, "backoff_s": 0.01, "retries": 3}
    values.update(kw)
    return RodanClient(server.url, **values)  # type: ignore[arg-type]


@pytest.mark.parametrize("generation", ["email", "username", "both"])
def test_token_from_either_endpoint_generation(server: RodanStandin, generation: str) -> None:
    server.token_field = generation  # type: ignore[assignment]
    token = client(server).get_token()
    assert token == server.user(EMAIL).token and len(token) == 40


def test_5xx_bursts_are_retried_then_succeed(server: RodanStandin) -> None:
    server.fail_next(2, status=503, paths="/api/auth/token/")
    assert client(server).get_token() == server.user(EMAIL).token
    token_posts = [r for r in server.requests if r.path == "/api/auth/token/"]
    assert len(token_posts) == 3


def test_5xx_forever_gives_up_as_transient(server: RodanStandin) -> None:
    server.fail_next(10, status=502, paths="/api/auth/token/")
    with pytest.raises(TransientError, match="502"):
        client(server, retries=2).get_token()
    assert len([r for r in server.requests if r.path == "/api/auth/token/"]) == 3


def test_wrong_password_is_not_retried(server: RodanStandin) -> None:
    with pytest.raises(RodanAuthError, match="401: Invalid email or password"):
        client(server, password="wrong").get_token()
    assert len([r for r in server.requests if r.path == "/api/auth/token/"]) == 1


def test_inactive_account_403(server: RodanStandin) -> None:
    server.set_active(EMAIL, False)
    with pytest.raises(RodanAuthError, match="403: Account is not activated"):
        client(server).get_token()


def test_unreachable_rodan_is_transient() -> None:
    with pytest.raises(TransientError, match="unreachable"):
        RodanClient("http://127.0.0.1:9", password="x", retries=1, backoff_s=0.01).get_token()


def test_download_streams_whole_file_with_token(server: RodanStandin, tmp_path: Path) -> None:
    c = client(server)
    c.get_token()
    result = c.download("/uploads/projects/f.bin", tmp_path / "out.bin", max_bytes=CAP)
    assert result.bytes == 2 * 1024 * 1024
    assert (tmp_path / "out.bin").read_bytes() == (tmp_path / "projects" / "f.bin").read_bytes()
    get = [r for r in server.requests if r.path == "/uploads/projects/f.bin"][-1]
    assert get.authorization == f"Token {c.token}"


def test_truncated_download_is_retried_and_detected(server: RodanStandin, tmp_path: Path) -> None:
    c = client(server, retries=1)
    server.truncate_next(1, paths="/uploads/")
    result = c.download("/uploads/projects/f.bin", tmp_path / "out.bin", max_bytes=CAP)  # second try succeeds
    assert result.bytes == 2 * 1024 * 1024
    server.truncate_next(5, paths="/uploads/")
    with pytest.raises(TransientError, match="truncated"):
        c.download("/uploads/projects/f.bin", tmp_path / "out2.bin", max_bytes=CAP)
    assert not (tmp_path / "out2.bin").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], "no partial file left"


def test_reset_connections_are_retried(server: RodanStandin, tmp_path: Path) -> None:
    server.reset_next(2, paths="/uploads/")
    assert client(server).download("/uploads/projects/f.bin", tmp_path / "o", max_bytes=CAP).bytes == 2 * 1024 * 1024


def test_missing_resource_is_permanent(server: RodanStandin, tmp_path: Path) -> None:
    with pytest.raises(PermanentError, match="HTTP 404"):
        client(server).download("/uploads/projects/none", tmp_path / "o", max_bytes=CAP)


def test_token_never_sent_to_another_host(server: RodanStandin, tmp_path: Path) -> None:
    with RodanStandin(tmp_path) as other:
        c = client(server)
        c.get_token()
        url = f"{other.url}/uploads/projects/f.bin"
        assert not c.sends_token_to(url)
        with pytest.raises(PermanentError, match="is not a file on Rodan"):
            c.download(url, tmp_path / "o", max_bytes=CAP)
        assert other.requests == [], "another origin is not even asked"
        # same host name, other port: still another origin
        assert not c.sends_token_to(server.url.rsplit(":", 1)[0] + ":1/uploads/x")
        assert c.sends_token_to(f"{server.url}/uploads/x")


def test_slow_server_times_out_as_transient(server: RodanStandin, tmp_path: Path) -> None:
    server.delay(2.0, paths="/uploads/")
    started = time.monotonic()
    with pytest.raises(TransientError):
        client(server, timeout_s=0.3, retries=1).download("/uploads/projects/f.bin", tmp_path / "o", max_bytes=CAP)
    assert time.monotonic() - started < 5


# --- 408 and 429: "later", retried with backoff, honouring Retry-After --------------------------------


class Sleeps(list[float]):
    """Stands in for time.sleep between tries: records each wait instead of waiting."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


@pytest.mark.parametrize("status", [408, 429])
def test_token_endpoint_408_429_are_retried_after_retry_after(server: RodanStandin, status: int) -> None:
    sleeps = Sleeps()
    server.fail_next(2, status=status, paths="/api/auth/token/", retry_after=7)
    assert client(server, sleep=sleeps).get_token() == server.user(EMAIL).token
    assert len([r for r in server.requests if r.path == "/api/auth/token/"]) == 3
    assert sleeps == [7, 7], "Rodan's Retry-After, not the 0.01 s backoff"


def test_retry_after_is_capped_and_backoff_used_without_it(server: RodanStandin, tmp_path: Path) -> None:
    sleeps = Sleeps()
    server.fail_next(1, status=429, paths="/uploads/", retry_after=3600)
    server.fail_next(1, status=408, paths="/uploads/")
    c = client(server, sleep=sleeps, backoff_s=0.5)
    assert c.download("/uploads/projects/f.bin", tmp_path / "o", max_bytes=CAP).bytes == 2 * 1024 * 1024
    assert sleeps == [60.0, 1.0], "an hour asked is capped at a minute; then plain backoff (0.5 s x 2)"
    assert [r.status for r in server.requests] == [429, 408, 200]


def test_429_forever_gives_up_as_transient(server: RodanStandin, tmp_path: Path) -> None:
    server.fail_next(100, status=429, paths="/uploads/")
    with pytest.raises(TransientError, match="server answered 429"):
        client(server, retries=2, sleep=Sleeps()).download("/uploads/projects/f.bin", tmp_path / "o", max_bytes=CAP)
    assert len(server.requests) == 3
    assert not (tmp_path / "o").exists()


def test_of_the_4xx_only_408_and_429_are_retried(server: RodanStandin, tmp_path: Path) -> None:
    for status, tries in ((400, 1), (405, 1), (410, 1), (408, 3), (429, 3)):
        server.clear_requests()
        server.fail_next(5, status=status, paths="/uploads/")
        error = TransientError if tries > 1 else PermanentError
        with pytest.raises(error, match=f"{status}"):
            client(server, sleep=Sleeps(), retries=2).download("/uploads/projects/f.bin", tmp_path / "o", max_bytes=CAP)
        assert len(server.requests) == tries, status
        server.clear_faults()


# --- 401/403 bodies never reach an error --------------------------------------------------------------


@pytest.mark.parametrize("status", [401, 403])
@pytest.mark.parametrize("html", [False, True])
def test_download_refusal_names_the_status_not_the_body(
    server: RodanStandin, tmp_path: Path, status: int, html: bool
) -> None:
    body = "<script>steal()</script> call 555-0100 for access"
    server.fail_next(1, status=status, paths="/uploads/", detail=body, html=html)
    with pytest.raises(RodanAuthError) as caught:
        client(server).download("/uploads/projects/f.bin", tmp_path / "o", max_bytes=CAP)
    message = str(caught.value)
    assert f"refused ({status})" in message and "hpc-bridge doctor" in message
    assert "steal" not in message and "555-0100" not in message
    assert len(server.requests) == 1, "never retried"


def test_token_endpoint_detail_is_kept_but_truncated(server: RodanStandin) -> None:
    server.fail_next(1, status=401, paths="/api/auth/token/", detail="x" * 5000)
    with pytest.raises(RodanAuthError) as caught:
        client(server).get_token()
    assert "(401: " + "x" * 200 + ")" in str(caught.value)
    assert "x" * 201 not in str(caught.value)
