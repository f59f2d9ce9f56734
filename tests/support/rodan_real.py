"""A real Rodan 3.1.0 for the tests: ``deploy/dev/rodan.sh`` brings it up once per test session
(or finds it already up: ``up`` is idempotent and takes about a second then), and the
``rodan_real`` fixture gives its URL and account.

Registered as a pytest plugin by tests/conftest.py; a test that uses ``rodan_real`` gets the
``rodan`` marker from there. Helpers for what tests do with it: make a project, upload a file as a
resource (``POST /api/resources/``) and find its download URL and its ``/uploads/...`` path.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from bridge.testing.rodan_api import Api, Upload

REPO = Path(__file__).resolve().parents[2]
RODAN_SH = REPO / "deploy" / "dev" / "rodan.sh"
#: A cold ``up`` (venv built, migrate) takes about a minute and a half; a warm one seconds.
UP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Resource:
    """A file uploaded to Rodan: its API URL, its absolute download URL (``resource_file``) and the
    relative form a Rodan job's ``resource_url`` has (``/uploads/projects/.../original_file``)."""

    url: str
    resource_file: str

    @property
    def path(self) -> str:
        return urlsplit(self.resource_file).path


@dataclass(frozen=True)
class RealRodan:
    """A running Rodan 3.1.0 and the account the tests use on it."""

    url: str
    email: str
    password: str = field(repr=False)
    state_dir: Path
    #: An account Rodan refuses with 403 "Account is not activated." (the same password).
    inactive_email: str = ""

    @property
    def media_root(self) -> Path:
        """Rodan's MEDIA_ROOT: what is under it is served at ``/uploads/``."""
        return self.state_dir / "media"

    def session(self, *, token: str | None = None) -> requests.Session:
        """A session that asks for JSON (Rodan's API answers HTML to ``Accept: */*``) and closes each
        connection (runserver closes it after every answer, without saying so)."""
        session = requests.Session()
        session.headers["Accept"] = "application/json"
        session.headers["Connection"] = "close"
        if token:
            session.headers["Authorization"] = f"Token {token}"
        return session

    def token(self) -> str:
        with self.session() as session:
            response = session.post(
                f"{self.url}/api/auth/token/",
                data={"email": self.email, "password": self.password},
                timeout=REQUEST_TIMEOUT_S,
            )
        response.raise_for_status()
        return str(response.json()["token"])

    def api(self, *, token: str | None = None) -> Api:
        """Rodan's REST API as the test account (``bridge.testing.rodan_api``, as the demo drives it)."""
        return Api(self.url, token or self.token())

    def create_project(self, name: str | None = None, *, token: str | None = None) -> str:
        """A new project; its API URL (``http://.../api/project/UUID/``)."""
        return self.api(token=token).create_project(name or f"test-{uuid.uuid4().hex[:8]}")

    def upload(
        self,
        project: str,
        name: str,
        data: bytes,
        *,
        resource_type: str = "image/rgb+png",
        token: str | None = None,
    ) -> Resource:
        """Upload ``data`` as a resource of ``project`` (``POST /api/resources/``, multipart); its
        file is served at once (the tests do not wait for Rodan to set its type)."""
        first = self.api(token=token).post_resource(project, Upload(name, data, resource_type))
        return Resource(url=str(first["url"]), resource_file=str(first["resource_file"]))


def parse_env(text: str) -> dict[str, str]:
    """``KEY=value`` lines (what ``rodan.sh env`` prints) as a dict."""
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def rodan_up(*, timeout_s: float = UP_TIMEOUT_S) -> RealRodan:
    """``rodan.sh up`` (idempotent, serialised by the script's lock), then its ``env``."""
    up = subprocess.run(["bash", str(RODAN_SH), "up"], capture_output=True, text=True, timeout=timeout_s, check=False)
    if up.returncode != 0:
        raise RuntimeError(
            f"deploy/dev/rodan.sh up failed (rc {up.returncode}):\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}"
        )
    env = subprocess.run(["bash", str(RODAN_SH), "env"], capture_output=True, text=True, timeout=60, check=False)
    if env.returncode != 0:
        raise RuntimeError(f"deploy/dev/rodan.sh env failed (rc {env.returncode}): {env.stderr[-2000:]}")
    values = parse_env(env.stdout)
    return RealRodan(
        url=values["RODAN_URL"],
        email=values["RODAN_EMAIL"],
        password=values["RODAN_PASSWORD"],
        state_dir=Path(values["HPC_DEV_RODAN_DIR"]),
        inactive_email=values.get("RODAN_INACTIVE_EMAIL", ""),
    )


@pytest.fixture(scope="session")
def rodan_real() -> RealRodan:
    """The real Rodan 3.1.0 of this machine, up for the whole session (it stays up afterwards:
    ``bash deploy/dev/rodan.sh down`` removes it). Its job packages are ``rodan.sh``'s default
    (``HPC_DEV_RODAN_JOB_PACKAGES`` chooses others)."""
    if os.geteuid() != 0:
        pytest.fail("the real Rodan (deploy/dev/rodan.sh) needs root on the dev machine", pytrace=False)
    return rodan_up()
