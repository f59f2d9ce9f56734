"""Talking to Rodan's REST API: the token, and streaming downloads of resources.

Retries (with exponential backoff) only what can get better by itself:
connection errors, timeouts, 5xx. A 4xx is never retried. The token is sent
only to the configured Rodan host (scheme, host and port must match).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import requests
import structlog
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from bridge.errors import PermanentError, RodanAuthError, TransientError
from bridge.logs import register_secret

log = structlog.get_logger(__name__)
T = TypeVar("T")
CHUNK = 1 << 20  # 1 MiB (the historic side used 128 bytes)


@dataclass(frozen=True)
class DownloadResult:
    path: Path
    bytes: int
    seconds: float


class RodanClient:
    def __init__(
        self,
        base_url: str,
        *,
        user: str = "",
        email: str = "",
        password: str = "",
        token: str = "",
        timeout_s: float = 30.0,
        retries: int = 4,
        backoff_s: float = 1.0,
    ) -> None:
        parts = urlsplit(base_url)
        self.base_url = f"{parts.scheme}://{parts.netloc}"
        self._origin = _origin(self.base_url)
        self.user, self.email, self.password = user, email, password
        self.token = token
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.session = requests.Session()
        self.session.headers["User-Agent"] = "hpc-bridge/0.1"
        register_secret(password)
        register_secret(token)

    # --- authentication ------------------------------------------------------
    def get_token(self) -> str:
        """POST /api/auth/token/ with what both token endpoint generations accept."""
        form = {"username": self.user or self.email, "email": self.email or self.user, "password": self.password}

        def attempt() -> str:
            response = self._send("POST", "/api/auth/token/", data=form)
            if response.status_code in (401, 403):
                raise RodanAuthError(
                    f"Rodan refused the HPC account {self.user or self.email!r} "
                    f"({response.status_code}: {_detail(response)}); fix RODAN_USER/RODAN_PASSWORD"
                )
            if response.status_code != 200:
                raise PermanentError(f"Rodan token endpoint answered {response.status_code}: {_detail(response)}")
            try:
                token = str(response.json()["token"])
            except (ValueError, KeyError, TypeError):
                raise PermanentError("Rodan token endpoint answered 200 without a token") from None
            register_secret(token)
            return token

        self.token = self._retrying(attempt, "rodan_token")
        return self.token

    # --- resources -----------------------------------------------------------
    def resource_url(self, resource: str) -> str:
        return resource if resource.startswith(("http://", "https://")) else f"{self.base_url}{resource}"

    def sends_token_to(self, url: str) -> bool:
        return _origin(url) == self._origin

    def download(self, resource: str, dest: Path) -> DownloadResult:
        """Stream a resource to ``dest`` (atomically), verifying its length.

        No digest: nothing could check one (Rodan sends none), and sha256 at ~800 MB/s on the
        project machine held a download to 0.7x curl (benchmarks/README.md, downloads).
        """
        url = self.resource_url(resource)
        with_token = self.sends_token_to(url)
        if not with_token:
            log.warning("download_foreign_host", host=urlsplit(url).netloc, note="sent without the Rodan token")

        def attempt() -> DownloadResult:
            return self._download_once(url, dest, with_token)

        return self._retrying(attempt, "download")

    def _download_once(self, url: str, dest: Path, with_token: bool) -> DownloadResult:
        started = time.monotonic()
        headers = {"Authorization": f"Token {self.token}"} if with_token and self.token else {}
        tmp = dest.with_name(f".{dest.name}.part")
        received = 0
        expected: str | None = None
        try:
            with self.session.get(url, headers=headers, stream=True, timeout=self.timeout_s) as response:
                _raise_for_status(response, url)
                expected = response.headers.get("Content-Length")
                with tmp.open("wb") as handle:
                    for chunk in response.raw.stream(CHUNK, decode_content=True):
                        handle.write(chunk)
                        received += len(chunk)
                    handle.flush()
                    os.fsync(handle.fileno())
            if expected is not None and received != int(expected):
                raise TransientError(f"download of {_short(url)} truncated: {received} of {expected} bytes")
            os.replace(tmp, dest)
        except requests.RequestException as exc:
            raise TransientError(f"download of {_short(url)} failed: {type(exc).__name__}") from exc
        except Exception as exc:
            if "IncompleteRead" in type(exc).__name__ or "ProtocolError" in type(exc).__name__:
                got = received + _partial_bytes(exc)  # what arrived of the chunk being read counts too
                of = f" of {expected}" if expected is not None else ""
                raise TransientError(f"download of {_short(url)} truncated: {got}{of} bytes") from exc
            raise
        finally:
            tmp.unlink(missing_ok=True)
        return DownloadResult(dest, received, time.monotonic() - started)

    # --- plumbing ------------------------------------------------------------
    def _send(self, method: str, path: str, *, auth: bool = False, **kwargs: object) -> requests.Response:
        headers = {"Authorization": f"Token {self.token}"} if auth and self.token else {}
        try:
            response = self.session.request(
                method,
                f"{self.base_url}{path}",
                headers=headers,
                timeout=self.timeout_s,
                **kwargs,  # type: ignore[arg-type]
            )
        except requests.RequestException as exc:
            raise TransientError(f"Rodan at {self.base_url} unreachable: {type(exc).__name__}") from exc
        if response.status_code >= 500:
            raise TransientError(f"Rodan answered {response.status_code} on {path}")
        return response

    def _retrying(self, fn: Callable[[], T], what: str) -> T:
        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(f"{what}_retry", attempt=state.attempt_number, error=str(exc))

        retrying = Retrying(
            retry=retry_if_exception_type(TransientError),
            stop=stop_after_attempt(self.retries + 1),
            wait=wait_exponential(multiplier=self.backoff_s, max=30),
            before_sleep=before_sleep,
            reraise=True,
        )
        return retrying(fn)


def _partial_bytes(exc: BaseException) -> int:
    """Bytes an IncompleteRead (urllib3's, possibly wrapped in its ProtocolError) had read."""
    for candidate in (exc, *exc.args):
        if "IncompleteRead" in type(candidate).__name__:
            partial = getattr(candidate, "partial", 0)
            return len(partial) if isinstance(partial, bytes) else int(partial or 0)
    return 0


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return (parts.scheme, (parts.hostname or "").lower(), port)


def _raise_for_status(response: requests.Response, url: str) -> None:
    if response.status_code >= 500:
        raise TransientError(f"download of {_short(url)}: server answered {response.status_code}")
    if response.status_code in (401, 403):
        raise RodanAuthError(f"download of {_short(url)} refused ({response.status_code}): {_detail(response)}")
    if response.status_code != 200:
        raise PermanentError(f"download of {_short(url)} failed: HTTP {response.status_code}")


def _detail(response: requests.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:200]
    if isinstance(data, dict) and "detail" in data:
        return str(data["detail"])
    return str(data)[:200]


def _short(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.netloc}{parts.path}"
