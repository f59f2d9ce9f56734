"""Structured JSON logging (structlog), one event per step.

Context such as the correlation id, job id and attempt is bound with
``structlog.contextvars.bound_contextvars`` so every line of a request carries
it. A redaction processor removes anything registered as a secret (the Rodan
token, passwords) from every event, whatever key it hides under.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, Protocol, TextIO

import structlog

_secrets: set[str] = set()
_secrets_lock = threading.Lock()
_REDACTED = "[REDACTED]"
SECRET_KEYS = frozenset({"token", "password", "authorization", "rodan_password", "broker_url"})


def register_secret(value: str | None) -> None:
    """Never let ``value`` appear in a log line from now on."""
    if value and len(value) >= 4:
        with _secrets_lock:
            _secrets.add(value)


def redact(text: str) -> str:
    with _secrets_lock:
        secrets = sorted(_secrets, key=len, reverse=True)
    for secret in secrets:
        text = text.replace(secret, _REDACTED)
    return text


def _redact_value(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: (_REDACTED if str(k).lower() in SECRET_KEYS else _redact_value(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact_value(v) for v in value]
    return value


def _redaction_processor(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> Any:
    for key in list(event_dict):
        if key.lower() in SECRET_KEYS:
            event_dict[key] = _REDACTED
        else:
            event_dict[key] = _redact_value(event_dict[key])
    return event_dict


class LogStream(Protocol):
    def write(self, text: str, /) -> int: ...
    def flush(self) -> None: ...


class _Tee:
    """Write each log line to several files (the job's stdout and its run directory's job.log)."""

    def __init__(self, *outputs: LogStream) -> None:
        self.outputs = outputs

    def write(self, text: str) -> int:
        for out in self.outputs:
            out.write(text)
        return len(text)

    def flush(self) -> None:
        for out in self.outputs:
            out.flush()


def _open_append(path: Path) -> TextIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a", encoding="utf-8", buffering=1)
    os.chmod(path, 0o600)
    return handle


def configure_logging(
    *,
    level: str = "INFO",
    log_file: Path | None = None,
    stream: LogStream | None = None,
    component: str = "bridge",
) -> None:
    """JSON lines to ``log_file`` (appended, 0600) or ``stream`` (default stderr)."""
    out: Any = _open_append(log_file) if log_file is not None else (stream if stream is not None else sys.stderr)
    _settings.update(level=level, component=component, out=out)
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_component(component),
            structlog.processors.format_exc_info,
            _redaction_processor,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    # pika and urllib3 log through the stdlib; keep them quiet unless asked.
    logging.basicConfig(level=logging.WARNING, stream=out, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("pika").setLevel(logging.CRITICAL if numeric > logging.DEBUG else logging.INFO)


_settings: dict[str, Any] = {}


def tee_logs_to(path: Path) -> None:
    """From now on, also append every log line to ``path`` (e.g. a job's run directory)."""
    if not _settings:
        configure_logging()
    configure_logging(
        level=_settings["level"], stream=_Tee(_settings["out"], _open_append(path)), component=_settings["component"]
    )


def _add_component(component: str) -> Any:
    def processor(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> Any:
        event_dict.setdefault("component", component)
        return event_dict

    return processor
