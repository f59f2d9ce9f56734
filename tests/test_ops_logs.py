"""``hpc-bridge logs``: one request's bridge, worker and scheduler events, merged in time order."""

from __future__ import annotations

import argparse
import calendar
import gzip
import json
import os
import time
from typing import Any

import pytest

from bridge.ledger import Ledger, RequestRecord
from bridge.logs import register_secret
from bridge.ops import request_log
from bridge.spool import Spool
from tests.support.bridge import FAST_SETTINGS, NO_FRESH_STARTS, RODAN_PASSWORD, bridge_environ, run_bridge
from tests.support.cluster import cancel_spool_jobs

CORR = "5f0c2a9e-1111-4000-8000-000000000001"
TWIN = "5f0c2a9e-2222-4000-8000-000000000002"  # shares the prefix 5f0c2a9e-

#: A secret planted in a fake scheduler output to see it redacted; not one of the suite's real test
#: secrets, which tests/test_fault_secrets.py requires to be absent from every file left behind. Long
#: enough to straddle the display's cut of long values (a cut before redacting showed its first part).
PLANTED_SECRET = "planted-in-scheduler-output-4e1f"


def line(ts: str, event: str, corr: str = CORR, **fields: Any) -> str:
    return json.dumps({"event": event, "correlation_id": corr, "level": "info", "timestamp": ts, **fields}) + "\n"


@pytest.fixture
def fabricated(make_config, tmp_path):
    """A spool, bridge log (with a rotated, gzipped part), run directory and job output for CORR."""
    log_file = tmp_path / "bridge.log"
    config = make_config(HPC_LOG_FILE=str(log_file), RODAN_PASSWORD=PLANTED_SECRET)  # no Rodan call here
    spool = Spool(config.spool_dir).ensure()
    for corr in (CORR, TWIN):
        Ledger(spool).save(RequestRecord(correlation_id=corr, key=corr, reply_to="hpc-results"))
    with gzip.open(tmp_path / "bridge.log.2.gz", "wt") as handle:
        handle.write(line("2026-01-01T10:00:00.000000Z", "request_received"))
    (tmp_path / "bridge.log.1").write_text(line("2026-01-01T10:00:01.000000Z", "request_submitted", job_id="61"))
    log_file.write_text(
        line("2026-01-01T10:00:02.000000Z", "request_received", corr=TWIN)
        + line("2026-01-01T10:05:00.000000Z", "reply_published", outcome="ok", bytes=12345)
        + "pika WARNING not json\n"
    )
    run_dir = spool.root / "runs" / f"20260101-100003-{CORR}"
    run_dir.mkdir(parents=True)
    worker_lines = [
        line("2026-01-01T10:00:03.000000Z", "job_start", job_id="61", run_dir=str(run_dir)),
        line("2026-01-01T10:01:00.000000Z", "epoch", job_id="61", label="Model 0", loss=0.5, note="x" * 200),
        line("2026-01-01T10:04:00.000000Z", "job_trained", job_id="61", ok=True),
    ]
    (run_dir / "job.log").write_text("".join(worker_lines))
    job_dir = spool.job_dir(CORR)
    job_dir.mkdir(parents=True)
    (job_dir / "job.sh").write_text("#!/bin/sh\necho not a log\n")
    output = job_dir / "job-61.out"
    output.write_text(worker_lines[0] + f"Traceback: a plain line mentioning {PLANTED_SECRET}\n")
    stamp = calendar.timegm(time.strptime("2026-01-01 10:04:30", "%Y-%m-%d %H:%M:%S"))
    os.utime(output, (stamp, stamp))
    register_secret(PLANTED_SECRET)
    return config


def run_logs(config: Any, wanted: str, *, as_json: bool = False) -> int:
    return request_log.run(config, argparse.Namespace(correlation_id=wanted, json=as_json, follow=False))


def test_merges_bridge_worker_and_scheduler_in_time_order(fabricated, capsys):
    assert run_logs(fabricated, CORR) == 0
    out = capsys.readouterr().out.splitlines()
    columns = [(row.split()[2], row.split()[3]) for row in out]
    assert columns == [
        ("bridge", "request_received"),
        ("bridge", "request_submitted"),
        ("worker", "job_start"),
        ("worker", "epoch"),
        ("worker", "job_trained"),
        ("scheduler", "output"),  # no timestamp: its file's mtime; its JSON copy of job_start is left out
        ("bridge", "reply_published"),
    ]
    assert out[0].startswith("2026-01-01 10:00:00.000  bridge")
    assert "job_id=61" in out[1] and "loss=0.5" in out[3] and "x" * 100 not in out[3] and "..." in out[3]
    assert PLANTED_SECRET not in "\n".join(out) and "[REDACTED]" in out[5]
    assert TWIN not in "\n".join(out)

    assert run_logs(fabricated, CORR, as_json=True) == 0
    events = [json.loads(row) for row in capsys.readouterr().out.splitlines()]
    assert [e["source"] for e in events] == ["bridge", "bridge", "worker", "worker", "worker", "scheduler", "bridge"]
    assert events[3]["note"] == "x" * 200 and events[3]["loss"] == 0.5


def test_prefix_ambiguous_and_unknown_ids(fabricated, capsys):
    assert run_logs(fabricated, "5f0c2a9e-1") == 0
    assert "job_trained" in capsys.readouterr().out
    assert run_logs(fabricated, "5f0c2a9e") == 2
    err = capsys.readouterr().err
    assert "ambiguous" in err and CORR in err and TWIN in err
    assert run_logs(fabricated, "0000dead") == 1
    assert "no request '0000dead'" in capsys.readouterr().err


@pytest.mark.training
def test_a_real_request_end_to_end(broker_url, standin, queues, rodan, sample_inputs, tmp_path, slurm):
    spool = tmp_path / "spool"
    env = bridge_environ(
        broker_url, standin, queues, spool, HPC_LOG_FILE=str(tmp_path / "bridge.log"), HPC_TRAINING_SEED="1",
        HPC_JOB_PROLOGUE=NO_FRESH_STARTS,
    )  # fmt: skip
    corr = rodan.publish_request(sample_inputs("new", n_layers=1, height=256, width=320, seed=8), FAST_SETTINGS)
    try:
        deadline = time.monotonic() + 600  # a real training: its job may wait for room on a busy node
        while not (spool / "replies" / f"{corr}.json").exists():
            assert time.monotonic() < deadline, (tmp_path / "bridge.log").read_text()[-3000:]
            assert run_bridge(env, "check").returncode == 0
            time.sleep(1)
    finally:
        cancel_spool_jobs(spool)
    shown = run_bridge(env, "logs", corr[:8], "--json")
    assert shown.returncode == 0, shown.stderr
    events = [json.loads(row) for row in shown.stdout.splitlines()]
    sources = {e["source"] for e in events}
    assert {"bridge", "worker"} <= sources
    names = [(e["source"], e["event"]) for e in events]
    marker = json.loads((spool / "replies" / f"{corr}.json").read_text())
    assert marker["outcome"] == "ok", names
    for earlier, later in [
        (("bridge", "request_received"), ("bridge", "request_submitted")),
        (("bridge", "request_submitted"), ("worker", "job_start")),
        (("worker", "job_start"), ("worker", "epoch")),
        (("worker", "epoch"), ("worker", "job_trained")),
    ]:
        assert earlier in names and later in names and names.index(earlier) < names.index(later), names
    stamps = [e["timestamp"] for e in events if "timestamp" in e]
    assert stamps == sorted(stamps)
    assert all(e.get("correlation_id") in (corr, None) for e in events)
    text = run_bridge(env, "logs", corr)
    assert text.returncode == 0 and "  worker     epoch  " in text.stdout and RODAN_PASSWORD not in text.stdout
