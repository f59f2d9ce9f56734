"""The Slurm backend: rendered script (golden file), state table, submit-error classification."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from bridge.errors import SchedulerRejected, SchedulerUnavailable
from bridge.schedulers import JobSpec, JobState, SlurmScheduler
from bridge.schedulers.slurm import STATE_TABLE, translate

GOLDEN = Path(__file__).parent / "golden" / "slurm_job.sh"


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
