"""Progress display (bridge/progress.py): rendering in each mode, what the login node reads of a
request (ledger + job.log), the chain follower's status, and ``enqueue --wait --progress json``
on a real request through the broker and Slurm."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bridge.chain.follow import follow
from bridge.chain.link import run_link
from bridge.enqueue import RequestWatcher, progress_poller
from bridge.ledger import Ledger, RequestState
from bridge.progress import CLEAR_LINE, Progress, format_bar, format_elapsed, read_new_events, resolve_mode
from bridge.schedulers import JobInfo, JobState
from bridge.spool import Spool
from tests.support.bridge import FAST_SETTINGS, NO_FRESH_STARTS, REPO, bridge_environ, run_bridge
from tests.support.chain import PY, Recording, link_env, make_chain
from tests.support.cluster import cancel_spool_jobs
from tests.support.wait import wait_until


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def progress(mode: str = "auto", stream: io.StringIO | None = None, width: int = 80) -> tuple[Progress, Any, Clock]:
    clock = Clock()
    out = stream if stream is not None else FakeTTY()
    return Progress("5f0c2a9e", mode=mode, stream=out, clock=clock, width=width), out, clock


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# --- rendering -----------------------------------------------------------------------------------


def test_auto_is_an_in_place_line_on_a_terminal_and_json_elsewhere() -> None:
    assert resolve_mode("auto", FakeTTY()) == "bar"
    assert resolve_mode("auto", io.StringIO()) == "json"
    assert resolve_mode("lines", FakeTTY()) == "lines"
    with pytest.raises(ValueError, match="unknown progress mode"):
        resolve_mode("fancy", io.StringIO())


def test_elapsed_and_bar_formats() -> None:
    assert [format_elapsed(s) for s in (0, 45.9, 134, 3725)] == ["0s", "45s", "2m14s", "1h02m"]
    assert format_bar(0.3) == "[###.......] 30%"
    assert format_bar(0) == "[..........] 0%"
    assert format_bar(1.7) == "[##########] 100%"


def test_tty_mode_redraws_one_line_in_place_and_finish_ends_it() -> None:
    p, tty, clock = progress()
    assert p.in_place
    p.update("running", "slurm job 61  layer 1/2 epoch 3/10", fraction=0.15)
    first = tty.getvalue()
    assert first == CLEAR_LINE + "5f0c2a9e  running  slurm job 61  layer 1/2 epoch 3/10  [#.........] 15%  0s"
    clock.now += 0.4
    p.update("running", "slurm job 61  layer 1/2 epoch 3/10", fraction=0.15)  # nothing new, under a second
    assert tty.getvalue() == first
    clock.now += 133.6
    p.tick()  # the elapsed time ticks on
    assert tty.getvalue() == first + CLEAR_LINE + "5f0c2a9e  running  slurm job 61  layer 1/2 epoch 3/10  " + (
        "[#.........] 15%  2m14s"
    )
    p.update("running", "slurm job 61  layer 1/2 epoch 4/10", fraction=0.2)
    line = "5f0c2a9e  running  slurm job 61  layer 1/2 epoch 4/10  [##........] 20%  2m14s"
    assert tty.getvalue().endswith(CLEAR_LINE + line)
    assert "\n" not in tty.getvalue()
    p.finish()
    p.finish()  # twice is harmless
    assert tty.getvalue().endswith("2m14s\n") and tty.getvalue().count("\n") == 1
    p.update("replied")  # after finish: nothing more
    assert tty.getvalue().endswith("2m14s\n")


def test_tty_mode_cuts_the_line_to_the_terminal_width_keeping_state_and_elapsed() -> None:
    p, tty, clock = progress(width=70)
    clock.now += 75
    p.started = 1000.0
    p.update("running", "slurm job 61  continued 2x  layer 11/12 epoch 130/150 and much more", fraction=0.9)
    drawn = tty.getvalue().split(CLEAR_LINE)[-1]
    assert 60 < len(drawn) <= 69
    assert drawn.startswith("5f0c2a9e  running  slurm job 61") and drawn.endswith("~  [#########.] 90%  1m15s")
    narrow, tty2, _ = progress(width=12)
    narrow.update("running", "slurm job 61")
    assert tty2.getvalue() == CLEAR_LINE + "5f0c2a9e  r"


def test_tty_width_comes_from_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "30")
    tty = FakeTTY()
    p = Progress("5f0c2a9e", stream=tty, clock=Clock())
    p.update("waiting", "for the reply, and more words than fit")
    assert len(tty.getvalue().split(CLEAR_LINE)[-1]) == 29


def test_a_note_prints_above_the_status_line() -> None:
    p, tty, _ = progress()
    printed: list[str] = []

    def out(line: str) -> None:
        printed.append(line)
        tty.write(line + "\n")  # stdout and stderr on the same terminal

    p.update("pending", "link 1/3 (job 61)")
    p.note("link 1/3 (job 61) started on node1, restart 0", out=out)
    assert printed == ["link 1/3 (job 61) started on node1, restart 0"]
    assert tty.getvalue() == (
        CLEAR_LINE + "5f0c2a9e  pending  link 1/3 (job 61)  0s"
        + CLEAR_LINE + "link 1/3 (job 61) started on node1, restart 0\n"
        + CLEAR_LINE + "5f0c2a9e  pending  link 1/3 (job 61)  0s"
    )  # fmt: skip


def test_lines_mode_prints_one_plain_line_per_change() -> None:
    p, out, clock = progress("lines", io.StringIO())
    p.update("waiting", state_text="waiting for the reply")
    clock.now += 5
    p.update("waiting", state_text="waiting for the reply")
    p.tick()
    clock.now += 7
    p.update("submitted", "slurm job 61", job_id="61")
    p.update("submitted", "slurm job 61", job_id="61", job_state="PENDING")  # JSON fields only: no new line
    p.update("running", "slurm job 61  layer 1/1 epoch 1/2", fraction=0.5, job_id="61")
    p.note("a message")
    p.finish()
    assert out.getvalue().splitlines() == [
        "5f0c2a9e  waiting for the reply  0s",
        "5f0c2a9e  submitted  slurm job 61  12s",
        "5f0c2a9e  running  slurm job 61  layer 1/1 epoch 1/2  [#####.....] 50%  12s",
        "a message",
    ]
    assert "\r" not in out.getvalue()


def test_json_mode_prints_one_object_per_change() -> None:
    p, out, clock = progress("json", FakeTTY())  # json even on a terminal when asked
    p.update("waiting", state_text="waiting for the reply", correlation_id="5f0c2a9e-x")
    clock.now += 3
    p.update("waiting", state_text="waiting for the reply", correlation_id="5f0c2a9e-x")
    p.tick()
    assert len(out.getvalue().splitlines()) == 1
    p.update("running", "slurm job 61", fraction=0.25, job_id="61", epoch=1)
    p.note("started", link=1)
    p.update("replied", "slurm job 61  ok", job_id="61", outcome="ok")
    p.finish()
    events = json_lines(out.getvalue())
    assert [e["event"] for e in events] == ["progress", "progress", "message", "progress"]
    assert [e["state"] for e in events if e["event"] == "progress"] == ["waiting", "running", "replied"]
    assert events[0] == {"event": "progress", "what": "5f0c2a9e", "state": "waiting", "elapsed_s": 0.0,
                         "correlation_id": "5f0c2a9e-x"}  # fmt: skip
    assert events[1]["fraction"] == 0.25 and events[1]["job_id"] == "61" and events[1]["elapsed_s"] == 3.0
    assert events[2] == {"event": "message", "what": "5f0c2a9e", "elapsed_s": 3.0, "text": "started", "link": 1}
    assert events[3]["outcome"] == "ok" and events[3]["detail"] == "slurm job 61  ok"
    assert "\r" not in out.getvalue()


def test_none_mode_prints_nothing() -> None:
    p, out, _ = progress("none")
    p.update("running", "x", fraction=0.5)
    p.note("y")
    p.finish()
    assert out.getvalue() == ""


def test_new_events_are_read_incrementally_and_half_lines_wait(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    assert read_new_events(log, 0) == (0, [])
    log.write_text('{"event": "job_start"}\nplain text\n{"event": "epo')
    offset, events = read_new_events(log, 0)
    assert events == [{"event": "job_start"}]
    with log.open("a") as handle:
        handle.write('ch", "epoch": 1}\n')
    offset, events = read_new_events(log, offset)
    assert events == [{"event": "epoch", "epoch": 1}] and offset == log.stat().st_size


# --- what the login node sees of a request ---------------------------------------------------------


def write_record(spool: Path, correlation_id: str, **values: Any) -> None:
    ledger = Ledger(Spool(spool).ensure())
    record = ledger.open(correlation_id, "hpc-results")
    for key, value in values.items():
        setattr(record, key, value)
    ledger.save(record)


def test_the_watcher_reads_the_ledger_and_the_job_log(tmp_path: Path) -> None:
    spool, corr = tmp_path / "spool", "5f0c2a9e-0000-4000-8000-000000000001"
    watcher = RequestWatcher(spool, spool / "runs", corr)
    view = watcher.poll()
    assert (view.state, view.label_text, view.detail(), view.fraction) == ("waiting", "waiting for the reply", "", None)

    write_record(spool, corr)
    assert watcher.poll().state == "queued"
    write_record(spool, corr, state=RequestState.SUBMITTED, scheduler="slurm", job_id="61", job_state="PENDING")
    view = watcher.poll()
    assert (view.state, view.detail(), view.fields()["job_id"]) == ("pending", "slurm job 61", "61")

    run = spool / "runs" / f"20260101-000000-{corr}"
    run.mkdir(parents=True)
    (run / "settings.json").write_text(json.dumps({"epochs": 4}))
    log = run / "job.log"
    events = [
        {"event": "job_start", "layers": ["Background Model", "Model 0"], "job_id": "61"},
        {"event": "epoch", "label": "Background Model", "epoch": 4, "job_id": "61"},
        {"event": "epoch", "label": "Model 0", "epoch": 1, "job_id": "61"},
    ]
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    view = watcher.poll()
    assert view.state == "running"  # the job's own log says so before reconciliation does
    assert (view.layer, view.layers, view.epoch, view.epochs) == (2, 2, 1, 4)
    assert view.fraction == pytest.approx(5 / 8)
    assert view.detail() == "slurm job 61  layer 2/2 epoch 1/4"

    with log.open("a") as handle:
        handle.write(json.dumps({"event": "job_continuing", "job_id": "61"}) + "\n")
    write_record(spool, corr, state=RequestState.SUBMITTED, scheduler="slurm", job_id="61", continuations=1)
    view = watcher.poll()
    assert view.state == "continuing" and view.detail() == "slurm job 61  continued 1x  layer 2/2 epoch 1/4"
    with log.open("a") as handle:
        handle.write(json.dumps({"event": "job_resume", "job_id": "61"}) + "\n")
        handle.write(json.dumps({"event": "epoch", "label": "Model 0", "epoch": 2, "job_id": "61"}) + "\n")
    assert watcher.poll().state == "running"
    with log.open("a") as handle:
        handle.write(json.dumps({"event": "job_trained", "ok": True, "job_id": "61"}) + "\n")
    assert watcher.poll().state == "replying"
    write_record(spool, corr, state=RequestState.REPLIED, outcome="ok")
    view = watcher.poll()
    assert view.state == "replied" and view.fields()["outcome"] == "ok" and view.fields()["epoch"] == 2


def test_the_poller_looks_at_most_once_a_second_and_reports_changes(tmp_path: Path) -> None:
    spool, corr = tmp_path / "spool", "5f0c2a9e-0000-4000-8000-000000000002"
    p, out, clock = progress("json", io.StringIO())
    poll = progress_poller(RequestWatcher(spool, spool / "runs", corr), p, every_s=1.0)
    poll(0.0)
    write_record(spool, corr, state=RequestState.SUBMITTED, scheduler="slurm", job_id="7")
    poll(0.5)  # too soon to look again
    assert [e["state"] for e in json_lines(out.getvalue())] == ["waiting"]
    clock.now += 1
    poll(1.0)
    events = json_lines(out.getvalue())
    assert [e["state"] for e in events] == ["waiting", "submitted"] and events[1]["job_id"] == "7"


# --- the chain follower ------------------------------------------------------------------------------


class Ended(Recording):
    def query(self, job_ids: Any) -> dict[str, JobInfo]:
        return {"101": JobInfo("101", JobState.COMPLETED, "COMPLETED"), "102": JobInfo("102", JobState.CANCELLED, "")}


def test_the_follower_reports_links_and_events_as_json(tmp_path: Path) -> None:
    run, scheduler = make_chain(tmp_path, [PY, "-c", "pass"], links=2)
    assert run_link(run, 1, scheduler=scheduler, environ=link_env("101")) == 0
    p, err, _ = progress("json", io.StringIO())
    lines: list[str] = []
    assert follow(run, Ended(), out=lines.append, log_poll_s=0.01, query_every_s=0.01, progress=p) == 0
    done_line = "chain done: the command finished in link 1/2; cancelled job(s) 102"
    assert done_line in lines  # the lines still come
    events = json_lines(err.getvalue())
    assert events[0]["event"] == "progress" and events[0]["state"] == "submitted" and events[0]["link"] == 1
    chain_events = [e["chain_event"] for e in events if e["event"] == "message" and "chain_event" in e]
    assert chain_events == ["chain_submitted", "link_start", "command_exit", "chain_done"]
    done = next(e for e in events if e.get("chain_event") == "chain_done")
    assert done["text"] == done_line and done["link"] == 1 and done["cancelled"] == ["102"]
    assert any(e["event"] == "progress" and e["state"] == "completed" and e["job_id"] == "101" for e in events)


def test_the_follower_keeps_its_status_line_under_the_event_lines(tmp_path: Path) -> None:
    run, scheduler = make_chain(tmp_path, [PY, "-c", "raise SystemExit(2)"], links=2)
    assert run_link(run, 1, scheduler=scheduler, environ=link_env("101")) == 2
    tty = FakeTTY()
    p = Progress("chain unit", mode="bar", stream=tty, clock=Clock(), width=200)
    lines: list[str] = []

    def out(line: str) -> None:
        lines.append(line)
        tty.write(line + "\n")

    assert follow(run, Ended(), out=out, log_poll_s=0.01, query_every_s=0.01, progress=p) == 1
    p.finish()
    screen = tty.getvalue()
    assert any(line.startswith("chain failed: the command exited 2 in link 1/2") for line in lines)
    # every printed line begins on a cleared line, and a status line is drawn after it
    for line in lines:
        at = screen.index(CLEAR_LINE + line + "\n")
        assert screen[at + len(CLEAR_LINE + line + "\n") :].startswith(CLEAR_LINE + "chain unit  ")
    assert screen.endswith("\n") and screen.rsplit(CLEAR_LINE, 1)[-1].startswith("chain unit  completed  link 1/2")


# --- integration: enqueue --wait --progress json on a real request (broker, stand-in, Slurm) ----------


@pytest.mark.broker
@pytest.mark.slurm
@pytest.mark.training
def test_enqueue_wait_shows_json_progress_of_a_real_request(
    broker_url: str, standin: Any, queues: Any, rodan: Any, sample_inputs: Any, slurm: None, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    env = bridge_environ(
        broker_url, standin, queues, spool, HPC_LOG_FILE=str(tmp_path / "bridge.log"), HPC_JOB_PROLOGUE=NO_FRESH_STARTS
    )
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps(sample_inputs("new", n_layers=1, height=256, width=320, seed=5)))
    settings = [arg for name, value in FAST_SETTINGS.items() for arg in ("--setting", f"{name}={value}")]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "RODAN_", "HPC_"))}
    err_file = tmp_path / "enqueue.err"
    with err_file.open("w") as err:
        waiter = subprocess.Popen(
            [sys.executable, "-m", "bridge", "enqueue", "--inputs", str(inputs), *settings,
             "--wait", "--timeout", "300", "--progress", "json"],
            env={**full_env, **env}, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 330
            while waiter.poll() is None and time.monotonic() < deadline:
                assert run_bridge(env, "check").returncode == 0  # cron's pass
                time.sleep(2)
            stdout, _ = waiter.communicate(timeout=30)
        finally:
            if waiter.poll() is None:
                waiter.kill()
            cancel_spool_jobs(spool)
    assert waiter.returncode == 0, err_file.read_text()[-2000:]
    result_lines = stdout.splitlines()
    assert len(result_lines) == 1  # standard output is still exactly the result
    result = json.loads(result_lines[0])
    assert sorted(result["models"]) == ["Background Model", "Model 0"]
    corr = result["correlation_id"]
    record = wait_until(lambda: Ledger(Spool(spool)).get(corr), 10, what="the ledger record")

    stderr = err_file.read_text()
    assert "\r" not in stderr
    events = [e for e in json_lines(stderr) if e.get("event") == "progress"]
    states = [e["state"] for e in events]
    assert states[-1] == "replied", states
    assert {"submitted", "pending", "running"} & set(states), states
    assert all(e["what"] == corr[:8] and e["correlation_id"] == corr for e in events)
    elapsed = [e["elapsed_s"] for e in events]
    assert elapsed == sorted(elapsed)
    # once the bridge had submitted it, every event names the real Slurm job
    with_job = [e for e in events if e["state"] not in ("waiting", "queued", "submitting")]
    assert with_job and all(e["job_id"] == record.job_id and e["scheduler"] == "slurm" for e in with_job)
    last = events[-1]
    assert last["outcome"] == "ok" and last["job_id"] == record.job_id
    # the worker's job.log gave the training position: both layers, up to 2 epochs each
    assert last["layers"] == 2 and last["epochs"] == FAST_SETTINGS["Maximum number of training epochs"]
    assert 1 <= last["layer"] <= 2 and 1 <= last["epoch"] <= 2
