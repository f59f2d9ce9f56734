"""What the bridge benchmarks share: a throw-away deployment (spool, unique queues, the Rodan
stand-in, the environment a bridge process reads), publishing requests as Rodan does, reading the
ledger, and cleaning up the jobs and queues afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bridge.testing.rodan import RodanStandin, User  # noqa: E402
from bridge.testing.samples import make_sample_page  # noqa: E402

BROKER = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
SETTINGS = {"Maximum time (D-HH:MM)": "0-00:05", "Maximum memory (MB)": 1024, "CPUs": 1}
EMAIL, PASSWORD = "hpc@example.org", "bench-pw"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1) of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def load() -> str:
    """The 1-minute load average, printed next to every figure (2 cores; others share them)."""
    return f"{os.getloadavg()[0]:.2f}"


@dataclass
class Deployment:
    """One bridge deployment in a temporary directory, with its own queues."""

    tmp: Path
    rodan: RodanStandin
    inputs: dict[str, str]
    request_q: str
    reply_q: str
    dead_q: str
    env: dict[str, str]
    published: dict[str, float] = field(default_factory=dict)  # correlation id -> wall time of publish

    @property
    def spool(self) -> Path:
        return Path(self.env["HPC_SPOOL_DIR"])

    def body(self) -> bytes:
        return json.dumps({"inputs": self.inputs, "settings": SETTINGS}).encode()

    def ledger(self) -> list[dict[str, Any]]:
        records = []
        for path in (self.spool / "ledger").glob("*.json"):
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue  # being rewritten right now
        return records

    def submitted(self) -> dict[str, dict[str, Any]]:
        return {r["correlation_id"]: r for r in self.ledger() if r.get("submitted_at")}

    def bridge(self, *args: str, **popen: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "bridge", *args], env=self.env, cwd=REPO, **popen)

    def log_events(self) -> list[dict[str, Any]]:
        path = Path(self.env["HPC_LOG_FILE"])
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


class Publisher:
    """Publishes Rodan's request (transient, reply_to + uuid4 correlation id) on one connection."""

    def __init__(self, dep: Deployment) -> None:
        self.dep = dep
        self.connection = pika.BlockingConnection(pika.URLParameters(BROKER))
        self.channel = self.connection.channel()
        self.channel.queue_declare(dep.request_q)
        self.channel.queue_declare(dep.reply_q)
        self._body = dep.body()

    def publish(self) -> str:
        corr = str(uuid.uuid4())
        props = pika.BasicProperties(reply_to=self.dep.reply_q, correlation_id=corr)
        self.dep.published[corr] = time.time()
        self.channel.basic_publish("", self.dep.request_q, self._body, props)
        return corr

    def idle(self, seconds: float) -> None:
        """Wait while keeping the connection serviced."""
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            self.connection.process_data_events(time_limit=min(remaining, 1.0))

    def publish_at(self, offsets: Sequence[float]) -> None:
        """Publish one request at each offset (seconds from now, ascending)."""
        start = time.monotonic()
        for offset in offsets:
            self.idle(offset - (time.monotonic() - start))
            self.publish()

    def close(self) -> None:
        if self.connection.is_open:
            self.connection.close()


def cancel_jobs(dep: Deployment) -> int:
    """scancel every job the deployment's ledger knows (by id, in batches), until squeue shows none."""
    ids = {r["job_id"] for r in dep.ledger() if r.get("job_id")}
    for _ in range(5):  # a loaded slurmctld lets some cancellations of a big batch time out
        left = sorted(ids)
        for start in range(0, len(left), 100):
            subprocess.run(["scancel", *left[start : start + 100]], capture_output=True)
        listed = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
        ids &= set(listed)
        if not ids:
            break
        time.sleep(1)
    return len(ids)


@contextmanager
def deployment(*, hold: bool = True, **extra_env: str) -> Iterator[Deployment]:
    """A spool, unique queues, the stand-in; jobs, queues and the directory removed afterwards.

    ``hold`` submits every job held (``sbatch --hold``): still accepted by Slurm (a job id, a
    ledger entry, sacct), but it never takes the shared node's CPUs from other people's tests.
    """
    tag = uuid.uuid4().hex[:8]
    with (
        tempfile.TemporaryDirectory(prefix="hpc-bench-") as tmp_name,
        RodanStandin(Path(tmp_name), users=[User(EMAIL, "hpc", PASSWORD)]) as rodan,
    ):
        tmp = Path(tmp_name)
        inputs = make_sample_page(tmp, generation="new", n_layers=1)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "RODAN_", "HPC_"))}
        env.update(
            RABBITMQ_URL=BROKER,
            RODAN_HOST=rodan.host_port,
            RODAN_SCHEME="http",
            RODAN_USER=EMAIL,
            RODAN_PASSWORD=PASSWORD,
            HPC_REQUEST_QUEUE=f"bench-{tag}-jobs",
            HPC_REPLY_QUEUE=f"bench-{tag}-results",
            HPC_DEAD_LETTER_QUEUE=f"bench-{tag}-dead",
            HPC_SPOOL_DIR=str(tmp / "spool"),
            HPC_WORKER_PYTHON="/bin/true",
            HPC_LOG_FILE=str(tmp / "bridge.log"),
        )
        if hold:
            env["HPC_SCHEDULER_ARGS"] = "--hold"
        env.update(extra_env)
        dep = Deployment(
            tmp, rodan, inputs, env["HPC_REQUEST_QUEUE"], env["HPC_REPLY_QUEUE"], env["HPC_DEAD_LETTER_QUEUE"], env
        )
        try:
            yield dep
        finally:
            cancel_jobs(dep)
            try:
                connection = pika.BlockingConnection(pika.URLParameters(BROKER))
                channel = connection.channel()
                for name in (dep.request_q, dep.reply_q, dep.dead_q):
                    channel.queue_delete(name)
                connection.close()
            except pika.exceptions.AMQPError:
                pass


def sacct_names(job_ids: Sequence[str], names: set[str], margin: int = 200) -> dict[str, int]:
    """How many Slurm jobs (allocations, not steps) carry each of ``names``, among every job id from
    the lowest of ``job_ids`` to ``margin`` past the highest: a duplicate submission would be a second
    job of the same name in that range. (By id, not ``--name -S``: sacct's time window leaves out
    held jobs, which have no eligible time.)"""
    numbers = [int(j) for j in job_ids]
    counts = dict.fromkeys(names, 0)
    if not numbers:
        return counts
    ids = [str(i) for i in range(min(numbers), max(numbers) + margin + 1)]
    for start in range(0, len(ids), 500):
        out = subprocess.run(
            ["sacct", "-X", "-n", "-P", "-a", "-j", ",".join(ids[start : start + 500]), "-o", "JobID,JobName%100"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for line in out.splitlines():
            _, _, name = line.partition("|")
            if name in counts:
                counts[name] += 1
    return counts


def proc_stat(pid: int) -> tuple[float, float, int]:
    """(own user+system CPU seconds, that of its waited-for children, RSS bytes) of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    own = (int(fields[11]) + int(fields[12])) / ticks
    children = (int(fields[13]) + int(fields[14])) / ticks
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return own, children, rss
