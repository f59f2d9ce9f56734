"""Safe scheduler options: ``HPC_SCHEDULER_ARGS`` checked like ``HPC_JOB_DIRECTIVES``, the QOS in
``HPC_SLURM_QOS``, bridge options a site forbids left out with ``HPC_SLURM_OMIT`` / ``HPC_SGE_OMIT``,
and ``hpc-bridge script``, which prints the batch script a request would get.

Unit tests on both backends (what is refused and why, what passes, the rendered text), the CLI
against the script the bridge's own submit writes, then real held jobs on the local Slurm: what
Slurm recorded of the QOS and of the options left out (``scontrol show job``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from bridge.chain.rundir import ChainRunDir
from bridge.chain.settings import ChainSettings, scheduler_options
from bridge.chain.submit import link_spec
from bridge.cli import main
from bridge.config import BridgeConfig, load_config
from bridge.errors import ConfigError, SchedulerRejected
from bridge.intake import Intake
from bridge.ledger import Ledger
from bridge.ops.doctor import check_template
from bridge.protocol import build_request_body, parse_request
from bridge.replies import ReplyBox
from bridge.rodan import RodanClient
from bridge.schedulers import GridEngineScheduler, JobSpec, Scheduler, SlurmScheduler, get_scheduler
from bridge.shell import run_command
from bridge.spool import Spool, safe_key

RODAN_PASSWORD = "Rodan-Pw-7c41e9a0d2"
BROKER_PASSWORD = "Broker-Pw-2b8f60c1e5"
TOKEN = "token-9d3a71c0b6f24e58"
BASE = {
    "RABBITMQ_URL": f"amqp://hpc:{BROKER_PASSWORD}@127.0.0.1:5672/%2F",
    "RODAN_HOST": "rodan.example.org",
    "RODAN_USER": "bridge@example.org",
    "RODAN_PASSWORD": RODAN_PASSWORD,
    "HPC_WORKER_PYTHON": sys.executable,
}


def config(**extra: str) -> BridgeConfig:
    return load_config(environ={**BASE, **extra})


def problems(**extra: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        config(**extra)
    return [p for p in caught.value.problems if not p.startswith("no credentials file was read")]


def spec(**kw: Any) -> JobSpec:
    values: dict[str, Any] = dict(
        name="rodan-3f2b8c1e",
        comment="3f2b8c1e",
        time_minutes=90,
        memory_mb=16000,
        cpus=4,
        command=("/opt/venv/bin/python", "-m", "worker", "run", "/spool/params/3f2b8c1e.json"),
        log_dir=Path("/spool/jobs/3f2b8c1e"),
        workdir=Path("/spool/jobs/3f2b8c1e"),
        gres="gpu:1",
        email="lab@example.org",
        account="def-lab",
        partition="gpu",
        warn_seconds=300,
    )
    values.update(kw)
    return JobSpec(**values)


def directive_lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(f"{prefix} ")]


# --- HPC_SCHEDULER_ARGS: refused at configuration load, the setting to use named ----------------------


@pytest.mark.parametrize(
    ("args", "argument", "says"),
    [
        ("--time=10", "--time=10", "--time is set by the bridge: the time limit is the request's 'Maximum time"),
        ("--time 10", "--time", "the time limit is the request's"),
        ("-t10", "-t10", "-t (--time) is set by the bridge"),
        ("-t 10", "-t", "-t (--time) is set by the bridge"),
        ("--job-name=x", "--job-name=x", "--job-name is set by the bridge: the bridge names each job"),
        ("-J x", "-J", "-J (--job-name) is set by the bridge"),
        ("--output=x.out", "--output=x.out", "--output is set by the bridge: the job's log"),
        ("--out x.out", "--out", "--output is set by the bridge"),  # sbatch takes abbreviations
        ("-o x.out", "-o", "-o (--output) is set by the bridge"),
        ("--account=other", "--account=other", "--account is set by the bridge: set HPC_SLURM_ACCOUNT instead"),
        ("-A other", "-A", "set HPC_SLURM_ACCOUNT instead"),
        ("--partition gpu", "--partition", "set HPC_SLURM_PARTITION instead"),
        ("-p gpu", "-p", "set HPC_SLURM_PARTITION instead"),
        ("--qos=high", "--qos=high", "--qos is set by the bridge: set HPC_SLURM_QOS instead"),
        ("-q high", "-q", "-q (--qos) is set by the bridge: set HPC_SLURM_QOS instead"),
        ("--mem=4G", "--mem=4G", "the request's 'Maximum memory (MB)' (HPC_SLURM_OMIT=--mem leaves it out)"),
        ("--no-requeue", "--no-requeue", "the bridge continues jobs itself (HPC_WARN_SECONDS, HPC_SLURM_CONTINUE)"),
        ("--gres=gpu:2", "--gres=gpu:2", "GPUs are requested by HPC_GPU_RULES"),
        ("--wait", "--wait", "sbatch must return the new job's id at once"),
        ("-kJ x", "-kJ", "-J (--job-name)"),  # flags run together
    ],
)
def test_slurm_scheduler_args_that_set_the_bridges_options_are_refused(args: str, argument: str, says: str) -> None:
    found = problems(HPC_SCHEDULER_ARGS=args)
    assert len(found) == 1, found
    assert found[0].startswith(f"HPC_SCHEDULER_ARGS argument {argument!r}: "), found
    assert says in found[0], found


def test_the_issues_example_is_four_problems_each_naming_what_to_do() -> None:
    found = problems(HPC_SCHEDULER_ARGS="--time=10 --job-name=x --output=x.out --account=other")
    assert [p.split("': ", 1)[0] for p in found] == [
        "HPC_SCHEDULER_ARGS argument '--time=10",
        "HPC_SCHEDULER_ARGS argument '--job-name=x",
        "HPC_SCHEDULER_ARGS argument '--output=x.out",
        "HPC_SCHEDULER_ARGS argument '--account=other",
    ]
    assert found[3].endswith("--account is set by the bridge: set HPC_SLURM_ACCOUNT instead")


@pytest.mark.parametrize(
    "args",
    [
        "--hold",
        "-H",
        "-M beluga",
        "-Mbeluga",
        "--clusters=a,b",
        "--cluster beluga",
        "--nice=10",
        "--constraint=v100",
        "-C v100",
        "--exclusive",
        "--export=ALL",
        "--mem-bind=local",  # not --mem
        "--hold -M beluga --nice=10",
    ],
)
def test_slurm_scheduler_args_the_bridge_does_not_set_pass(args: str) -> None:
    assert config(HPC_SCHEDULER_ARGS=args).scheduler_args == tuple(args.split())


@pytest.mark.parametrize(
    ("args", "argument", "says"),
    [
        ("-N other", "-N", "-N is set by the bridge: the bridge names each job after its request"),
        ("-o /tmp/x", "-o", "-o is set by the bridge: the job's log"),
        ("-e /tmp/x", "-e", "-e is set by the bridge"),
        ("-l h_rt=1:00:00", "-l h_rt=1:00:00", "-l h_rt is set by the bridge: the time limit is the request's"),
        ("-l h_vmem=4G,mf=8G", "-l h_vmem=4G,mf=8G", "(HPC_SGE_OMIT=-l mem_free leaves it out)"),
        ("-pe smp 4", "-pe", "CPUs use HPC_SGE_PE"),
        ("-P other", "-P", "-P is set by the bridge: set HPC_SGE_PROJECT instead"),
        ("-q other.q", "-q", "-q is set by the bridge: set HPC_SGE_QUEUE instead"),
        ("-w n", "-w", "(HPC_SGE_OMIT=-w leaves it out)"),
        ("-m ea", "-m", "mail goes to the request's notification address (HPC_SGE_OMIT=-m leaves it out)"),
        ("-hold_jid 4", "-hold_jid", "the bridge continues jobs itself"),
        ("-sync y", "-sync", "qsub must return the new job's id at once"),
    ],
)
def test_gridengine_scheduler_args_that_set_the_bridges_options_are_refused(
    args: str, argument: str, says: str
) -> None:
    found = problems(HPC_SCHEDULER="gridengine", HPC_SCHEDULER_ARGS=args)
    assert len(found) == 1, found
    assert found[0].startswith(f"HPC_SCHEDULER_ARGS argument {argument!r}: "), found
    assert says in found[0], found


@pytest.mark.parametrize("args", ["-h", "-p -5", "-A lab", "-l h_vmem=4G", "-R y", "-h -p -5 -l gpu_type=a100"])
def test_gridengine_scheduler_args_the_bridge_does_not_set_pass(args: str) -> None:
    assert config(HPC_SCHEDULER="gridengine", HPC_SCHEDULER_ARGS=args).scheduler_args == tuple(args.split())


@pytest.mark.parametrize(
    ("backend", "option"),
    [
        (SlurmScheduler(), "--time=10"),
        (SlurmScheduler(), "-J x"),
        (SlurmScheduler(), "--account=other"),
        (SlurmScheduler(), "--qos=high"),
        (SlurmScheduler(), "--mem=4G"),
        (GridEngineScheduler(), "-N x"),
        (GridEngineScheduler(), "-l h_rt=1:00:00"),
        (GridEngineScheduler(), "-P other"),
    ],
)
def test_an_argument_is_refused_with_the_directives_words(backend: Scheduler, option: str) -> None:
    """The same option, in HPC_JOB_DIRECTIVES or in HPC_SCHEDULER_ARGS: the same reason, word for word."""
    (as_directive,) = backend.directive_problems([option])
    (as_argument,) = backend.argument_problems(option.split())
    assert as_directive.startswith(f"HPC_JOB_DIRECTIVES entry {option!r}: ")
    assert as_directive.partition("': ")[2] == as_argument.partition("': ")[2] != ""


def test_only_a_directive_may_not_hold_the_job_or_choose_the_cluster() -> None:
    slurm, ge = SlurmScheduler(), GridEngineScheduler()
    assert slurm.argument_problems(["--hold", "-M", "beluga"]) == [] and ge.argument_problems(["-h"]) == []
    assert "a held job would never start" in slurm.directive_problems(["--hold"])[0]
    assert "set HPC_SCHEDULER_ARGS=-M NAME" in slurm.directive_problems(["-M beluga"])[0]
    assert "a held job would never start" in ge.directive_problems(["-h"])[0]


def test_a_password_in_the_scheduler_args_is_refused() -> None:
    found = problems(HPC_SCHEDULER_ARGS=f"--wckey={RODAN_PASSWORD}")
    assert found == [
        "HPC_SCHEDULER_ARGS contains a password from the credentials: the submit command is seen by every user "
        "of the login node (ps) and printed by `hpc-bridge script`"
    ]


def test_doctor_fails_scheduler_args_that_got_past_the_configuration() -> None:
    built = dataclasses.replace(config(), scheduler_args=("--time=10", "--hold"))  # built in code
    check = check_template(built)
    assert check.status == "FAIL", check
    assert "HPC_SCHEDULER_ARGS argument '--time=10': --time is set by the bridge" in check.found
    assert "--hold" not in check.found and "HPC_SCHEDULER_ARGS" in check.fix
    fine = check_template(config(HPC_SCHEDULER_ARGS="--hold", HPC_SLURM_OMIT="--mem"))
    assert fine.status == "ok" and "without --mem (HPC_SLURM_OMIT)" in fine.found, fine


# --- HPC_SLURM_QOS -------------------------------------------------------------------------------------------


def test_the_qos_is_a_directive_after_the_partition() -> None:
    plain = SlurmScheduler().render(spec())
    with_qos = SlurmScheduler(qos="normal").render(spec())
    assert "--qos" not in plain
    assert with_qos == plain.replace("#SBATCH --partition=gpu\n", "#SBATCH --partition=gpu\n#SBATCH --qos=normal\n")


def test_the_qos_setting_reaches_the_requests_script() -> None:
    chosen = config(HPC_SLURM_QOS="high")
    assert chosen.scheduler_options == {"qos": "high"}
    scheduler = get_scheduler("slurm", options=chosen.scheduler_options)
    assert "#SBATCH --qos=high\n" in scheduler.render(spec())
    assert "--qos" not in get_scheduler("slurm", options=config().scheduler_options).render(spec())


@pytest.mark.parametrize("qos", ["a b", "x;y", "$(id)", "high\n#SBATCH --uid=0"])
def test_an_unsafe_qos_is_refused(qos: str) -> None:
    with pytest.raises(ValueError, match="refusing unsafe value for HPC_SLURM_QOS"):
        SlurmScheduler(qos=qos)
    found = problems(HPC_SLURM_QOS=qos)
    assert len(found) == 1 and "HPC_SLURM_QOS" in found[0], found


# --- HPC_SLURM_OMIT / HPC_SGE_OMIT -------------------------------------------------------------------------


def test_slurm_leaves_out_exactly_the_options_named() -> None:
    full = SlurmScheduler().render(spec())
    left = SlurmScheduler(omit="--mem, --mail-type").render(spec())
    assert left == full.replace("#SBATCH --mem=16000M\n", "").replace("#SBATCH --mail-type=END,FAIL\n", "")
    assert "#SBATCH --mail-user=lab@example.org\n" in left
    assert directive_lines(left, "#SBATCH") == [
        "#SBATCH --job-name=rodan-3f2b8c1e",
        "#SBATCH --comment=3f2b8c1e",
        "#SBATCH --time=0-01:30",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        "#SBATCH --cpus-per-task=4",
        "#SBATCH --output=/spool/jobs/3f2b8c1e/job-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --gres=gpu:1",
        "#SBATCH --account=def-lab",
        "#SBATCH --partition=gpu",
        "#SBATCH --mail-user=lab@example.org",
    ]


def test_gridengine_leaves_out_exactly_the_options_named() -> None:
    full = GridEngineScheduler().render(spec())
    left = GridEngineScheduler(omit="-l mem_free, -w, -M, -m").render(spec())
    for line in ("#$ -l mem_free=4000M\n", "#$ -w e\n", "#$ -M lab@example.org\n", "#$ -m ea\n"):
        assert line in full
        full = full.replace(line, "")
    assert left == full
    vmem = GridEngineScheduler(memory_resource="h_vmem", omit="-l  h_vmem")  # spaces as an operator types them
    assert "h_vmem" not in vmem.render(spec()) and "#$ -l h_rt=1:30:00\n" in vmem.render(spec())


@pytest.mark.parametrize(
    ("backend", "setting", "option"),
    [
        (SlurmScheduler, "HPC_SLURM_OMIT", "--job-name"),
        (SlurmScheduler, "HPC_SLURM_OMIT", "--output"),
        (SlurmScheduler, "HPC_SLURM_OMIT", "--time"),
        (SlurmScheduler, "HPC_SLURM_OMIT", "--signal"),
        (SlurmScheduler, "HPC_SLURM_OMIT", "--open-mode"),
        (SlurmScheduler, "HPC_SLURM_OMIT", "--dependency"),
        (GridEngineScheduler, "HPC_SGE_OMIT", "-N"),
        (GridEngineScheduler, "HPC_SGE_OMIT", "-o"),
        (GridEngineScheduler, "HPC_SGE_OMIT", "-l h_rt"),
        (GridEngineScheduler, "HPC_SGE_OMIT", "-notify"),
        (GridEngineScheduler, "HPC_SGE_OMIT", "-hold_jid"),
    ],
)
def test_what_the_bridge_cannot_work_without_cannot_be_left_out(
    backend: type[Scheduler], setting: str, option: str
) -> None:
    with pytest.raises(ValueError) as caught:
        backend(omit=option)  # type: ignore[call-arg]
    text = str(caught.value)
    assert text.startswith(f"{setting}: {option} cannot be left out: the bridge cannot work without it: "), text
    assert "(what can be left out: " in text


def test_an_unknown_or_setting_controlled_option_names_what_can_be_left_out() -> None:
    found = problems(HPC_SLURM_OMIT="--foo")
    assert found == [
        "HPC_SLURM_OMIT: --foo is not set by the bridge (what can be left out: --comment, --mem, --nodes, "
        "--ntasks, --cpus-per-task, --mail-user, --mail-type)"
    ]
    (qos,) = problems(HPC_SLURM_OMIT="--qos")
    assert qos.startswith("HPC_SLURM_OMIT: --qos cannot be left out: leave HPC_SLURM_QOS empty instead")
    (gres,) = problems(HPC_SLURM_OMIT="--gres")
    assert "set HPC_GPU_RULES=none instead" in gres
    (ge,) = problems(HPC_SCHEDULER="gridengine", HPC_SGE_OMIT="-l h_vmem")  # not the memory resource in use
    assert ge == "HPC_SGE_OMIT: -l h_vmem is not set by the bridge (what can be left out: -l mem_free, -w, -M, -m)"
    assert config(HPC_SCHEDULER="gridengine", HPC_SGE_OMIT="-l mem_free, -M").scheduler_options["omit"] == (
        "-l mem_free, -M"
    )


def test_the_omit_setting_is_judged_with_the_backends_other_settings() -> None:
    vmem = config(HPC_SCHEDULER="gridengine", HPC_SGE_MEMORY_RESOURCE="h_vmem", HPC_SGE_OMIT="-l h_vmem")
    assert "h_vmem" not in get_scheduler("gridengine", options=vmem.scheduler_options).render(spec())
    # Every refused site option is reported in one run, each naming its setting.
    found = problems(HPC_SLURM_QOS="a b", HPC_SLURM_OMIT="--time", HPC_SCHEDULER_ARGS="-t 5")
    assert [p.split(":")[0] for p in found] == [
        "refusing unsafe value for HPC_SLURM_QOS",
        "HPC_SLURM_OMIT",
        "HPC_SCHEDULER_ARGS argument '-t'",
    ]


@pytest.mark.parametrize("backend", [SlurmScheduler(qos="normal"), GridEngineScheduler()], ids=["slurm", "sge"])
def test_every_option_the_bridge_renders_is_judged_for_omission(backend: Scheduler) -> None:
    """Each directive the backend can write is in its own_options (a new one must say whether it can go)."""
    rendered = [
        *backend.directives(spec(cpus=4, hold_after="41")),
        *backend.directives(spec(continue_by="successor", hold_after="41")),
    ]
    own = backend.own_options()
    assert {backend.directive_key(d) for d in rendered} == set(own)
    assert backend.omittable() == [o for o, why in own.items() if not why]


def test_a_continuation_and_a_chain_keep_the_qos_and_the_omission(tmp_path: Path) -> None:
    # The worker re-renders its successor with the options the bridge handed over (config.scheduler_options).
    options = config(HPC_SLURM_QOS="normal", HPC_SLURM_OMIT="--mem").scheduler_options
    job = spec(log_dir=tmp_path, workdir=tmp_path)
    path, _ = get_scheduler("slurm", options=options).write_successor("41", tmp_path / "job.sh", job)
    text = path.read_text()
    assert "#SBATCH --qos=normal\n" in text and "--mem=" not in text and "--dependency=afterany:41" in text
    # hpc-bridge chain reads the site settings from the environment.
    chain_options = scheduler_options("slurm", {"HPC_SLURM_QOS": "normal", "HPC_SLURM_OMIT": "--mem"})
    assert chain_options == {"qos": "normal", "omit": "--mem"}
    settings = ChainSettings(
        name="c", links=2, time_limit_s=600, warn_s=60, cpus=1, memory_mb=100, gpus=0, command=("/bin/true",),
        workdir=str(tmp_path), scheduler="slurm", scheduler_options=chain_options,
    )  # fmt: skip
    run = ChainRunDir(tmp_path / "run")
    link = get_scheduler("slurm", options=settings.scheduler_options).render(link_spec(settings, run, 1, ""))
    assert "#SBATCH --qos=normal\n" in link and "--mem=" not in link


# --- hpc-bridge script ----------------------------------------------------------------------------------


class Recording(SlurmScheduler):
    """The Slurm backend with a submit that keeps what it was given instead of running sbatch."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.submitted: list[tuple[str, list[str]]] = []

    def submit(self, script: Path, spec: JobSpec, *, env: Mapping[str, str] | None = None) -> str:
        self.submitted.append((script.read_text(), self.submit_command(script, spec)))
        return "4242"


def credentials(tmp_path: Path, **extra: str) -> Path:
    path = tmp_path / "credentials.env"
    values = {**BASE, "HPC_SPOOL_DIR": str(tmp_path / "spool"), **extra}
    path.write_text("".join(f"{k}='{v}'\n" for k, v in values.items()))
    path.chmod(0o600)
    return path


def submit_as_the_bridge(cfg: BridgeConfig, body: bytes, correlation_id: str, scheduler: Scheduler) -> tuple[Path, str]:
    """The request through the bridge's own intake and submit: the batch script it wrote in the
    spool, and the job id."""
    spool = Spool(cfg.spool_dir).ensure()
    ledger = Ledger(spool)
    intake = Intake(cfg, spool, ledger, scheduler, cast(RodanClient, None), cast(ReplyBox, None))
    request = parse_request(
        body, correlation_id=correlation_id, reply_to="hpc-results", rodan_origin=cfg.rodan_base_url
    )
    record = ledger.open(correlation_id, "hpc-results")
    job_id = intake._submit(request, record, TOKEN)
    return spool.job_dir(record.key) / "job.sh", job_id


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The credentials file alone decides (the test runner may export settings of its own)."""
    for name in [n for n in os.environ if n.startswith(("HPC_", "RODAN_", "RABBITMQ_"))]:
        monkeypatch.delenv(name)


def run_script_command(capsys: pytest.CaptureFixture[str], argv: Sequence[str]) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.usefixtures("clean_environment")
def test_script_prints_what_the_bridge_submits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    extra = {"HPC_SLURM_QOS": "normal", "HPC_SLURM_OMIT": "--mem,--mail-type", "HPC_SCHEDULER_ARGS": "--hold -M dev"}
    path = credentials(tmp_path, **extra)
    body_file = tmp_path / "body.json"
    inputs = {"Image": "/uploads/1/a.png", "Background": "/uploads/2/b.png", "Selected Regions": "/uploads/3/c.png",
              "rgba PNG - Layer 0": "/uploads/4/d.png"}  # fmt: skip
    body_file.write_text(json.dumps({"inputs": inputs, "settings": {"CPUs": 3}}))
    cid = str(uuid.uuid4())
    code, out, err = run_script_command(
        capsys,
        ["--credentials", str(path), "script", "--request", str(body_file), "--correlation-id", cid,
         "--setting", "Slurm Notification Email=lab@example.org", "--setting", "Maximum memory (MB)=2048"],
    )  # fmt: skip
    assert code == 0, err

    cfg = load_config(path, environ={})
    scheduler = Recording(**cfg.scheduler_options, **SlurmScheduler.lookup_options(cfg.scheduler_args))
    settings = {"CPUs": 3, "Slurm Notification Email": "lab@example.org", "Maximum memory (MB)": 2048}
    written, job_id = submit_as_the_bridge(cfg, build_request_body(inputs, settings), cid, scheduler)
    assert job_id == "4242"
    [(submitted, command)] = scheduler.submitted
    assert out == written.read_text() == submitted  # byte for byte the bridge's job.sh
    assert "#SBATCH --qos=normal\n" in out and "#SBATCH --cpus-per-task=3\n" in out
    assert "--mem=" not in out and "--mail-type" not in out and "#SBATCH --mail-user=lab@example.org\n" in out
    assert f"hpc-bridge script: submitted as: sbatch --parsable --hold -M dev {written}\n" in err
    assert command == ["sbatch", "--parsable", "--hold", "-M", "dev", str(written)]
    for secret in (RODAN_PASSWORD, BROKER_PASSWORD, TOKEN):
        assert secret not in out and secret not in err
    assert TOKEN in (cfg.spool_dir / "params" / f"{safe_key(cid)}.json").read_text()  # where the token does go


@pytest.mark.usefixtures("clean_environment")
def test_script_without_a_request_shows_a_rodan3_request_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = credentials(tmp_path, HPC_SCHEDULER="gridengine", HPC_SGE_OMIT="-m,-M")
    code, out, err = run_script_command(capsys, ["--credentials", str(path), "script", "--setting", "CPUs=2"])
    assert code == 0, err
    assert out.startswith("#!/bin/bash\n") and "#$ -N rodan-script-preview\n" in out
    assert "#$ -pe smp 2\n" in out and "#$ -l h_rt=24:00:00\n" in out  # Rodan 3.x's default 'Maximum time'
    assert "#$ -m" not in out and "#$ -M" not in out
    assert "submitted as: qsub -terse " in err and RODAN_PASSWORD not in out + err
    assert not (tmp_path / "spool").exists()


@pytest.mark.usefixtures("clean_environment")
def test_script_says_why_the_bridge_would_refuse_the_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = credentials(tmp_path)
    code, out, err = run_script_command(capsys, ["--credentials", str(path), "script", "--setting", "CPUs=0"])
    assert (code, out) == (2, "")
    assert err.startswith("hpc-bridge script: the bridge would refuse this request: invalid request: ")
    code, out, err = run_script_command(capsys, ["--credentials", str(path), "script", "--setting", "CPUs"])
    assert (code, out, err) == (2, "", "hpc-bridge script: --setting expects NAME=VALUE, got 'CPUs'\n")


@pytest.mark.usefixtures("clean_environment")
def test_script_refuses_a_configuration_with_unsafe_scheduler_args(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = credentials(tmp_path, HPC_SCHEDULER_ARGS="--job-name=x")
    code, out, err = run_script_command(capsys, ["--credentials", str(path), "script"])
    assert (code, out) == (2, "")
    assert "HPC_SCHEDULER_ARGS argument '--job-name=x': --job-name is set by the bridge" in err


# --- real jobs on the local Slurm --------------------------------------------------------------------------


@pytest.fixture
def held_jobs() -> Iterator[list[str]]:
    jobs: list[str] = []
    yield jobs
    for job_id in jobs:
        run_command(["scancel", job_id], timeout=60, check=False)


def job_fields(job_id: str) -> dict[str, str]:
    """``scontrol show job``'s KEY=VALUE fields."""
    text = run_command(["scontrol", "show", "job", job_id], timeout=30).stdout
    return dict(word.split("=", 1) for word in text.split() if "=" in word)


@pytest.mark.slurm
def test_real_slurm_records_the_qos_and_the_options_left_out(slurm: None, held_jobs: list[str], tmp_path: Path) -> None:
    """The dev cluster has one QOS, 'normal' (sacctmgr show qos), every job's default: a second job with a
    QOS Slurm does not know shows that the line reaches it."""
    base = {"HPC_SCHEDULER_ARGS": "--hold", "HPC_GPU_RULES": "none", "HPC_SPOOL_DIR": str(tmp_path / "spool")}
    inputs = {"Sample 1": "/uploads/1/sample.zip"}
    settings = {"Slurm Notification Email": "lab@example.org", "Maximum memory (MB)": 1024, "CPUs": 1}
    body = build_request_body(inputs, settings)

    def submit(tag: str, **extra: str) -> dict[str, str]:
        cfg = config(**base, **extra)
        scheduler = get_scheduler("slurm", timeout_s=30, options=cfg.scheduler_options)
        written, job_id = submit_as_the_bridge(cfg, body, f"hpcbt-{tag}-{uuid.uuid4().hex[:8]}", scheduler)
        held_jobs.append(job_id)
        return {"script": written.read_text(), **job_fields(job_id)}

    # Without the settings: the bridge's memory (--mem=1024M) and mail, the cluster's default QOS.
    plain = submit("plain")
    assert plain["MinMemoryNode"] == "1G" and plain["MailType"] == "END,FAIL", plain
    assert plain["QOS"] == "normal" and plain["JobState"] == "PENDING", plain

    # --mem and --mail-type left out: Slurm applies its defaults (DefMemPerCPU, no mail); the QOS is ours.
    left = submit("omit", HPC_SLURM_QOS="normal", HPC_SLURM_OMIT="--mem,--mail-type")
    assert "#SBATCH --qos=normal\n" in left["script"] and "--mem=" not in left["script"]
    assert "MinMemoryNode" not in left and "MinMemoryCPU" in left, left
    assert "MailType" not in left and left["QOS"] == "normal", left

    # The QOS line reaches Slurm: a QOS it does not know is refused, or recorded instead of the default.
    try:
        unknown = submit("qos", HPC_SLURM_QOS="hpcbt-no-such-qos")
    except SchedulerRejected as exc:
        assert "Invalid qos" in str(exc)
    else:
        assert unknown["QOS"] != "normal", unknown
