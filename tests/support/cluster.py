"""The real dev clusters (deploy/dev/slurm.sh, deploy/dev/gridengine.sh) as the tests see them:
which jobs carry a name, which ran, cancelling what a test's bridge submitted, a second unix user."""

from __future__ import annotations

import json
import os
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

from bridge.schedulers import Scheduler, scheduler_class

# --- Slurm -------------------------------------------------------------------------------------


def jobs_named(name: str) -> list[str]:
    """Every Slurm job with this name, live or in accounting."""
    ids: set[str] = set()
    out = subprocess.run(["squeue", "-h", "-t", "all", "--name", name, "-o", "%i"], capture_output=True, text=True)
    ids.update(x.strip() for x in out.stdout.split() if x.strip())
    acct = subprocess.run(
        ["sacct", "-n", "-X", "-P", "--name", name, "-S", "now-1days", "-o", "JobIDRaw"], capture_output=True, text=True
    )
    ids.update(x.strip() for x in acct.stdout.split() if x.strip())
    return sorted(ids)


def jobs_started(name: str) -> list[str]:
    """Jobs with this name whose batch script ran. A submit-time rejection is still recorded by
    slurmdbd (FAILED, sometimes even with a start time), but it never has a ``.batch`` step."""
    acct = subprocess.run(
        ["sacct", "-n", "-P", "--name", name, "-S", "now-1days", "-o", "JobIDRaw"],
        capture_output=True,
        text=True,
    )
    steps = acct.stdout.split()
    return sorted(s.removesuffix(".batch") for s in steps if s.endswith(".batch"))


# --- Grid Engine -------------------------------------------------------------------------------


def sge_live(name: str) -> dict[str, str]:
    """Live Grid Engine jobs with this name: id -> state letters."""
    out = subprocess.run(["qstat", "-xml", "-u", "*"], capture_output=True, text=True, timeout=30).stdout
    if not out.strip():
        return {}
    jobs = {}
    for job in ET.fromstring(out).iter("job_list"):  # qstat's own output
        if job.findtext("JB_name") == name:
            jobs[job.findtext("JB_job_number", "")] = job.findtext("state", "")
    return jobs


def sge_accounted(name: str) -> list[str]:
    """Grid Engine jobs with this name in accounting (those that ran)."""
    out = subprocess.run(["qacct", "-j", name], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[1] for line in out.splitlines() if line.startswith("jobnumber")]


# --- both schedulers behind one helper -----------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    """One real scheduler, as the end-to-end tests need it (``HPC_SCHEDULER`` = ``name``)."""

    name: str

    @property
    def backend(self) -> type[Scheduler]:
        """The bridge's backend for this cluster (its names and commands)."""
        return scheduler_class(self.name)

    @property
    def label(self) -> str:
        return self.backend.display_name

    @property
    def submit_command(self) -> str:
        return self.backend.commands[0]

    @property
    def commands(self) -> tuple[str, ...]:
        """Every command the bridge runs on this cluster."""
        return self.backend.commands

    def jobs_named(self, name: str) -> list[str]:
        """Every job with this name, live or in accounting."""
        if self.name == "slurm":
            return jobs_named(name)
        return sorted({*sge_live(name), *sge_accounted(name)}, key=int)

    def jobs_started(self, name: str) -> list[str]:
        """Jobs with this name whose batch script ran."""
        if self.name == "slurm":
            return jobs_started(name)
        return sorted(set(sge_accounted(name)), key=int)  # a refused or never-started job has no record

    def is_running(self, job_id: str) -> bool:
        if self.name == "slurm":
            out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
            return out.stdout.strip() == "RUNNING"
        out = subprocess.run(["qstat", "-u", "*"], capture_output=True, text=True).stdout
        return any(line.split()[:1] == [job_id] and line.split()[4] == "r" for line in out.splitlines())

    def cancel(self, job_id: str) -> None:
        subprocess.run(["scancel" if self.name == "slurm" else "qdel", job_id], capture_output=True, timeout=30)

    def cancel_named(self, name: str) -> None:
        if self.name == "slurm":
            subprocess.run(["scancel", "--name", name], capture_output=True, timeout=30)
        else:
            for job_id in sge_live(name):
                self.cancel(job_id)


def cancel_ledger_jobs(spool: Path, cluster: Cluster) -> None:
    """Cancel every job a test's bridge submitted (found through its ledger)."""
    ledger = spool / "ledger"
    if not ledger.exists():
        return
    for path in ledger.glob("*.json"):
        record = json.loads(path.read_text())
        if record.get("job_name"):
            cluster.cancel_named(record["job_name"])


def cancel_spool_jobs(spool: Path) -> None:
    """Cancel every Slurm job a test's bridge submitted (found through its ledger)."""
    cancel_ledger_jobs(spool, Cluster("slurm"))


# --- a second user, for "only our jobs" -------------------------------------------------------------

#: A unix user who may submit on both dev clusters (deploy/dev/setup.sh creates it).
OTHER_USER = os.environ.get("HPC_DEV_OTHER_USER", "hpcother")


def require_other_user(script: str) -> str:
    """OTHER_USER, or a failure naming the script that creates it (never a skip)."""
    import pwd

    try:
        pwd.getpwnam(OTHER_USER)
    except KeyError:
        pytest.fail(
            f"no unix user {OTHER_USER!r} to submit another user's jobs: run 'bash deploy/dev/setup.sh' "
            f"(or 'bash deploy/dev/{script} up'), which creates it"
        )
    return OTHER_USER
