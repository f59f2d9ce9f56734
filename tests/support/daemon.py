"""``hpc-bridge run`` as systemd runs it: one daemon process, its JSON log and its ledger."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.bridge import FAST_SETTINGS, REPO, clean_environ
from tests.support.wait import wait_until

#: One epoch in at most 2 GB: the daemon tests' requests.
DAEMON_SETTINGS = {**FAST_SETTINGS, "Maximum number of training epochs": 1, "Maximum memory (MB)": 2048}


class Daemon:
    """A running ``hpc-bridge run`` with only the given settings; started once it has connected."""

    def __init__(self, env: dict[str, str], log: Path, spool: Path) -> None:
        self.log, self.spool = log, spool
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bridge", "run"],
            env=clean_environ(env),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        wait_until(lambda: self.events("broker_connected"), 30, 0.1, "the daemon to connect")

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        events = [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]
        return [e for e in events if name is None or e["event"] == name]

    def record(self, corr: str) -> dict[str, Any] | None:
        path = self.spool / "ledger" / f"{corr}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def state(self, corr: str) -> str:
        record = self.record(corr)
        return record["state"] if record else ""

    def stop(self) -> int:
        """SIGTERM, and the exit status; killed (status -9) if it has not exited within 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


def connection_named(given: str) -> list[str]:
    """Broker-side ids (Erlang pids) of the connections whose client called itself ``given``."""
    out = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "--no-table-headers", "pid", "client_properties"],
        capture_output=True,
        text=True,
    ).stdout
    return [line.split("\t")[0] for line in out.splitlines() if f'{{"connection_name","{given}"}}' in line]
