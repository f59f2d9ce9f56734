"""A RabbitMQ node of the tests' own, beside the shared one on 5672: its own node name, ports, data
and log directories and Erlang cookie, and the ``max_message_size`` a test needs, set in its
``rabbitmq.conf`` before it boots. Tests stop and restart it (tests/test_fault_broker.py) or publish
into a broker with a smaller limit than the shared one (RabbitMQ 4.x's 16 MiB:
tests/test_reply_parts.py, tests/test_rodan3_bridge.py) without touching the shared broker.

The fixtures are in tests/conftest.py: ``private_broker`` (one node per test session and limit)
and ``node`` (that node, running). A test says which limit it needs with :func:`private_node`:

    @private_node(max_message_size=16 * 1024 * 1024)
    def test_x(node: PrivateBroker) -> None: ...

and gets the ``broker`` marker and the xdist group :data:`GROUP` from tests/conftest.py: under
pytest-xdist's ``--dist loadgroup`` (deploy/dev/test.sh) every test on a private node runs in one
worker, one after another, so that two nodes never boot at once on 2 cores (one then failed to
start), and pytest stops one limit's node before it starts the next.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.wait import wait_until

RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")  # the real scripts (/usr/sbin's wrappers su to rabbitmq)
#: The pytest-xdist group of every test that uses a private node.
GROUP = "private_broker"
#: The fixture that a test's limit parametrises (indirectly).
FIXTURE = "private_broker"


def private_node(*, max_message_size: int) -> pytest.MarkDecorator:
    """Run the marked test on a private node whose ``max_message_size`` is this (in bytes)."""
    return pytest.mark.parametrize(
        FIXTURE, [max_message_size], indirect=True, ids=[f"max_message_size={max_message_size}"]
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class PrivateBroker:
    """A RabbitMQ node of its own: ``stop_app``/``start_app`` and full stop/start never touch 5672."""

    def __init__(self, base: Path, max_message_size: int) -> None:
        self.base = base
        self.max_message_size = max_message_size
        self.node = f"hpcb-private-{os.getpid()}-{uuid.uuid4().hex[:6]}@localhost"
        self.port = free_port()
        dist = free_port()
        base.mkdir(parents=True, exist_ok=True)
        cookie = base / ".erlang.cookie"
        cookie.write_text(uuid.uuid4().hex.upper())
        cookie.chmod(0o400)
        (base / "enabled_plugins").write_text("[].\n")
        (base / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{self.port}\nloopback_users.guest = true\n"
            f"max_message_size = {max_message_size}\n"
        )
        (base / "rabbitmq-env.conf").write_text("")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        self.env.update(
            HOME=str(base),  # the Erlang cookie of this node and of its CLI
            RABBITMQ_NODENAME=self.node,
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(dist),
            RABBITMQ_MNESIA_BASE=str(base / "mnesia"),
            RABBITMQ_LOG_BASE=str(base / "log"),
            RABBITMQ_PID_FILE=str(base / "rabbit.pid"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(base / "enabled_plugins"),
            RABBITMQ_CONFIG_FILE=str(base / "rabbitmq.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(base / "advanced.config"),
            RABBITMQ_CONF_ENV_FILE=str(base / "rabbitmq-env.conf"),
        )
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    def ctl(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(RABBIT_BIN / "rabbitmqctl"), "-n", self.node, *args],
            env=self.env,
            cwd=self.base,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2):
                return True
        except OSError:
            return False

    def start(self) -> None:
        subprocess.run(
            [str(RABBIT_BIN / "rabbitmq-server"), "-detached"], env=self.env, cwd=self.base, check=True, timeout=60
        )
        wait_until(lambda: self.ctl("-q", "ping", timeout=30).returncode == 0, 90, 0.5, "the private node to boot")
        result = self.ctl("await_startup", "--timeout", "90", timeout=120)
        assert result.returncode == 0, result.stderr
        wait_until(self.answers, 30, 0.2, "the private node's AMQP listener")

    def stop_app(self) -> None:
        assert self.ctl("stop_app").returncode == 0
        wait_until(lambda: not self.answers(), 30, 0.1, "the listener to close")

    def start_app(self) -> None:
        assert self.ctl("start_app").returncode == 0
        wait_until(self.answers, 60, 0.2, "the listener to open")

    def stop(self) -> None:
        """A full stop of the node (the Erlang VM exits)."""
        self.ctl("stop", timeout=120)
        pid_file = self.base / "rabbit.pid"
        if pid_file.exists():
            pid = int(pid_file.read_text().strip() or 0)
            wait_until(lambda: not alive(pid), 60, 0.2, "the node's VM to exit")

    def kill(self) -> None:
        """Last resort at teardown: our own node's VM, by its pid file."""
        pid_file = self.base / "rabbit.pid"
        if pid_file.exists() and (text := pid_file.read_text().strip()) and alive(int(text)):
            os.kill(int(text), signal.SIGKILL)

    def running(self) -> PrivateBroker:
        """This node, started again if a test left it stopped (its app, or the whole VM)."""
        if not self.answers():
            if self.ctl("-q", "ping", timeout=30).returncode == 0:
                self.start_app()
            else:
                self.start()
        return self


@contextmanager
def private_broker_running(base: Path, max_message_size: int) -> Iterator[PrivateBroker]:
    """A private node in ``base`` (keep the path short: Erlang and RabbitMQ dislike long socket and
    data paths), started; stopped, and its directory removed, on leaving the block."""
    if not (RABBIT_BIN / "rabbitmq-server").exists():
        if os.environ.get("RABBITMQ_URL"):  # the tests' broker is elsewhere: no server to start here
            pytest.skip("a private RabbitMQ node needs the rabbitmq-server package on this machine")
        pytest.fail("rabbitmq-server is not installed: deploy/dev/setup.sh installs it")
    broker = PrivateBroker(base, max_message_size)
    try:
        broker.start()
        yield broker
    finally:
        broker.stop()
        broker.kill()
        shutil.rmtree(base, ignore_errors=True)
