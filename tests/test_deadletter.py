"""``hpc-bridge requeue-dead`` and ``hpc-bridge purge`` against the real broker, ``check`` and Slurm."""

from __future__ import annotations

import argparse
import json
import os
import pty
import subprocess
import sys
from pathlib import Path
from typing import Any

import pika
import pytest

from tests.support.bridge import FAST_SETTINGS, REPO, bridge_environ, run_bridge
from tests.support.cluster import cancel_spool_jobs


def ops(env: dict[str, str], *args: str, stdin: Any = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    """An operator command in a fresh process; stdin is not a terminal unless given one."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "RODAN_", "HPC_"))}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-m", "bridge", *args], env=full, stdin=stdin, capture_output=True, text=True, timeout=60,
        cwd=REPO,
    )  # fmt: skip


def check(env: dict[str, str], **extra: str) -> None:
    result = run_bridge({**env, **extra}, "check")
    assert result.returncode == 0, result.stderr[-2000:]


def peek(broker_url: str, queue: str) -> list[tuple[str | None, str | None, dict[str, Any]]]:
    """(correlation_id, reply_to, headers) of every message in ``queue``, all left in place."""
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    channel = connection.channel()
    seen = []
    while True:
        method, props, _body = channel.basic_get(queue, auto_ack=False)
        if method is None:
            break
        seen.append((props.correlation_id, props.reply_to, dict(props.headers or {})))
    channel.basic_nack(0, multiple=True, requeue=True)
    connection.close()
    return seen


def status(env: dict[str, str], *args: str) -> tuple[dict[str, dict[str, Any]], dict[str, int], list[str]]:
    """``hpc-bridge status``: its JSON rows by correlation id, its counters, and its table's lines."""
    result = ops(env, "status", "--json", *args)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    table = ops(env, "status", *args)
    assert table.returncode == 0, table.stderr
    assert all(len(line) <= 80 for line in table.stdout.splitlines()), table.stdout
    return {r["correlation_id"]: r for r in data["requests"]}, data["counters"], table.stdout.splitlines()


def row_of(lines: list[str], corr: str) -> list[str]:
    (line,) = [line for line in lines if line.startswith(corr[:8])]
    return line.split()


def events(log: Path, name: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [e for e in lines if e.get("event") == name]


@pytest.fixture
def env(broker_url, standin, queues, tmp_path):
    environ = bridge_environ(
        broker_url, standin, queues, tmp_path / "spool", HPC_LOG_FILE=str(tmp_path / "bridge.log"),
        HPC_SCHEDULER="slurm",
    )  # fmt: skip
    yield environ
    cancel_spool_jobs(tmp_path / "spool")


def test_purge_drops_exactly_the_chosen_and_asks_first(env, rodan, queues, broker_url, tmp_path):
    a, b, c = (rodan.publish(b"{not json") for _ in range(3))
    check(env)
    assert {x[0] for x in peek(broker_url, queues.dead)} == {a, b, c}

    listed = ops(env, "purge")  # nothing chosen: a list, nothing dropped
    assert listed.returncode == 0 and all(x in listed.stdout for x in (a, b, c)) and "not valid JSON" in listed.stdout
    refused = ops(env, "purge", "--id", a)  # no --yes and stdin is no terminal
    assert refused.returncode == 1 and "not a terminal" in refused.stderr
    unknown = ops(env, "purge", "--yes", "--id", "no-such-id", "--id", a)
    assert unknown.returncode == 1 and "no-such-id" in unknown.stderr
    assert sorted(x[0] or "" for x in peek(broker_url, queues.dead)) == sorted([a, b, c])

    dropped = ops(env, "purge", "--yes", "--id", a, "--id", b[:13])  # an exact id and a unique prefix
    assert dropped.returncode == 0, dropped.stderr
    left = peek(broker_url, queues.dead)
    assert [x[0] for x in left] == [c] and "not valid JSON" in left[0][2]["x-hpc-bridge-reason"]
    assert sorted(e["correlation_id"] for e in events(tmp_path / "bridge.log", "dead_letter_purged")) == sorted([a, b])

    # On a terminal it asks; "y" drops it.
    controller, terminal = pty.openpty()
    try:
        os.write(controller, b"y\n")
        asked = ops(env, "purge", "--id", c, stdin=terminal)
    finally:
        os.close(controller)
        os.close(terminal)
    assert asked.returncode == 0, asked.stderr
    assert "would drop 1 of 1" in asked.stdout and c in asked.stdout
    assert rodan.depth(queues.dead) == 0 and rodan.depth(queues.request) == 0


def test_requeue_after_rodan_refused_the_account_needs_force_then_submits(
    env, rodan, queues, broker_url, sample_inputs, tmp_path, slurm
):
    spool = tmp_path / "spool"
    corr = rodan.publish_request(sample_inputs("new", n_layers=1, seed=3), FAST_SETTINGS)
    other = rodan.publish(b"{not json")
    check(env, RODAN_PASSWORD="wrong-password")
    replies = rodan.drain()
    assert [c for c, _b, _h in replies if c == corr] == [corr]
    assert "Rodan refused the HPC account" in json.loads(next(b for c, b, _h in replies if c == corr))["error"]
    ledger = spool / "ledger" / f"{corr}.json"
    assert json.loads(ledger.read_text())["state"] == "rejected"
    # status: both are rejected and dead-lettered, in the table and the JSON.
    rows, counters, lines = status(env, "--no-scheduler")
    assert {c: (r["state"], r["dead_lettered"], r["job_id"]) for c, r in rows.items()} == {
        corr: ("rejected", True, ""),
        other: ("rejected", True, ""),
    }
    assert "Rodan refused the HPC account" in rows[corr]["last_event"]
    assert (counters["rejected"], counters["dead_lettered"], counters["submitted"]) == (2, 2, 0)
    assert row_of(lines, corr)[2:4] == ["-", "rejected"] and row_of(lines, other)[2:4] == ["-", "rejected"]
    assert lines[-1].split()[5:7] == ["dead-letter", "2"], lines[-1]

    # Rodan already has its answer: a second one is refused without --force, and nothing moves.
    refused = ops(env, "requeue-dead", "--yes", "--id", corr[:8])
    assert refused.returncode == 1 and "already got its reply" in refused.stdout
    assert {x[0] for x in peek(broker_url, queues.dead)} == {corr, other}
    assert json.loads(ledger.read_text())["state"] == "rejected" and (spool / "replies" / f"{corr}.json").exists()

    forced = ops(env, "requeue-dead", "--yes", "--force", "--id", corr[:8])
    assert forced.returncode == 0, forced.stderr
    assert [x[0] for x in peek(broker_url, queues.dead)] == [other]  # the other one stays
    (requeued,) = peek(broker_url, queues.request)
    assert requeued[:2] == (corr, queues.reply)
    assert not any(k.startswith("x-hpc-bridge-") for k in requeued[2])
    record = json.loads(ledger.read_text())
    assert (record["state"], record["attempts"], record["dead_lettered"]) == ("received", 0, False)
    assert not (spool / "replies" / f"{corr}.json").exists()
    assert list((spool / "replies").glob(f"{corr}.json.superseded-*"))
    (event,) = events(tmp_path / "bridge.log", "dead_letter_requeued")
    assert event["correlation_id"] == corr and event["previous_state"] == "rejected"
    # status: the requeued request is queued afresh and no longer dead-lettered; the other stays
    # (the replies were drained above: Rodan took them).
    rows, counters, lines = status(env, "--no-scheduler")
    assert (rows[corr]["state"], rows[corr]["dead_lettered"], rows[corr]["reason"]) == ("queued", False, "")
    assert (rows[other]["state"], rows[other]["dead_lettered"]) == ("rejected", True)
    assert (counters["rejected"], counters["dead_lettered"]) == (1, 1)
    assert row_of(lines, corr)[2:4] == ["-", "queued"] and row_of(lines, other)[3] == "rejected"
    assert lines[-1].split()[1:7] == ["request", "1", "reply", "0", "dead-letter", "1"], lines[-1]

    check(env)  # the right password now: the request is submitted to the real Slurm
    record = json.loads(ledger.read_text())
    assert record["state"] == "submitted" and record["job_id"], record
    rows, counters, lines = status(env)  # with the live Slurm state
    assert rows[corr]["state"] in ("submitted", "pending", "running"), rows[corr]
    assert (rows[corr]["scheduler"], rows[corr]["job_id"], rows[corr]["dead_lettered"]) == (
        "slurm",
        record["job_id"],
        False,
    )
    # (the table is another process: the job may have started in between)
    job_column, table_state = row_of(lines, corr)[2:4], row_of(lines, corr)[4]
    assert job_column == ["slurm", record["job_id"]] and table_state in ("submitted", "pending", "running"), lines
    assert (counters["submitted"], counters["rejected"], counters["dead_lettered"]) == (1, 1, 1)
    assert rodan.depth(queues.request) == 0 and [x[0] for x in peek(broker_url, queues.dead)] == [other]
    # --all without --force skips what was answered already, and leaves it queued.
    again = ops(env, "requeue-dead", "--yes", "--all")
    assert again.returncode == 1 and f"skipped {other}" in again.stdout
    assert [x[0] for x in peek(broker_url, queues.dead)] == [other]
    cancel_spool_jobs(spool)


def test_a_failed_publish_puts_everything_back(env, rodan, queues, broker_url, make_config, tmp_path, monkeypatch):
    from bridge.errors import BrokerUnavailable
    from bridge.ops import deadletter

    corr = rodan.publish(b"{not json")
    check(env)
    spool = tmp_path / "spool"
    before = json.loads((spool / "ledger" / f"{corr}.json").read_text())
    marker = (spool / "replies" / f"{corr}.json").read_text()

    def refuse(*_args: Any, **_kw: Any) -> None:
        raise BrokerUnavailable("broker nacked the message")

    monkeypatch.setattr(deadletter, "publish", refuse)
    args = argparse.Namespace(command="requeue-dead", ids=[corr], all=False, yes=True, force=True)
    assert deadletter.run(make_config(HPC_LOG_FILE=env["HPC_LOG_FILE"]), args) == 1
    after = json.loads((spool / "ledger" / f"{corr}.json").read_text())
    after.pop("updated_at")
    before.pop("updated_at")
    assert after == before
    assert (spool / "replies" / f"{corr}.json").read_text() == marker
    assert not list((spool / "replies").glob("*.superseded-*"))
    assert [x[0] for x in peek(broker_url, queues.dead)] == [corr] and rodan.depth(queues.request) == 0
