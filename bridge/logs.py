"""Structured JSON logging (structlog), one event per step.

Context such as the correlation id, job id and attempt is bound with
``structlog.contextvars.bound_contextvars`` so every line of a request carries
it. A redaction processor removes anything registered as a secret (the Rodan
token, passwords) from every event, whatever key it hides under.

The standard library's ``logging`` (pika, urllib3, TensorFlow's and absl's Python loggers, the
trainer), ``warnings.warn`` and uncaught exceptions are rendered by the same processors
(``structlog.stdlib.ProcessorFormatter``) to the same file: every line is one JSON object.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import MutableMapping
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TextIO

import structlog

_secrets: set[str] = set()
_secrets_lock = threading.Lock()
_REDACTED = "[REDACTED]"
SECRET_KEYS = frozenset({"token", "password", "authorization", "rodan_password", "broker_url"})

log = structlog.get_logger("logs")


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
    """JSON lines to ``log_file`` (appended, 0600) or ``stream`` (default stderr).

    Our own structlog events and every standard-library ``logging`` record (pika, urllib3,
    TensorFlow's and absl's Python loggers, the trainer, ``warnings.warn``) go through the same
    processors: timestamp, level, component, bound context, tracebacks as a field, redaction,
    one JSON object per line. Records below ``level`` are dropped; pika's, but for its critical
    ones, below DEBUG.
    """
    out: Any = _open_append(log_file) if log_file is not None else (stream if stream is not None else sys.stderr)
    _settings.update(level=level, component=component, out=out)
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_component(component),
    ]
    rendering: list[Any] = [
        structlog.processors.format_exc_info,
        _redaction_processor,
        structlog.processors.JSONRenderer(sort_keys=False),
    ]
    structlog.configure(
        processors=[*shared, *rendering],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    _route_stdlib_logging(out, numeric, shared, rendering)


class _JSONLineHandler(logging.Handler):
    """Writes formatted records through a ``structlog.WriteLogger`` on the same file as the events,
    so that both share its lock and a line is never split by another thread's."""

    def __init__(self, out: Any, level: int) -> None:
        super().__init__(level)
        self._writer = structlog.WriteLogger(out)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._writer.msg(self.format(record))
        except Exception:
            self.handleError(record)


_handler: _JSONLineHandler | None = None


def _route_stdlib_logging(out: Any, level: int, shared: list[Any], rendering: list[Any]) -> None:
    """Replace the root logger's handler by one that renders records like our events."""
    global _handler
    handler = _JSONLineHandler(out, level)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *rendering],
        )
    )
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    root.addHandler(handler)
    _handler = handler
    # Lowered only: another handler on the root (a test's capture) keeps getting what it got.
    if root.level == logging.NOTSET or level < root.level:
        root.setLevel(level)
    # pika logs each connection attempt, and its failures at ERROR, which the bridge reports in its
    # own events (broker_unavailable, ...): below DEBUG, only its critical lines get through.
    logging.getLogger("pika").setLevel(logging.CRITICAL if level > logging.DEBUG else logging.INFO)
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger
    if sys.excepthook in (sys.__excepthook__, _log_uncaught):
        sys.excepthook = _log_uncaught
    if threading.excepthook in (threading.__excepthook__, _log_uncaught_in_thread):
        threading.excepthook = _log_uncaught_in_thread


def _log_uncaught(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """An exception nobody caught ends the process as a JSON line too (Ctrl-C stays as it was)."""
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)
        return
    try:
        log.critical("uncaught_exception", exc_info=(kind, value, tb))
    except Exception:
        sys.__excepthook__(kind, value, tb)


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    try:
        thread = args.thread.name if args.thread is not None else None
        log.critical("uncaught_exception", thread=thread, exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
    except Exception:
        threading.__excepthook__(args)


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
