"""systemd's notify protocol (``sd_notify``) without systemd's libraries: one datagram per message.

Under ``Type=notify`` systemd passes ``$NOTIFY_SOCKET`` (a path, or ``@name`` for an abstract
socket) and, with ``WatchdogSec=``, ``$WATCHDOG_USEC`` (and possibly ``$WATCHDOG_PID``). The daemon
sends:

* ``READY=1`` once, after its first broker connection (``systemctl start`` returns then; until
  then ``STATUS=`` says what it is waiting for, and ``TimeoutStartSec=`` applies);
* ``WATCHDOG=1`` from its own loop, at most every ``WATCHDOG_USEC``/4 and so at least every half
  of it while the loop turns. The ping is sent by the thread that services the broker connection,
  never by a side thread, so a loop that hangs stops pinging and systemd restarts the daemon;
* ``STATUS=...``: one line for ``systemctl status`` (connected or not, requests in flight, jobs);
* ``STOPPING=1`` once the loop has seen SIGTERM (the message in hand is still finished).

Nothing here is called from a signal handler. Without ``$NOTIFY_SOCKET`` every call does nothing.
A failed send is logged once and never raised: systemd supervision must not end the daemon.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import MutableMapping

import structlog

log = structlog.get_logger(__name__)

ENV_SOCKET = "NOTIFY_SOCKET"
ENV_WATCHDOG_USEC = "WATCHDOG_USEC"
ENV_WATCHDOG_PID = "WATCHDOG_PID"
#: A STATUS= line longer than this is cut (systemd shows one line; keep datagrams small).
MAX_STATUS_CHARS = 200


def _address(value: str) -> str | bytes | None:
    """``$NOTIFY_SOCKET`` as a socket address: a path, or an abstract name (leading ``@``)."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode("utf-8")
    if value.startswith("/"):
        return value
    return None  # vsock: and other forms systemd may pass: not supported, stay silent


def watchdog_interval(environ: MutableMapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds systemd waits for a ``WATCHDOG=1``, or None when no watchdog is asked of this process."""
    env = os.environ if environ is None else environ
    usec = env.get(ENV_WATCHDOG_USEC, "").strip()
    if not usec:
        return None
    owner = env.get(ENV_WATCHDOG_PID, "").strip()
    if owner and owner != str(os.getpid() if pid is None else pid):
        return None  # meant for another process (e.g. our parent's)
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1e6 if value > 0 else None


class Notifier:
    """Sends notify messages to systemd (or to a test's socket); inert when not asked for."""

    def __init__(self, environ: MutableMapping[str, str] | None = None, *, unset_environment: bool = True) -> None:
        env = os.environ if environ is None else environ
        raw = env.get(ENV_SOCKET, "")
        self.address = _address(raw) if raw else None
        self.watchdog_s = watchdog_interval(env)
        if unset_environment:
            # As sd_notify(unset_environment=1): child processes (sbatch, the batch jobs it
            # submits with the login environment) must not inherit them.
            for name in (ENV_SOCKET, ENV_WATCHDOG_USEC, ENV_WATCHDOG_PID):
                env.pop(name, None)
        self._socket: socket.socket | None = None
        self._last_ping = 0.0
        self._status = ""
        self._ready = False
        self._stopping = False
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        """Send ``lines`` as one datagram; True when it was sent."""
        if self.address is None:
            return False
        payload = "\n".join(lines).encode("utf-8")
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._socket.sendto(payload, self.address)
        except OSError as exc:
            if not self._failed:  # once: a missing socket would otherwise log at every ping
                log.warning("sd_notify_failed", error=f"{type(exc).__name__}: {exc}")
                self._failed = True
            return False
        self._failed = False
        return True

    def ready(self, status: str = "") -> None:
        """``READY=1`` (once), with a STATUS= line when given."""
        if self._ready:
            if status:
                self.status(status)
            return
        self._ready = True
        lines = ["READY=1"]
        if status:
            self._status = self._line(status)
            lines.append(f"STATUS={self._status}")
        if self.notify(*lines):
            log.info("sd_notify_ready", watchdog_s=self.watchdog_s)

    def status(self, text: str) -> None:
        """``STATUS=text`` when it changed."""
        line = self._line(text)
        if line != self._status:
            self._status = line
            self.notify(f"STATUS={line}")

    def watchdog(self, now: float | None = None) -> None:
        """``WATCHDOG=1`` when a quarter of the watchdog interval has passed since the last one."""
        if self.watchdog_s is None or self.address is None:
            return
        now = time.monotonic() if now is None else now
        if now - self._last_ping >= self.watchdog_s / 4:
            self._last_ping = now
            self.notify("WATCHDOG=1")

    def stopping(self, status: str = "stopping") -> None:
        """``STOPPING=1`` (once)."""
        if self._stopping:
            return
        self._stopping = True
        self._status = self._line(status)
        self.notify("STOPPING=1", f"STATUS={self._status}")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    @staticmethod
    def _line(text: str) -> str:
        flat = " ".join(text.split())
        return flat if len(flat) <= MAX_STATUS_CHARS else flat[: MAX_STATUS_CHARS - 1] + "…"
