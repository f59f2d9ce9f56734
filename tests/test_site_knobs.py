"""A site's own job set-up: HPC_JOB_DIRECTIVES (extra ``#SBATCH`` / ``#$`` lines) and HPC_JOB_PROLOGUE
(shell lines run before the worker), on both schedulers.

Rendering: where they go, that nothing unsafe and no option the bridge sets itself gets in, that a
job re-rendered from its JSON (a continuation) keeps them, and that the Rodan request's job carries
the configured ones. ``doctor``'s template check renders them and reports a prologue that is not
valid bash. Real jobs on the local Slurm and Grid Engine: the directives reach the scheduler
(``scontrol show job`` / ``qstat -j``), the prologue runs before the command, and a failing
prologue line fails the job with its reason in the job's log. (The golden files with both are in
tests/test_slurm_backend.py and tests/test_gridengine_backend.py.)
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from bridge.config import BridgeConfig, load_config
from bridge.errors import ConfigError
from bridge.intake import Intake
from bridge.ledger import Ledger
from bridge.ops.doctor import check_template
from bridge.protocol import parse_request
from bridge.replies import ReplyBox
from bridge.rodan import RodanClient
from bridge.schedulers import GridEngineScheduler, JobInfo, JobSpec, JobState, Scheduler, SlurmScheduler
from bridge.spool import Spool
from tests.support.bridge import FAST_SETTINGS

PROLOGUE = 'export SITE_VALUE="from the prologue"\necho "site prologue ran in $PWD"'
SLURM_DIRECTIVES = ("--nice=10", "--delay-boot=7")
GE_DIRECTIVES = ("-l h_vmem=1G", "-p -5", "-A hpcbt-site")
PAGE_INPUTS = ("Image", "Background", "Selected Regions", "rgba PNG - Layer 0")


def spec(tmp_path: Path, **kw: object) -> JobSpec:
    values: dict[str, object] = dict(
        name=f"hpcbt-site-{uuid.uuid4().hex[:10]}",
        comment="test",
        time_minutes=5,
        memory_mb=100,
        cpus=1,
        command=("/bin/bash", "-c", 'echo "command sees: $SITE_VALUE in $PWD"'),
        log_dir=tmp_path,
        workdir=tmp_path,
    )
    values.update(kw)
    return JobSpec(**values)


def both() -> list[Scheduler]:
    return [SlurmScheduler(), GridEngineScheduler()]


# --- rendering -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scheduler", "directives"), [(SlurmScheduler(), SLURM_DIRECTIVES), (GridEngineScheduler(), GE_DIRECTIVES)]
)
def test_directives_follow_the_bridges_own_and_the_prologue_runs_last_before_the_command(
    scheduler: Scheduler, directives: tuple[str, ...], tmp_path: Path
) -> None:
    job = spec(tmp_path, directives=directives, prologue=PROLOGUE)
    lines = scheduler.render(job).splitlines()
    prefix = scheduler.directive_prefix
    own = [f"{prefix} {d}" for d in scheduler.directives(job)]
    header = [line for line in lines if line.startswith(f"{prefix} ")]
    assert header == own + [f"{prefix} {d}" for d in directives]  # site lines last: never before ours
    strict = lines.index("set -euo pipefail")
    assert lines.index(own[-1]) < strict  # all directives before the first command
    body = lines[lines.index('export SITE_VALUE="from the prologue"') - 3 :]
    assert body[:3] == [
        "# The site's set-up (HPC_JOB_PROLOGUE): a failing line ends the job here.",
        "set +u",
        """trap 'echo "hpc-bridge: HPC_JOB_PROLOGUE failed (exit $?, line $LINENO of this script)" >&2' ERR""",
    ]
    assert body[3:] == [
        'export SITE_VALUE="from the prologue"',
        'echo "site prologue ran in $PWD"',
        "trap - ERR",
        "set -u",
        f"cd {tmp_path}",
        "exec /bin/bash -c 'echo \"command sees: $SITE_VALUE in $PWD\"'",
    ]
    assert lines.index("umask 077") < lines.index("set +u")  # after the strict mode, umask and environment


def test_without_knobs_the_script_has_no_trace_of_them(tmp_path: Path) -> None:
    for scheduler in both():
        text = scheduler.render(spec(tmp_path))
        assert "HPC_JOB_PROLOGUE" not in text and "set +u" not in text
        assert text.splitlines()[-2].startswith('echo "hpc-bridge job ') and text.endswith("\n")


@pytest.mark.parametrize(
    "entry",
    [
        "--comment=x\n#SBATCH --uid=0",
        "--qos=high\r",
        "--constraint=$(id)",
        "--constraint=`id`",
        "--qos=high; rm -rf /",
        "--qos=high && id",
        "--qos='high'",
        '--qos="high"',
        "--qos=high # comment",
        "--qos=a|b",
        "--output=>x",
        "--qos=\\x",
        "qos=high",
        "-",
        "--",
        "--qos  high",
        " --qos=high",
        "--qos=high\0",
    ],
)
def test_unsafe_directive_text_never_reaches_a_script(entry: str, tmp_path: Path) -> None:
    for scheduler in both():
        with pytest.raises(ValueError, match="unsafe value for HPC_JOB_DIRECTIVES"):
            scheduler.render(spec(tmp_path, directives=(entry,)))


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("--job-name=other", "--job-name is set by the bridge"),
        ("-J other", "-J (--job-name) is set by the bridge"),
        ("--out=/tmp/x", "--output is set by the bridge"),  # sbatch takes abbreviations
        ("-o /tmp/x", "--output"),
        ("--error=/tmp/x", "--error"),
        ("--time=99:00:00", "Maximum time"),
        ("-t 5", "Maximum time"),
        ("--mem-per-cpu=4G", "Maximum memory"),
        ("--no-requeue", "continues jobs itself"),
        ("--signal=B:USR1@60", "continues jobs itself"),
        ("-d afterok:1", "continues jobs itself"),
        ("--gres=gpu:4", "HPC_GPU_RULES"),
        ("-G 2", "HPC_GPU_RULES"),
        ("--account=other", "HPC_SLURM_ACCOUNT"),
        ("-p debug", "HPC_SLURM_PARTITION"),
        ("--array=1-3", "one job per request"),
        ("-kH", "held job"),  # flags run together: -k -H
        ("--nice=10 --time=5", "Maximum time"),  # sbatch reads every word of the line
        ("--qos=high", "HPC_SLURM_QOS"),
        ("-q high", "HPC_SLURM_QOS"),
        ("--wait", "at once"),
        ("-M other", "HPC_SCHEDULER_ARGS"),
        ("--comment=x", "--comment"),
    ],
)
def test_slurm_directives_never_override_the_bridges_own(entry: str, why: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="refusing HPC_JOB_DIRECTIVES entry") as err:
        SlurmScheduler().render(spec(tmp_path, directives=("--nice=10", entry)))
    assert why in str(err.value)


@pytest.mark.parametrize(
    "entry",
    [
        "--constraint=v100",
        "-C v100",
        "--exclusive",
        "--nice=10",
        "--gpus-per-task=1",  # not --gpus: a different option
        "--mem-bind=local",  # not --mem
        "--time-min=30",
        "-kC v100",  # -k takes no value, -C takes 'v100'
        "--export=ALL",
        "--reservation=maint",
    ],
)
def test_slurm_site_options_are_accepted(entry: str, tmp_path: Path) -> None:
    assert f"#SBATCH {entry}\n" in SlurmScheduler().render(spec(tmp_path, directives=(entry,)))


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("-N other", "-N is set by the bridge"),
        ("-o /tmp/x", "-o is set"),
        ("-l h_rt=99:00:00", "Maximum time"),
        ("-l s_rt=1:00:00", "Maximum time"),
        ("-l h_vmem=4G,mem_free=8G", "Maximum memory"),
        ("-l mf=8G", "Maximum memory"),  # mem_free's shortcut
        ("-hard -l gpu=2", "HPC_GPU_RULES"),
        ("-pe mpi 4", "HPC_SGE_PE"),
        ("-P other", "HPC_SGE_PROJECT"),
        ("-q other.q", "HPC_SGE_QUEUE"),
        ("-r y", "continues jobs itself"),
        ("-hold_jid 5", "continues jobs itself"),
        ("-w n", "refused at submit"),
        ("-t 1-3", "one job per request"),
        ("-h", "held job"),
        ("-clear", "directives are read"),
        ("-@ /tmp/options", "directives are read"),
        ("-C #PBS", "unsafe value"),
    ],
)
def test_gridengine_directives_never_override_the_bridges_own(entry: str, why: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="HPC_JOB_DIRECTIVES entry") as err:
        GridEngineScheduler().render(spec(tmp_path, directives=("-l h_vmem=4G", entry)))
    assert why in str(err.value)


def test_gridengine_resources_follow_the_site_settings(tmp_path: Path) -> None:
    ge = GridEngineScheduler(memory_resource="h_vmem", gpu_resource="ngpus")
    with pytest.raises(ValueError, match="-l h_vmem is set by the bridge"):
        ge.render(spec(tmp_path, directives=("-l h_vmem=4G",)))
    assert "#$ -l mem_free=4G\n#$ -l gpu=1\n" in ge.render(spec(tmp_path, directives=("-l mem_free=4G", "-l gpu=1")))


@pytest.mark.parametrize(
    ("scheduler", "line"), [(SlurmScheduler(), "#SBATCH --uid=0"), (GridEngineScheduler(), "  #$ -u root")]
)
def test_a_prologue_line_read_as_a_directive_is_refused(scheduler: Scheduler, line: str, tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match="would be read as a scheduler directive; put directives in HPC_JOB_DIRECTIVES"
    ):
        scheduler.render(spec(tmp_path, prologue=f"module load cuda\n{line}"))
    with pytest.raises(ValueError, match="NUL"):
        scheduler.render(spec(tmp_path, prologue="echo a\0b"))


def test_a_prologue_is_pasted_verbatim_not_expanded_by_the_template(tmp_path: Path) -> None:
    prologue = "export A=$HOME ${B:-x} $(hostname)\n  source /etc/profile.d/modules.sh  \n\nmodule load cuda"
    for scheduler in both():
        assert f"\n{prologue}\ntrap - ERR\n" in scheduler.render(spec(tmp_path, prologue=f"\n{prologue}\n\n"))


def test_a_continuation_re_rendered_from_json_keeps_them(tmp_path: Path) -> None:
    """A job that continues itself renders its successor from ``JobSpec.to_json`` in the parameter file."""
    for scheduler, directives in ((SlurmScheduler(), SLURM_DIRECTIVES), (GridEngineScheduler(), GE_DIRECTIVES)):
        job = spec(tmp_path, directives=directives, prologue=PROLOGUE, warn_seconds=60)
        again = JobSpec.from_json(job.to_json())
        assert again == job and again.directives == directives and again.prologue == PROLOGUE
        held = scheduler.render(JobSpec.from_json({**job.to_json(), "hold_after": "41"}))
        assert all(f"{scheduler.directive_prefix} {d}\n" in held for d in directives) and PROLOGUE in held


def test_older_parameter_files_without_them_still_load(tmp_path: Path) -> None:
    data = spec(tmp_path).to_json()
    del data["directives"], data["prologue"]
    assert JobSpec.from_json(data) == spec(tmp_path, name=data["name"])


# --- from the settings to the request's job -----------------------------------------------------


def site_config(tmp_path: Path, scheduler: str, **extra: str) -> BridgeConfig:
    env = {
        "RODAN_HOST": "rodan.example.org",
        "RODAN_USER": "hpc@example.org",
        "RODAN_PASSWORD": "a-password-9f2c",
        "RABBITMQ_URL": "amqp://u:broker-secret-3a1b@127.0.0.1:5672/%2F",
        "HPC_SPOOL_DIR": str(tmp_path / "spool"),
        "HPC_WORKER_PYTHON": sys.executable,
        "HPC_SCHEDULER": scheduler,
    }
    env.update(extra)
    return load_config(environ=env)


@pytest.mark.parametrize(
    ("scheduler", "directives"),
    [("slurm", "--nice=10; --constraint=v100\n--exclusive"), ("gridengine", "-l h_vmem=4G\n-p -5")],
)
def test_the_request_job_carries_the_configured_knobs(scheduler: str, directives: str, tmp_path: Path) -> None:
    config = site_config(tmp_path, scheduler, HPC_JOB_DIRECTIVES=directives, HPC_JOB_PROLOGUE=f"{PROLOGUE}\n")
    backend: Scheduler = SlurmScheduler() if scheduler == "slurm" else GridEngineScheduler()
    intake = Intake(config, Spool(tmp_path / "spool"), cast(Ledger, None), backend, cast(RodanClient, None),
                    cast(ReplyBox, None))  # fmt: skip
    inputs = {name: f"/uploads/{i}/original_file" for i, name in enumerate(PAGE_INPUTS)}
    body = json.dumps({"inputs": inputs, "settings": FAST_SETTINGS}).encode()
    request = parse_request(body, correlation_id="corr-site", reply_to="hpc-results")
    job = intake.job_spec(request, "corr-site")
    entries = tuple(e.strip() for e in directives.replace("\n", ";").split(";"))
    assert job.directives == entries and job.prologue == PROLOGUE
    text = backend.render(job)
    assert all(f"{backend.directive_prefix} {e}\n" in text for e in entries) and f"\n{PROLOGUE}\n" in text


def test_settings_refuse_what_the_script_would_refuse(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="HPC_JOB_DIRECTIVES"):
        site_config(tmp_path, "slurm", HPC_JOB_DIRECTIVES="--qos=$(id)")
    with pytest.raises(ConfigError, match="HPC_JOB_PROLOGUE"):
        site_config(tmp_path, "slurm", HPC_JOB_PROLOGUE="export TOKEN=a-password-9f2c")


# --- doctor's template check ------------------------------------------------------------------------


@pytest.mark.parametrize("scheduler", ["slurm", "gridengine"])
def test_doctor_renders_the_sites_knobs(scheduler: str, tmp_path: Path) -> None:
    directives = "--nice=10" if scheduler == "slurm" else "-l h_vmem=4G"
    check = check_template(site_config(tmp_path, scheduler, HPC_JOB_DIRECTIVES=directives, HPC_JOB_PROLOGUE=PROLOGUE))
    assert check.status == "ok", check
    assert "1 site directive(s), the site's prologue, no secret" in check.found


@pytest.mark.parametrize("scheduler", ["slurm", "gridengine"])
def test_doctor_fails_a_prologue_that_is_not_valid_bash(scheduler: str, tmp_path: Path) -> None:
    broken = "module load cuda\nif [ -d /opt/site ]; then\n  source /opt/site/env.sh\n"  # no 'fi'
    check = check_template(site_config(tmp_path, scheduler, HPC_JOB_PROLOGUE=broken))
    assert check.status == "FAIL", check
    assert "is not valid bash" in check.found and "syntax error" in check.found
    assert check.fix == "fix the shell syntax of HPC_JOB_PROLOGUE (check the lines with 'bash -n')"


def test_a_directive_the_bridge_sets_itself_is_refused_at_start_and_by_doctor(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--time is set by the bridge"):
        site_config(tmp_path, "slurm", HPC_JOB_DIRECTIVES="--time=1-00:00")
    # A configuration that got past that (built in code) is still caught when the script renders.
    config = dataclasses.replace(site_config(tmp_path, "slurm"), job_directives=("--time=1-00:00",))
    check = check_template(config)
    assert check.status == "FAIL" and "--time is set by the bridge" in check.found
    assert "HPC_JOB_DIRECTIVES" in check.fix


# --- real jobs -----------------------------------------------------------------------------------------


@pytest.fixture
def submitted() -> Iterator[list[tuple[Scheduler, str]]]:
    jobs: list[tuple[Scheduler, str]] = []
    yield jobs
    for scheduler, job_id in jobs:
        subprocess.run(["scancel" if scheduler.name == "slurm" else "qdel", job_id], capture_output=True, timeout=60)


def submit(scheduler: Scheduler, job: JobSpec, jobs: list[tuple[Scheduler, str]]) -> str:
    script = job.workdir / f"{job.name}.sh"
    script.write_text(scheduler.render(job))
    job_id = scheduler.submit(script, job)
    jobs.append((scheduler, job_id))
    return job_id


def ended(scheduler: Scheduler, job_id: str, timeout: float = 120) -> JobInfo:
    deadline = time.monotonic() + timeout
    info = None
    while time.monotonic() < deadline:
        info = scheduler.query([job_id]).get(job_id)
        if info is not None and info.state.is_terminal and info.source == "accounting":
            return info
        time.sleep(0.5)
    raise AssertionError(f"job {job_id}: {info} after {timeout:g} s")


def fields(scheduler: Scheduler, job_id: str) -> str:
    argv = ["scontrol", "show", "job", job_id] if scheduler.name == "slurm" else ["qstat", "-j", job_id]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout


@pytest.mark.slurm
def test_real_slurm_job_gets_the_directives_and_runs_the_prologue(
    slurm: None, submitted: list[tuple[Scheduler, str]], tmp_path: Path
) -> None:
    scheduler = SlurmScheduler(timeout_s=30)
    job = spec(tmp_path, directives=SLURM_DIRECTIVES, prologue=PROLOGUE)
    job_id = submit(scheduler, job, submitted)
    shown = fields(scheduler, job_id)
    assert " Nice=10 " in shown and " DelayBoot=00:07:00" in shown, shown
    assert ended(scheduler, job_id).state is JobState.COMPLETED
    log = scheduler.log_file(tmp_path, job_id).read_text()
    assert f"site prologue ran in {tmp_path}\ncommand sees: from the prologue in {tmp_path}\n" in log


@pytest.mark.gridengine
def test_real_gridengine_job_gets_the_directives_and_runs_the_prologue(
    gridengine: None, submitted: list[tuple[Scheduler, str]], tmp_path: Path
) -> None:
    scheduler = GridEngineScheduler(timeout_s=30)
    job = spec(tmp_path, directives=GE_DIRECTIVES, prologue=PROLOGUE)
    job_id = submit(scheduler, job, submitted)
    shown = {
        k.strip(): v.strip() for k, _, v in (line.partition(":") for line in fields(scheduler, job_id).splitlines())
    }
    assert shown["account"] == "hpcbt-site" and shown["priority"] == "-5", shown
    assert "h_vmem=1G" in shown["hard resource_list"].split(","), shown
    assert ended(scheduler, job_id).state is JobState.COMPLETED
    log = scheduler.log_file(tmp_path, job_id).read_text()
    assert f"site prologue ran in {tmp_path}\ncommand sees: from the prologue in {tmp_path}\n" in log


@pytest.mark.parametrize(
    "name", [pytest.param("slurm", marks=pytest.mark.slurm), pytest.param("gridengine", marks=pytest.mark.gridengine)]
)
def test_a_failing_prologue_line_fails_the_job_before_the_command(
    name: str, request: pytest.FixtureRequest, submitted: list[tuple[Scheduler, str]], tmp_path: Path
) -> None:
    request.getfixturevalue(name)  # the cluster is up (fails, never skips)
    scheduler: Scheduler = SlurmScheduler(timeout_s=30) if name == "slurm" else GridEngineScheduler(timeout_s=30)
    prologue = "echo before\nmodule-that-does-not-exist load cuda/12\necho after"
    job = spec(tmp_path, prologue=prologue, command=("/bin/bash", "-c", "echo the command ran"))
    job_id = submit(scheduler, job, submitted)
    info = ended(scheduler, job_id)
    assert info.state is JobState.FAILED and info.exit_code.split(":")[0] == "127", info
    log = scheduler.log_file(tmp_path, job_id).read_text()
    line = scheduler.render(job).splitlines().index("module-that-does-not-exist load cuda/12") + 1
    assert "before\n" in log and "module-that-does-not-exist: command not found" in log
    assert f"hpc-bridge: HPC_JOB_PROLOGUE failed (exit 127, line {line} of this script)" in log
    assert "after" not in log.splitlines() and "the command ran" not in log


def test_directive_problems_are_listed_for_a_check_at_start() -> None:
    """What a settings check can call before any request (the same rules as rendering)."""
    assert SlurmScheduler().directive_problems(["--nice=10", "--exclusive"]) == []
    problems = GridEngineScheduler().directive_problems(["-l h_vmem=4G", "-l h_rt=1:00:00", "-A $(id)"])
    assert problems == [
        "HPC_JOB_DIRECTIVES entry '-l h_rt=1:00:00': -l h_rt is set by the bridge: the time limit is the "
        "request's 'Maximum time (D-HH:MM)'",
        "HPC_JOB_DIRECTIVES entry '-A $(id)': refusing unsafe value for HPC_JOB_DIRECTIVES entry: '-A $(id)'",
    ]
