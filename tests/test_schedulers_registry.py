"""The backend registry: everything outside bridge/schedulers/ learns a scheduler from its class.

The last tests register a third backend for the length of one test and watch configuration, the
chain command, status, metrics, install and doctor take it without any change of their own.
"""

from __future__ import annotations

import json
import signal
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from bridge import schedulers
from bridge.chain.settings import ChainError, scheduler_choice, scheduler_options
from bridge.config import known_keys, load_config
from bridge.errors import SchedulerUnavailable
from bridge.ledger import Ledger, RequestRecord, RequestState
from bridge.ops.doctor import check_scheduler
from bridge.ops.install import scheduler_environment
from bridge.ops.metrics import display_state, render
from bridge.ops.status import Row, format_table
from bridge.schedulers import (
    BACKENDS,
    GridEngineScheduler,
    JobInfo,
    JobSpec,
    JobState,
    Scheduler,
    SiteOption,
    SlurmScheduler,
    backend_name,
    job_state_value,
    own_job_id,
    restart_variables,
    scheduler_class,
    scratch_variables,
    short_name,
)
from bridge.spool import Spool, atomic_write_json

BASE = {
    "RABBITMQ_URL": "amqp://g:g@127.0.0.1/%2F",
    "RODAN_HOST": "rodan.example.org",
    "RODAN_USER": "hpc@example.org",
    "RODAN_PASSWORD": "secret",
}


# --- the two real backends ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "name"),
    [("slurm", "slurm"), ("SLURM", "slurm"), ("gridengine", "gridengine"), ("sge", "gridengine"),
     (" Grid  Engine ", "gridengine"), ("pbs", ""), ("", "")],
)  # fmt: skip
def test_a_backend_is_found_by_its_name_or_an_alias(text: str, name: str) -> None:
    assert backend_name(text) == name
    if name:
        assert scheduler_class(text) is BACKENDS[name]
    else:
        with pytest.raises(ValueError, match="unknown scheduler"):
            scheduler_class(text)


@pytest.mark.parametrize("cls", list(BACKENDS.values()), ids=list(BACKENDS))
def test_every_backend_says_what_the_rest_of_the_bridge_needs(cls: type[Scheduler]) -> None:
    assert BACKENDS[cls.name] is cls and cls.short_name and cls.display_name
    assert cls.commands and cls.controller and cls.accounting_command in cls.commands
    assert cls.accounting_fix and isinstance(cls.warning_signal, signal.Signals)
    settings = [o.setting for o in cls.site_options]
    assert len(set(settings)) == len(settings) and all(s.startswith(cls.setting_prefix) for s in settings)
    for role in (cls.account_setting, cls.partition_setting, cls.continue_setting):
        assert role == "" or role in settings
    # Its state translation: a JobState value of its own word, MISSING for a word it does not know.
    assert cls.translate("no-such-state") is JobState.MISSING


def test_the_backends_differ_where_the_bridge_used_to_name_them() -> None:
    assert (SlurmScheduler.short_name, GridEngineScheduler.short_name) == ("slurm", "sge")
    assert SlurmScheduler.commands[0] == "sbatch" and GridEngineScheduler.commands[0] == "qsub"
    assert SlurmScheduler.translate("CANCELLED by 0") is JobState.CANCELLED
    assert GridEngineScheduler.translate("hqw") is JobState.PENDING
    assert GridEngineScheduler.translate("Eqw") is JobState.ERROR
    assert SlurmScheduler.continue_setting == "HPC_SLURM_CONTINUE" and not GridEngineScheduler.continue_setting
    assert {SlurmScheduler.warning_signal, GridEngineScheduler.warning_signal} == {signal.SIGUSR1, signal.SIGUSR2}
    assert GridEngineScheduler.constructor_options({"HPC_SGE_PE": "omp", "HPC_SGE_QUEUE": "gpu.q"}) == {"pe": "omp"}
    assert SlurmScheduler.constructor_options({"HPC_SLURM_ACCOUNT": "lab"}) == {}


def test_what_a_job_reads_of_its_own_scheduler() -> None:
    assert "SLURM_TMPDIR" in scratch_variables()
    assert restart_variables() == ("SLURM_RESTART_COUNT", "RESTARTED")
    assert own_job_id({"HPC_JOB_ID": "12", "SLURM_JOB_ID": "99"}) == "12"
    assert own_job_id({"SLURM_JOB_ID": "99"}) == "99" and own_job_id({"JOB_ID": "7"}) == "7"
    assert own_job_id({}) == ""


# --- the ledger keeps JobState values, and reads the words older ledgers kept ----------------------


@pytest.mark.parametrize(
    ("scheduler", "word", "value"),
    [
        ("gridengine", "r", "RUNNING"),
        ("gridengine", "hqw", "PENDING"),
        ("gridengine", "Eqw", "ERROR"),
        ("slurm", "CANCELLED by 0", "CANCELLED"),
        ("slurm", "COMPLETING", "RUNNING"),
        ("gridengine", "RUNNING", "RUNNING"),  # already a JobState value
        ("slurm", "pending", "PENDING"),
        ("gridengine", "exit 0", "EXIT 0"),  # an accounting word no table has: kept
        ("", "weird", "WEIRD"),
    ],
)
def test_a_schedulers_own_word_becomes_a_job_state(scheduler: str, word: str, value: str) -> None:
    assert job_state_value(scheduler, word) == value


def test_an_old_ledger_record_is_read_with_its_state_translated(tmp_path: Path) -> None:
    spool = Spool(tmp_path).ensure()
    ledger = Ledger(spool)
    for key, scheduler, word in [("a", "gridengine", "r"), ("b", "slurm", "CANCELLED by 0"), ("c", "slurm", "")]:
        record = RequestRecord(key, key, "q", RequestState.SUBMITTED, scheduler=scheduler, job_id="5", job_state=word)
        atomic_write_json(ledger.path(key), record.to_json())  # as an older bridge wrote it
    assert {r.key: r.job_state for r in ledger.all()} == {"a": "RUNNING", "b": "CANCELLED", "c": ""}
    assert display_state(ledger.get("a")) == "running"  # type: ignore[arg-type]
    assert json.loads(ledger.path("a").read_text())["job_state"] == "r"  # reading rewrites nothing


# --- a third backend, registered for one test --------------------------------------------------------


class PbsScheduler(Scheduler):
    """A made-up backend, as small as the registry allows: only class knowledge and fakes."""

    name = "pbs"
    aliases = ("torque", "openpbs")
    display_name = "PBS"
    short_name = "pbs"
    commands = ("pbs-submit-nowhere", "pbs-stat-nowhere")
    command_environment = ("PBS_SERVER",)
    setting_prefix = "HPC_PBS_"
    site_options = (
        SiteOption("HPC_PBS_ACCOUNT", private_as="<account>"),
        SiteOption("HPC_PBS_PLACE", default="free", keyword="place", choices=("free", "pack")),
    )
    account_setting = "HPC_PBS_ACCOUNT"
    controller = "pbs_server"
    accounting_command = "pbs-stat-nowhere"
    accounting_fix = "turn on job history"
    template_name = "slurm.sh"
    directive_prefix = "#PBS"
    job_id_variable = "PBS_JOBID"
    log_name = "job-%j.out"
    log_name_id = "%j"

    def __init__(self, *, timeout_s: float = 60.0, user: str | None = None, place: str = "free") -> None:
        super().__init__(timeout_s=timeout_s, user=user)
        self.place = place

    @classmethod
    def translate(cls, native: str) -> JobState:
        return {"R": JobState.RUNNING, "Q": JobState.PENDING}.get(native.strip(), JobState.MISSING)

    def directives(self, spec: JobSpec) -> list[str]:
        return [f"-N {spec.name}"]

    def submit(self, script: Path, spec: JobSpec) -> str:
        raise SchedulerUnavailable("pbs_server down")

    def query(self, job_ids: Sequence[str]) -> Mapping[str, JobInfo]:
        return {}

    def find_by_name(self, name: str) -> list[str]:
        return []

    def cancel(self, job_id: str) -> None:
        return None

    def ping(self) -> str:
        raise SchedulerUnavailable("pbs_server down")

    def check_accounting(self) -> str:
        raise SchedulerUnavailable("no history")


@pytest.fixture
def pbs(monkeypatch: pytest.MonkeyPatch) -> type[Scheduler]:
    monkeypatch.setitem(schedulers.BACKENDS, PbsScheduler.name, PbsScheduler)
    return PbsScheduler


def test_a_third_backend_is_configured_by_its_class_alone(pbs: type[Scheduler]) -> None:
    assert {"HPC_PBS_ACCOUNT", "HPC_PBS_PLACE", "HPC_SGE_PE", "HPC_SLURM_CONTINUE"} <= known_keys()
    config = load_config(
        environ={**BASE, "HPC_SCHEDULER": "Torque", "HPC_PBS_ACCOUNT": "lab7", "HPC_PBS_PLACE": "pack"}
    )
    assert (config.scheduler, config.backend) == ("pbs", pbs)
    assert (config.account, config.partition, config.continue_by) == ("lab7", "", "requeue")
    assert config.scheduler_options == {"place": "pack"}
    assert config.public("account lab7 has no hours left") == "account <account> has no hours left"
    built = schedulers.get_scheduler(config.scheduler, options=config.scheduler_options)
    assert isinstance(built, PbsScheduler) and built.place == "pack"
    with pytest.raises(Exception, match="HPC_PBS_PLACE must be one of free, pack"):
        load_config(environ={**BASE, "HPC_SCHEDULER": "pbs", "HPC_PBS_PLACE": "spread"})
    with pytest.raises(Exception, match="HPC_SCHEDULER must be 'slurm', 'gridengine' or 'pbs'"):
        load_config(environ={**BASE, "HPC_SCHEDULER": "lsf"})


def test_a_third_backend_reaches_chain_status_metrics_and_install(pbs: type[Scheduler]) -> None:
    assert scheduler_choice("openpbs", {}) == "pbs"
    assert scheduler_options("pbs", {"HPC_PBS_PLACE": "pack", "HPC_SGE_PE": "omp"}) == {"place": "pack"}
    with pytest.raises(ChainError, match="use slurm, gridengine or pbs"):
        scheduler_choice("lsf", {})
    assert short_name("pbs") == "pbs"
    row = Row(
        correlation_id="c0ffee00", generation="new", scheduler="pbs", job_id="42", state="running", continuations=0,
        age_s=5.0, training_s=None, last_event="", job_state="RUNNING", dead_lettered=False, reason="",
        created_at=0.0, replied_at=0.0,
    )  # fmt: skip
    assert "pbs 42" in format_table([row])[1]
    record = RequestRecord("c", "c", "q", RequestState.SUBMITTED, scheduler="pbs", job_id="42", job_state="Q")
    assert display_state(record) == "pending"
    assert 'hpc_bridge_jobs{state="PENDING"} 1' in render([record], outbox=0, now=1.0)
    assert scheduler_environment("pbs", {"PATH": "/usr/bin:/bin", "PBS_SERVER": "head1"}) == [("PBS_SERVER", "head1")]


def test_doctor_checks_a_third_backends_commands_and_gives_its_advice(
    pbs: type[Scheduler], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stat_command = bindir / "pbs-stat-nowhere"
    stat_command.write_text("#!/bin/sh\nexit 1\n")
    stat_command.chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", str(bindir))
    config = load_config(environ={**BASE, "HPC_SCHEDULER": "pbs"})
    commands, answered, accounting = check_scheduler(config)
    assert commands.status == "FAIL" and commands.found == "pbs-submit-nowhere not on PATH (PBS)"
    assert answered.status == "FAIL" and "check that pbs_server runs" in answered.fix
    assert accounting.status == "FAIL" and accounting.fix == "turn on job history"
