"""The broker side of the HPC Paco trainer job: everything that needs no Django and no Rodan.

It runs inside Rodan's Celery worker (Python 3.7, pika 1.1.0) and is imported by
``hpc_fast_trainer.py``. One call of :func:`step` is one poll of a run: it publishes the request
once, moves the reply parts that have arrived from the run's own queue to files under the state
directory, and returns the decoded reply when every part is there (``None`` while it is not).
Nothing here blocks for longer than one connection attempt, so the Celery task can end its call
and retry later (README.md, "How waiting works").
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import os
import re
import shutil
import socket
import ssl
import tempfile
import time
import urllib.parse
import zipfile
from typing import Any, Callable, Collection, Mapping

import pika
import pika.exceptions

LOG = logging.getLogger("rodan.hpc_paco_trainer")

SAMPLE_PORTS = tuple(f"Sample {n}" for n in range(1, 21))
MULTI_SAMPLE = "Multi-Sample Zip"
INPUT_MODEL_PORTS = ("Background Model", *tuple(f"Model {n}" for n in range(1, 5)))
OUTPUT_MODEL_PORTS = ("Background Model", *tuple(f"Model {n}" for n in range(1, 10)))
LOG_FILE = "Log File"
REPLY_QUEUE_PREFIX = "hpc-results."
PART_HEADER = "x-hpc-part"
PARTS_HEADER = "x-hpc-parts"
RABBITMQ_CONSUMER_TIMEOUT_S = 1800  # RabbitMQ's default consumer_timeout: a retry waits less
DAY_S = 86400.0
RUNJOB_HEADER = "x-rodan-runjob"
#: The longest wait between two polls: below RabbitMQ's consumer_timeout (a retried call's message is
#: held unacknowledged by the worker until it is due), with 5 minutes to spare.
MAX_POLL_S = RABBITMQ_CONSUMER_TIMEOUT_S - 300
#: A waiting run polls again after this share of the time it has waited so far (at least
#: HPC_POLL_SECONDS, at most its cap): a reply is picked up at most ~10 % after it came.
POLL_GROWTH = 0.1
#: The cap of a run's interval is this share of its 'Maximum time' (a 1-hour run polls at least every
#: 2.5 minutes, a run of 10 hours or more every 25 minutes).
POLL_CAP_SHARE = 1.0 / 24
#: How often a poll looks through every run's state for runs to remove (a file's age says when it last did).
SWEEP_EVERY_S = 300.0
#: How long the record of a RunJob's last attempt is kept after that attempt began: a Retry within
#: it gets a new correlation id (the bridge answers each correlation id once).
ATTEMPT_RECORD_KEEP_S = 30 * DAY_S
ATTEMPTS_FOLDER = ".attempts"
_TIME_LIMIT = re.compile(r"^(\d{1,3})-(\d{1,2}):(\d{2})$")
_URL_USERINFO = re.compile(r"(amqps?://)[^@/\s]*@", re.IGNORECASE)


class HPCJobError(Exception):
    """A run that ends in a Rodan error: ``summary`` is the one line Rodan shows, ``details`` the rest."""

    def __init__(self, summary: str, details: str = "") -> None:
        super().__init__(summary)
        self.summary = summary
        self.details = details


class BrokerUnavailable(Exception):
    """The broker could not be reached this time (the run retries until ``broker_retry_s``)."""


# --------------------------------------------------------------------------- configuration


class RelayConfig:
    """Settings from Rodan's environment (README.md, "Settings")."""

    def __init__(
        self,
        url: str,
        state_dir: str,
        ca_file: str | None = None,
        request_queue: str = "hpc-jobs",
        poll_seconds: int = 30,
        max_continuations: int = 5,
        max_pending_s: float = 3 * DAY_S,
        slack_s: float = DAY_S,
        broker_retry_s: float = 1800.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme not in ("amqp", "amqps"):
            raise HPCJobError(
                "HPC_RABBITMQ_URL must be an amqp:// or amqps:// URL",
                "Set HPC_RABBITMQ_URL in the environment of Rodan's Python3 worker.",
            )
        if ca_file and scheme != "amqps":
            raise HPCJobError(
                "HPC_RABBITMQ_CA_FILE is set but HPC_RABBITMQ_URL is not amqps://",
                "A CA file is only used for TLS; use an amqps:// URL or unset HPC_RABBITMQ_CA_FILE.",
            )
        if not 1 <= poll_seconds < RABBITMQ_CONSUMER_TIMEOUT_S:
            raise HPCJobError(
                f"HPC_POLL_SECONDS must be between 1 and {RABBITMQ_CONSUMER_TIMEOUT_S - 1}",
                "A Celery retry waits unacknowledged in the worker; RabbitMQ closes a channel that "
                "holds a delivery for longer than its consumer_timeout (30 minutes by default).",
            )
        self.url = url
        self.scheme = scheme
        self.state_dir = state_dir
        self.ca_file = ca_file or None
        self.request_queue = request_queue
        self.poll_seconds = poll_seconds
        self.max_continuations = max_continuations
        self.max_pending_s = max_pending_s
        self.slack_s = slack_s
        self.broker_retry_s = broker_retry_s
        self.connect_timeout_s = connect_timeout_s

    def redact(self, text: str) -> str:
        """``text`` without the broker's credentials (every log line and error goes through this)."""
        return redact(text, self.url)


def config_from_env(env: Mapping[str, str], media_root: str) -> RelayConfig:
    """The configuration from Rodan's environment; the state lives under MEDIA_ROOT unless
    ``HPC_STATE_DIR`` says otherwise."""
    url = env.get("HPC_RABBITMQ_URL", "").strip()
    if not url:
        raise HPCJobError(
            "HPC_RABBITMQ_URL is not set",
            "Set HPC_RABBITMQ_URL (amqp:// or amqps://) in the environment of Rodan's Python3 worker.",
        )

    def number(name: str, default: float) -> float:
        text = env.get(name, "").strip()
        if not text:
            return default
        try:
            value = float(text)
        except ValueError:
            raise HPCJobError(f"{name} is not a number: {text!r}") from None
        if value < 0:
            raise HPCJobError(f"{name} must not be negative")
        return value

    return RelayConfig(
        url=url,
        state_dir=env.get("HPC_STATE_DIR", "").strip() or os.path.join(media_root, "hpc_paco_trainer"),
        ca_file=env.get("HPC_RABBITMQ_CA_FILE", "").strip() or None,
        request_queue=env.get("HPC_REQUEST_QUEUE", "").strip() or "hpc-jobs",
        poll_seconds=int(number("HPC_POLL_SECONDS", 30)),
        max_continuations=int(number("HPC_BRIDGE_MAX_CONTINUATIONS", 5)),
        max_pending_s=number("HPC_BRIDGE_MAX_PENDING", 3 * DAY_S),
        slack_s=number("HPC_SILENCE_SLACK", DAY_S),
        broker_retry_s=number("HPC_BROKER_RETRY_LIMIT", 1800.0),
    )


def redact(text: str, url: str = "") -> str:
    """Remove the user information of any AMQP URL and the literal password of ``url``."""
    out = _URL_USERINFO.sub(r"\1***@", text)
    if url:
        parts = urllib.parse.urlsplit(url)
        for secret in (parts.password, urllib.parse.unquote(parts.password or "")):
            if secret and len(secret) >= 3:
                out = out.replace(secret, "***")
    return out


def connection_parameters(config: RelayConfig) -> pika.URLParameters:
    """pika parameters for the URL: amqps:// always verifies the certificate and the host name
    (against HPC_RABBITMQ_CA_FILE when set, else the system's CAs)."""
    params = pika.URLParameters(config.url)
    if config.scheme == "amqps":
        try:
            context = ssl.create_default_context(cafile=config.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise HPCJobError("HPC_RABBITMQ_CA_FILE cannot be used", f"{type(exc).__name__}: {exc}") from None
        context.check_hostname = True
        context.verify_mode = ssl.CERT_REQUIRED
        host = urllib.parse.urlsplit(config.url).hostname or "localhost"
        params.ssl_options = pika.SSLOptions(context, server_hostname=host)
    params.connection_attempts = 2
    params.retry_delay = 2
    params.socket_timeout = config.connect_timeout_s
    params.blocked_connection_timeout = 60
    params.heartbeat = 60
    return params


# --------------------------------------------------------------------------- the request


def parse_time_limit(text: str) -> float:
    """Seconds of a ``D-HH:MM`` time limit."""
    match = _TIME_LIMIT.match(str(text).strip())
    if not match or int(match.group(2)) > 23 or int(match.group(3)) > 59:
        raise HPCJobError(f"'Maximum time (D-HH:MM)' is not D-HH:MM: {text!r}")
    days, hours, minutes = (int(g) for g in match.groups())
    return float(days * DAY_S + hours * 3600 + minutes * 60)


def silence_bound_s(settings: Mapping[str, Any], config: RelayConfig) -> float:
    """How long after the request a run waits for a reply before it fails: every job the request
    may use (the first and its continuations) at its time limit, the bridge's pending limit, slack."""
    limit = parse_time_limit(settings.get("Maximum time (D-HH:MM)", "1-00:00"))
    return limit * (1 + config.max_continuations) + config.max_pending_s + config.slack_s


def build_request(inputs_with_urls: Mapping[str, list[Mapping[str, Any]]], settings: Mapping[str, Any]) -> bytes:
    """The request body: each connected input port's Rodan URL, and the settings as Rodan gives them."""
    named: dict[str, str] = {}
    for port in (*SAMPLE_PORTS, MULTI_SAMPLE, *INPUT_MODEL_PORTS):
        entries = inputs_with_urls.get(port) or []
        if entries:
            url = entries[0].get("resource_url")
            if not url:
                raise HPCJobError(f"Input '{port}' has no Rodan URL")
            named[port] = str(url)
    if not any(port in named for port in (*SAMPLE_PORTS, MULTI_SAMPLE)):
        raise HPCJobError(
            "No training sample", "Connect at least one 'Sample N' input or the 'Multi-Sample Zip' input."
        )
    return json.dumps({"inputs": named, "settings": dict(settings)}, sort_keys=True).encode("utf-8")


def reply_queue_name(correlation_id: str) -> str:
    return REPLY_QUEUE_PREFIX + correlation_id


def reply_queue_arguments(bound_s: float) -> dict[str, Any]:
    """The run's reply queue lives a day past the silence bound once nobody uses it."""
    return {"x-expires": int((bound_s + DAY_S) * 1000)}


# --------------------------------------------------------------------------- layers


def _sample_member_names(path: str, port: str) -> list[list[str]]:
    """File names per sample in a sample zip (one sample) or a Multi-Sample Zip (one per folder)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [info.filename for info in archive.infolist() if not info.is_dir()]
    except (OSError, zipfile.BadZipFile) as exc:
        raise HPCJobError(f"Input '{port}' is not a zip file", str(exc)) from None
    for name in names:
        if name.startswith("/") or ".." in name.split("/") or "\\" in name:
            raise HPCJobError(f"Input '{port}' holds an unsafe member name", repr(name))
    if port != MULTI_SAMPLE:
        if any("/" in name for name in names):
            raise HPCJobError(f"Input '{port}' is not a sample zip: it has folders")
        return [names]
    folders: dict[str, list[str]] = {}
    for name in names:
        if name.count("/") != 1:
            raise HPCJobError("'Multi-Sample Zip' must hold one level of sample folders", repr(name))
        folder, member = name.split("/")
        folders.setdefault(folder, []).append(member)
    return [folders[key] for key in sorted(folders)]


def check_layers(inputs: Mapping[str, list[Mapping[str, Any]]], outputs: Mapping[str, Any]) -> int:
    """The layers of the samples (files - 2, counting the background, as FastPacoTrainer counts);
    refuse, before anything is sent, what FastPacoTrainer refuses (more starting models than layers,
    samples with different layer counts) and a connected ``Model N`` output the training cannot
    produce (N above the sample's layers)."""
    counts = []
    for port in (*SAMPLE_PORTS, MULTI_SAMPLE):
        for entry in inputs.get(port) or []:
            for members in _sample_member_names(str(entry["resource_path"]), port):
                counts.append(len(members) - 2)
    if not counts:
        raise HPCJobError(
            "No training sample", "Connect at least one 'Sample N' input or the 'Multi-Sample Zip' input."
        )
    if len(set(counts)) != 1 or counts[0] < 2:
        raise HPCJobError(
            "The samples do not have the same layers",
            f"Layers per sample (background included): {counts}; every sample needs the same layers, "
            "at least a background and one more.",
        )
    layers = counts[0]
    models = sum(1 for port in INPUT_MODEL_PORTS if inputs.get(port))
    if models > layers:
        raise HPCJobError(f"Number of models ({models}) exceeds number of layers ({layers})")
    too_high = [port for port in OUTPUT_MODEL_PORTS[1:] if port in outputs and int(port.split()[1]) > layers - 1]
    if too_high:
        raise HPCJobError(
            "Output {} is connected but the samples have only {} layers besides the background".format(
                ", ".join(f"'{p}'" for p in too_high), layers - 1
            ),
            f"Disconnect the Model outputs above 'Model {layers - 1}'.",
        )
    return layers


# --------------------------------------------------------------------------- state on disk


def _write_atomic(path: str, data: bytes) -> None:
    folder = os.path.dirname(path)
    handle, temp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class RunState:
    """What survives between polls (and worker restarts): ``<state_dir>/<RunJob uuid>/`` holds
    ``state.json`` (the attempt: its Celery task id, number and correlation id; first-publish time,
    broker outage, outcome) and ``part-N`` (the reply parts of that attempt received and acknowledged)."""

    _SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

    def __init__(self, state_dir: str, runjob_id: str) -> None:
        if not self._SAFE.match(runjob_id):
            raise HPCJobError("Unusable RunJob id", repr(runjob_id))
        self.folder = os.path.join(state_dir, runjob_id)
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        self.path = os.path.join(self.folder, "state.json")
        self.data: dict[str, Any] = {}
        if os.path.exists(self.path):
            with open(self.path, "rb") as handle:
                self.data = json.loads(handle.read().decode("utf-8"))

    def get(self, key: str) -> Any:
        return self.data.get(key)

    def update(self, **values: Any) -> None:
        self.data.update(values)
        _write_atomic(self.path, json.dumps(self.data, sort_keys=True).encode("utf-8"))

    def reset(self, **values: Any) -> None:
        """Forget the previous attempt: its parts go, ``state.json`` holds ``values`` only."""
        for name in os.listdir(self.folder):
            if name.startswith("part-"):
                os.unlink(os.path.join(self.folder, name))
        self.data = {}
        self.update(**values)

    def part_path(self, index: int) -> str:
        return os.path.join(self.folder, f"part-{index}")

    def save_part(self, index: int, total: int, body: bytes) -> None:
        known = self.get("parts")
        if known is not None and known != total:
            raise HPCJobError(
                "The reply's parts disagree on their number",
                f"part {index} says {total} parts, an earlier one said {known}",
            )
        if known is None:
            self.update(parts=total)
        path = self.part_path(index)
        if os.path.exists(path):
            if os.path.getsize(path) != len(body):
                LOG.warning("reply part %d came again with other bytes; the first copy is kept", index)
            return
        _write_atomic(path, body)

    def missing_parts(self) -> list[int] | None:
        """The part numbers not yet here (``None`` before any part came)."""
        total = self.get("parts")
        if total is None:
            return None
        return [n for n in range(1, int(total) + 1) if not os.path.exists(self.part_path(n))]

    def assemble(self) -> bytes:
        chunks = []
        for n in range(1, int(self.get("parts")) + 1):
            with open(self.part_path(n), "rb") as handle:
                chunks.append(handle.read())
        return b"".join(chunks)


def sweep_state(
    state_dir: str,
    now: float,
    keep_s: float = DAY_S,
    over: Callable[[list[str]], Collection[str]] | None = None,
) -> list[str]:
    """Remove the state of runs that ended more than ``keep_s`` ago, whose reply queue has
    expired, that never published in a week, or (``over``: given the RunJob ids of the runs that
    have not ended, it returns those whose RunJob is cancelled, failed, finished or gone) that Rodan
    ended; returns the correlation ids removed (their reply queues may still be there: the caller
    deletes them). Records of attempts older than ``ATTEMPT_RECORD_KEEP_S`` go too."""
    removed: list[str] = []
    try:
        names = os.listdir(state_dir)
    except FileNotFoundError:
        return removed
    open_runs: dict[str, dict[str, Any]] = {}
    for name in names:
        path = os.path.join(state_dir, name, "state.json")
        try:
            with open(path, "rb") as handle:
                data = json.loads(handle.read().decode("utf-8"))
        except (OSError, ValueError):
            continue
        ended = data.get("ended_at")
        expires = data.get("expires_at")
        created = data.get("created_at")
        never_published = data.get("published_at") is None and created is not None
        if (
            (ended is not None and now - float(ended) > keep_s)
            or (expires is not None and now > float(expires))
            or (never_published and now - float(created) > 7 * DAY_S)
        ):
            removed.append(_remove_run(state_dir, name, data, now))
        elif ended is None:
            open_runs[name] = data
    if over is not None and open_runs:
        for name in sorted(set(over(sorted(open_runs))) & set(open_runs)):
            removed.append(_remove_run(state_dir, name, open_runs[name], now))
            LOG.info("RunJob %s ended in Rodan: the state of its HPC run %s was removed", name, removed[-1])
    _sweep_attempt_records(state_dir, now)
    return removed


def _remove_run(state_dir: str, name: str, data: Mapping[str, Any], now: float) -> str:
    """Remove one run's folder, keeping the record of its attempt; returns its correlation id."""
    if data.get("published_at") is not None or data.get("task_id") is not None:
        write_attempt_record(state_dir, name, int(data.get("attempt") or 1), data.get("task_id"), now)
    shutil.rmtree(os.path.join(state_dir, name), ignore_errors=True)
    return str(data.get("correlation_id") or name)


def maybe_sweep(state_dir: str, now: float, over: Callable[[list[str]], Collection[str]] | None = None) -> list[str]:
    """:func:`sweep_state` at most once every ``SWEEP_EVERY_S`` for the whole state directory (the
    time of the last sweep is kept in ``.attempts/swept``), so that a poll stays cheap."""
    marker = os.path.join(state_dir, ATTEMPTS_FOLDER, "swept")
    try:
        with open(marker, "rb") as handle:
            last = float(handle.read().decode("ascii") or 0)
    except (OSError, ValueError):
        last = None
    if last is not None and 0 <= now - last < SWEEP_EVERY_S:
        return []
    os.makedirs(os.path.dirname(marker), mode=0o700, exist_ok=True)
    _write_atomic(marker, repr(now).encode("ascii"))
    return sweep_state(state_dir, now, over=over)


# --------------------------------------------------------------------------- attempts


class AttemptOver(Exception):
    """This call belongs to an attempt whose state was removed (Rodan cancelled the run, or a
    newer attempt of the RunJob took over): it must end without touching anything."""


def correlation_id_for(runjob_id: str, attempt: int) -> str:
    """Attempt 1 of a RunJob is its uuid (as 0.4.0 had it); attempt n >= 2 is ``<uuid>.<n>``."""
    return runjob_id if attempt <= 1 else f"{runjob_id}.{attempt}"


def _attempt_record_path(state_dir: str, runjob_id: str) -> str:
    return os.path.join(state_dir, ATTEMPTS_FOLDER, runjob_id)


def read_attempt_record(state_dir: str, runjob_id: str) -> dict[str, Any] | None:
    """The last attempt of a RunJob (``attempt``, ``task_id``, ``at``), kept apart from its state
    folder so that a Retry after the folder was removed still gets a new correlation id."""
    try:
        with open(_attempt_record_path(state_dir, runjob_id), "rb") as handle:
            data = json.loads(handle.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("attempt"), int) else None


def write_attempt_record(state_dir: str, runjob_id: str, attempt: int, task_id: str | None, now: float) -> None:
    path = _attempt_record_path(state_dir, runjob_id)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    _write_atomic(path, json.dumps({"attempt": attempt, "task_id": task_id, "at": now}).encode("utf-8"))


def _sweep_attempt_records(state_dir: str, now: float) -> None:
    folder = os.path.join(state_dir, ATTEMPTS_FOLDER)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    for name in names:
        if name == "swept" or name.startswith(".tmp-"):
            continue
        record = read_attempt_record(state_dir, name)
        if record is not None and now - float(record.get("at") or 0) > ATTEMPT_RECORD_KEEP_S:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))


def begin_attempt(state_dir: str, runjob_id: str, task_id: str | None, now: float) -> RunState:
    """The state of this call's attempt. A call whose Celery task id differs from the one the state
    recorded, for a state that published (or failed, or ended; or 0.4.0's state, without a task id,
    that failed), starts the next attempt: the previous attempt's parts go and its correlation id is
    queued for deletion of its reply queue (``delete_queues``). The same task id (Celery's retry, a
    redelivery) is the same attempt. Raises :class:`AttemptOver` for a call of an attempt whose
    state was removed."""
    state_file = os.path.join(state_dir, runjob_id, "state.json")
    existed = os.path.exists(state_file)
    record = read_attempt_record(state_dir, runjob_id)
    if not existed:
        if record is not None and task_id is not None and record.get("task_id") == task_id:
            raise AttemptOver(f"the state of RunJob {runjob_id}'s attempt {record['attempt']} was removed")
        attempt = int(record["attempt"]) + 1 if record is not None else 1
        state = RunState(state_dir, runjob_id)
        stale = [correlation_id_for(runjob_id, int(record["attempt"]))] if record is not None else []
        state.update(
            created_at=now,
            task_id=task_id,
            attempt=attempt,
            correlation_id=correlation_id_for(runjob_id, attempt),
            delete_queues=stale,
        )
        write_attempt_record(state_dir, runjob_id, attempt, task_id, now)
        if record is not None:
            LOG.info(
                "RunJob %s runs again (Celery task %s): attempt %d, correlation id %s (attempt %s had ended)",
                runjob_id,
                task_id,
                attempt,
                state.get("correlation_id"),
                record["attempt"],
            )
        return state
    state = RunState(state_dir, runjob_id)
    recorded = state.get("task_id")
    started = state.get("failed") is not None or any(
        state.get(key) is not None for key in ("published_at", "ended_at", "complete")
    )
    if task_id is None or recorded == task_id:
        if state.get("correlation_id") is None:
            state.update(attempt=int(state.get("attempt") or 1), correlation_id=runjob_id)
        return state
    if (recorded is None and state.get("failed") is None) or (recorded is not None and not started):
        # 0.4.0's state of a run still waiting (its retries now carry their task id), or an attempt
        # that never published: the same attempt, now this task's.
        attempt = int(state.get("attempt") or 1)
        state.update(task_id=task_id, attempt=attempt, correlation_id=state.get("correlation_id") or runjob_id)
        write_attempt_record(state_dir, runjob_id, attempt, task_id, now)
        return state
    previous = max(int(state.get("attempt") or 1), int(record["attempt"]) if record is not None else 1)
    old = str(state.get("correlation_id") or runjob_id)
    attempt = previous + 1
    state.reset(
        created_at=now,
        task_id=task_id,
        attempt=attempt,
        correlation_id=correlation_id_for(runjob_id, attempt),
        delete_queues=sorted({old, *(state.get("delete_queues") or [])}),
    )
    write_attempt_record(state_dir, runjob_id, attempt, task_id, now)
    LOG.info(
        "RunJob %s runs again (Celery task %s): attempt %d, correlation id %s; attempt %s (%s) is dropped",
        runjob_id,
        task_id,
        attempt,
        state.get("correlation_id"),
        previous,
        old,
    )
    return state


def end_attempt(
    config: RelayConfig, runjob_id: str, task_id: str | None, reason: str, connect: Connect | None = None
) -> bool:
    """Rodan ended this attempt (Cancel, a newer attempt, a deleted RunJob): delete its reply
    queue and remove its state folder (the attempt record stays), if the state is this attempt's
    (or has no task id: 0.4.0's); returns whether it was. The broker is tried once, briefly; a
    queue that cannot be deleted now expires by its ``x-expires``."""
    state_file = os.path.join(config.state_dir, runjob_id, "state.json")
    if not os.path.exists(state_file):
        LOG.info("HPC poll of RunJob %s (Celery task %s) ends: %s; nothing left to remove", runjob_id, task_id, reason)
        return False
    state = RunState(config.state_dir, runjob_id)
    recorded = state.get("task_id")
    if task_id is not None and recorded is not None and recorded != task_id:
        LOG.info(
            "HPC poll of RunJob %s (Celery task %s) ends: %s; the state is attempt %s's, left alone",
            runjob_id,
            task_id,
            reason,
            state.get("attempt"),
        )
        return False
    cid = str(state.get("correlation_id") or runjob_id)
    attempt = int(state.get("attempt") or 1)
    queues = sorted({cid, *(state.get("delete_queues") or [])})
    write_attempt_record(config.state_dir, runjob_id, attempt, recorded or task_id, time.time())
    shutil.rmtree(state.folder, ignore_errors=True)
    deleted = delete_reply_queues(config, queues, connect)
    LOG.info(
        "HPC run %s (RunJob %s, attempt %d) ends: %s; state removed, reply queue %s",
        cid,
        runjob_id,
        attempt,
        reason,
        "deleted" if deleted else "left to expire",
    )
    return True


def delete_reply_queues(config: RelayConfig, correlation_ids: list[str], connect: Connect | None = None) -> bool:
    """Delete the reply queues of these correlation ids (one short connection attempt); returns
    whether every deletion went through."""
    if not correlation_ids:
        return True
    try:
        connection = (connect or _open_once)(config)
    except Exception as exc:  # any failure: the queues expire by x-expires
        LOG.warning(
            "could not reach RabbitMQ to delete reply queues: %s", config.redact(f"{type(exc).__name__}: {exc}")
        )
        return False
    try:
        for cid in correlation_ids:
            connection.channel().queue_delete(queue=reply_queue_name(cid))
        return True
    except Exception as exc:
        LOG.warning("could not delete reply queues: %s", config.redact(f"{type(exc).__name__}: {exc}"))
        return False
    finally:
        with contextlib.suppress(Exception):
            if connection.is_open:
                connection.close()


# --------------------------------------------------------------------------- when to poll


def poll_interval_s(waited_s: float, min_s: float, time_limit_s: float | None) -> int:
    """Seconds until the next poll of a run that has waited ``waited_s`` since its request:
    ``POLL_GROWTH`` of the time waited, at least ``min_s`` (HPC_POLL_SECONDS), at most the run's
    cap: ``POLL_CAP_SHARE`` of its 'Maximum time' (never below ``min_s``, never above
    ``MAX_POLL_S``); a ``min_s`` above both caps wins (0.4.0 allowed up to 1799 s). A reply that
    arrives waits at most this long to be picked up."""
    cap = float(MAX_POLL_S)
    if time_limit_s is not None:
        cap = min(cap, max(float(min_s), time_limit_s * POLL_CAP_SHARE))
    return int(max(float(min_s), min(cap, max(0.0, waited_s) * POLL_GROWTH)))


def next_poll_s(config: RelayConfig, runjob_id: str, now: float) -> int:
    """The countdown of the retry that ends this poll (:func:`poll_interval_s` of the run's state)."""
    try:
        with open(os.path.join(config.state_dir, runjob_id, "state.json"), "rb") as handle:
            data = json.loads(handle.read().decode("utf-8"))
    except (OSError, ValueError):
        data = {}
    published = data.get("published_at")
    waited = 0.0 if published is None else now - float(published)
    limit = data.get("time_limit_s")
    return poll_interval_s(waited, config.poll_seconds, None if limit is None else float(limit))


def nothing_new(
    config: RelayConfig, runjob_id: str, task_id: str | None, now: float, connect: Connect | None = None
) -> bool:
    """The cheap poll: True when this attempt has published, has not ended, is within its
    silence bound and its reply queue holds no message (one passive declaration); then the call
    only needs to wait again. Anything else (a message, no state, an outage, an error) is False: the
    full poll (:func:`step`) deals with it."""
    try:
        with open(os.path.join(config.state_dir, runjob_id, "state.json"), "rb") as handle:
            data = json.loads(handle.read().decode("utf-8"))
    except (OSError, ValueError):
        return False
    if task_id is None or data.get("task_id") != task_id or data.get("published_at") is None:
        return False
    if data.get("complete") or data.get("failed") or data.get("delete_queues") or data.get("broker_down_since"):
        return False
    bound = data.get("bound_s")
    if bound is None or now - float(data["published_at"]) > float(bound):
        return False
    try:
        connection = (connect or _open_once)(config)
    except Exception:  # the full poll counts the outage
        return False
    try:
        queue = reply_queue_name(str(data.get("correlation_id") or runjob_id))
        count = connection.channel().queue_declare(queue=queue, passive=True).method.message_count
    except Exception:  # a queue gone or a broker error: the full poll sees to it
        return False
    finally:
        with contextlib.suppress(Exception):
            if connection.is_open:
                connection.close()
    return int(count) == 0


# --------------------------------------------------------------------------- the reply


def _header_int(headers: Mapping[str, Any], name: str) -> int | None:
    value = headers.get(name)
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise HPCJobError(f"The reply has a malformed {name} header", repr(value)) from None


def part_numbers(properties: Any) -> tuple[int, int]:
    """(part, parts) of a reply message; a message without the headers is the whole reply."""
    headers = getattr(properties, "headers", None) or {}
    part = _header_int(headers, PART_HEADER)
    parts = _header_int(headers, PARTS_HEADER)
    if part is None and parts is None:
        return 1, 1
    if part is None or parts is None or not 1 <= part <= parts:
        raise HPCJobError("The reply has inconsistent part headers", f"part {part!r} of {parts!r}")
    return part, parts


def decode_reply(body: bytes) -> dict[str, bytes]:
    """The files of a joined reply body (``Background Model``, ``Model N``, ``Log File``); an
    ``{"error": ...}`` reply raises :class:`HPCJobError` with the reason."""
    try:
        reply = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise HPCJobError("The HPC reply is not JSON", str(exc)) from None
    if not isinstance(reply, dict):
        raise HPCJobError("The HPC reply is not a JSON object")
    if "error" in reply:
        reason = str(reply["error"])
        raise HPCJobError("The HPC training failed: {}".format(reason.splitlines()[0] if reason else ""), reason)
    files: dict[str, bytes] = {}
    for key, value in reply.items():
        if key != LOG_FILE and key not in OUTPUT_MODEL_PORTS:
            LOG.warning("reply key %r is not an output of this job; ignored", key)
            continue
        if not isinstance(value, str):
            raise HPCJobError(f"The HPC reply's {key!r} is not base64 text")
        try:
            files[key] = base64.b64decode(value.replace("\n", "").encode("ascii"), validate=True)
        except (UnicodeEncodeError, binascii.Error, ValueError) as exc:
            raise HPCJobError(f"The HPC reply's {key!r} is not base64", str(exc)) from None
    if "Background Model" not in files or "Model 1" not in files:
        raise HPCJobError("The HPC reply has no 'Background Model' and 'Model 1'", f"keys: {sorted(reply)}")
    return files


def write_outputs(
    files: Mapping[str, bytes],
    outputs: Mapping[str, list[Mapping[str, Any]]],
    inputs: Mapping[str, list[Mapping[str, Any]]],
) -> list[str]:
    """Write each connected output port; returns the ports written. A connected port the reply
    has no file for is an error, raised before anything is written."""
    missing = [
        port
        for port in outputs
        if port != MULTI_SAMPLE and (port == LOG_FILE or port in OUTPUT_MODEL_PORTS) and port not in files
    ]
    if missing:
        raise HPCJobError(
            "The training produced no file for the connected output {}".format(
                ", ".join(f"'{p}'" for p in sorted(missing))
            ),
            "The reply holds: {}".format(", ".join(sorted(files))),
        )
    written = []
    for port in sorted(outputs):
        target = str(outputs[port][0]["resource_path"])
        if port == MULTI_SAMPLE:
            build_multi_sample_zip(inputs, target)
        elif port in files:
            with open(target, "wb") as out:
                out.write(files[port])
        else:
            continue
        written.append(port)
    return written


def build_multi_sample_zip(inputs: Mapping[str, list[Mapping[str, Any]]], target: str) -> list[str]:
    """Every input sample in one zip, one folder per sample (the folders of an input Multi-Sample
    Zip keep their names; ``Sample N`` becomes folder ``Sample N``); returns the folder names."""
    folders: list[str] = []
    chosen: dict[tuple[str, str], str] = {}
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
        for port in (MULTI_SAMPLE, *SAMPLE_PORTS):
            for entry in inputs.get(port) or []:
                with zipfile.ZipFile(str(entry["resource_path"])) as archive:
                    for info in archive.infolist():
                        if info.is_dir():
                            continue
                        name = info.filename
                        if name.startswith("/") or ".." in name.split("/") or "\\" in name:
                            raise HPCJobError(f"Input '{port}' holds an unsafe member name", repr(name))
                        if port == MULTI_SAMPLE:
                            source, _, member = name.partition("/")
                        else:
                            source, member = port, name
                        if not source or not member or "/" in member:
                            raise HPCJobError(f"Input '{port}' is not laid out as samples", repr(name))
                        folder = chosen.get((port, source))
                        if folder is None:
                            folder = source
                            while folder in folders:
                                folder = f"{source} ({len(folders) + 1})"
                            chosen[(port, source)] = folder
                            folders.append(folder)
                        with archive.open(info) as data, out.open(folder + "/" + member, "w") as sink:
                            shutil.copyfileobj(data, sink, 1 << 20)
    return folders


# --------------------------------------------------------------------------- the broker


Connect = Callable[[RelayConfig], Any]


def open_connection(config: RelayConfig) -> pika.BlockingConnection:
    return pika.BlockingConnection(connection_parameters(config))


def _open_once(config: RelayConfig) -> pika.BlockingConnection:
    """One short connection attempt (the cheap poll, clean-ups in the worker's main process)."""
    params = connection_parameters(config)
    params.connection_attempts = 1
    params.socket_timeout = min(5.0, config.connect_timeout_s)
    return pika.BlockingConnection(params)


_PERMANENT = (
    pika.exceptions.ProbableAuthenticationError,
    pika.exceptions.ProbableAccessDeniedError,
    pika.exceptions.AuthenticationError,
)
_TRANSIENT = (pika.exceptions.AMQPConnectionError, pika.exceptions.StreamLostError, socket.error, ssl.SSLError)


def publish_request(
    channel: Any, config: RelayConfig, correlation_id: str, body: bytes, bound_s: float, runjob_id: str | None = None
) -> None:
    """Declare the run's reply queue, then publish the request persistent, with confirms and
    ``mandatory`` (an unroutable or refused publish raises), with the header ``x-rodan-runjob``
    (the RunJob's uuid, which every attempt of the RunJob shares)."""
    reply_to = reply_queue_name(correlation_id)
    channel.confirm_delivery()
    channel.queue_declare(queue=reply_to, durable=True, arguments=reply_queue_arguments(bound_s))
    # Declared exactly as Rodan and the bridge declare it, so a request waits for a bridge that restarts.
    channel.queue_declare(queue=config.request_queue, durable=False, exclusive=False, auto_delete=False)
    channel.basic_publish(
        exchange="",
        routing_key=config.request_queue,
        body=body,
        properties=pika.BasicProperties(
            correlation_id=correlation_id,
            reply_to=reply_to,
            delivery_mode=2,
            headers={RUNJOB_HEADER: runjob_id or correlation_id},
        ),
        mandatory=True,
    )


def drain_replies(channel: Any, correlation_id: str, state: RunState) -> int:
    """Move every message of the run's queue to part files (each acknowledged once its file is
    written); returns how many messages were taken."""
    taken = 0
    queue = reply_queue_name(correlation_id)
    while True:
        method, properties, body = channel.basic_get(queue=queue, auto_ack=False)
        if method is None:
            return taken
        taken += 1
        if getattr(properties, "correlation_id", None) not in (None, correlation_id):
            LOG.warning("a message for another correlation id in %s was dropped", queue)
            channel.basic_ack(method.delivery_tag)
            continue
        part, parts = part_numbers(properties)
        state.save_part(part, parts, body)
        channel.basic_ack(method.delivery_tag)


def step(
    config: RelayConfig,
    runjob_id: str,
    request_body: Callable[[], bytes],
    bound_s: float,
    now: Callable[[], float] = time.time,
    connect: Connect = open_connection,
    task_id: str | None = None,
    time_limit_s: float | None = None,
) -> dict[str, bytes] | None:
    """One poll of a run: of the attempt of Celery task ``task_id`` of RunJob ``runjob_id``
    (:func:`begin_attempt`). Returns the reply's files when it is complete, ``None`` while the run
    should wait; raises :class:`HPCJobError` for an error reply, silence past ``bound_s``, a broker
    unreachable longer than ``config.broker_retry_s`` or refusing the job's account, and
    :class:`AttemptOver` for an attempt whose state was removed."""
    state = begin_attempt(config.state_dir, runjob_id, task_id, now())
    correlation_id = str(state.get("correlation_id"))
    if state.get("complete"):
        return decode_reply(state.assemble())
    if state.get("failed"):
        # The same attempt again (a redelivered call): the same outcome. Rodan's Retry is another
        # Celery task id, which starts a new attempt in begin_attempt.
        raise HPCJobError(str(state.get("failed")), str(state.get("failed_details") or ""))
    try:
        connection = connect(config)
    except _PERMANENT as exc:
        raise HPCJobError(
            "RabbitMQ refused the job's account (HPC_RABBITMQ_URL)", config.redact(type(exc).__name__)
        ) from None
    except _TRANSIENT as exc:
        _broker_down(config, state, now(), exc)
        return None
    try:
        channel = connection.channel()
        stale = list(state.get("delete_queues") or [])
        if stale:
            # The previous attempt's queue goes before this attempt publishes: its late reply is
            # then unroutable (dropped by the bridge), never taken for this attempt's.
            for old in stale:
                channel.queue_delete(queue=reply_queue_name(old))
            state.update(delete_queues=[])
        if state.get("published_at") is None:
            publish_request(channel, config, correlation_id, request_body(), bound_s, runjob_id)
            published = now()
            state.update(
                published_at=published,
                expires_at=published + bound_s + DAY_S,
                ended_at=None,
                bound_s=bound_s,
                time_limit_s=time_limit_s,
            )
            LOG.info(
                "published HPC request %s (RunJob %s, attempt %s) to %s",
                correlation_id,
                runjob_id,
                state.get("attempt"),
                config.request_queue,
            )
        else:
            channel.queue_declare(
                queue=reply_queue_name(correlation_id), durable=True, arguments=reply_queue_arguments(bound_s)
            )
            if state.get("bound_s") is None:  # a run that 0.4.0 published: now the cheap poll serves it too
                state.update(bound_s=bound_s, time_limit_s=time_limit_s)
        drain_replies(channel, correlation_id, state)
        missing = state.missing_parts()
        if missing == []:
            state.update(complete=True, ended_at=now())
            try:
                channel.queue_delete(queue=reply_queue_name(correlation_id))
            except pika.exceptions.AMQPError as exc:
                LOG.warning("could not delete the reply queue: %s", config.redact(str(exc)))
    except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
        raise HPCJobError(
            f"RabbitMQ did not accept the request for queue '{config.request_queue}'",
            config.redact(f"{type(exc).__name__}: {exc}"),
        ) from None
    except pika.exceptions.ChannelClosedByBroker as exc:
        raise HPCJobError("RabbitMQ refused the job's queues", config.redact(str(exc))) from None
    except _TRANSIENT as exc:
        _broker_down(config, state, now(), exc)
        return None
    finally:
        try:
            if connection.is_open:
                connection.close()
        except Exception:  # noqa: S110 - a connection that is already gone needs no closing
            pass
    if state.get("broker_down_since") is not None:
        state.update(broker_down_since=None)
    if state.get("complete"):
        return decode_reply(state.assemble())
    waited = now() - float(state.get("published_at"))
    if waited > bound_s:
        missing = state.missing_parts()
        raise _ended(
            state,
            now(),
            HPCJobError(
                f"No reply from the HPC cluster after {_duration(waited)}",
                "The request {} was published {:.0f} s ago; the bound is {:.0f} s ('Maximum time' x (1 + "
                "HPC_BRIDGE_MAX_CONTINUATIONS) + HPC_BRIDGE_MAX_PENDING + HPC_SILENCE_SLACK). {}".format(
                    correlation_id,
                    waited,
                    bound_s,
                    "No part of the reply arrived." if missing is None else f"Reply parts still missing: {missing}.",
                ),
            ),
        )
    return None


def _duration(seconds: float) -> str:
    """``N hours`` from two hours on, else ``N minutes`` (a short bound said "after 0 hours")."""
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.0f} hours"
    minutes = max(1, round(seconds / 60))
    return f"{minutes} minute{'' if minutes == 1 else 's'}"


def _ended(state: RunState, at: float, error: HPCJobError) -> HPCJobError:
    """Record that the attempt failed and return the error. After a publish, a redelivery of the
    same call fails alike; before one, it tries afresh. Rodan's Retry (another Celery task id)
    starts the next attempt either way."""
    if state.get("published_at") is None:
        state.update(ended_at=at, broker_down_since=None)
    else:
        state.update(ended_at=at, broker_down_since=None, failed=error.summary, failed_details=error.details)
    return error


def _broker_down(config: RelayConfig, state: RunState, at: float, exc: BaseException) -> None:
    since = state.get("broker_down_since")
    if since is None:
        since = at
        state.update(broker_down_since=since)
    reason = config.redact(f"{type(exc).__name__}: {exc}")
    LOG.warning("RabbitMQ unreachable (%s); the run retries", reason)
    if at - float(since) > config.broker_retry_s:
        raise _ended(
            state,
            at,
            HPCJobError(
                f"RabbitMQ unreachable for {(at - float(since)) / 60:.0f} minutes",
                f"HPC_RABBITMQ_URL could not be reached for {at - float(since):.0f} s ({reason}); "
                f"HPC_BROKER_RETRY_LIMIT is {config.broker_retry_s:.0f} s.",
            ),
        )
    return None
