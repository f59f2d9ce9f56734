"""The real dev clusters (deploy/dev/slurm.sh, deploy/dev/gridengine.sh) as the tests see them:
which jobs carry a name, which ran, cancelling what a test's bridge submitted, a second unix user."""

from __future__ import annotations

import json
import os
import subprocess
import xml.etree.ElementTree as ET
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

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
    return sorted(ids, key=int)  # numerically: 99 comes before 100


def jobs_started(name: str) -> list[str]:
    """Jobs with this name whose batch script ran. A submit-time rejection is still recorded by
    slurmdbd (FAILED, sometimes even with a start time), but it never has a ``.batch`` step."""
    acct = subprocess.run(
        ["sacct", "-n", "-P", "--name", name, "-S", "now-1days", "-o", "JobIDRaw"],
        capture_output=True,
        text=True,
    )
    steps = acct.stdout.split()
    return sorted((s.removesuffix(".batch") for s in steps if s.endswith(".batch")), key=int)


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


# --- one helper per scheduler backend ---------------------------------------------------------------


class Cluster(ABC):
    """One real scheduler, as the end-to-end tests need it (``HPC_SCHEDULER`` = ``name``).

    ``Cluster(name)`` is that backend's helper (as ``Path(...)`` is a ``PosixPath``): one subclass per
    backend in :data:`CLUSTERS`, each with its own queue, accounting and cancel commands. A backend
    without a helper raises, so a third backend's tests never run another scheduler's commands."""

    name: ClassVar[str]

    def __new__(cls, name: str) -> Cluster:
        helper = CLUSTERS.get(name)
        if helper is None:
            raise ValueError(
                f"no test cluster helper for the scheduler backend {name!r}: add a Cluster subclass for it to "
                f"tests/support/cluster.py CLUSTERS (there are: {', '.join(sorted(CLUSTERS))})"
            )
        if cls is not Cluster and cls is not helper:
            raise ValueError(f"{cls.__name__} is the helper for {cls.name!r}, not for {name!r}")
        return super().__new__(helper)

    def __init__(self, name: str) -> None:  # the name chose the class (__new__)
        pass

    def __repr__(self) -> str:
        return f"Cluster({self.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cluster) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

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

    @abstractmethod
    def jobs_named(self, name: str) -> list[str]:
        """Every job with this name, live or in accounting."""

    def jobs_by_name(self, names: list[str]) -> dict[str, list[str]]:
        """:meth:`jobs_named` of each name (a backend may ask once for them all)."""
        return {name: self.jobs_named(name) for name in names}

    @abstractmethod
    def jobs_started(self, name: str) -> list[str]:
        """Jobs with this name whose batch script ran."""

    @abstractmethod
    def live_names(self) -> set[str]:
        """The names of every job in the live queue (any user's, any state)."""

    @abstractmethod
    def is_running(self, job_id: str) -> bool:
        """Whether the job runs now."""

    @abstractmethod
    def is_active(self, job_id: str) -> bool:
        """Whether the scheduler still holds the job (pending, held, running, requeued)."""

    @abstractmethod
    def cancel(self, job_id: str) -> None: ...

    @abstractmethod
    def cancel_named(self, name: str) -> None:
        """Cancel every live job with this name."""


class SlurmCluster(Cluster):
    name = "slurm"

    def jobs_named(self, name: str) -> list[str]:
        return jobs_named(name)

    def jobs_by_name(self, names: list[str]) -> dict[str, list[str]]:
        """Fifty names per squeue/sacct call: a crash test asks for hundreds."""
        found: dict[str, set[str]] = {name: set() for name in names}
        for start in range(0, len(names), 50):
            chunk = ",".join(names[start : start + 50])
            live = subprocess.run(
                ["squeue", "-h", "-t", "all", "--name", chunk, "-o", "%j|%i"],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
            acct = subprocess.run(
                ["sacct", "-a", "-n", "-X", "-P", "--name", chunk, "-S", "now-1days", "-o", "JobName,JobIDRaw"],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
            for line in (*live.splitlines(), *acct.splitlines()):
                job_name, _, job_id = line.strip().partition("|")
                if job_name in found and job_id:
                    found[job_name].add(job_id)
        return {name: sorted(ids, key=int) for name, ids in found.items()}

    def jobs_started(self, name: str) -> list[str]:
        return jobs_started(name)

    def live_names(self) -> set[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True, timeout=60)
        return set(out.stdout.split())

    def _state(self, job_id: str) -> str:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip()

    def is_running(self, job_id: str) -> bool:
        return self._state(job_id) == "RUNNING"

    def is_active(self, job_id: str) -> bool:
        return self._state(job_id) in {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED"}

    def cancel(self, job_id: str) -> None:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)

    def cancel_named(self, name: str) -> None:
        subprocess.run(["scancel", "--name", name], capture_output=True, timeout=30)


class GridEngineCluster(Cluster):
    name = "gridengine"

    def jobs_named(self, name: str) -> list[str]:
        return sorted({*sge_live(name), *sge_accounted(name)}, key=int)

    def jobs_started(self, name: str) -> list[str]:
        return sorted(set(sge_accounted(name)), key=int)  # a refused or never-started job has no record

    def live_names(self) -> set[str]:
        out = subprocess.run(["qstat", "-xml", "-u", "*"], capture_output=True, text=True, timeout=30).stdout
        if not out.strip():
            return set()
        return {job.findtext("JB_name", "") for job in ET.fromstring(out).iter("job_list")}

    def _states(self) -> dict[str, str]:
        """Live job id -> qstat's state letters."""
        out = subprocess.run(["qstat", "-u", "*"], capture_output=True, text=True, timeout=30).stdout
        return {line.split()[0]: line.split()[4] for line in out.splitlines() if len(line.split()) > 4}

    def is_running(self, job_id: str) -> bool:
        return self._states().get(job_id) == "r"

    def is_active(self, job_id: str) -> bool:
        return job_id in self._states()

    def cancel(self, job_id: str) -> None:
        subprocess.run(["qdel", job_id], capture_output=True, timeout=30)

    def cancel_named(self, name: str) -> None:
        for job_id in sge_live(name):
            self.cancel(job_id)


#: The helper of each scheduler backend the tests run on (tests/test_cluster_helper.py: every one).
CLUSTERS: dict[str, type[Cluster]] = {helper.name: helper for helper in (SlurmCluster, GridEngineCluster)}


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
