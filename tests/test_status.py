"""``hpc-bridge status`` and the metrics file: unit tests, and one run on the real broker and Slurm
that drives requests into every state a short test can reach and reads them back."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bridge.ledger import Ledger, RequestRecord, RequestState
from bridge.ops.metrics import display_state, render
from bridge.ops.status import Row, format_age, format_table, parse_duration, select
from bridge.spool import Spool
from tests.support.bridge import FAST_SETTINGS, bridge_environ, run_bridge
from tests.support.broker import Queues, Rodan
from tests.support.cluster import Cluster, cancel_ledger_jobs
from tests.support.wait import wait_until


def sleeping_worker(tmp_path: Path) -> Path:
    """A stand-in for the worker's Python that keeps its job running for two minutes."""
    sleeper = tmp_path / "sleeper"
    sleeper.write_text("#!/bin/sh\nexec sleep 120\n")
    sleeper.chmod(0o755)
    return sleeper


def check_pass(env: dict[str, str]) -> None:
    """One ``hpc-bridge check`` pass, which must succeed."""
    result = run_bridge(env, "check")
    assert result.returncode == 0, result.stderr[-2000:]


# --- units ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("90s", 90), ("30m", 1800), ("2h", 7200), ("1d", 86400), ("1.5h", 5400), (" 1W ", 604800)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "2x", "-1h", "1h30m"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration(text)


def test_format_age() -> None:
    assert [format_age(s) for s in (None, 5, 125, 3 * 3600 + 300, 2 * 86400 + 4 * 3600)] == [
        "-",
        "5s",
        "2m",
        "3h05",
        "2d04",
    ]


def _row(corr: str, state: str, *, age: float = 10.0, last: str = "", continuations: int = 0) -> Row:
    return Row(
        correlation_id=corr,
        generation="new",
        scheduler="gridengine",
        job_id="1234567890123",
        state=state,
        continuations=continuations,
        age_s=age,
        training_s=None,
        last_event=last,
        job_state="",
        dead_lettered=False,
        reason="",
        created_at=0.0,
        replied_at=0.0,
    )


def test_table_fits_80_columns_and_shortens_ids() -> None:
    rows = [
        _row("0123456789abcdef", "continued", last="x" * 200, continuations=3),
        _row("fedcba9876543210", "replied-error", last="Slurm job 61 ended without a result: TIMEOUT"),
    ]
    lines = format_table(rows)
    assert lines[0].split()[:4] == ["ID", "GEN", "JOB", "STATE"]
    assert all(len(line) <= 80 for line in lines)
    assert lines[1].startswith("01234567 new sge ") and "continued 3x" in lines[1] and lines[1].endswith("~")
    assert lines[2].startswith("fedcba98 ") and "replied-error" in lines[2]


def test_select_by_state_and_age() -> None:
    rows = [_row("a", "replied-ok", age=30), _row("b", "replied-error", age=4000), _row("c", "running", age=100)]
    assert [r.correlation_id for r in select(rows, ["replied"], None, None)] == ["a", "b"]
    assert [r.correlation_id for r in select(rows, ["running", "replied-ok"], None, None)] == ["a", "c"]
    assert [r.correlation_id for r in select(rows, [], 3600, None)] == ["b"]
    assert [r.correlation_id for r in select(rows, [], None, 60)] == ["a"]


def test_display_state_and_metrics_text() -> None:
    def rec(state: RequestState, **kw: object) -> RequestRecord:
        return RequestRecord(correlation_id=str(kw.pop("corr", "c")), key="k", reply_to="q", state=state, **kw)  # type: ignore[arg-type]

    now = 1_000_000.0
    records = [
        rec(RequestState.RECEIVED, corr="1"),
        rec(RequestState.SUBMITTED, corr="2", job_id="7", job_state="PENDING"),
        rec(RequestState.SUBMITTED, corr="3", job_id="8", job_state="PENDING", continuations=2),
        rec(RequestState.REPLIED, corr="4", job_id="9", outcome="ok", created_at=now, replied_at=now + 100),
        rec(RequestState.REJECTED, corr="5", outcome="error", dead_lettered=True, created_at=now, replied_at=now + 1),
    ]
    assert [display_state(r) for r in records] == ["queued", "pending", "continued", "replied-ok", "rejected"]
    assert display_state(records[1], "RUNNING") == "running"
    text = render(records, outbox=2, job_states={"2": "RUNNING"}, reconciliations=4, broker_reconnects=1, now=now)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("hpc_bridge_requests_total", (("outcome", "received"),))] == 5
    assert samples[("hpc_bridge_requests_total", (("outcome", "submitted"),))] == 3
    assert samples[("hpc_bridge_requests_total", (("outcome", "replied_ok"),))] == 1
    assert samples[("hpc_bridge_requests_total", (("outcome", "rejected"),))] == 1
    assert samples[("hpc_bridge_continuations_total", ())] == 2
    assert samples[("hpc_bridge_reply_latency_seconds_bucket", (("le", "60"),))] == 1
    assert samples[("hpc_bridge_reply_latency_seconds_bucket", (("le", "300"),))] == 2
    assert samples[("hpc_bridge_reply_latency_seconds_count", ())] == 2
    assert samples[("hpc_bridge_reply_latency_seconds_sum", ())] == 101
    assert samples[("hpc_bridge_ledger_requests", (("state", "running"),))] == 1
    assert samples[("hpc_bridge_ledger_requests", (("state", "continued"),))] == 1
    assert samples[("hpc_bridge_jobs", (("state", "RUNNING"),))] == 1
    assert samples[("hpc_bridge_outbox_replies", ())] == 2
    assert samples[("hpc_bridge_reconciliations_total", ())] == 4
    assert samples[("hpc_bridge_broker_reconnects_total", ())] == 1


def test_display_state_reads_the_schedulers_own_words() -> None:
    """The ledger keeps each scheduler's own word for the last state seen (Grid Engine: letters)."""

    def rec(scheduler: str, job_state: str, **kw: object) -> RequestRecord:
        return RequestRecord(
            correlation_id="c", key="k", reply_to="q", state=RequestState.SUBMITTED, job_id="5",
            scheduler=scheduler, job_state=job_state, **kw,  # type: ignore[arg-type]
        )  # fmt: skip

    ge = {"r": "running", "Rr": "running", "t": "running", "qw": "pending", "hqw": "pending", "s": "pending"}
    assert {word: display_state(rec("gridengine", word)) for word in [*ge, "Eqw", ""]} == {
        **ge,
        "Eqw": "submitted",
        "": "submitted",
    }
    slurm = {"RUNNING": "running", "COMPLETING": "running", "PENDING": "pending", "CANCELLED by 0": "submitted"}
    assert {word: display_state(rec("slurm", word)) for word in slurm} == slurm
    # A live state (already a JobState value) wins over the ledger's word, on either scheduler.
    assert display_state(rec("gridengine", "qw"), "RUNNING") == "running"
    assert display_state(rec("gridengine", "r"), "PENDING") == "pending"
    assert display_state(rec("gridengine", "r", continuations=1)) == "continued"
    text = render([rec("gridengine", "r")], outbox=0, now=1.0)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("hpc_bridge_ledger_requests", (("state", "running"),))] == 1
    assert samples[("hpc_bridge_ledger_requests", (("state", "submitted"),))] == 0


# --- on the real broker and Slurm ---------------------------------------------------------------


def _status(env: dict[str, str], *args: str) -> tuple[int, str]:
    result = run_bridge(env, "status", *args, timeout=60)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.broker
def test_status_and_metrics_on_real_requests(broker_url, standin, queues, rodan, sample_inputs, tmp_path, slurm):
    spool = tmp_path / "spool"
    metrics = tmp_path / "textfile" / "hpc_bridge.prom"
    env = bridge_environ(
        broker_url,
        standin,
        queues,
        spool,
        HPC_SCHEDULER="slurm",
        HPC_LOG_FILE=str(tmp_path / "bridge.log"),
        HPC_METRICS_FILE=str(metrics),
        HPC_DEFER_LIMIT="3600",
        HPC_RODAN_RETRIES="0",
    )
    sleeper = sleeping_worker(tmp_path)
    page = sample_inputs("new", n_layers=1, seed=11)

    def check(**extra: str) -> None:
        check_pass({**env, **extra})

    try:
        bad = rodan.publish(b"{not json")
        standin.fail_next(1, status=403, paths="/api/auth/token/")  # Rodan refuses the HPC account
        refused = rodan.publish_request(page, FAST_SETTINGS)
        check()
        done = rodan.publish_request(page, FAST_SETTINGS)
        check(HPC_WORKER_PYTHON="/bin/true")  # the job ends at once without a reply
        running = rodan.publish_request(page, FAST_SETTINGS)
        check(HPC_WORKER_PYTHON=str(sleeper))
        pending = rodan.publish_request(page, FAST_SETTINGS)
        check(HPC_SCHEDULER_ARGS="--hold")  # submitted, held: pending until cancelled
        standin.fail_next(10_000, status=503, paths="/api/auth/token/")  # Rodan down: deferred, stays queued
        queued = rodan.publish_request(page, FAST_SETTINGS)

        def ready() -> bool:
            check()
            record = json.loads((spool / "ledger" / f"{done}.json").read_text())
            return record["state"] == "replied" and Cluster("slurm").is_running(
                json.loads((spool / "ledger" / f"{running}.json").read_text())["job_id"]
            )

        wait_until(ready, timeout=300, interval=1, what="the /bin/true job replied and the sleeper running")
        expected = {
            bad: "rejected",
            refused: "rejected",
            done: "replied-error",
            running: "running",
            pending: "pending",
            queued: "queued",
        }

        code, out = _status(env)
        assert code == 0, out
        lines = out.splitlines()
        assert all(len(line) <= 80 for line in lines), out
        rows = {line[:8]: line.split() for line in lines[1:] if not line.startswith("queues:")}
        by_short = {corr[:8]: state for corr, state in expected.items()}
        for short, words in rows.items():
            assert by_short[short] in words, (short, words)
        assert rows[running[:8]][2:4] == [
            "slurm",
            json.loads((spool / "ledger" / f"{running}.json").read_text())["job_id"],
        ]
        summary = next(line for line in lines if line.startswith("queues:"))
        assert summary.split() == ["queues:", "request", "1", "reply", "3", "dead-letter", "2", "|", "outbox", "0"]

        code, out = _status(env, "--json")
        assert code == 0, out
        data = json.loads(out)
        states = {r["correlation_id"]: r["state"] for r in data["requests"]}
        assert states == expected
        by_id = {r["correlation_id"]: r for r in data["requests"]}
        assert by_id[bad]["dead_lettered"] and by_id[refused]["dead_lettered"]
        assert "COMPLETED" in by_id[done]["last_event"] and by_id[done]["scheduler"] == "slurm"
        assert by_id[running]["job_state"] == "RUNNING" and by_id[pending]["job_state"] == "PENDING"
        assert {k: v["depth"] for k, v in data["queues"].items()} == {"request": 1, "reply": 3, "dead_letter": 2}
        assert data["outbox"] == 0
        assert data["counters"] == {
            "received": 6,
            "submitted": 3,
            "replied_ok": 0,
            "replied_error": 1,
            "reply_expired": 0,
            "rejected": 2,
            "dead_lettered": 2,
            "continuations": 0,
            "cancelled_by_rodan": 0,
        }

        def ids(*args: str) -> set[str]:
            code, out = _status(env, "--json", "--no-scheduler", *args)
            assert code == 0, out
            return {r["correlation_id"] for r in json.loads(out)["requests"]}

        assert ids("--state", "rejected") == {bad, refused}
        assert ids("--state", "replied", "--state", "queued") == {done, queued}
        assert ids("--newer-than", "1h") == set(expected)
        assert ids("--older-than", "1h") == set()

        # The metrics file of the last pass: 0644, and its counters are what happened.
        assert stat.S_IMODE(os.stat(metrics).st_mode) == 0o644
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.read_text())
            for s in family.samples
        }
        for outcome, value in data["counters"].items():
            if outcome != "continuations":
                assert samples[("hpc_bridge_requests_total", (("outcome", outcome),))] == value, outcome
        replied = sum(1 for r in data["requests"] if r["replied_at"] > 0)
        assert replied >= 1 and samples[("hpc_bridge_reply_latency_seconds_count", ())] == replied
        assert samples[("hpc_bridge_ledger_requests", (("state", "queued"),))] == 1
        assert samples[("hpc_bridge_ledger_requests", (("state", "rejected"),))] == 2
        assert samples[("hpc_bridge_outbox_replies", ())] == 0
        assert samples[("hpc_bridge_reconciliations_total", ())] == 1  # per check process
        assert time.time() - samples[("hpc_bridge_metrics_timestamp_seconds", ())] < 3600

        # Broker down: the table still comes, the summary says so, exit 1.
        code, out = _status({**env, "RABBITMQ_URL": "amqp://guest:guest@127.0.0.1:1/%2F"}, "--no-scheduler")
        assert code == 1 and "broker down" in out and "request -  reply -  dead-letter -" in out, out
        assert len([line for line in out.splitlines() if line[:8] in by_short]) == 6
    finally:
        standin.clear_faults()
        cancel_ledger_jobs(spool, Cluster("slurm"))


@pytest.mark.broker
def test_status_shows_live_grid_engine_jobs(broker_url, standin, queues, rodan, sample_inputs, tmp_path, gridengine):
    cluster = Cluster("gridengine")
    spool = tmp_path / "spool"
    metrics = tmp_path / "hpc_bridge.prom"
    env = bridge_environ(
        broker_url,
        standin,
        queues,
        spool,
        HPC_SCHEDULER="gridengine",
        HPC_LOG_FILE=str(tmp_path / "bridge.log"),
        HPC_METRICS_FILE=str(metrics),
    )
    sleeper = sleeping_worker(tmp_path)
    page = sample_inputs("new", n_layers=1, seed=21)

    def check(**extra: str) -> None:
        check_pass({**env, **extra})

    def job_of(corr: str) -> str:
        return str(json.loads((spool / "ledger" / f"{corr}.json").read_text())["job_id"])

    try:
        running = rodan.publish_request(page, FAST_SETTINGS)
        check(HPC_WORKER_PYTHON=str(sleeper))
        held = rodan.publish_request(page, FAST_SETTINGS)
        check(HPC_SCHEDULER_ARGS="-h")  # qsub -h: held, pending until deleted
        jobs = {running: job_of(running), held: job_of(held)}
        assert all(jobs.values()), jobs
        # Up to 5 minutes: in the schedulers phase other tests' jobs may hold the Grid Engine node's
        # slots and memory for minutes (CI waited 60 s in vain once, 0.5.0 on the Intel Xeon).
        wait_until(lambda: cluster.is_running(jobs[running]), timeout=300, interval=1, what="the sleeper running")
        check()  # reconciliation records the states it saw (qstat's letters) and writes the metrics
        expected = {running: "running", held: "pending"}

        code, out = _status(env)
        assert code == 0, out
        lines = out.splitlines()
        assert all(len(line) <= 80 for line in lines), out
        rows = {line[:8]: line.split() for line in lines[1:] if not line.startswith("queues:")}
        assert set(rows) == {running[:8], held[:8]}, out
        for corr, state in expected.items():
            assert rows[corr[:8]][2:5] == ["sge", jobs[corr], state], rows[corr[:8]]

        code, out = _status(env, "--json")
        assert code == 0, out
        data = json.loads(out)
        by_id = {r["correlation_id"]: r for r in data["requests"]}
        assert {c: r["state"] for c, r in by_id.items()} == expected
        assert {c: (r["scheduler"], r["job_id"]) for c, r in by_id.items()} == {
            c: ("gridengine", j) for c, j in jobs.items()
        }
        assert by_id[running]["job_state"] == "RUNNING" and by_id[held]["job_state"] == "PENDING"
        assert data["notes"] == []
        assert data["counters"]["submitted"] == 2 and data["counters"]["replied_ok"] == 0

        # Without asking Grid Engine, and with Grid Engine unreachable: the states last seen
        # (the ledger keeps qstat's own letters, r and hqw) are read the same way.
        code, out = _status(env, "--json", "--no-scheduler")
        assert code == 0, out
        assert {r["correlation_id"]: r["state"] for r in json.loads(out)["requests"]} == expected
        code, out = _status({**env, "SGE_QMASTER_PORT": "1"}, "--json")
        assert code == 0, out
        data = json.loads(out)
        assert {r["correlation_id"]: r["state"] for r in data["requests"]} == expected
        (note,) = data["notes"]
        assert note.startswith("scheduler did not answer") and "states are the last ones seen" in note, note
        code, out = _status({**env, "SGE_QMASTER_PORT": "1"})
        assert code == 0 and "scheduler did not answer" in out, out

        # The metrics the last check wrote count the same states.
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.read_text())
            for s in family.samples
        }
        assert samples[("hpc_bridge_ledger_requests", (("state", "running"),))] == 1
        assert samples[("hpc_bridge_ledger_requests", (("state", "pending"),))] == 1
        assert samples[("hpc_bridge_ledger_requests", (("state", "submitted"),))] == 0
        assert samples[("hpc_bridge_requests_total", (("outcome", "submitted"),))] == 2
    finally:
        cancel_ledger_jobs(spool, cluster)


# --- the exit status: the broker unreachable is 1 ------------------------------------------------


@contextlib.contextmanager
def _closed_port() -> Iterator[int]:
    """A port on 127.0.0.1 that refuses connections: bound by this test (so nobody else listens on
    it) but never listening."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        yield int(held.getsockname()[1])


def _status_settings(tmp_path: Path, broker_url: str, queues: Queues) -> dict[str, str]:
    """Settings for ``status`` alone (it never reaches Rodan), and one request in the ledger."""
    spool = Spool(tmp_path / "spool").ensure()
    Ledger(spool).save(RequestRecord("d3adbeef-status", "d3adbeef-status", queues.reply, state=RequestState.RECEIVED))
    return {
        "RABBITMQ_URL": broker_url,
        "RODAN_HOST": "rodan.example.org",
        "RODAN_USER": "hpc@example.org",
        "RODAN_PASSWORD": "status-test-pw",
        "HPC_REQUEST_QUEUE": queues.request,
        "HPC_REPLY_QUEUE": queues.reply,
        "HPC_DEAD_LETTER_QUEUE": queues.dead,
        "HPC_SPOOL_DIR": str(spool.root),
    }


@pytest.mark.parametrize("json_output", [False, True], ids=["table", "json"])
def test_status_exits_1_when_the_broker_refuses(tmp_path: Path, json_output: bool) -> None:
    queues = Queues.fresh()  # names only: nothing is declared
    with _closed_port() as port:
        env = _status_settings(tmp_path, f"amqp://guest:guest@127.0.0.1:{port}/%2F", queues)
        code, out = _status(env, "--no-scheduler", *(["--json"] if json_output else []))
    assert code == 1, out
    if json_output:
        data = json.loads(out)
        assert [r["correlation_id"] for r in data["requests"]] == ["d3adbeef-status"]  # still listed
        assert {role: q["depth"] for role, q in data["queues"].items()} == dict.fromkeys(
            ("request", "reply", "dead_letter")
        )
        assert any(note.startswith("broker down") for note in data["notes"]), data["notes"]
    else:
        assert "broker down" in out and "request -  reply -  dead-letter -" in out, out
        assert any(line.startswith("d3adbeef ") and "queued" in line for line in out.splitlines()), out


@pytest.mark.broker
def test_status_exits_0_when_the_broker_answers(tmp_path: Path, broker_url: str, rodan: Rodan) -> None:
    rodan.publish(b"{}")  # as Rodan does: declares the request and reply queues, one message sent
    env = _status_settings(tmp_path, broker_url, rodan.queues)
    code, out = _status(env, "--no-scheduler")
    assert code == 0, out
    assert "broker down" not in out and "request 1  reply 0  dead-letter -" in out, out
    code, out = _status(env, "--no-scheduler", "--json")
    assert code == 0, out
    data = json.loads(out)
    assert data["queues"]["request"]["depth"] == 1 and data["notes"] == []


def test_status_help_names_its_exit_statuses() -> None:
    result = run_bridge({}, "status", "--help")
    assert result.returncode == 0, result.stderr
    epilog = result.stdout[result.stdout.index("exit status:") :]
    assert re.search(r"^\s+0\s+the broker answered", epilog, re.M), epilog
    assert re.search(r"^\s+1\s+the broker is unreachable", epilog, re.M), epilog
    assert re.search(r"^\s+2\s+configuration error", epilog, re.M), epilog


def test_metrics_file_is_not_written_without_the_setting(tmp_path: Path) -> None:
    from bridge.config import load_config

    base = {
        "RABBITMQ_URL": "amqp://g:g@127.0.0.1:1/%2F",
        "RODAN_HOST": "h",
        "RODAN_USER": "a@b.c",
        "RODAN_PASSWORD": "p",
    }
    assert load_config(environ=base).metrics_file is None
    assert (
        load_config(environ={**base, "HPC_METRICS_FILE": str(tmp_path / "m.prom")}).metrics_file == tmp_path / "m.prom"
    )


def _metric(path: Path, name: str) -> float | None:
    if not path.exists():
        return None
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return None


@pytest.mark.broker
@pytest.mark.skipif(
    subprocess.run(["which", "rabbitmqctl"], capture_output=True).returncode != 0
    or bool(os.environ.get("RABBITMQ_URL")),
    reason="closing a connection needs rabbitmqctl on the broker's own machine",
)
def test_daemon_metrics_count_reconciliations_and_reconnects(broker_url, standin, queues, tmp_path, slurm):
    from tests.support.daemon import Daemon, connection_named

    spool, log, metrics = tmp_path / "spool", tmp_path / "bridge.log", tmp_path / "bridge.prom"
    env = bridge_environ(broker_url, standin, queues, spool, HPC_LOG_FILE=str(log), HPC_METRICS_FILE=str(metrics))
    daemon = Daemon(env, log, spool)
    try:
        wait_until(lambda: (_metric(metrics, "hpc_bridge_reconciliations_total") or 0) >= 1, 30, 0.1, "metrics")
        assert _metric(metrics, "hpc_bridge_broker_reconnects_total") == 0
        mine = connection_named(f"hpc-bridge/{daemon.proc.pid}")
        assert len(mine) == 1
        subprocess.run(["rabbitmqctl", "-q", "close_connection", mine[0], "test: simulated broker loss"], check=True)
        wait_until(
            lambda: _metric(metrics, "hpc_bridge_broker_reconnects_total") == 1, 60, 0.2, "the reconnect counted"
        )
        assert (_metric(metrics, "hpc_bridge_reconciliations_total") or 0) >= 2
    finally:
        assert daemon.stop() == 0
