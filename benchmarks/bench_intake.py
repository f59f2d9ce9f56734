"""Intake throughput: N Rodan requests in the queue -> one `hpc-bridge check` pass -> N real Slurm jobs.

Measures the whole pass (one fresh process, as cron runs it) and, from the bridge's own JSON log,
where the time of each request goes: validation, the Rodan token (cached for 10 minutes), writing
the parameter file and batch script, sbatch, the ledger, and the ack. The jobs run /bin/true instead
of the worker (this measures the bridge, not training) and are cancelled afterwards.

    .venv/bin/python benchmarks/bench_intake.py --requests 100
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

import pika

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bridge.standin.samples import make_sample_page  # noqa: E402
from bridge.standin.server import RodanStandin, User  # noqa: E402

SETTINGS = {"Maximum time (D-HH:MM)": "0-00:05", "Maximum memory (MB)": 1024, "CPUs": 1}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--broker", default=os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"))
    args = parser.parse_args()

    tag = uuid.uuid4().hex[:8]
    request_q, reply_q, dead_q = f"bench-{tag}-jobs", f"bench-{tag}-results", f"bench-{tag}-dead"
    with (
        tempfile.TemporaryDirectory() as tmp_name,
        RodanStandin(Path(tmp_name), users=[User("hpc@example.org", "hpc", "bench-pw")]) as rodan,
    ):
        tmp = Path(tmp_name)
        inputs = make_sample_page(tmp, generation="new", n_layers=1)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "RODAN_", "HPC_"))}
        env.update(
            RABBITMQ_URL=args.broker,
            RODAN_HOST=rodan.host_port,
            RODAN_SCHEME="http",
            RODAN_USER="hpc@example.org",
            RODAN_PASSWORD="bench-pw",
            HPC_REQUEST_QUEUE=request_q,
            HPC_REPLY_QUEUE=reply_q,
            HPC_DEAD_LETTER_QUEUE=dead_q,
            HPC_SPOOL_DIR=str(tmp / "spool"),
            HPC_WORKER_PYTHON="/bin/true",
            HPC_LOG_FILE=str(tmp / "bridge.log"),
        )
        connection = pika.BlockingConnection(pika.URLParameters(args.broker))
        channel = connection.channel()
        channel.queue_declare(request_q)
        channel.queue_declare(reply_q)
        body = json.dumps({"inputs": inputs, "settings": SETTINGS}).encode()
        for _ in range(args.requests):
            props = pika.BasicProperties(reply_to=reply_q, correlation_id=str(uuid.uuid4()))
            channel.basic_publish("", request_q, body, props)
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "bridge", "check"], env=env, cwd=REPO, capture_output=True)
        pass_s = time.monotonic() - started
        try:
            events = [json.loads(line) for line in (tmp / "bridge.log").read_text().splitlines()]
            per_request: dict[str, dict[str, float]] = {}
            for event in events:
                corr = event.get("correlation_id")
                if corr:
                    ts = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
                    per_request.setdefault(corr, {}).setdefault(event["event"], ts)
            submitted = [e for e in per_request.values() if "request_acked" in e and "request_received" in e]
            total = [(e["request_acked"] - e["request_received"]) * 1000 for e in submitted]
            sbatch = [(e["request_submitted"] - e["request_valid"]) * 1000 for e in submitted if "request_valid" in e]
        finally:
            for name in (request_q, reply_q, dead_q):
                channel.queue_delete(name)
            connection.close()
            for path in (tmp / "spool" / "ledger").glob("*.json"):
                subprocess.run(["scancel", "--name", json.loads(path.read_text())["job_name"]], capture_output=True)

    print(f"hpc-bridge check: {args.requests} requests into real Slurm (exit status {result.returncode})\n")
    print(f"{'metric':<46}{'value':>12}")
    print(f"{'requests submitted in the pass':<46}{len(submitted):>12}")
    print(f"{'whole pass, incl. process start (s)':<46}{pass_s:>12.2f}")
    print(f"{'throughput (requests/s)':<46}{len(submitted) / pass_s:>12.1f}")
    print(f"{'per request, received -> acked, p50 (ms)':<46}{statistics.median(total):>12.1f}")
    print(f"{'per request, received -> acked, p95 (ms)':<46}{percentile(total, 0.95):>12.1f}")
    print(f"{'per request, token+files+sbatch+ledger p50 (ms)':<46}{statistics.median(sbatch):>12.1f}")
    return 0 if len(submitted) == args.requests else 1


if __name__ == "__main__":
    raise SystemExit(main())
