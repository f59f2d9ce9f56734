"""The Slurm backend: rendered script (golden file), state table, submit-error classification,
odd scheduler output and the options every command carries (fake commands); then, on the local
Slurm (deploy/dev/slurm.sh up), only our jobs: another user's jobs named like ours, array jobs, a
held job's pending reason, and a cluster chosen with -M."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.errors import SchedulerRejected, SchedulerUnavailable
from bridge.schedulers import JobInfo, JobSpec, JobState, SlurmScheduler, get_scheduler, slurm_cluster_args
from bridge.schedulers.slurm import STATE_TABLE, translate
from bridge.shell import run_command
from tests.support.bridge import fake_command
from tests.support.cluster import require_other_user

GOLDEN = Path(__file__).parent / "golden" / "slurm_job.sh"
GOLDEN_SITE = Path(__file__).parent / "golden" / "slurm_job_site.sh"
#: HPC_JOB_PROLOGUE as a site writes it (environment modules, its own activation script, a proxy).
SITE_PROLOGUE = (
    "module load cuda/12.2 cudnn\nsource /opt/site/tensorflow-env.sh\nexport HTTPS_PROXY=http://proxy.example.org:3128"
)


def spec(**kw: object) -> JobSpec:
    values: dict[str, object] = dict(
        name="rodan-3f2b8c1e-0d4a-4c1b-9a57-6f1f0c3e2d10",
        comment="3f2b8c1e-0d4a-4c1b-9a57-6f1f0c3e2d10",
        time_minutes=6 * 60,
        memory_mb=16000,
        cpus=6,
        command=("/opt/venv/bin/python", "-m", "worker", "run", "/spool/params/3f2b.json"),
        log_dir=Path("/spool/jobs/3f2b"),
        warn_seconds=300,
        workdir=Path("/spool/jobs/3f2b"),
        gres="gpu:1",
        email="lab@example.org",
        account="def-lab",
        partition="gpu",
    )
    values.update(kw)
    return JobSpec(**values)  # type: ignore[arg-type]


def test_rendered_script_matches_the_golden_file() -> None:
    text = SlurmScheduler().render(spec())
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_site_directives_and_prologue_match_the_golden_file() -> None:
    """HPC_JOB_DIRECTIVES after the bridge's own directives, HPC_JOB_PROLOGUE just before the worker."""
    text = SlurmScheduler().render(
        spec(directives=("--nice=10", "--constraint=v100", "--exclusive"), prologue=SITE_PROLOGUE)
    )
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN_SITE.write_text(text)
    assert text == GOLDEN_SITE.read_text()


def test_optional_directives_are_left_out() -> None:
    text = SlurmScheduler().render(spec(gres=None, email="", account="", partition=""))
    assert "--gres" not in text and "--mail-user" not in text and "--account" not in text
    assert "--partition" not in text
    assert "#SBATCH --time=0-06:00" in text and "#SBATCH --mem=16000M" in text


@pytest.mark.parametrize(
    "field",
    [
        {"email": "a@b.org\n#SBATCH --uid=0"},
        {"gres": "gpu:1 --uid=0"},
        {"account": "x;rm -rf /"},
        {"log_dir": Path("/tmp/a b")},
        {"hold_after": "12;rm"},
        {"environment": {"A B": "x"}},
        {"environment": {"A": "x\n#SBATCH --uid=0"}},
        {"name": "rodan-$(id)"},
    ],
)
def test_unsafe_values_never_reach_the_script(field: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="unsafe value"):
        SlurmScheduler().render(spec(**field))


def test_command_arguments_are_shell_quoted() -> None:
    text = SlurmScheduler().render(spec(command=("/opt/py", "-m", "worker", "run", "/spool/it's here.json")))
    assert "exec /opt/py -m worker run '/spool/it'\"'\"'s here.json'" in text


def test_state_table_covers_every_terminal_state_and_never_guesses() -> None:
    assert translate("CANCELLED by 0") is JobState.CANCELLED
    assert translate("COMPLETING") is JobState.RUNNING
    assert translate("REQUEUED") is JobState.REQUEUED
    assert translate("") is JobState.MISSING
    assert translate("SOMETHING_NEW") is JobState.MISSING
    for word in ["FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "COMPLETED"]:
        assert STATE_TABLE[word].is_terminal
    for word in ["PENDING", "RUNNING", "SUSPENDED", "REQUEUED", "COMPLETING"]:
        assert not STATE_TABLE[word].is_terminal


def _fake_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "sbatch"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")


def test_permanent_rejection_is_quoted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_sbatch(
        tmp_path,
        monkeypatch,
        'echo "sbatch: error: Memory specification can not be satisfied" >&2\n'
        'echo "sbatch: error: Batch job submission failed: Requested node configuration is not available" >&2\n'
        "exit 1\n",
    )
    with pytest.raises(SchedulerRejected, match="Memory specification can not be satisfied"):
        SlurmScheduler().submit(tmp_path / "job.sh", spec())


def test_controller_down_is_transient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_sbatch(
        tmp_path,
        monkeypatch,
        'echo "sbatch: error: Batch job submission failed: Unable to contact slurm controller '
        '(connect failure)" >&2\nexit 1\n',
    )
    with pytest.raises(SchedulerUnavailable, match="Unable to contact slurm controller"):
        SlurmScheduler().submit(tmp_path / "job.sh", spec())


def test_hanging_sbatch_times_out_as_transient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_sbatch(tmp_path, monkeypatch, "sleep 30\n")
    with pytest.raises(SchedulerUnavailable, match="timed out"):
        SlurmScheduler(timeout_s=0.5).submit(tmp_path / "job.sh", spec())


def test_submit_environment_has_no_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RABBITMQ_PASSWORD", "hunter2")
    monkeypatch.setenv("RODAN_PASSWORD", "hunter3")
    out = tmp_path / "env.txt"
    _fake_sbatch(tmp_path, monkeypatch, f'env > "{out}"\necho 42\n')
    assert SlurmScheduler().submit(tmp_path / "job.sh", spec()) == "42"
    env = out.read_text()
    assert "hunter2" not in env and "hunter3" not in env and "PATH=" in env


# --- only our jobs, and odd output, with fake commands ---------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["-M", "beluga"], ("--clusters=beluga",)),
        (["-Mbeluga"], ("--clusters=beluga",)),
        (["--clusters=beluga"], ("--clusters=beluga",)),
        (["--clusters", "beluga"], ("--clusters=beluga",)),
        (["--cluster=beluga"], ("--clusters=beluga",)),
        (["--cluster", "beluga"], ("--clusters=beluga",)),
        (["--qos=normal", "-M", "beluga", "--mail-type=NONE"], ("--clusters=beluga",)),
        (["--qos", "normal", "--clusters=a,b"], ("--clusters=a,b",)),
        ([], ()),
        (["--qos=normal", "--mail-type=NONE", "-m", "block"], ()),
        (["--cluster-constraint=x", "--mem=1G"], ()),
        (["-M"], ()),  # no value: sbatch refuses it anyway
        (["--clusters="], ()),
    ],
)
def test_cluster_selection_is_found_in_the_scheduler_args(args: list[str], expected: tuple[str, ...]) -> None:
    assert slurm_cluster_args(args) == expected


def test_get_scheduler_passes_the_cluster_on() -> None:
    scheduler = get_scheduler("slurm", scheduler_args=("--qos=normal", "-M", "beluga"))
    assert isinstance(scheduler, SlurmScheduler) and scheduler.cluster_args == ("--clusters=beluga",)
    assert get_scheduler("slurm").cluster_args == ()  # type: ignore[attr-defined]
    assert scheduler.user == pwd.getpwuid(os.geteuid()).pw_name  # the effective user, by default
    with pytest.raises(ValueError, match="unsafe value"):
        SlurmScheduler(user="-a")


def test_every_command_carries_our_user_and_the_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = tmp_path / "calls.txt"
    record = f'echo "$(basename "$0") $*" >> "{calls}"\n'
    fake_command(
        tmp_path,
        monkeypatch,
        "squeue",
        record + 'case "$*" in\n*"%i|%T|%r"*) echo "5|PENDING|Priority";;\n*"%i|%T"*) echo "5|PENDING";;\n'
        "*) echo 5;;\nesac\n",
    )
    fake_command(
        tmp_path,
        monkeypatch,
        "sacct",
        record + 'case "$*" in\n*State*) echo "6|6|COMPLETED|0:0|00:00:01";;\n*) echo "6|6";;\nesac\n',
    )
    fake_command(tmp_path, monkeypatch, "scancel", record)
    fake_command(tmp_path, monkeypatch, "scontrol", record + 'echo "Slurmctld(primary) at vm is UP"\n')
    fake_command(tmp_path, monkeypatch, "sbatch", record + 'echo "42;beluga"\n')
    scheduler = get_scheduler("slurm", scheduler_args=("-M", "beluga"), options={"user": "hpcbt"})
    job = spec(extra_args=("-M", "beluga"))
    assert scheduler.submit(tmp_path / "job.sh", job) == "42"
    assert scheduler.query(["5", "6"]) == {
        "5": JobInfo("5", JobState.PENDING, "PENDING", source="queue", reason="Priority"),
        "6": JobInfo("6", JobState.COMPLETED, "COMPLETED", "0:0", "00:00:01", "accounting"),
    }
    assert scheduler.find_by_name(job.name) == ["5", "6"]
    scheduler.cancel("5")
    assert scheduler.continue_job("5", tmp_path / "job.sh", job) == "5"
    scheduler.ping()
    scheduler.check_accounting()
    lines = calls.read_text().splitlines()
    commands = {line.split()[0] for line in lines}
    assert commands == {"sbatch", "squeue", "sacct", "scancel", "scontrol"}
    for line in lines:
        words = line.split()
        if words[0] == "sbatch":  # the cluster comes with the rest of HPC_SCHEDULER_ARGS
            assert words[1:] == ["--parsable", "-M", "beluga", str(tmp_path / "job.sh")]
            continue
        assert "--clusters=beluga" in words, line
        if words[0] != "scontrol":  # requeue and ping are about one job id or the cluster
            assert "--user=hpcbt" in words, line


def test_odd_scheduler_output_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    garbage = r"printf '\n  \n|\ngarbage\nabc|RUNNING|None\n\377\376|PENDING|x\n\331\243|RUNNING|None\n'"
    reason = "ReqNodeNotAvail, UnavailableNodes:" + "n" * 400
    fake_command(
        tmp_path,
        monkeypatch,
        "squeue",
        garbage + "\n"
        'case "$*" in\n'
        f'*"%i|%T|%r"*) echo "7|PENDING|Resources"; echo "7_1|RUNNING|None"; echo "8|RUNNING|None"; '
        f'echo "11|PENDING|{reason}"; echo "12|PENDING|None";;\n'
        '*) echo "7"; echo "123_1"; echo "124_[0-3]"; echo " 8 "; echo "125+0";;\nesac\n',
    )
    fake_command(
        tmp_path,
        monkeypatch,
        "sacct",
        garbage + "\n"
        'case "$*" in\n'
        '*State*) echo "9|9|COMPLETED|0:0|00:00:01"; echo "10_1|10|FAILED|1:0|00:00:01"; echo "short|line";;\n'
        '*) echo "9|9"; echo "10_1|10"; echo "12+0|12"; echo "13|14"; echo "x|x";;\nesac\n',
    )
    scheduler = SlurmScheduler(user="hpcbt")
    assert scheduler.find_by_name("rodan-x") == ["7", "8", "9"]
    found = scheduler.query(["7", "8", "9", "10", "11", "12", "abc", "1_2", ""])
    assert sorted(found, key=int) == ["7", "8", "9", "11", "12"]
    assert (found["7"].state, found["7"].reason) == (JobState.PENDING, "Resources")
    assert (found["8"].state, found["8"].reason) == (JobState.RUNNING, "")
    assert (found["9"].state, found["9"].source) == (JobState.COMPLETED, "accounting")
    assert found["11"].reason == reason[:300] and found["12"].reason == ""
    assert scheduler.query(["abc", "1_2"]) == {}  # not plain ids: never ours


# --- the real Slurm: only our jobs ------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_user(slurm: None) -> str:
    """A second unix user who may submit jobs (deploy/dev/slurm.sh up creates it). Fails, never skips."""
    return require_other_user("slurm.sh")


@pytest.fixture
def leftovers() -> Iterator[list[str]]:
    """Job ids to cancel (as root, whoever owns them) after the test."""
    ids: list[str] = []
    yield ids
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, timeout=60)


def _sbatch_as(user: str | None, name: str, *args: str) -> str:
    """``sbatch`` of a job that does nothing, run by ``user`` (runuser) or by us; returns its id."""
    as_user = ["runuser", "-u", user, "--"] if user else []
    sbatch = ["sbatch", "--parsable", "-J", name, "-o", "/dev/null", "--chdir=/", "-t", "1", *args, "--wrap", "true"]
    return run_command([*as_user, *sbatch], timeout=60).stdout.strip().split(";")[0]


def _raw_state(job_id: str) -> str:
    """The job's state as root sees it (any user's job), from squeue, else sacct."""
    live = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    if live.stdout.strip():
        return live.stdout.strip()
    acct = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True, text=True)
    return acct.stdout.strip()


def _wait_state(job_id: str, states: tuple[str, ...], timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = _raw_state(job_id)
        if state.split(" ")[0] in states:
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job_id}: {state!r}, not one of {states} after {timeout:g} s")


def _in_accounting(job_id: str, name: str, timeout: float = 120) -> None:
    """Wait until sacct lists the job under its name (as find_by_name asks, any user's)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        acct = subprocess.run(
            ["sacct", "-a", "-n", "-X", "-P", "--name", name, "-S", "now-1days", "-o", "JobIDRaw"],
            capture_output=True,
            text=True,
        )
        if job_id in acct.stdout.split():
            return
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} not in accounting after {timeout:g} s")


def held_spec(tmp_path: Path, name: str, *extra: str) -> JobSpec:
    return JobSpec(
        name=name,
        comment="test",
        time_minutes=1,
        memory_mb=100,
        cpus=1,
        command=("/bin/true",),
        log_dir=tmp_path,
        workdir=tmp_path,
        extra_args=("--hold", *extra),
    )


def submit_held(scheduler: SlurmScheduler, tmp_path: Path, name: str, *extra: str) -> str:
    job = held_spec(tmp_path, name, *extra)
    script = tmp_path / f"{uuid.uuid4().hex[:8]}.sh"
    script.write_text(scheduler.render(job))
    return scheduler.submit(script, job)


@pytest.mark.slurm
def test_another_users_jobs_are_never_ours(other_user: str, leftovers: list[str], tmp_path: Path) -> None:
    name = f"rodan-hpcbt-{uuid.uuid4().hex[:12]}"
    scheduler = SlurmScheduler(timeout_s=30)
    theirs_held = _sbatch_as(other_user, name, "--hold")
    leftovers.append(theirs_held)
    theirs_done = _sbatch_as(other_user, name)
    leftovers.append(theirs_done)
    ours = submit_held(scheduler, tmp_path, name)
    leftovers.append(ours)
    _wait_state(theirs_done, ("COMPLETED", "FAILED"))
    _in_accounting(theirs_done, name)

    assert scheduler.find_by_name(name) == [ours]
    found = scheduler.query([theirs_held, theirs_done, ours])
    assert list(found) == [ours] and found[ours].state is JobState.PENDING

    scheduler.cancel(theirs_held)
    assert _raw_state(theirs_held) == "PENDING"  # still there: not ours to cancel
    scheduler.cancel(ours)
    assert _wait_state(ours, ("CANCELLED",)).startswith("CANCELLED")
    assert scheduler.query([ours])[ours].state is JobState.CANCELLED


@pytest.mark.slurm
def test_an_array_job_of_ours_is_not_adopted(slurm: None, leftovers: list[str], tmp_path: Path) -> None:
    name = f"rodan-hpcbt-{uuid.uuid4().hex[:12]}"
    scheduler = SlurmScheduler(timeout_s=30)
    array = _sbatch_as(None, name, "--hold", "--array=0-1")
    leftovers.append(array)
    plain = submit_held(scheduler, tmp_path, name)
    leftovers.append(plain)
    assert _raw_state(array) == "PENDING"
    assert scheduler.find_by_name(name) == [plain]
    assert list(scheduler.query([array, plain])) == [plain]


@pytest.mark.slurm
def test_a_held_job_says_why_it_waits(slurm: None, leftovers: list[str], tmp_path: Path) -> None:
    scheduler = SlurmScheduler(timeout_s=30)
    job_id = submit_held(scheduler, tmp_path, f"rodan-hpcbt-{uuid.uuid4().hex[:12]}")
    leftovers.append(job_id)
    info = scheduler.query([job_id])[job_id]
    assert (info.state, info.native_state, info.reason, info.source) == (
        JobState.PENDING,
        "PENDING",
        "JobHeldUser",
        "queue",
    )


def _cluster_name() -> str:
    config = run_command(["scontrol", "show", "config"], timeout=30).stdout
    for line in config.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "ClusterName":
            return value.strip()
    raise AssertionError("scontrol show config names no ClusterName")


@pytest.mark.slurm
def test_a_cluster_chosen_with_dash_m_is_asked_everywhere(slurm: None, leftovers: list[str], tmp_path: Path) -> None:
    cluster = _cluster_name()
    args = ("-M", cluster)
    scheduler = get_scheduler("slurm", timeout_s=30, scheduler_args=args)
    assert isinstance(scheduler, SlurmScheduler)
    name = f"rodan-hpcbt-{uuid.uuid4().hex[:12]}"
    job_id = submit_held(scheduler, tmp_path, name, *args)  # sbatch prints "ID;CLUSTER"
    leftovers.append(job_id)
    assert scheduler.query([job_id])[job_id].reason == "JobHeldUser"
    assert scheduler.find_by_name(name) == [job_id]
    assert "UP" in scheduler.ping()
    assert scheduler.check_accounting() == "sacct answers"
    scheduler.cancel(job_id)
    assert _wait_state(job_id, ("CANCELLED",)).startswith("CANCELLED")
    assert scheduler.query([job_id])[job_id].state is JobState.CANCELLED
