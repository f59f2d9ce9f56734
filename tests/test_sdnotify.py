"""systemd's notify protocol: ``bridge/sdnotify.py`` and the daemon under a ``Type=notify`` unit.

No systemd is needed: the test binds the unix datagram socket systemd would pass as
``$NOTIFY_SOCKET`` and reads what the real ``hpc-bridge run`` sends to it, against the real broker.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bridge.config import load_config
from bridge.intake import Decision, Message, Outcome
from bridge.runner import Bridge
from bridge.sdnotify import Notifier, watchdog_interval
from tests.support.bridge import REPO, bridge_environ
from tests.support.cluster import cancel_spool_jobs
from tests.support.daemon import DAEMON_SETTINGS, Daemon
from tests.support.wait import wait_until


@dataclass
class NotifySocket:
    """What systemd does with ``$NOTIFY_SOCKET``: receive datagrams, remember when each came."""

    path: Path
    received: list[tuple[float, str]] = field(default_factory=list)  # (time.monotonic(), one line)

    def __post_init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            now = time.monotonic()
            self.received.extend((now, line) for line in data.decode().splitlines())

    def lines(self, prefix: str = "") -> list[str]:
        return [line for _t, line in list(self.received) if line.startswith(prefix)]

    def times(self, line: str) -> list[float]:
        return [t for t, got in list(self.received) if got == line]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    # AF_UNIX paths are limited to ~107 bytes: pytest's tmp_path may be longer.
    sock = NotifySocket(Path("/tmp") / f"hpc-notify-{uuid.uuid4().hex[:12]}.sock")
    yield sock
    sock.close()
    sock.path.unlink(missing_ok=True)


# --- the protocol, alone -------------------------------------------------------------------------


def test_notifier_sends_each_message_as_systemd_expects(notify_socket: NotifySocket) -> None:
    env = {"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "2000000", "KEEP": "1"}
    notifier = Notifier(env)
    assert env == {"KEEP": "1"}, "the variables are not passed on to child processes (sbatch, the jobs)"
    assert notifier.enabled and notifier.watchdog_s == 2.0
    notifier.status("connecting\nto the broker")
    notifier.ready("connected")
    notifier.ready("connected")  # once only
    notifier.watchdog(now=100.0)
    notifier.watchdog(now=100.2)  # within a quarter of the interval: not again
    notifier.watchdog(now=100.6)
    notifier.stopping()
    notifier.stopping()
    wait_until(lambda: notify_socket.lines("STOPPING=1"), 5, 0.05, "the datagrams")
    assert [line for _t, line in notify_socket.received] == [
        "STATUS=connecting to the broker",
        "READY=1",
        "STATUS=connected",
        "WATCHDOG=1",
        "WATCHDOG=1",
        "STOPPING=1",
        "STATUS=stopping",
    ]
    notifier.close()


def test_abstract_socket_names_are_understood() -> None:
    name = f"hpc-notify-test-{uuid.uuid4().hex}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind("\0" + name)
    server.settimeout(5)
    try:
        Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert server.recv(4096) == b"READY=1"
    finally:
        server.close()


def test_watchdog_only_for_this_process_and_nothing_without_a_socket(tmp_path: Path) -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "5000000", "WATCHDOG_PID": str(os.getpid())}) == 5.0
    assert watchdog_interval({"WATCHDOG_USEC": "5000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({}) is None
    silent = Notifier({})
    assert not silent.enabled and not silent.notify("READY=1")
    # A socket that went away is logged once and never raised: supervision must not end the daemon.
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "absent.sock"), "WATCHDOG_USEC": "1000000"})
    gone.ready()
    gone.watchdog(now=10.0)
    assert not gone.notify("WATCHDOG=1")


# --- the daemon -----------------------------------------------------------------------------------


@pytest.fixture
def daemon_env(broker_url, standin, queues, tmp_path, slurm):
    spool = tmp_path / "spool"
    env = bridge_environ(
        broker_url,
        standin,
        queues,
        spool,
        HPC_LOG_FILE=str(tmp_path / "bridge.log"),
        HPC_STATUS_QUEUE="none",
        HPC_WORKER_PYTHON="/bin/true",
        HPC_SCHEDULER_ARGS="--hold",
    )
    yield env, tmp_path / "bridge.log", spool
    cancel_spool_jobs(spool)


@pytest.mark.broker
@pytest.mark.slurm
def test_daemon_is_ready_after_connecting_pings_the_watchdog_and_says_stopping(
    daemon_env, notify_socket: NotifySocket, rodan, sample_inputs
) -> None:
    env, log, spool = daemon_env
    env = {**env, "NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "2000000"}
    daemon = Daemon(env, log, spool)
    try:
        wait_until(lambda: notify_socket.lines("READY=1"), 30, 0.05, "READY=1")
        ready_at = notify_socket.times("READY=1")[0]
        assert daemon.events("broker_connected"), "READY=1 comes after the broker connection"
        assert len(notify_socket.lines("READY=1")) == 1
        corr = rodan.publish_request(sample_inputs("new", n_layers=1), DAEMON_SETTINGS)
        wait_until(lambda: daemon.state(corr) == "submitted", 30, 0.1, "the request to be submitted")
        wait_until(lambda: len(notify_socket.times("WATCHDOG=1")) >= 6, 30, 0.1, "watchdog pings")
        pings = [t for t in notify_socket.times("WATCHDOG=1") if t >= ready_at]
        assert len(pings) >= 4, "the watchdog is fed while the daemon runs"
        status = notify_socket.lines("STATUS=")
        assert any("requests in flight" in s for s in status), status  # systemctl status shows counts
        assert not notify_socket.lines("STOPPING=1")
    finally:
        assert daemon.stop() == 0
    wait_until(lambda: notify_socket.lines("STOPPING=1"), 5, 0.05, "STOPPING=1")
    assert notify_socket.lines("STOPPING=1") == ["STOPPING=1"]


class _Forwarder:
    """A TCP port that refuses connections until ``open()``, then forwards them to the broker:
    a broker that comes up after the daemon has started."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()  # nothing listens on it now: connections are refused
        self.server: socket.socket | None = None
        self.links: list[socket.socket] = []

    def open(self) -> None:
        self.server = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        assert self.server is not None
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.links += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for s in self.links:
            s.close()


@pytest.mark.broker
def test_no_ready_until_the_broker_answers(broker_url, standin, queues, tmp_path, notify_socket) -> None:
    from urllib.parse import urlsplit

    parts = urlsplit(broker_url)
    if parts.scheme != "amqp":
        pytest.skip("a RABBITMQ_URL with amqps://: a forwarder on 127.0.0.1 would fail its TLS host name check")
    forwarder = _Forwarder((parts.hostname or "127.0.0.1", parts.port or 5672))
    url = broker_url.replace(parts.netloc, f"{parts.username}:{parts.password}@127.0.0.1:{forwarder.port}")
    log = tmp_path / "bridge.log"
    env = bridge_environ(url, standin, queues, tmp_path / "spool", HPC_LOG_FILE=str(log), HPC_STATUS_QUEUE="none")
    env.update(NOTIFY_SOCKET=str(notify_socket.path), WATCHDOG_USEC="2000000")
    full = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "RODAN_", "HPC_"))}
    full.update(env)
    proc = subprocess.Popen([sys.executable, "-m", "bridge", "run"], env=full, cwd=REPO, stdout=subprocess.DEVNULL)
    try:
        wait_until(lambda: any("waiting for the broker" in s for s in notify_socket.lines("STATUS=")), 30, 0.1)
        wait_until(lambda: len(notify_socket.lines("WATCHDOG=1")) >= 3, 30, 0.1, "pings while waiting")
        assert not notify_socket.lines("READY=1"), "not ready while the broker cannot be reached"
        assert proc.poll() is None
        forwarder.open()
        wait_until(lambda: notify_socket.lines("READY=1"), 90, 0.1, "READY=1 once the broker answers")
        assert "broker_connected" in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        forwarder.close()


@pytest.mark.broker
@pytest.mark.slurm
def test_watchdog_stops_when_the_helper_thread_hangs(
    broker_url, standin, queues, tmp_path, slurm, rodan, sample_inputs, notify_socket
) -> None:
    """A request whose handling never ends must not keep the daemon alive for ever: the pings go on
    while the helper thread works (a slow submit is normal), and stop once it has run longer than
    the daemon's bound, so systemd restarts the daemon."""
    env = bridge_environ(broker_url, standin, queues, tmp_path / "spool", HPC_STATUS_QUEUE="none")
    notifier = Notifier({"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "2000000"})
    bridge = Bridge(load_config(environ=env), notifier=notifier, hung_work_s=3.0)
    work: dict[str, float] = {}

    def stuck(msg: Message) -> Decision:
        if work:
            return Decision(Outcome.DUPLICATE, "test: handled once")
        work["start"] = time.monotonic()
        time.sleep(12)  # the "hung" call (it ends, so the test can)
        work["end"] = time.monotonic()
        return Decision(Outcome.DUPLICATE, "test: handled once")

    bridge.intake.process = stuck  # type: ignore[method-assign]
    runner = threading.Thread(target=bridge.run, daemon=True)
    runner.start()
    try:
        wait_until(lambda: notify_socket.lines("READY=1"), 30, 0.05, "READY=1")
        rodan.publish_request(sample_inputs("new", n_layers=1), DAEMON_SETTINGS)
        wait_until(lambda: "end" in work, 40, 0.1, "the stuck call to end")
        wait_until(lambda: [t for t in notify_socket.times("WATCHDOG=1") if t > work["end"]], 10, 0.1, "pings again")
    finally:
        bridge.request_stop()
        runner.join(60)
    pings = notify_socket.times("WATCHDOG=1")
    during = [t for t in pings if work["start"] <= t <= work["end"]]
    assert any(t < work["start"] + 2.5 for t in during), "pinged while the call was young"
    late = [t for t in during if t > work["start"] + 3 + 2.5]
    assert not late, f"pinged {len(late)} times after the call had run past the bound"
    assert not runner.is_alive()
