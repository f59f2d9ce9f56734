"""Talking to Rodan's REST API: the token, checks of inputs, and bounded streaming downloads.

Retries (with exponential backoff) only what can get better by itself: connection errors,
timeouts, 5xx, 408 and 429 (waiting at least the ``Retry-After`` seconds Rodan asks for, at most
60). Any other 4xx is never retried.

Only Rodan's own files are fetched: a resource is a path on the configured Rodan, or an absolute
URL of the same origin (scheme, host and port), and redirects are followed only within it. Anything
else is refused without a request, so the token (sent to Rodan only) and the compute nodes reach no
other server. Downloads are capped on the raw bytes on the wire (``Accept-Encoding: identity``; a
response that is still compressed is refused), so neither a chunked body without end nor a
compressed one can fill the disk.
"""

from __future__ import annotations

import http.client
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar
from urllib.parse import urljoin, urlsplit
from uuid import UUID

import requests
import structlog
import urllib3
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt
from urllib3.util import parse_url

from bridge.atomic import atomic_file
from bridge.errors import BridgeError, PermanentError, RodanAuthError, TransientError
from bridge.handoff import DEFAULT_RODAN_RETRIES, DEFAULT_RODAN_TIMEOUT_S
from bridge.logs import register_secret

log = structlog.get_logger(__name__)
T = TypeVar("T")
CHUNK = 1 << 20  # 1 MiB (the historic side used 128 bytes)
#: The longest wait a ``Retry-After`` from Rodan can impose between two tries.
MAX_RETRY_AFTER_S = 60.0
MAX_BACKOFF_S = 30.0
MAX_REDIRECTS = 5
#: How much of an input :meth:`RodanClient.check_input` reads: enough for any signature below.
SNIFF_BYTES = 16
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
JPEG_SIGNATURE = b"\xff\xd8\xff"
ZIP_SIGNATURE = b"PK\x03\x04"  # a zip's first local file header (an empty zip starts PK\x05\x06: refused)
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"  # a Keras HDF5 model (no user block)
#: Besides 5xx, the answers that say "later" rather than "no".
RETRY_LATER_STATUSES = frozenset({408, 429})

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")

InputKind = Literal["png", "jpeg", "zip", "hdf5"]
#: What the older generations' inputs must be; generation 3 asks for "zip" or "hdf5".
IMAGE_KINDS: tuple[InputKind, ...] = ("png", "jpeg")
_KIND_NAMES: dict[tuple[InputKind, ...], str] = {
    IMAGE_KINDS: "a PNG or JPEG file",
    ("zip",): "a zip file (a sample as Pixel.js writes it)",
    ("hdf5",): "an HDF5 file (a Keras model)",
}


@dataclass(frozen=True)
class DownloadResult:
    path: Path
    bytes: int
    seconds: float


@dataclass(frozen=True)
class InputInfo:
    """What :meth:`RodanClient.check_input` found: the file's URL on Rodan, its size in bytes
    (None when Rodan did not say) and its type."""

    url: str
    bytes: int | None
    kind: InputKind


class RodanBusy(TransientError):
    """Rodan answered "later" (5xx, 408, 429); ``retry_after_s`` is its ``Retry-After``, if any."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RodanClient:
    def __init__(
        self,
        base_url: str,
        *,
        user: str = "",
        email: str = "",
        password: str = "",
        token: str = "",
        timeout_s: float = DEFAULT_RODAN_TIMEOUT_S,
        retries: int = DEFAULT_RODAN_RETRIES,
        backoff_s: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        parts = urlsplit(base_url)
        self.base_url = f"{parts.scheme}://{parts.netloc}"
        self._origin = _origin(self.base_url)
        self.user, self.email, self.password = user, email, password
        self.token = token
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._sleep = sleep  # between tries (tests record the waits instead of sleeping)
        self.session = requests.Session()
        self.session.headers["User-Agent"] = "hpc-bridge/0.1"
        # Rodan's API answers ``Accept: */*`` with its browsable API's HTML, refusals included: ask
        # for the JSON its ``detail`` is read from.
        self.session.headers["Accept"] = "application/json"
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

    # --- runs ------------------------------------------------------------------
    def runjob_status(self, runjob: str) -> int | None:
        """``GET /api/runjob/<uuid>/``: the RunJob's ``status`` (Rodan's task_status codes), or None when
        Rodan answers 404. Rodan answers 404 also to an account that may not view the RunJob (Django
        REST framework's object permissions): the caller tells the two apart. Tried once (the caller
        asks again on its next pass); an expired token is renewed once. TransientError when Rodan is
        unreachable or busy; BridgeError for a refusal or an answer without a status (no reply ever
        carries them: the caller logs them and asks again later)."""
        uuid = str(UUID(runjob))  # only a uuid reaches the URL
        if not self.token:
            self.get_token()
        response = self._send("GET", f"/api/runjob/{uuid}/", auth=True)
        if response.status_code == 401:
            self.get_token()
            response = self._send("GET", f"/api/runjob/{uuid}/", auth=True)
        if response.status_code == 404:
            return None
        if response.status_code in (401, 403):
            raise BridgeError(f"Rodan refused to show RunJob {uuid} ({response.status_code}: {_detail(response)})")
        if response.status_code != 200:
            raise BridgeError(f"Rodan answered {response.status_code} for RunJob {uuid}: {_detail(response)}")
        try:
            return int(response.json()["status"])
        except (ValueError, KeyError, TypeError):
            raise BridgeError(f"Rodan's answer for RunJob {uuid} has no status") from None

    # --- resources -----------------------------------------------------------
    def sends_token_to(self, url: str) -> bool:
        return _same_origin(url, self._origin)

    def check_input(
        self, resource: str, *, name: str, max_bytes: int, kinds: tuple[InputKind, ...] = IMAGE_KINDS
    ) -> InputInfo:
        """Check, before any job waits for it, that input ``name`` can be downloaded and trained on.

        One ranged GET (``Range: bytes=0-15``, with the token) answers all three questions: the file
        exists, its size (``Content-Range``, or ``Content-Length`` when Rodan ignores the range;
        a HEAD when neither says) is at most ``max_bytes``, and it starts with the signature of one
        of ``kinds`` (a PNG or a JPEG unless told otherwise). PermanentError when it does not
        (404/410, too large, another type, not on Rodan, 401/403 as RodanAuthError); TransientError,
        after the client's retries, when Rodan is unreachable or answers 5xx, 408 or 429.
        """
        url = self._rodan_url(resource)
        if url is None:
            raise PermanentError(
                f"input {name!r} is {_clip(resource)!r}, which is not a file on Rodan ({self.base_url}); "
                "only Rodan's own files are fetched (RODAN_SCHEME://RODAN_HOST)"
            )

        def attempt() -> InputInfo:
            return self._check_once(url, name, max_bytes, kinds)

        return self._retrying(attempt, "input_check")

    def download(self, resource: str, dest: Path, *, max_bytes: int) -> DownloadResult:
        """Stream a resource to ``dest`` (atomically), verifying its length; at most ``max_bytes``.

        The cap is on the bytes on the wire: a ``Content-Length`` over it is refused before the body
        is read, and a body without one is cut off as soon as it passes the cap (the partial file is
        removed). No digest: nothing could check one (Rodan sends none), and hashing every chunk was
        the slowest part of a download (benchmarks/README.md, "Downloads").
        """
        url = self._rodan_url(resource)
        if url is None:
            raise PermanentError(
                f"download of {_clip(resource)!r} refused: it is not a file on Rodan ({self.base_url}); "
                "only Rodan's own files are fetched (RODAN_SCHEME://RODAN_HOST)"
            )

        def attempt() -> DownloadResult:
            return self._download_once(url, dest, max_bytes)

        return self._retrying(attempt, "download")

    def _download_once(self, url: str, dest: Path, max_bytes: int) -> DownloadResult:
        started = time.monotonic()
        what = f"download of {_short(url)}"
        received = 0
        expected: int | None = None
        try:
            with self._get(url, what) as response:
                _raise_for_status(response, what)
                _refuse_encoded(response, what)
                expected = _content_length(response)
                if expected is not None and expected > max_bytes:
                    raise PermanentError(
                        f"{what} refused: Rodan says it is {expected} bytes, "
                        f"larger than the limit of {max_bytes} bytes (HPC_MAX_INPUT_BYTES)"
                    )
                # An exception inside the block removes the partial file; dest appears only whole.
                with atomic_file(dest, mode=None) as handle:
                    for chunk in response.raw.stream(CHUNK, decode_content=False):
                        received += len(chunk)
                        if received > max_bytes:
                            raise PermanentError(
                                f"{what} stopped: it is larger than the limit of {max_bytes} bytes "
                                "(HPC_MAX_INPUT_BYTES)"
                            )
                        handle.write(chunk)
                    if expected is not None and received != expected:
                        raise TransientError(f"{what} truncated: {received} of {expected} bytes")
        except requests.RequestException as exc:
            raise TransientError(f"{what} failed: {type(exc).__name__}") from exc
        except urllib3.exceptions.HTTPError as exc:
            if "IncompleteRead" in type(exc).__name__ or "ProtocolError" in type(exc).__name__:
                got = _arrived(received, exc)
                of = f" of {expected}" if expected is not None else ""
                raise TransientError(f"{what} truncated: {got}{of} bytes") from exc
            raise TransientError(f"{what} failed: {type(exc).__name__}") from exc
        return DownloadResult(dest, received, time.monotonic() - started)

    def _check_once(self, url: str, name: str, max_bytes: int, kinds: tuple[InputKind, ...]) -> InputInfo:
        what = f"checking input {name!r} ({_short(url)})"
        headers = {"Range": f"bytes=0-{SNIFF_BYTES - 1}"}
        try:
            with self._get(url, what, headers) as response:
                status = response.status_code
                if status in (404, 410):
                    raise PermanentError(f"input {name!r}: Rodan has no file at {_path(url)} ({status})")
                if status == 416:  # not even byte 0: the file is empty
                    raise PermanentError(wrong_kind(name, b"", kinds))
                _raise_for_status(response, what, ok=(200, 206))
                _refuse_encoded(response, what)
                if status == 206:
                    size = _range_total(response.headers.get("Content-Range", ""), what)
                else:  # the range was ignored: the whole file follows, of which 16 bytes are read
                    size = _content_length(response)
                head = response.raw.read(SNIFF_BYTES, decode_content=False) or b""
        except requests.RequestException as exc:
            raise TransientError(f"{what} failed: {type(exc).__name__}") from exc
        except urllib3.exceptions.HTTPError as exc:
            raise TransientError(f"{what} failed: {type(exc).__name__}") from exc
        if size is None:
            size = self._head_size(url, what)
        if size is not None and size > max_bytes:
            raise PermanentError(
                f"input {name!r} is {size} bytes, larger than the limit of {max_bytes} bytes (HPC_MAX_INPUT_BYTES)"
            )
        kind = sniff(head)
        if kind is None or kind not in kinds:
            raise PermanentError(wrong_kind(name, head, kinds))
        return InputInfo(url, size, kind)

    def _head_size(self, url: str, what: str) -> int | None:
        """The size a HEAD's Content-Length gives, or None (best effort: only "later" and a refused
        token raise)."""
        try:
            with self._get(url, what, method="HEAD") as response:
                if response.status_code != 200:
                    if response.status_code >= 500 or response.status_code in (401, 403, *RETRY_LATER_STATUSES):
                        _raise_for_status(response, what)
                    return None
                _refuse_encoded(response, what)
                return _content_length(response)
        except requests.RequestException as exc:
            raise TransientError(f"{what} failed: {type(exc).__name__}") from exc

    # --- plumbing ------------------------------------------------------------
    def _rodan_url(self, resource: str) -> str | None:
        """The absolute URL of ``resource`` if it is on Rodan's origin, else None.

        A path (``/uploads/...``) is on Rodan; an absolute URL is when urlsplit and urllib3 (which
        connects) both read Rodan's origin from it. Rodan's resources are plain ASCII without user
        info, backslashes or white space; anything else is refused rather than interpreted.
        """
        if not resource.isascii() or "\\" in resource or any(c.isspace() or not c.isprintable() for c in resource):
            return None
        if resource.startswith("/"):
            if resource.startswith("//"):  # a network-path reference: another host
                return None
            url = f"{self.base_url}{resource}"
        else:
            url = resource
        try:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or "@" in parts.netloc:
                return None
        except ValueError:
            return None
        return url if _same_origin(url, self._origin) else None

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Token {self.token}"} if self.token else {}

    def _get(
        self, url: str, what: str, headers: dict[str, str] | None = None, *, method: str = "GET"
    ) -> requests.Response:
        """A streamed GET (or HEAD) of a URL on Rodan, with the token and no compression.

        Redirects are followed only within Rodan's origin (at most MAX_REDIRECTS); a redirect
        elsewhere is refused without a request there.
        """
        sent = {**self._auth(), "Accept-Encoding": "identity", **(headers or {})}
        for _ in range(MAX_REDIRECTS + 1):
            response = self._request(
                method, url, headers=sent, stream=True, timeout=self.timeout_s, allow_redirects=False
            )
            if not response.is_redirect:
                return response
            location = response.headers.get("Location", "")
            response.close()
            target = urljoin(url, location)
            if self._rodan_url(target) is None:
                raise PermanentError(
                    f"{what} refused: Rodan redirected it to {_clip(_short(target))!r}, which is not a file on "
                    f"Rodan ({self.base_url})"
                )
            url = target
        raise PermanentError(f"{what} refused: more than {MAX_REDIRECTS} redirects")

    def _request(self, method: str, url: str, **kwargs: object) -> requests.Response:
        """``session.request``, sent once more at once when the kept-alive connection it went out on
        turns out closed before any answer (``RemoteDisconnected``): Rodan 3.1.0 under runserver
        closes every connection after its answer without a ``Connection: close``, so the next
        request can meet that close. Nothing was answered, so nothing was done; curl and browsers
        send such a request again too. Any other failure is left to the caller's retries."""
        try:
            return self.session.request(method, url, **kwargs)  # type: ignore[arg-type]
        except requests.ConnectionError as exc:
            if not _closed_before_answer(exc):
                raise
        return self.session.request(method, url, **kwargs)  # type: ignore[arg-type]

    def _send(self, method: str, path: str, *, auth: bool = False, **kwargs: object) -> requests.Response:
        headers = self._auth() if auth else {}
        try:
            response = self._request(
                method,
                f"{self.base_url}{path}",
                headers=headers,
                timeout=self.timeout_s,
                **kwargs,
            )
        except requests.RequestException as exc:
            raise TransientError(f"Rodan at {self.base_url} unreachable: {type(exc).__name__}") from exc
        if response.status_code >= 500 or response.status_code in RETRY_LATER_STATUSES:
            raise RodanBusy(f"Rodan answered {response.status_code} on {path}", _retry_after(response))
        return response

    def _wait(self, state: RetryCallState) -> float:
        """Exponential backoff, but at least what Rodan's Retry-After asked for (capped)."""
        backoff = min(self.backoff_s * 2.0 ** (state.attempt_number - 1), MAX_BACKOFF_S)
        exc = state.outcome.exception() if state.outcome else None
        asked = exc.retry_after_s if isinstance(exc, RodanBusy) else None
        return backoff if asked is None else max(backoff, asked)

    def _retrying(self, fn: Callable[[], T], what: Literal["rodan_token", "download", "input_check"]) -> T:
        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            fields = {"attempt": state.attempt_number, "error": str(exc), "wait_s": round(state.upcoming_sleep, 2)}
            if what == "download":
                log.warning("download_retry", **fields)
            elif what == "input_check":
                log.warning("input_check_retry", **fields)
            else:
                log.warning("rodan_token_retry", **fields)

        retrying = Retrying(
            retry=retry_if_exception_type(TransientError),
            stop=stop_after_attempt(self.retries + 1),
            wait=self._wait,
            sleep=self._sleep,
            before_sleep=before_sleep,
            reraise=True,
        )
        return retrying(fn)


def sniff(head: bytes) -> InputKind | None:
    """``"png"``, ``"jpeg"``, ``"zip"`` or ``"hdf5"`` from a file's first bytes, else None."""
    if head.startswith(PNG_SIGNATURE):
        return "png"
    if head.startswith(JPEG_SIGNATURE):
        return "jpeg"
    if head.startswith(ZIP_SIGNATURE):
        return "zip"
    if head.startswith(HDF5_SIGNATURE):
        return "hdf5"
    return None


def wrong_kind(name: str, head: bytes, kinds: tuple[InputKind, ...]) -> str:
    """The reason an input whose first bytes are ``head`` is not one of ``kinds``."""
    wanted = _KIND_NAMES.get(kinds) or " or ".join(kinds)
    if not head:
        start = "it is empty"
    elif head.startswith(b"PK\x05\x06"):
        start = "it is an empty zip archive"
    else:
        start = f"it starts with {head.hex()}"
    return f"input {name!r} is not {wanted} ({start})"


def _closed_before_answer(exc: BaseException) -> bool:
    """Whether a requests ConnectionError is a connection closed before any answer (urllib3's
    ``ProtocolError('Connection aborted.', RemoteDisconnected(...))``)."""
    seen: list[object] = [exc]
    while seen:
        item = seen.pop()
        if isinstance(item, http.client.RemoteDisconnected):
            return True
        if isinstance(item, BaseException):
            seen.extend(item.args)
    return False


def _arrived(received: int, exc: BaseException) -> int:
    """The bytes of a body that arrived before an IncompleteRead (possibly wrapped in urllib3's
    ProtocolError): ``received`` from the chunks already yielded, plus what http.client's had read of
    the chunk being read (its ``partial`` is those bytes); urllib3's own counts them all (an int)."""
    for candidate in (exc, *exc.args):
        if "IncompleteRead" in type(candidate).__name__:
            partial = getattr(candidate, "partial", 0)
            if isinstance(partial, bytes):
                return received + len(partial)
            return max(received, int(partial or 0))
    return received


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return (parts.scheme, (parts.hostname or "").lower(), port)


def _same_origin(url: str, origin: tuple[str, str, int]) -> bool:
    """Whether urlsplit and urllib3 (which connects) both read ``origin`` from ``url``."""
    try:
        ours = _origin(url)
        theirs = parse_url(url)
    except ValueError:  # a port out of range, '[::1', ... (urllib3's LocationParseError is one too)
        return False
    scheme = (theirs.scheme or "").lower()
    port = theirs.port or (443 if scheme == "https" else 80)
    return ours == origin and (scheme, (theirs.host or "").lower().strip("[]"), port) == origin


def _retry_after(response: requests.Response) -> float | None:
    """``Retry-After`` in seconds (the HTTP-date form is ignored), capped at MAX_RETRY_AFTER_S."""
    value = response.headers.get("Retry-After", "").strip()
    return min(float(value), MAX_RETRY_AFTER_S) if value.isascii() and value.isdigit() else None


def _raise_for_status(response: requests.Response, what: str, ok: tuple[int, ...] = (200,)) -> None:
    status = response.status_code
    if status in ok:
        return
    if status >= 500 or status in RETRY_LATER_STATUSES:
        raise RodanBusy(f"{what}: server answered {status}", _retry_after(response))
    if status in (401, 403):  # the body is not echoed: say what the status means and what to do
        raise RodanAuthError(
            f"{what} refused ({status}): Rodan did not accept the HPC account's token; "
            "check the account's rights in Rodan (hpc-bridge doctor)"
        )
    raise PermanentError(f"{what} failed: HTTP {status}")


def _refuse_encoded(response: requests.Response, what: str) -> None:
    """The cap counts bytes on the wire: a compressed body could inflate far beyond it."""
    encoding = response.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise PermanentError(
            f"{what} refused: Rodan sent it compressed (Content-Encoding: {_clip(encoding, 40)}), "
            "although only uncompressed files were asked for"
        )


def _content_length(response: requests.Response) -> int | None:
    value = response.headers.get("Content-Length", "").strip()
    return int(value) if value.isascii() and value.isdigit() else None


def _range_total(content_range: str, what: str) -> int | None:
    """The file's size from a 206's ``Content-Range: bytes 0-15/SIZE`` (None for ``/*``)."""
    match = _CONTENT_RANGE.fullmatch(content_range.strip())
    if match is None or match.group(1) != "0":
        raise PermanentError(
            f"{what} failed: Rodan answered a range it was not asked for ({_clip(content_range, 60)!r})"
        )
    return None if match.group(3) == "*" else int(match.group(3))


def _detail(response: requests.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:200]
    if isinstance(data, dict) and "detail" in data:
        return str(data["detail"])[:200]
    return str(data)[:200]


def _short(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.netloc}{parts.path}"


def _path(url: str) -> str:
    return _clip(urlsplit(url).path)


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
