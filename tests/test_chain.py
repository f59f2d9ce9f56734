"""``hpc-bridge chain``: unit tests (options, the link supervisor with a recording scheduler and
fake commands) and integration tests against the real Slurm and Grid Engine dev clusters.

Integration tests run each scenario on both schedulers, with unique job names; a finalizer cancels
whatever a chain left queued. They assert on outcomes (chain.log events, markers, checkpoints,
scheduler states), never on durations.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bridge.chain import EX_TEMPFAIL, ChainError, ChainRunDir, ChainSettings, cancel_chain
from bridge.chain.follow import FINAL_EVENTS, follow
from bridge.chain.link import run_link
from bridge.chain.rundir import default_run_dir
from bridge.chain.settings import parse_environment, parse_time, resolve_command, scheduler_choice, scheduler_options
from bridge.chain.submit import submit_chain
from bridge.cli import main as cli_main
from bridge.errors import SchedulerUnavailable
from bridge.logs import configure_logging
from bridge.schedulers import JobInfo, JobSpec, JobState, get_scheduler
from tests.support.chain import PY, Recording, link_env, make_chain

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "deploy" / "examples" / "train_chain.py"


@pytest.fixture(autouse=True)
def _logging_to_a_live_stream() -> Iterator[None]:
    """The CLI configures structlog to the sys.stderr of the moment (capsys's, closed afterwards)."""
    yield
    configure_logging()


def unique(label: str) -> str:
    return f"ch{label}{uuid.uuid4().hex[:8]}"


def events_of(run: Path, name: str | None = None) -> list[dict[str, Any]]:
    found = ChainRunDir(run).events()
    return [e for e in found if name is None or e["event"] == name]


def ts(event: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00"))


# --- unit: options -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("5", 300),
        ("1:00:00", 3600),
        ("90:30", 5460),
        ("0:30", 60),
        ("1-0", 86400),
        ("2-03:04", 183840),
        ("1-0:0:1", 86460),
    ],
)
def test_time_limits_in_slurm_formats_round_up_to_minutes(text: str, seconds: int) -> None:
    assert parse_time(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "abc", "1h", "1:2:3:4", "-5", "0:00"])
def test_bad_time_limits_are_refused(text: str) -> None:
    with pytest.raises(ChainError, match="--time"):
        parse_time(text)


def test_environment_values_keep_commas_spaces_and_quotes() -> None:
    env = parse_environment(
        ["A=x,y z", "B=", 'C=it\'s "q" $HOME;`id`', "FROM_HERE", "D=a=b"], {"FROM_HERE": "here, too"}
    )
    assert env == {"A": "x,y z", "B": "", "C": 'it\'s "q" $HOME;`id`', "FROM_HERE": "here, too", "D": "a=b"}


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("1A=x", "not a valid"),
        ("A-B=x", "not a valid"),
        ("=x", "not a valid"),
        ("A=x\ny", "newline"),
        ("MISSING_HERE", "no such variable"),
        ("HPC_CHECKPOINT_DIR=/x", "set by hpc-bridge chain"),
        ("HPC_JOB_ID=1", "set by hpc-bridge chain"),
    ],
)
def test_bad_environment_items_are_refused(item: str, message: str) -> None:
    with pytest.raises(ChainError, match=message):
        parse_environment([item], {})


def test_scheduler_choice_option_then_environment_then_slurm() -> None:
    assert scheduler_choice(None, {}) == "slurm"
    assert scheduler_choice(None, {"HPC_SCHEDULER": "SGE"}) == "gridengine"
    assert scheduler_choice("slurm", {"HPC_SCHEDULER": "gridengine"}) == "slurm"
    with pytest.raises(ChainError, match="unknown scheduler"):
        scheduler_choice("pbs", {})
    assert scheduler_options("slurm", {"HPC_SGE_PE": "omp"}) == {}
    assert scheduler_options("gridengine", {"HPC_SGE_PE": "omp", "HPC_SGE_MEMORY_RESOURCE": "h_vmem"}) == {
        "pe": "omp",
        "memory_resource": "h_vmem",
    }


def test_bare_program_names_resolve_through_path(tmp_path: Path) -> None:
    program = tmp_path / "mytrainer"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin"}
    assert resolve_command(["mytrainer", "--x"], env) == [str(program), "--x"]
    assert resolve_command(["./local.py"], env) == ["./local.py"]
    assert resolve_command(["not-installed-anywhere"], env) == ["not-installed-anywhere"]


def test_default_run_dir_is_named_after_the_chain_and_never_reused(tmp_path: Path) -> None:
    now = datetime(2025, 1, 2, 3, 4, 5)
    first = default_run_dir("train", tmp_path, now)
    assert first == tmp_path / "chain-runs" / "train-20250102T030405Z"
    first.mkdir(parents=True)
    assert default_run_dir("train", tmp_path, now).name == "train-20250102T030405Z-2"


def _cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    monkeypatch.chdir(tmp_path)  # no credentials.env here, and none is needed
    for name in list(os.environ):
        if name.startswith(("RABBITMQ_", "RODAN_", "HPC_")):
            monkeypatch.delenv(name)
    assert cli_main(["chain", *argv]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--jobs", "3", "--time", "5", "--"], "no command"),
        (["--jobs", "3", "--time", "5"], "no command"),
        (["--jobs", "0", "--time", "5", "--", "true"], "--jobs"),
        (["--jobs", "2", "--time", "1x", "--", "true"], "--time"),
        (["--jobs", "2", "--time", "1", "--warn", "60", "--", "true"], "--warn"),
        (["--jobs", "2", "--time", "5", "--name", "1abc", "--", "true"], "--name"),
        (["--jobs", "2", "--time", "5", "--name", "a b", "--", "true"], "--name"),
        (["--jobs", "2", "--time", "5", "-v", "BAD NAME=1", "--", "true"], "-v"),
        (["--jobs", "2", "--time", "5", "--scheduler", "pbs", "--", "true"], "unknown scheduler"),
        (["--jobs", "2", "--time", "5", "--run-dir", "with space/run", "--", "true"], "log directory"),
    ],
)
def test_cli_refuses_bad_options_without_needing_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    err = _cli(tmp_path, monkeypatch, capsys, *argv)
    assert "hpc-bridge chain:" in err and message in err
    assert not list(tmp_path.rglob("chain.json"))  # nothing was submitted


def test_cli_refuses_a_run_dir_that_holds_a_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "chain.json").write_text("{}")
    err = _cli(tmp_path, monkeypatch, capsys, "--jobs", "2", "--time", "5", "--run-dir", "run", "--", "true")
    assert "already holds a chain" in err


# --- unit: the link supervisor, with a recording scheduler ----------------------------------------


def test_submission_holds_each_link_on_the_one_before(tmp_path: Path) -> None:
    run, scheduler = make_chain(tmp_path, [PY, "-c", "pass"], environment={"A": "x, y"})
    assert [s.hold_after for s in scheduler.submitted] == ["", "101", "102"]
    assert [s.name for s in scheduler.submitted] == ["unit-1", "unit-2", "unit-3"]
    first = scheduler.submitted[0]
    assert first.command == (PY, "-m", "bridge.chain", str(run), "1") and first.command[0].startswith("/")
    assert first.log_dir == run / "logs" and first.environment == {"A": "x, y"}
    record = json.loads((run / "chain.json").read_text())
    assert record["state"] == "submitted" and record["job_ids"] == ["101", "102", "103"]
    assert record["command"] == [PY, "-c", "pass"] and record["links"] == 3
    assert (run / "checkpoints").is_dir() and (run / "scripts" / "link-2.sh").exists()
    script = (run / "scripts" / "link-2.sh").read_text()
    assert "--dependency=afterany:101" in script and "export A='x, y'" in script
    assert [e["event"] for e in events_of(run)] == ["chain_submitted"]


def test_a_failed_submission_cancels_what_was_submitted(tmp_path: Path) -> None:
    class FailsThird(Recording):
        def submit(self, script: Path, spec: JobSpec) -> str:
            if len(self.submitted) == 2:
                raise SchedulerUnavailable("sbatch failed: slurmctld down")
            return super().submit(script, spec)

    settings = ChainSettings("unit", 3, 600, 0, 1, 100, 0, (PY, "-c", "pass"), str(tmp_path), "slurm")
    scheduler = FailsThird()
    with pytest.raises(SchedulerUnavailable):
        submit_chain(settings, ChainRunDir(tmp_path / "run"), scheduler)
    assert scheduler.cancelled == ["102", "101"]
    assert json.loads((tmp_path / "run" / "chain.json").read_text())["state"] == "submit_failed"
    assert events_of(tmp_path / "run", "chain_failed")
    # A link that starts anyway runs nothing.
    marker = tmp_path / "ran"
    code = run_link(tmp_path / "run", 1, scheduler=scheduler, environ=link_env("101"))
    assert code == 0 and not marker.exists()
    assert events_of(tmp_path / "run", "link_skipped")[0]["reason"] == "submit_failed"


@pytest.mark.parametrize(
    ("exit_code", "link", "expected", "final", "cancelled", "marker"),
    [
        (0, 1, 0, "chain_done", ["102", "103"], "DONE"),
        (0, 3, 0, "chain_done", [], "DONE"),
        (75, 1, 0, None, [], None),
        (75, 3, 75, "chain_incomplete", [], None),
        (2, 1, 2, "chain_failed", ["102", "103"], "FAILED"),
        (2, 2, 2, "chain_failed", ["103"], "FAILED"),
        (100, 1, 1, "chain_failed", ["102", "103"], "FAILED"),  # never 99/100: Grid Engine reads those specially
        (-9, 1, 1, "chain_failed", ["102", "103"], "FAILED"),  # killed by a signal nobody forwarded
    ],
)
def test_link_exit_codes(
    tmp_path: Path,
    exit_code: int,
    link: int,
    expected: int,
    final: str | None,
    cancelled: list[str],
    marker: str | None,
) -> None:
    body = (
        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)" if exit_code < 0 else f"raise SystemExit({exit_code})"
    )
    run, scheduler = make_chain(tmp_path, [PY, "-c", body])
    assert run_link(run, link, scheduler=scheduler, environ=link_env(str(100 + link))) == expected
    assert sorted(scheduler.cancelled) == cancelled
    assert scheduler.cancelled == sorted(cancelled, reverse=True)  # the last link first: none is released
    exit_event = events_of(run, "command_exit")[0]
    assert exit_event["code"] == exit_code and exit_event["link"] == link and exit_event["job_id"] == str(100 + link)
    finals = [e for e in events_of(run) if e["event"] in FINAL_EVENTS]
    assert [e["event"] for e in finals] == ([final] if final else [])
    if final == "chain_failed":
        assert finals[0]["code"] == exit_code
    assert sorted(p.name for p in run.iterdir() if p.name in ("DONE", "FAILED")) == ([marker] if marker else [])


def test_a_command_that_cannot_start_fails_the_chain(tmp_path: Path) -> None:
    run, scheduler = make_chain(tmp_path, [str(tmp_path / "no-such-program")])
    assert run_link(run, 1, scheduler=scheduler, environ=link_env("101")) == 127
    assert events_of(run, "chain_failed")[0]["code"] == 127
    assert scheduler.cancelled == ["103", "102"]


@pytest.mark.parametrize("kind", ["DONE", "FAILED"])
def test_a_link_after_the_end_skips_without_running_the_command(tmp_path: Path, kind: str) -> None:
    flag = tmp_path / "ran"
    run, scheduler = make_chain(tmp_path, [PY, "-c", f"open({str(flag)!r}, 'w').close()"])
    (run / kind).write_text(json.dumps({"link": 1}))
    assert run_link(run, 2, scheduler=scheduler, environ=link_env("102")) == 0
    assert not flag.exists()
    skipped = events_of(run, "link_skipped")
    assert skipped and skipped[0]["reason"] == kind.lower() and skipped[0]["by_link"] == 1
    assert scheduler.cancelled == ["103"] and not events_of(run, "link_start")


CONTRACT_DUMP = """
import json, os, signal, sys
names = [n for n in os.environ if n.startswith("HPC_") or n in ("A", "B")]
out = {n: os.environ[n] for n in names}
out["usr1_ignored"] = signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
out["usr2_ignored"] = signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
out["cwd"] = os.getcwd()
path = os.path.join(os.environ["HPC_CHECKPOINT_DIR"], "env-%s.json" % os.environ["HPC_RESTART_COUNT"])
open(path, "w").write(json.dumps(out))
sys.exit(75 if os.environ["HPC_RESTART_COUNT"] == "0" else 0)
"""


def test_the_command_gets_the_contract_environment(tmp_path: Path) -> None:
    run, scheduler = make_chain(tmp_path, [PY, "-c", CONTRACT_DUMP])
    assert run_link(run, 1, scheduler=scheduler, environ=link_env("101", A="x, y")) == 0
    assert run_link(run, 2, scheduler=scheduler, environ=link_env("102", A="x, y")) == 0
    first = json.loads((run / "checkpoints" / "env-0.json").read_text())
    second = json.loads((run / "checkpoints" / "env-1.json").read_text())
    assert first["HPC_CHECKPOINT_DIR"] == second["HPC_CHECKPOINT_DIR"] == str(run / "checkpoints")
    assert (first["HPC_RESTART_COUNT"], second["HPC_RESTART_COUNT"]) == ("0", "1")
    assert (first["HPC_CHAIN_LINK"], second["HPC_CHAIN_LINK"], first["HPC_CHAIN_LINKS"]) == ("1", "2", "3")
    assert first["HPC_RUN_DIR"] == str(run) and first["A"] == "x, y" and first["cwd"] == str(tmp_path)
    assert first["usr1_ignored"] and first["usr2_ignored"]  # until the command installs its own handler
    assert [e["restart_count"] for e in events_of(run, "link_start")] == [0, 1]
    assert events_of(run, "chain_done")[0]["link"] == 2 and scheduler.cancelled == ["103"]


WAITS_FOR_WARNING = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
open(sys.argv[1], "w").close()
deadline = time.monotonic() + 120
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(75 if got else 3)
"""


def test_the_supervisor_fires_its_own_warning_timer(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    run, scheduler = make_chain(tmp_path, [PY, "-c", WAITS_FOR_WARNING, str(ready)], links=2)
    # Limit 600 s, warning 597 s before it: the timer fires 3 s after the job started.
    env = link_env("101", HPC_JOB_WARN_S="597")
    assert run_link(run, 1, scheduler=scheduler, environ=env) == 0
    assert events_of(run, "warning_forwarded")[0]["source"] == "timer"
    assert events_of(run, "command_exit")[0]["code"] == 75


def _supervisor(tmp_path: Path, command: list[str], **env: str) -> tuple[subprocess.Popen[str], Path]:
    run, _ = make_chain(tmp_path, command, links=1)
    proc = subprocess.Popen(
        [PY, "-m", "bridge.chain", str(run), "1"],
        env=link_env("101", **env),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, run


def _wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2], ids=["USR1", "USR2"])
def test_the_schedulers_warning_is_forwarded_as_sigusr1(tmp_path: Path, sig: signal.Signals) -> None:
    ready = tmp_path / "ready"
    proc, run = _supervisor(tmp_path, [PY, "-c", WAITS_FOR_WARNING, str(ready)])
    _wait_for(ready, proc)
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, output  # the only link asked for more: incomplete
    assert events_of(run, "warning_forwarded")[0]["source"] == f"scheduler ({sig.name})"
    assert events_of(run, "command_exit")[0]["code"] == 75
    assert events_of(run, "chain_incomplete")


def test_the_schedulers_termination_is_forwarded_and_does_not_fail_the_chain(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    sleeper = f"import sys, time; open({str(ready)!r}, 'w').close(); time.sleep(120); sys.exit(3)"
    proc, run = _supervisor(tmp_path, [PY, "-c", sleeper])
    _wait_for(ready, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, output
    exit_event = events_of(run, "command_exit")[0]
    assert exit_event["outcome"] == "terminated" and exit_event["signal"] == "SIGTERM"
    assert events_of(run, "chain_incomplete") and not events_of(run, "chain_failed")
    assert not (run / "FAILED").exists()


def test_chain_log_events_are_written_whatever_the_log_level(tmp_path: Path) -> None:
    configure_logging(level="ERROR", stream=io.StringIO(), component="test")
    try:
        run, scheduler = make_chain(tmp_path, [PY, "-c", "pass"], links=1)
        assert run_link(run, 1, scheduler=scheduler, environ=link_env("101")) == 0
    finally:
        configure_logging()
    assert [e["event"] for e in events_of(run)] == ["chain_submitted", "link_start", "command_exit", "chain_done"]


def test_the_follower_prints_events_and_returns_the_outcome(tmp_path: Path) -> None:
    run, scheduler = make_chain(tmp_path, [PY, "-c", "raise SystemExit(2)"], links=2)
    assert run_link(run, 1, scheduler=scheduler, environ=link_env("101")) == 2

    class Ended(Recording):
        def query(self, job_ids: Any) -> dict[str, JobInfo]:
            return {"101": JobInfo("101", JobState.FAILED, "FAILED"), "102": JobInfo("102", JobState.CANCELLED, "X")}

    lines: list[str] = []
    assert follow(run, Ended(), out=lines.append, log_poll_s=0.01, query_every_s=0.01) == 1
    assert any("command ended with exit 2" in line for line in lines)
    assert any(line.startswith("chain failed: the command exited 2 in link 1/2") for line in lines)


def test_the_follower_cancels_links_the_chain_could_not(tmp_path: Path) -> None:
    class CannotCancel(Recording):
        def cancel(self, job_id: str) -> None:
            raise SchedulerUnavailable("qdel: not a submit host")

    run, _ = make_chain(tmp_path, [PY, "-c", "pass"], links=3)
    assert run_link(run, 1, scheduler=CannotCancel(), environ=link_env("101")) == 0
    assert events_of(run, "cancel_failed") and events_of(run, "chain_done")[0]["cancelled"] == []

    class LoginNode(Recording):
        def query(self, job_ids: Any) -> dict[str, JobInfo]:
            return {
                j: JobInfo(j, JobState.CANCELLED if j in self.cancelled or j == "101" else JobState.PENDING, "")
                for j in job_ids
            }

    login = LoginNode()
    lines: list[str] = []
    assert follow(run, login, out=lines.append, log_poll_s=0.01, query_every_s=0.01) == 0
    assert login.cancelled == ["103", "102"]
    assert events_of(run, "links_cancelled")[0]["job_ids"] == ["102", "103"]
    assert "cancelled waiting job(s) 102 103" in lines


def test_the_follower_concludes_when_links_end_without_a_final_event(tmp_path: Path) -> None:
    run, _ = make_chain(tmp_path, [PY, "-c", "pass"], links=1)

    class Gone(Recording):
        def query(self, job_ids: Any) -> dict[str, JobInfo]:
            return {"101": JobInfo("101", JobState.TIMEOUT, "TIMEOUT")}

    lines: list[str] = []
    assert follow(run, Gone(), out=lines.append, log_poll_s=0.01, query_every_s=0.01) == 1
    failed = events_of(run, "chain_failed")
    assert failed and failed[0]["by"] == "follower" and failed[0]["job_states"] == {"101": "TIMEOUT"}


# --- unit: nobody but the chain's user can change what a later link runs -------------------------

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
NOBODY = 65534


def modes(*paths: Path) -> list[str]:
    return [f"{p.name}:{os.lstat(p).st_mode & 0o7777:04o}" for p in paths]


def test_a_chain_is_created_private_whatever_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o002)  # a group-friendly umask, as many clusters set
    try:
        run, _ = make_chain(tmp_path / "runs", [PY, "-c", "pass"])
    finally:
        os.umask(previous)
    folders = [run.parent, run, run / "checkpoints", run / "logs", run / "scripts"]
    assert modes(*folders) == [f"{p.name}:0700" for p in folders]
    assert modes(run / "chain.json", run / "chain.log") == ["chain.json:0600", "chain.log:0600"]
    assert modes(run / "scripts" / "link-1.sh") == ["link-1.sh:0700"]
    assert all(os.lstat(p).st_uid == os.geteuid() for p in [*folders, run / "chain.json", run / "chain.log"])


@pytest.mark.parametrize(
    ("prepare", "message"),
    [
        (lambda run: run.mkdir(mode=0o775) or run.chmod(0o775), "is writable by group or others (mode 0775)"),
        (lambda run: run.mkdir(mode=0o700) or (run / "logs").mkdir() or (run / "logs").chmod(0o777), "chmod go-w"),
        (lambda run: (run.parent / "real").mkdir() or run.symlink_to(run.parent / "real"), "is a symbolic link"),
    ],
    ids=["group-writable", "a folder world-writable", "a symlink"],
)
def test_submission_refuses_an_existing_run_dir_others_could_change(
    tmp_path: Path, prepare: Callable[[Path], object], message: str
) -> None:
    run = tmp_path / "run"
    prepare(run)
    scheduler = Recording()
    settings = ChainSettings("unit", 2, 600, 0, 1, 100, 0, (PY, "-c", "pass"), str(tmp_path), "slurm")
    with pytest.raises(ChainError, match=re.escape(message)) as refused:
        submit_chain(settings, ChainRunDir(run), scheduler)
    assert str(run) in str(refused.value)
    assert not scheduler.submitted and not list(tmp_path.rglob("chain.json"))


def test_the_cli_says_how_to_make_a_shared_run_dir_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared").chmod(0o770)
    err = _cli(tmp_path, monkeypatch, capsys, "--jobs", "2", "--time", "5", "--run-dir", "shared", "--", "true")
    assert f"chmod go-w {tmp_path / 'shared'}" in err
    assert not (tmp_path / "shared" / "chain.json").exists()


def _evil_chain_json(run: Path, flag: Path) -> Path:
    """What a group member would put in place of chain.json: the same chain running their command."""
    record = json.loads((run / "chain.json").read_text())
    record["command"] = [PY, "-c", f"open({str(flag)!r}, 'w').close()"]
    evil = run.parent / "evil.json"
    evil.write_text(json.dumps(record))
    return evil


def _tamper(kind: str, run: Path, evil: Path) -> Path:
    """Make ``run`` something others could have changed; returns the path to give the link."""
    if kind == "run dir group-writable":
        run.chmod(0o770)
    elif kind == "run dir world-writable":
        run.chmod(0o702)
    elif kind == "run dir another user's":
        os.chown(run, NOBODY, -1)
    elif kind == "run dir a symlink":
        (run.parent / "link").symlink_to(run)
        return run.parent / "link"
    elif kind == "chain.json group-writable":
        (run / "chain.json").chmod(0o620)
    elif kind == "chain.json another user's":
        os.chown(run / "chain.json", NOBODY, -1)
    elif kind == "chain.json a symlink":
        (run / "chain.json").unlink()
        (run / "chain.json").symlink_to(evil)
    elif kind == "checkpoints group-writable":
        (run / "checkpoints").chmod(0o770)
    else:
        raise AssertionError(kind)
    return run


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("run dir group-writable", "writable by group or others (mode 0770)"),
        ("run dir world-writable", "writable by group or others (mode 0702)"),
        pytest.param("run dir another user's", f"belongs to uid {NOBODY}", marks=ROOT_ONLY),
        ("run dir a symlink", "is a symbolic link"),
        ("chain.json group-writable", "writable by group or others (mode 0620)"),
        pytest.param("chain.json another user's", f"belongs to uid {NOBODY}", marks=ROOT_ONLY),
        ("chain.json a symlink", "is a symbolic link"),
        ("checkpoints group-writable", "writable by group or others (mode 0770)"),
    ],
)
def test_a_link_runs_nothing_from_a_run_dir_others_could_change(tmp_path: Path, kind: str, message: str) -> None:
    ours, theirs = tmp_path / "ours-ran", tmp_path / "theirs-ran"
    run, scheduler = make_chain(tmp_path, [PY, "-c", f"open({str(ours)!r}, 'w').close()"])
    before = (run / "chain.log").read_bytes()
    given = _tamper(kind, run, _evil_chain_json(run, theirs))
    with pytest.raises(ChainError, match=re.escape(message)) as refused:
        run_link(given, 1, scheduler=scheduler, environ=link_env("101"))
    where = str(refused.value).split(" ")[0]
    assert where.startswith(str(given))  # the message names the path
    if "writable" in message:
        assert f"chmod go-w {where}" in str(refused.value)
    assert not ours.exists() and not theirs.exists()  # neither the chain's command nor another's ran
    assert (run / "chain.log").read_bytes() == before and not scheduler.cancelled
    assert not (run / "DONE").exists() and not (run / "FAILED").exists()


def test_the_follower_refuses_a_run_dir_others_could_change(tmp_path: Path) -> None:
    class Ended(Recording):
        def query(self, job_ids: Any) -> dict[str, JobInfo]:
            return {"101": JobInfo("101", JobState.TIMEOUT, "TIMEOUT")}

    run, _ = make_chain(tmp_path, [PY, "-c", "pass"], links=1)
    (run / "checkpoints").chmod(0o777)
    lines: list[str] = []
    with pytest.raises(ChainError, match=re.escape(f"chmod go-w {run / 'checkpoints'}")):
        follow(run, Ended(), out=lines.append, log_poll_s=0.01, query_every_s=0.01)
    assert lines == [] and [e["event"] for e in events_of(run)] == ["chain_submitted"]


def test_the_link_job_logs_why_it_refused_and_exits_1(tmp_path: Path) -> None:
    flag = tmp_path / "ran"
    run, _ = make_chain(tmp_path, [PY, "-c", f"open({str(flag)!r}, 'w').close()"], links=1)
    (run / "chain.json").chmod(0o666)
    proc = subprocess.run(
        [PY, "-m", "bridge.chain", str(run), "1"], env=link_env("101"), cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    refused = [e for e in map(json.loads, proc.stderr.splitlines()) if e.get("event") == "link_refused"]
    assert refused and refused[0]["link"] == 1 and refused[0]["level"] == "error"
    assert f"chmod go-w {run / 'chain.json'}" in refused[0]["error"]
    assert not flag.exists()
    # Made private again, the same link runs.
    (run / "chain.json").chmod(0o600)
    assert run_link(run, 1, scheduler=Recording(), environ=link_env("101")) == 0 and flag.exists()


# --- integration: real schedulers ----------------------------------------------------------------


@pytest.fixture(
    params=[pytest.param("slurm", marks=pytest.mark.slurm), pytest.param("gridengine", marks=pytest.mark.gridengine)]
)
def scheduler_name(request: pytest.FixtureRequest) -> str:
    name = str(request.param)
    if name == "slurm":
        request.getfixturevalue("slurm")  # conftest: fails, never skips, when the cluster is down
    else:
        request.getfixturevalue("gridengine")  # conftest: fails, never skips, when Grid Engine is missing
        try:
            get_scheduler("gridengine").ping()
        except SchedulerUnavailable as exc:
            pytest.fail(f"Grid Engine does not answer ({exc}): run 'bash deploy/dev/gridengine.sh up'")
    return name


@pytest.fixture
def run_chain(
    tmp_path: Path, scheduler_name: str
) -> Iterator[Callable[..., tuple[subprocess.CompletedProcess[str], Path]]]:
    """``hpc-bridge chain --scheduler NAME --wait ...`` as a researcher runs it: a fresh process, no
    credentials.env, no bridge settings in the environment. Cancels leftovers afterwards."""
    runs: list[Path] = []

    def go(*args: str, command: list[str], timeout: float = 600) -> tuple[subprocess.CompletedProcess[str], Path]:
        run = tmp_path / f"run{len(runs) + 1}"
        runs.append(run)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "RODAN_", "HPC_"))}
        argv = [PY, "-m", "bridge", "chain", "--scheduler", scheduler_name, "--run-dir", str(run), "--mem", "300"]
        result = subprocess.run(
            [*argv, "--wait", *args, "--", *command], env=env, cwd=tmp_path, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
        return result, run

    yield go
    for run in runs:
        if (run / "chain.json").exists():
            cancel_chain(run)


def job_states(run: Path) -> dict[str, str]:
    record = json.loads((run / "chain.json").read_text())
    found = get_scheduler(record["scheduler"]).query(record["job_ids"])
    return {j: (found[j].state.value if j in found else "gone") for j in record["job_ids"]}


def never_ran(run: Path, link: int) -> bool:
    """The link's command never ran: no link_start; the job was cancelled, or it skipped."""
    if any(e["link"] == link for e in events_of(run, "link_start")):
        return False
    job_id = json.loads((run / "chain.json").read_text())["job_ids"][link - 1]
    skipped = any(e["link"] == link for e in events_of(run, "link_skipped"))
    return skipped or job_states(run)[job_id] in ("CANCELLED", "gone")


def checkpoint(run: Path) -> dict[str, Any]:
    with np.load(run / "checkpoints" / "state.npz") as data:
        return {
            "w": data["w"].copy(),
            "step": int(data["step"]),
            "total_steps": int(data["total_steps"]),
            "segments": json.loads(str(data["segments"])),
        }


def test_work_that_needs_two_links_finishes_in_the_second(
    run_chain: Callable[..., tuple[subprocess.CompletedProcess[str], Path]], scheduler_name: str, tmp_path: Path
) -> None:
    # 40 steps of 0.1 s need ~4 s; each job stops itself after 3 s: exactly two links do the work.
    work = ["--total-steps", "40", "--step-delay", "0.1", "--max-seconds-per-job", "3"]
    result, run = run_chain("--jobs", "3", "--time", "2", "--name", unique("two"), command=[PY, str(EXAMPLE), *work])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "chain done: the command finished in link 2/3" in result.stdout
    # standard error is no terminal: the progress comes as JSON lines (links, states, chain events)
    shown = [e for e in map(json.loads, result.stderr.splitlines()) if e.get("event") in ("progress", "message")]
    chain_events = [e["chain_event"] for e in shown if "chain_event" in e]
    assert chain_events[-1] == "chain_done" and chain_events.count("link_start") == 2
    record = json.loads((run / "chain.json").read_text())
    links_seen = {(e["link"], e["job_id"]) for e in shown if e["event"] == "progress" and "link" in e}
    assert (2, record["job_ids"][1]) in links_seen
    assert shown[-1]["event"] == "progress" and shown[-1]["state"] == "done" and shown[-1]["code"] == 0

    starts, exits = events_of(run, "link_start"), events_of(run, "command_exit")
    assert [(e["link"], e["restart_count"]) for e in starts] == [(1, 0), (2, 1)]
    assert [(e["link"], e["code"]) for e in exits] == [(1, 75), (2, 0)]
    # Strictly in order: link 2 started after link 1's command had ended.
    assert ts(starts[0]) < ts(exits[0]) < ts(starts[1]) < ts(exits[1])
    assert events_of(run, "chain_done")[0]["link"] == 2 and (run / "DONE").exists()
    assert never_ran(run, 3)

    state = checkpoint(run)
    assert state["step"] == state["total_steps"] == 40
    first, second = state["segments"]
    assert (first["restart"], second["restart"]) == (0, 1)
    assert first["start"] == 0 and first["end"] == second["start"] > 0 and second["end"] == 40
    # Resuming lost nothing: the same weights as one uninterrupted run.
    alone = tmp_path / "alone"
    env = {**os.environ, "HPC_CHECKPOINT_DIR": str(alone)}
    subprocess.run([PY, str(EXAMPLE), "--total-steps", "40"], env=env, check=True, capture_output=True, timeout=120)
    with np.load(alone / "state.npz") as data:
        # Equal to rounding: BLAS may sum in another order in another process (memory alignment,
        # threads), ~1e-16 here; a lost or repeated SGD step would move w by more than 1e-3.
        np.testing.assert_allclose(state["w"], data["w"], rtol=1e-12, atol=1e-14)
        assert not np.array_equal(data["w"], np.zeros_like(data["w"]))


def test_a_failing_command_stops_the_chain(
    run_chain: Callable[..., tuple[subprocess.CompletedProcess[str], Path]], scheduler_name: str
) -> None:
    fail = [PY, "-c", "import sys; print('broken input'); sys.exit(2)"]
    result, run = run_chain("--jobs", "3", "--time", "2", "--name", unique("fail"), command=fail)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "chain failed: the command exited 2 in link 1/3" in result.stdout
    failed = events_of(run, "chain_failed")
    assert len(failed) == 1 and failed[0]["code"] == 2 and failed[0]["link"] == 1
    record = json.loads((run / "chain.json").read_text())
    assert sorted(failed[0]["cancelled"]) == sorted(record["job_ids"][1:])
    assert never_ran(run, 2) and never_ran(run, 3)
    assert (run / "FAILED").exists() and not (run / "DONE").exists()
    log_file = get_scheduler(scheduler_name).log_file(run / "logs", record["job_ids"][0])
    assert "broken input" in log_file.read_text()


def test_environment_values_arrive_intact(
    run_chain: Callable[..., tuple[subprocess.CompletedProcess[str], Path]], scheduler_name: str
) -> None:
    tricky = 'it\'s "quoted", with $HOME; `id` and  two spaces'
    result, run = run_chain(
        "--jobs", "2", "--time", "2", "--name", unique("env"), "-v", "A=x,y,z", "-v", f"B={tricky}",
        command=[PY, "-c", CONTRACT_DUMP],
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads((run / "chain.json").read_text())
    first = json.loads((run / "checkpoints" / "env-0.json").read_text())
    second = json.loads((run / "checkpoints" / "env-1.json").read_text())
    for seen in (first, second):
        assert seen["A"] == "x,y,z" and seen["B"] == tricky
        assert seen["HPC_CHECKPOINT_DIR"] == str(run / "checkpoints") and seen["HPC_RUN_DIR"] == str(run)
        assert seen["HPC_CHAIN_LINKS"] == "2" and seen["HPC_JOB_SCHEDULER"] == scheduler_name
        assert seen["HPC_JOB_TIME_LIMIT_S"] == "120" and seen["HPC_JOB_WARN_S"] == "30"
        assert seen["HPC_JOB_STARTED"].isdigit() and seen["usr1_ignored"]
    assert (first["HPC_CHAIN_LINK"], first["HPC_RESTART_COUNT"], first["HPC_JOB_ID"]) == (
        "1",
        "0",
        record["job_ids"][0],
    )
    assert (second["HPC_CHAIN_LINK"], second["HPC_RESTART_COUNT"], second["HPC_JOB_ID"]) == (
        "2",
        "1",
        record["job_ids"][1],
    )


@pytest.mark.slow
@pytest.mark.waits  # for the link's time limit warning
def test_the_time_limit_warning_makes_the_script_checkpoint_and_the_next_link_resume(
    run_chain: Callable[..., tuple[subprocess.CompletedProcess[str], Path]], scheduler_name: str
) -> None:
    # One-minute jobs warned 25 s before the limit, and far more work than fits: each link stops on
    # the warning. On Slurm only the scheduler's signal (5-35 s after the start) may warn; Grid
    # Engine's own (USR2) only comes at the limit, so there the supervisor's timer (35 s) warns.
    timer = ["-v", "HPC_CHAIN_WARN_TIMER=0"] if scheduler_name == "slurm" else []
    work = [PY, str(EXAMPLE), "--total-steps", "1000000", "--step-delay", "0.05", "--checkpoint-every", "1000"]
    result, run = run_chain(
        "--jobs", "2", "--time", "1", "--warn", "25", *timer, "--name", unique("warn"), command=work
    )
    assert result.returncode == EX_TEMPFAIL, result.stdout + result.stderr
    assert "chain incomplete" in result.stdout

    warnings = events_of(run, "warning_forwarded")
    expected = "scheduler (SIGUSR1)" if scheduler_name == "slurm" else "timer"
    assert [(e["link"], e["source"]) for e in warnings] == [(1, expected), (2, expected)]
    assert [(e["link"], e["code"]) for e in events_of(run, "command_exit")] == [(1, 75), (2, 75)]
    assert events_of(run, "chain_incomplete")[0]["link"] == 2

    state = checkpoint(run)
    first, second = state["segments"]
    assert first["reason"] == second["reason"] == "SIGUSR1"
    assert 0 < first["end"] == second["start"] < second["end"] == state["step"]
    record = json.loads((run / "chain.json").read_text())
    backend = get_scheduler(scheduler_name)
    link1 = backend.log_file(run / "logs", record["job_ids"][0]).read_text()
    link2 = backend.log_file(run / "logs", record["job_ids"][1]).read_text()
    assert f"stopping (SIGUSR1) at step {first['end']} of 1000000" in link1
    assert f"resuming from step {first['end']} of 1000000" in link2
