"""The real Rodan 3.1.0 (deploy/dev/rodan.sh) against the stand-in and the bridge's client.

The same requests go to the real Rodan and to ``RodanStandin.like_rodan_3_1`` (which has the same
account and the same file at the same path) and the answers are compared: status, the JSON that
matters, the headers the client reads, the bytes served. Then the bridge's ``RodanClient`` runs
against the real Rodan: token by e-mail, input checks, downloads, refusals. A file of several GB is
checked through a proxy that counts what Rodan sent: runserver ignores ``Range`` and starts sending
the whole file, and the check must stop after the bytes it needs.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import subprocess
import threading
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from bridge.errors import PermanentError, RodanAuthError
from bridge.rodan import RodanClient
from bridge.testing.rodan import RodanStandin, User
from tests.support.rodan_real import REPO, RODAN_SH, RealRodan, Resource, parse_env

TIMEOUT_S = 30.0
#: Token, check and download in a row on one client, this many times: without the client's resend,
#: about one request in five met runserver's silent close (115 of 600 token/me pairs here).
REPEATS = 30
#: Headers whose presence and value the comparison covers (what the bridge's client reads).
COMPARED_HEADERS = ("Content-Type", "Content-Length", "Content-Range", "Accept-Ranges", "Content-Encoding")


def png_bytes(width: int = 7, height: int = 3) -> bytes:
    """A small valid RGB PNG."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(
        b"\x00" + b"".join(bytes((x * 30 % 256, y * 80 % 256, 7)) for x in range(width)) for y in range(height)
    )
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def project(rodan_real: RealRodan) -> str:
    return rodan_real.create_project(f"hpc-bridge test_rodan_real {uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="module")
def page(rodan_real: RealRodan, project: str) -> tuple[Resource, bytes]:
    data = png_bytes()
    return rodan_real.upload(project, "page.png", data), data


@pytest.fixture
def standin(rodan_real: RealRodan, tmp_path: Path) -> Iterator[RodanStandin]:
    """The stand-in as Rodan 3.1.0, with the real Rodan's accounts."""
    user = User(rodan_real.email, rodan_real.email.split("@")[0], rodan_real.password)
    inactive = User(rodan_real.inactive_email, "inactive", rodan_real.password, active=False)
    with RodanStandin.like_rodan_3_1(tmp_path / "uploads", users=[user, inactive]) as server:
        yield server


def mirror(standin: RodanStandin, resource: Resource, data: bytes) -> None:
    """Put ``data`` at the resource's path on the stand-in."""
    target = standin.uploads_dir / resource.path.removeprefix("/uploads/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def both(rodan_real: RealRodan, standin: RodanStandin) -> list[tuple[str, str]]:
    return [("real", rodan_real.url), ("standin", standin.url)]


def ask(base: str, method: str, path: str, **kwargs: Any) -> requests.Response:
    """One request on a connection of its own (runserver closes each one after its answer)."""
    headers = {"Accept": "application/json", "Accept-Encoding": "identity", **kwargs.pop("headers", {})}
    with requests.Session() as session:
        return session.request(method, base + path, headers=headers, timeout=TIMEOUT_S, allow_redirects=False, **kwargs)


def compared(response: requests.Response, *, body: bool = True) -> dict[str, Any]:
    shown: dict[str, Any] = {"status": response.status_code}
    for name in COMPARED_HEADERS:
        shown[name] = response.headers.get(name)
    if body and response.headers.get("Content-Type", "").startswith("application/json"):
        shown["json"] = response.json()
    return shown


# --- the token ------------------------------------------------------------------------------------

REFUSALS = [
    pytest.param({"email": "{email}", "password": "not-the-password"}, "data", id="wrong-password"),
    pytest.param({"email": "nobody@rodan.test", "password": "{password}"}, "data", id="unknown-email"),
    pytest.param({"username": "{username}", "password": "{password}"}, "data", id="username-only"),
    pytest.param({"email": "{email}"}, "data", id="no-password"),
    pytest.param({"email": "{inactive}", "password": "{password}"}, "data", id="inactive-account"),
    pytest.param({"email": "{inactive}", "password": "not-the-password"}, "data", id="inactive-wrong-password"),
    pytest.param({}, "data", id="empty-form"),
    pytest.param({"email": "{email}", "password": "not-the-password"}, "json", id="json-wrong-password"),
    pytest.param({"password": "{password}"}, "json", id="json-no-email"),
]


@pytest.mark.parametrize(("fields", "encoding"), REFUSALS)
def test_token_refusals_are_answered_alike(
    rodan_real: RealRodan, standin: RodanStandin, fields: dict[str, str], encoding: str
) -> None:
    values = {
        "email": rodan_real.email,
        "password": rodan_real.password,
        "username": rodan_real.email.split("@")[0],
        "inactive": rodan_real.inactive_email,
    }
    form = {key: value.format(**values) for key, value in fields.items()}
    answers = {
        name: compared(ask(base, "POST", "/api/auth/token/", **{encoding: form}))
        for name, base in both(rodan_real, standin)
    }
    real = answers["real"]
    assert real["status"] == (
        403 if form == {"email": rodan_real.inactive_email, "password": rodan_real.password} else 401
    )
    assert real["json"]["is_logged_in"] is False
    assert real["json"]["detail"].startswith(("You must supply", "Invalid", "Account is not activated."))
    answers["real"].pop("Content-Length")  # the stand-in's JSON has spaces after its separators
    answers["standin"].pop("Content-Length")
    assert answers["standin"] == real


def test_token_by_email_is_answered_alike(rodan_real: RealRodan, standin: RodanStandin) -> None:
    form = {"email": rodan_real.email, "password": rodan_real.password}
    for encoding in ("data", "json"):
        answers = {
            name: ask(base, "POST", "/api/auth/token/", **{encoding: form}) for name, base in both(rodan_real, standin)
        }
        real, stand = answers["real"].json(), answers["standin"].json()
        assert answers["real"].status_code == answers["standin"].status_code == 200
        assert set(real) == set(stand), set(real) ^ set(stand)
        assert re.fullmatch(r"[0-9a-f]{40}", real["token"]) and re.fullmatch(r"[0-9a-f]{40}", stand["token"])
        for key in ("email", "username", "is_active", "is_staff", "is_superuser"):
            assert real[key] == stand[key], key
        # Rodan's token does not change from one log-in to the next.
        assert ask(rodan_real.url, "POST", "/api/auth/token/", data=form).json()["token"] == real["token"]


def test_token_url_without_its_slash_is_a_server_error(rodan_real: RealRodan, standin: RodanStandin) -> None:
    form = {"email": rodan_real.email, "password": rodan_real.password}
    statuses = {
        name: ask(base, "POST", "/api/auth/token", data=form).status_code for name, base in both(rodan_real, standin)
    }
    assert statuses == {"real": 500, "standin": 500}


@pytest.mark.parametrize(
    "authorization",
    ["Token 0000000000000000000000000000000000000000", "Token", "Token two words", None],
    ids=["unknown-token", "no-key", "spaces", "no-header"],
)
def test_refused_tokens_are_answered_alike(
    rodan_real: RealRodan, standin: RodanStandin, authorization: str | None
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    answers = {}
    for name, base in both(rodan_real, standin):
        response = ask(base, "GET", "/api/auth/me/", headers=headers)
        answers[name] = {**compared(response), "WWW-Authenticate": response.headers.get("WWW-Authenticate")}
        answers[name].pop("Content-Length")
    assert answers["real"]["status"] == 401 and "detail" in answers["real"]["json"]
    assert answers["standin"] == answers["real"]


def test_a_good_token_is_taken_alike(rodan_real: RealRodan, standin: RodanStandin) -> None:
    form = {"email": rodan_real.email, "password": rodan_real.password}
    for _, base in both(rodan_real, standin):
        token = ask(base, "POST", "/api/auth/token/", data=form).json()["token"]
        me = ask(base, "GET", "/api/auth/me/", headers={"Authorization": f"Token {token}"})
        assert me.status_code == 200 and me.json()["email"] == rodan_real.email


# --- the uploads ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "headers"),
    [
        ("GET", {}),
        ("GET", {"Range": "bytes=0-15"}),
        ("GET", {"Range": "bytes=10-"}),
        ("HEAD", {}),
        ("GET", {"Authorization": "Token 0000000000000000000000000000000000000000"}),
    ],
    ids=["whole", "range-head", "range-tail", "head", "bad-token"],
)
def test_uploads_are_served_alike(
    rodan_real: RealRodan,
    standin: RodanStandin,
    page: tuple[Resource, bytes],
    method: str,
    headers: dict[str, str],
) -> None:
    resource, data = page
    mirror(standin, resource, data)
    answers = {}
    for name, base in both(rodan_real, standin):
        response = ask(base, method, resource.path, headers=headers)
        answers[name] = {**compared(response), "body": response.content}
    real = answers["real"]
    # runserver: no range, no authentication, the whole file every time
    assert (real["status"], real["Content-Length"], real["Accept-Ranges"]) == (200, str(len(data)), None)
    assert real["body"] == (b"" if method == "HEAD" else data)
    assert answers["standin"] == real


def test_a_missing_upload_is_404_on_both(
    rodan_real: RealRodan, standin: RodanStandin, page: tuple[Resource, bytes]
) -> None:
    resource, _ = page
    missing = resource.path.rsplit("/", 2)[0] + f"/{uuid.uuid4().hex}/original_file"
    statuses = {name: ask(base, "GET", missing).status_code for name, base in both(rodan_real, standin)}
    assert statuses == {"real": 404, "standin": 404}


def connection_after_one_answer(base: str, path: str) -> str:
    """The Connection header of the answer to one HTTP/1.1 request (keep-alive by default), read
    until the server closes the connection: a server that keeps it open makes this time out."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as conn:
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept-Encoding: identity\r\n\r\n".encode())
        received = b""
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                break  # the server closed the connection
            received += chunk
    head = received.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    connection = next(
        (line.split(":", 1)[1].strip() for line in head.splitlines() if line.lower().startswith("connection:")), ""
    )
    return connection


def test_both_close_each_connection_without_saying_so(
    rodan_real: RealRodan, standin: RodanStandin, page: tuple[Resource, bytes]
) -> None:
    resource, data = page
    mirror(standin, resource, data)
    answers = {name: connection_after_one_answer(base, resource.path) for name, base in both(rodan_real, standin)}
    assert answers == {"real": "", "standin": ""}


# --- the bridge's client against the real Rodan ---------------------------------------------------


def test_client_gets_a_token_checks_and_downloads(
    rodan_real: RealRodan, page: tuple[Resource, bytes], tmp_path: Path
) -> None:
    resource, data = page
    client = RodanClient(rodan_real.url, email=rodan_real.email, password=rodan_real.password, retries=0)
    token = client.get_token()
    assert re.fullmatch(r"[0-9a-f]{40}", token)
    # No retries: every request must succeed on its first try, one right after the other, although
    # runserver closes each connection after its answer without saying so.
    for _ in range(REPEATS):
        assert client.get_token() == token
        info = client.check_input(resource.path, name="Image", max_bytes=1 << 20)
        assert (info.kind, info.bytes, info.url) == ("png", len(data), resource.resource_file)
        result = client.download(resource.path, tmp_path / "page.png", max_bytes=1 << 20)
        assert result.bytes == len(data) and (tmp_path / "page.png").read_bytes() == data
    absolute = client.download(resource.resource_file, tmp_path / "again.png", max_bytes=1 << 20)
    assert (tmp_path / "again.png").read_bytes() == data and absolute.bytes == len(data)


def test_client_survives_connections_closed_after_each_answer(tmp_path: Path) -> None:
    """The stand-in as runserver: the same rapid sequence as above, without retries (no Rodan needed)."""
    data = png_bytes()
    with RodanStandin.like_rodan_3_1(tmp_path / "uploads") as server:
        server.uploads_dir.mkdir(parents=True)
        (server.uploads_dir / "page.png").write_bytes(data)
        client = RodanClient(server.url, email="hpc@example.org", password="standin-password", retries=0)
        for _ in range(REPEATS):
            client.get_token()
            assert client.check_input("/uploads/page.png", name="Image", max_bytes=1 << 20).bytes == len(data)
            assert client.download("/uploads/page.png", tmp_path / "page.png", max_bytes=1 << 20).bytes == len(data)
        assert all(r.status == 200 for r in server.requests)
        assert len(server.requests) >= 3 * REPEATS


def test_client_refusals_from_the_real_rodan(
    rodan_real: RealRodan, project: str, page: tuple[Resource, bytes], tmp_path: Path
) -> None:
    resource, data = page
    client = RodanClient(rodan_real.url, email=rodan_real.email, password="not-the-password", retries=0)
    with pytest.raises(RodanAuthError, match=r"401: Invalid email or password\."):
        client.get_token()
    client = RodanClient(rodan_real.url, email=rodan_real.email, password=rodan_real.password, retries=0)
    client.get_token()
    with pytest.raises(PermanentError, match=rf"is {len(data)} bytes, larger than the limit of 10 bytes"):
        client.check_input(resource.path, name="Image", max_bytes=10)
    text = rodan_real.upload(project, "notes.txt", b"plain text, not an image\n", resource_type="text/plain")
    with pytest.raises(PermanentError, match=r"is not a PNG or JPEG file \(it starts with 706c61696e"):
        client.check_input(text.path, name="Image", max_bytes=1 << 20)
    missing = resource.path.rsplit("/", 2)[0] + f"/{uuid.uuid4().hex}/original_file"
    with pytest.raises(PermanentError, match=r"Rodan has no file at .* \(404\)"):
        client.check_input(missing, name="Image", max_bytes=1 << 20)
    with pytest.raises(PermanentError, match=r"larger than the limit of 20 bytes"):
        client.download(resource.path, tmp_path / "capped.png", max_bytes=20)
    assert not (tmp_path / "capped.png").exists()


class CountingProxy:
    """A TCP proxy on loopback that counts the bytes the server sent towards the client."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.from_server = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target, timeout=TIMEOUT_S)
            for source, sink, counted in ((client, server, False), (server, client, True)):
                thread = threading.Thread(target=self._pump, args=(source, sink, counted), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pump(self, source: socket.socket, sink: socket.socket, counted: bool) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
                if counted:
                    with self._lock:
                        self.from_server += len(chunk)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=TIMEOUT_S)


BIG = 4 << 30  # 4 GiB, sparse: nothing is written but its first bytes


def test_input_check_stops_after_the_head_of_a_big_file(rodan_real: RealRodan, standin: RodanStandin) -> None:
    relative = f"hpc-bridge-tests/{uuid.uuid4().hex}/original_file"
    files = [rodan_real.media_root / relative, standin.uploads_dir / relative]
    try:
        for path in files:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("wb") as handle:
                handle.write(png_bytes())
                handle.truncate(BIG)
        for name, base in both(rodan_real, standin):
            host, port = base.removeprefix("http://").rsplit(":", 1)
            proxy = CountingProxy((host, int(port)))
            try:
                client = RodanClient(f"http://127.0.0.1:{proxy.port}", retries=0)
                info = client.check_input(f"/uploads/{relative}", name="Image", max_bytes=8 << 30)
            finally:
                proxy.close()
            assert (info.kind, info.bytes) == ("png", BIG), name
            # What Rodan got out before the client hung up: socket buffers, not the file.
            assert proxy.from_server < 64 << 20, (name, proxy.from_server)
            with pytest.raises(PermanentError, match=rf"is {BIG} bytes, larger than the limit"):
                RodanClient(base, retries=0).check_input(f"/uploads/{relative}", name="Image", max_bytes=1 << 30)
    finally:
        for path in files:
            path.unlink(missing_ok=True)
            try:
                path.parent.rmdir()
            except OSError:
                pass


# --- deploy/dev/rodan.sh itself -------------------------------------------------------------------


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_rodan_sh_status_and_env_describe_what_runs(rodan_real: RealRodan) -> None:
    status = subprocess.run(["bash", str(RODAN_SH), "status"], capture_output=True, text=True, timeout=60, check=False)
    assert status.returncode == 0, status.stdout + status.stderr
    server = int(re.search(r"server: running \(pid (\d+)\) (\S+)", status.stdout).group(1))  # type: ignore[union-attr]
    worker = int(re.search(r"worker: running \(pid (\d+)", status.stdout).group(1))  # type: ignore[union-attr]
    assert (rodan_real.state_dir / "run" / "server.pid").read_text().strip() == str(server)
    assert "runserver" in cmdline(server) and any(
        arg.endswith(rodan_real.url.rsplit(":", 1)[1]) for arg in cmdline(server)
    )
    worker_args = cmdline(worker)
    assert "--max-tasks-per-child=1" in worker_args and "celery,Python3" in worker_args
    env = parse_env(
        subprocess.run(["bash", str(RODAN_SH), "env"], capture_output=True, text=True, timeout=60, check=True).stdout
    )
    assert (env["RODAN_URL"], env["RODAN_EMAIL"], Path(env["HPC_DEV_RODAN_DIR"])) == (
        rodan_real.url,
        rodan_real.email,
        rodan_real.state_dir,
    )


def psql(query: str) -> str:
    return subprocess.run(
        ["psql", "-X", "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-tAc", query],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()


def bare_repo_of_archive(archive: Path, inner: str, tag: str, workdir: Path) -> Path:
    """A bare git repository whose one commit, tagged ``tag``, holds ``archive``'s ``inner`` folder
    at its root's ``inner`` path (as GitHub's DDMAL/Rodan holds ``rodan-main/code``)."""
    tree = workdir / "tree"
    tree.mkdir()
    subprocess.run(["tar", "-xzf", str(archive), "-C", str(tree)], check=True, timeout=120)
    assert (tree / inner).is_dir()
    git = ["git", "-c", "user.email=tests@hpc-bridge", "-c", "user.name=tests", "-C", str(tree)]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "archive"], ["tag", tag]):
        subprocess.run([*git, *args], check=True, timeout=120, capture_output=True)
    bare = workdir / "rodan.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(tree), str(bare)], check=True, timeout=120)
    return bare


@pytest.mark.rodan
@pytest.mark.broker
@pytest.mark.slow
def test_rodan_sh_from_git_up_then_down_leaves_nothing(tmp_path: Path) -> None:
    """The path a machine without ../shared takes (git clone at the tag), then ``down``: the
    processes, database, role, vhost and state directory are gone."""
    archive = REPO / ".." / "shared" / "rodan" / "rodan-v3.1.0-core.tar.gz"
    if not archive.exists():
        pytest.fail(f"{archive} is missing: the dev machine's shared folder holds it", pytrace=False)
    bare = bare_repo_of_archive(archive, "rodan-main/code", "v3.1.0", tmp_path)
    state = tmp_path / "state"
    env = {
        **os.environ,
        "HPC_DEV_RODAN_DIR": str(state),
        "HPC_DEV_RODAN_SOURCE": "git",
        "HPC_DEV_RODAN_GIT_URL": str(bare),
        "HPC_DEV_RODAN_PORT": "0",
    }
    pids: list[int] = []
    database = ""
    up = subprocess.run(
        ["bash", str(RODAN_SH), "up", "--no-job-packages"], env=env, capture_output=True, text=True, timeout=900
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"git clone {bare} (v3.1.0)" in up.stdout + up.stderr
        values = parse_env(
            subprocess.run(["bash", str(RODAN_SH), "env"], env=env, capture_output=True, text=True, check=True).stdout
        )
        client = RodanClient(
            values["RODAN_URL"], email=values["RODAN_EMAIL"], password=values["RODAN_PASSWORD"], retries=0
        )
        assert re.fullmatch(r"[0-9a-f]{40}", client.get_token())
        pids = [int((state / "run" / f"{name}.pid").read_text()) for name in ("server", "worker")]
        database = re.search(
            r"database: (\S+),",
            subprocess.run(["bash", str(RODAN_SH), "status"], env=env, capture_output=True, text=True).stdout,
        ).group(1)  # type: ignore[union-attr]
        assert psql(f"select count(*) from pg_database where datname = '{database}'") == "1"
    finally:
        down = subprocess.run(["bash", str(RODAN_SH), "down"], env=env, capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(Path(f"/proc/{pid}").exists() and "rodan" in " ".join(cmdline(pid)) for pid in pids)
    assert psql(f"select count(*) from pg_database where datname = '{database}'") == "0"
    assert psql(f"select count(*) from pg_roles where rolname = '{database}'") == "0"
    vhosts = subprocess.run(
        ["rabbitmqctl", "-q", "list_vhosts", "name"], capture_output=True, text=True, timeout=120
    ).stdout
    assert database.replace("_", "-") not in vhosts.split()
    assert not state.exists()
