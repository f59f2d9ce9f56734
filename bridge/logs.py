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

import atexit
import contextlib
import logging
import os
import re
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TextIO

import structlog

_secrets: set[str] = set()
_secrets_lock = threading.Lock()
#: The write end of the pipe to the process that relays file descriptor 2 after a crash (see
#: :func:`capture_native_stderr`): it carries the secrets registered after it was forked.
_guardian: dict[str, int | None] = {"lifeline": None}
_REDACTED = "[REDACTED]"
SECRET_KEYS = frozenset({"token", "password", "authorization", "rodan_password", "broker_url"})

log = structlog.get_logger("logs")


def register_secret(value: str | None) -> None:
    """Never let ``value`` appear in a log line from now on."""
    if value and len(value) >= 4:
        with _secrets_lock:
            _secrets.add(value)
            if _guardian["lifeline"] is not None:  # it redacts what it relays after a crash too
                with contextlib.suppress(OSError):
                    os.write(_guardian["lifeline"], value.encode() + b"\0")


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


class ReopeningFile:
    """``HPC_LOG_FILE``, appended to, and reopened by the first line written after it was rotated.

    Why the file's identity is looked at before each line, rather than a reopen on SIGHUP: the
    bridge runs both as a daemon and as cron's one-pass ``check``, several of which may be running
    when logrotate does; a signal would need a pidfile per process and a ``postrotate`` that finds
    them all (and SIGHUP's default action kills a process that has not installed a handler yet,
    e.g. one still importing). Comparing the path's device and inode with the open file's (what
    the standard library's ``WatchedFileHandler`` does) needs nothing from logrotate but a rename
    (``create``, no ``copytruncate``), and it costs one ``stat`` per line, a few microseconds
    beside the line's own formatting. A line written between the ``stat`` and logrotate's rename
    goes to the renamed file: it is in the rotated log, once, never lost (``copytruncate`` lost the
    lines written between its copy and its truncation). When the path cannot be reopened (its
    folder gone, no permission), the lines keep going to the open file and the next line tries
    again: logging never fails because of a rotation.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._handle = _open_append(path)
        self._identity = self._identity_of(self._handle)

    @staticmethod
    def _identity_of(handle: TextIO) -> tuple[int, int]:
        status = os.fstat(handle.fileno())
        return status.st_dev, status.st_ino

    def _current(self) -> TextIO:
        """The open file, reopened first when the path now names another file (or none)."""
        try:
            status = os.stat(self.path)
        except OSError:
            status = None
        if status is not None and (status.st_dev, status.st_ino) == self._identity:
            return self._handle
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = self.path.open("a", encoding="utf-8", buffering=1)
        except OSError:
            return self._handle  # the line still goes somewhere; the next one tries again
        with contextlib.suppress(OSError):  # logrotate's "create 0600" made it so already
            os.chmod(self.path, 0o600)
        old, self._handle, self._identity = self._handle, handle, self._identity_of(handle)
        with contextlib.suppress(OSError, ValueError):
            old.close()
        return handle

    def write(self, text: str) -> int:
        with self._lock:
            return self._current().write(text)

    def flush(self) -> None:
        with self._lock:
            self._handle.flush()

    def fileno(self) -> int:
        with self._lock:
            return self._handle.fileno()

    def close(self) -> None:
        with self._lock:
            self._handle.close()


def configure_logging(
    *,
    level: str = "INFO",
    log_file: Path | None = None,
    stream: LogStream | None = None,
    component: str = "bridge",
) -> None:
    """JSON lines to ``log_file`` (appended, 0600, reopened after logrotate renamed it: see
    :class:`ReopeningFile`) or ``stream`` (default stderr).

    Our own structlog events and every standard-library ``logging`` record (pika, urllib3,
    TensorFlow's and absl's Python loggers, the trainer, ``warnings.warn``) go through the same
    processors: timestamp, level, component, bound context, tracebacks as a field, redaction,
    one JSON object per line. Records below ``level`` are dropped; pika's, but for its critical
    ones, below DEBUG.
    """
    out: Any = ReopeningFile(log_file) if log_file is not None else (stream if stream is not None else sys.stderr)
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


# --- file descriptor 2 -------------------------------------------------------------------------

#: The severity a line on file descriptor 2 names: absl's prefix (``I0000 00:00:...``), TensorFlow's
#: older C++ one (``2024-01-01 12:00:00.000000: W tensorflow/...``), or a leading word.
_NATIVE_SEVERITY = re.compile(
    r"(?:([IWEF])\d{4} |\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: ([IWEF]) |(WARNING|ERROR|FATAL|Fatal Python error)\b)"
)
_SEVERITY = {"I": "info", "W": "warning", "E": "error", "F": "critical", "WARNING": "warning", "ERROR": "error"}
#: A longer run of bytes without a newline is logged in pieces of this size.
_NATIVE_LINE_MAX = 1 << 16
#: The socket's send buffer, if the kernel allows: a burst of lines does not block the writer.
_SOCKET_BYTES = 1 << 20
#: An unfinished line stays in the socket (where the guardian finds it after a crash) this long.
_PARTIAL_WAIT_S, _PARTIAL_POLL_MS = 1.0, 10
#: What the guardian leaves pending: the scheduler's warnings and Ctrl-C are the worker's to handle.
_GUARDIAN_BLOCKS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}


def native_severity(line: str) -> str:
    """The level a line written to file descriptor 2 is logged at (``warning`` when it names none)."""
    match = _NATIVE_SEVERITY.match(line)
    if match is None:
        return "warning"
    return _SEVERITY.get(next(group for group in match.groups() if group), "critical")


def _log_native_line(raw: bytes, **extra: Any) -> None:
    line = raw.decode("utf-8", "replace").rstrip("\r\n")
    if not line.strip():
        return
    severity = native_severity(line)
    if severity == "info":
        log.info("native_stderr", line=line, **extra)
    elif severity == "warning":
        log.warning("native_stderr", line=line, **extra)
    elif severity == "error":
        log.error("native_stderr", line=line, **extra)
    else:
        log.critical("native_stderr", line=line, **extra)


def _log_native_lines(data: bytes, fallback: int, **extra: Any) -> bytes:
    """Log every complete line of ``data``; return what follows the last newline."""
    *lines, rest = data.split(b"\n")
    if len(rest) >= _NATIVE_LINE_MAX:
        lines.append(rest)
        rest = b""
    for line in lines:
        try:
            _log_native_line(line, **extra)
        except Exception:  # the log itself fails: the line still goes somewhere (never back to fd 2)
            with contextlib.suppress(OSError):
                os.write(fallback, line + b"\n")
    return rest


def _relay(sock: socket.socket, wake_fd: int, fallback: int) -> None:
    """The reader thread: log what arrives until no writer is left, or until woken to stop (then
    what is already there, and the partial last line, are logged first).

    Bytes are peeked, logged, and only then taken out of the socket: when the process dies in
    between (a crash), the guardian finds them still there. An unfinished line is left in the socket
    while more of it may come (a crash trace is written piece by piece), up to ``_PARTIAL_WAIT_S``.
    """
    pending, stopping = b"", False
    partial, since = 0, 0.0  # the unfinished line left in the socket: its length, and since when
    try:
        while True:
            if not stopping:
                poller = select.poll()
                poller.register(wake_fd, select.POLLIN)
                if not partial:
                    poller.register(sock.fileno(), select.POLLIN)
                ready = poller.poll(_PARTIAL_POLL_MS if partial else None)
                stopping = any(fd == wake_fd for fd, _ in ready)
            try:
                data = sock.recv(_NATIVE_LINE_MAX, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                if stopping:
                    break
                continue
            if not data:
                break  # no writer left
            end = data.rfind(b"\n") + 1
            if not end and not stopping and len(data) < _NATIVE_LINE_MAX:
                if len(data) != partial:
                    partial, since = len(data), time.monotonic()
                if time.monotonic() - since < _PARTIAL_WAIT_S:
                    continue
            end = end or len(data)
            pending = _log_native_lines(pending + data[:end], fallback)
            while end > 0:
                end -= len(sock.recv(end))
            partial = 0
        _log_native_lines(pending + b"\n", fallback)
    finally:
        sock.close()
        os.close(wake_fd)


def _start_guardian(sock: socket.socket, writer: socket.socket, fallback: int) -> int | None:
    """Fork a process that waits for this one to end, then logs what is left in the socket: what a
    crash wrote last (faulthandler, "Fatal Python error", a C++ FATAL line) that the reader thread,
    gone with the process, could not. Returns the write end of its lifeline, which also carries the
    secrets registered from now on (closing it lets the guardian go)."""
    life_read, life_write = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(life_read)
        os.close(life_write)
        return None
    if pid:
        os.close(life_read)
        return life_write
    status = 0
    try:  # the forked process: no handler of the worker's runs here; Ctrl-C or SIGTERM wait for the end
        signal.pthread_sigmask(signal.SIG_BLOCK, _GUARDIAN_BLOCKS)
        writer.close()
        os.close(life_write)
        received = b""
        while chunk := os.read(life_read, 4096):  # secrets registered meanwhile, until this process ends
            *values, received = (received + chunk).split(b"\0")
            for value in values:
                register_secret(value.decode("utf-8", "replace"))
        pending = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := sock.recv(_NATIVE_LINE_MAX, socket.MSG_DONTWAIT):
                pending = _log_native_lines(pending + chunk, fallback, process_ended=True)
        _log_native_lines(pending + b"\n", fallback, process_ended=True)
    except BaseException:
        status = 1
    finally:
        os._exit(status)


def _fileno(stream: Any) -> int:
    try:
        return int(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return -1


def capture_native_stderr() -> Callable[[], None]:
    """From now on, log every line written to file descriptor 2 as a ``native_stderr`` event.

    TensorFlow's and absl's C++ runtime, other native libraries, ``sys.stderr`` and a crash trace
    (faulthandler) write there directly, past ``logging``; this turns each of their lines into a
    JSON line through the same processors (level from the line's prefix, redaction, ``tee_logs_to``).
    Call it once, early (before TensorFlow is imported), after :func:`configure_logging` and
    before other threads start. File descriptor 2 becomes one end of a socket pair read by a
    daemon thread; a forked guardian logs what is left there when the process dies without exiting
    (a crash). Returns the function that gives file descriptor 2 back and logs the last partial
    line; it also runs at exit.
    """
    if not _settings:
        configure_logging()
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    if _fileno(_settings["out"]) == 2:  # logging to fd 2 itself: keep writing there, not to the socket
        out = open(os.dup(2), "w", encoding="utf-8", errors="backslashreplace", buffering=1)
        configure_logging(level=_settings["level"], stream=out, component=_settings["component"])
    for stream in (sys.stdout, _settings["out"]):  # nothing buffered is written twice by the guardian
        with contextlib.suppress(Exception):
            stream.flush()
    saved = os.dup(2)
    sock, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(OSError):
        writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BYTES)
    lifeline = _start_guardian(sock, writer, saved)
    _guardian["lifeline"] = lifeline
    os.dup2(writer.fileno(), 2)
    writer.close()
    wake_read, wake_write = os.pipe()
    reader = threading.Thread(target=_relay, args=(sock, wake_read, saved), name="native-stderr", daemon=True)
    reader.start()
    done = threading.Lock()

    def restore() -> None:
        if not done.acquire(blocking=False):
            return
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)  # the socket's last writer, unless a child still holds it: the reader may end now
        with contextlib.suppress(OSError):
            os.write(wake_write, b"x")
        reader.join(timeout=10)
        os.close(wake_write)
        if not reader.is_alive():  # else it may still log, or fall back to ``saved``
            if lifeline is not None:
                with _secrets_lock:
                    _guardian["lifeline"] = None
                os.close(lifeline)  # the guardian finds the socket empty and ends
            os.close(saved)
        atexit.unregister(restore)

    atexit.register(restore)
    return restore
