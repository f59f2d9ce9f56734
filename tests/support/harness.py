"""One test's bridge against the real services, as the end-to-end and fault tests drive it: cron
passes (``hpc-bridge check``) or a daemon (``hpc-bridge run``), and what came back to Rodan."""

from __future__ import annotations

import json
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.bridge import run_bridge, settled
from tests.support.broker import Rodan
from tests.support.cluster import Cluster, cancel_ledger_jobs
from tests.support.daemon import Daemon
from tests.support.wait import wait_until


class Harness:
    """One test's bridge: its settings (``env``, with ``HPC_LOG_FILE``), spool, scheduler, the
    replies Rodan received (raw bodies by correlation id), and its daemon when one was started."""

    def __init__(self, env: dict[str, str], spool: Path, rodan: Rodan, cluster: Cluster) -> None:
        self.env = env
        self.spool = spool
        self.rodan = rodan
        self.cluster = cluster
        self.replies: dict[str, list[bytes]] = defaultdict(list)
        self.argv_seen: list[str] = []  # every process's arguments, seen between cron passes
        self.daemon: Daemon | None = None

    @property
    def log(self) -> Path:
        return Path(self.env["HPC_LOG_FILE"])

    # --- running the bridge ----------------------------------------------------------------------

    def check(self, **extra: str) -> subprocess.CompletedProcess[str]:
        """One cron pass (``extra`` overrides settings for it), which must succeed; then collect."""
        result = run_bridge({**self.env, **extra}, "check", timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        self.collect()
        return result

    def drive(self, corrs: list[str], timeout: float, during: Callable[[], None] | None = None, **extra: str) -> None:
        """Cron passes until every request has a reply (bounded), watching process arguments and
        calling ``during`` between passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check(**extra)
            self.argv_seen += subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
            if during:
                during()
            if self.all_replied(corrs):
                return
            time.sleep(3)  # a pass costs a process start and the bridge's imports: no more often
        missing = [c for c in corrs if not self.replies.get(c)]
        raise AssertionError(f"no reply within {timeout} s for {missing}; log tail:\n{self.log_tail()}")

    def settle(self, corrs: list[str], timeout: float = 180) -> None:
        """Cron passes until the bridge has settled every request after its jobs ended
        (:func:`tests.support.bridge.settled`), then collect: no reply can come after that."""

        def done() -> bool:
            records = [self.spool / "ledger" / f"{corr}.json" for corr in corrs]
            jobs = [j for path in records if path.exists() for j in json.loads(path.read_text())["job_ids"]]
            if any(self.cluster.is_running(job_id) for job_id in jobs):
                return False
            self.check()
            return settled(self.spool, corrs)

        wait_until(done, timeout, 1, "the bridge to settle every request")
        self.collect()

    def start_daemon(self, **extra: str) -> Daemon:
        """``hpc-bridge run`` with these settings (stopped at teardown)."""
        self.daemon = Daemon({**self.env, **extra}, self.log, self.spool)
        return self.daemon

    def teardown(self) -> None:
        """Stop the daemon, if any, and cancel every job this bridge submitted."""
        if self.daemon is not None:
            self.daemon.stop()
        cancel_ledger_jobs(self.spool, self.cluster)

    # --- what came back --------------------------------------------------------------------------

    def collect(self) -> dict[str, list[bytes]]:
        """Take every reply now in the reply queue; all replies so far."""
        for corr, body, _headers in self.rodan.drain():
            self.replies[corr or ""].append(body)
        return self.replies

    def all_replied(self, corrs: list[str]) -> bool:
        self.collect()
        return all(self.replies.get(c) for c in corrs)

    def reply(self, corr: str) -> dict[str, Any]:
        """The one reply of this request (fails on none or several)."""
        bodies = self.replies.get(corr, [])
        assert len(bodies) == 1, f"{len(bodies)} replies for {corr}"
        reply: dict[str, Any] = json.loads(bodies[0])
        return reply

    def error(self, corr: str) -> str:
        """The error of the one reply of this request ("" for models)."""
        return str(self.reply(corr).get("error", ""))

    def assert_one_reply_each(self, corrs: list[str], fragments: tuple[str, ...]) -> None:
        """Exactly one reply per request, an error with every fragment, and one job each."""
        self.check()  # one more pass: nothing else may come
        for corr in corrs:
            error = self.error(corr)
            assert all(f in error for f in fragments), error
            record = self.ledger(corr)
            assert record["state"] == "replied", record
            assert self.cluster.jobs_named(record["job_name"]) == [record["job_id"]], "one job per request"
        assert self.rodan.depth(self.rodan.queues.request) == 0

    # --- what the bridge left ----------------------------------------------------------------------

    def ledger(self, corr: str) -> dict[str, Any]:
        record: dict[str, Any] = json.loads((self.spool / "ledger" / f"{corr}.json").read_text())
        return record

    def log_events(self, name: str | None = None) -> list[dict[str, Any]]:
        """The bridge's log events (those named ``name``)."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        events = [json.loads(line) for line in lines if line.startswith("{")]
        return [e for e in events if name is None or e.get("event") == name]

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text().splitlines()[-30:]) if self.log.exists() else "(no log)"

    def job_output(self, corr: str) -> str:
        return "\n".join(p.read_text() for p in (self.spool / "jobs" / corr).glob("job-*.out"))
