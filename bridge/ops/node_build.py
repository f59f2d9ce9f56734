"""``hpc-bridge upgrade --build-on-node``: the new worker environment built by a batch job.

Where the compute nodes run another OS image, another CPU architecture (an aarch64 GPU node behind an
x86-64 login node) or have modules the login node lacks, an environment built on the login node may
not run where the jobs do. This builds it where they run: a batch job, submitted as a Rodan request's
job is (the same account, partition, GPUs, directives and ``HPC_JOB_PROLOGUE``, so the site's
``module load`` lines run first), creates the environment with the interpreter named (a path the
node can run: by default the current environment's), installs the package with the extra into it
and records what it built, and measures the oneDNN choice for the nodes of that kind with the new
environment (``hpc-worker tune``: its jobs then never measure). The login node waits for the job,
reads the version the environment's own ``hpc-worker --version`` gave on the node, and goes on with
the upgrade (the switch, under the lock).

The job's folder is ``SPOOL/jobs/upgrade-build-HEX/``: its ``build.sh`` (no secret: paths, the
requirement and pip's arguments), the scheduler's log, and ``built-version`` once the node has
checked the environment. It is removed when the build succeeded and kept, named in the error,
when it failed.
"""

from __future__ import annotations

import contextlib
import shlex
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from bridge.config import BridgeConfig, contains_secret
from bridge.errors import SchedulerRejected, SchedulerUnavailable
from bridge.intake import rodan_job_spec
from bridge.protocol import RequestSettings
from bridge.schedulers import JobInfo, JobState, Scheduler, format_duration, get_scheduler
from bridge.spool import Spool, atomic_write

KEY_PREFIX = "upgrade-build-"
SCRIPT_FILE = "build.sh"
VERSION_FILE = "built-version"  # written last, by the node: the environment's own hpc-worker --version
BUILT_ON_FILE = "hpc-bridge-built-on"  # in the environment: which host and job built it
BUILD_MINUTES = 60  # the job's time limit: pip with TensorFlow on a busy shared filesystem
BUILD_MEMORY_MB = 4096
DEFAULT_TIMEOUT_S = 4 * 3600.0  # queue and build together
POLL_S = 5.0
TUNE_FAILED = "hpc-worker tune failed: jobs keep TensorFlow's default oneDNN setting until doctor --job measures it"


class NodeBuildFailed(Exception):
    """The job did not build the environment; the message says what the job's log shows."""


def build_script(new: Path, target: str, extra: str, python: str | Path, pip_args: Sequence[str], out: Path) -> str:
    """The job's commands: every value shell-quoted; a failing command ends the job (``set -e``)."""
    q = shlex.quote
    pip = " ".join(q(str(a)) for a in [new / "bin" / "python", "-I", "-m", "pip", "install", *pip_args, target])
    return "\n".join(
        [
            "#!/bin/sh",
            "# hpc-bridge upgrade --build-on-node: the new worker environment, built on a compute node.",
            "set -eu",
            f'echo "building {new.name} on $(hostname)"',
            f"{q(str(python))} -I -m venv {q(str(new))}",
            pip,
            f"echo {q(extra)} > {q(str(new / 'hpc-bridge-extra'))}",
            f'echo "host=$(hostname) job=${{SLURM_JOB_ID:-${{JOB_ID:-}}}}" > {q(str(new / BUILT_ON_FILE))}',
            # The oneDNN choice for this kind of node and the new environment, so that its jobs never
            # measure (worker/onednn.py); a failure only leaves TensorFlow's default: the build goes on.
            f"{q(str(new / 'bin' / 'hpc-worker'))} tune || echo {q(TUNE_FAILED)}",
            f"{q(str(new / 'bin' / 'hpc-worker'))} --version > {q(str(out / VERSION_FILE))}.tmp",
            f"mv {q(str(out / VERSION_FILE))}.tmp {q(str(out / VERSION_FILE))}",
            "",
        ]
    )


def build_on_node(
    config: BridgeConfig,
    new: Path,
    target: str,
    extra: str,
    python: str | Path,
    pip_args: Sequence[str],
    say: Callable[[str], None],
    *,
    scheduler: Scheduler | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    poll_s: float = POLL_S,
) -> str:
    """Build ``new`` in a batch job; return the version its ``hpc-worker --version`` gave on the node.

    Raises :class:`NodeBuildFailed` (the job's folder is kept) when the job did not build it."""
    scheduler = scheduler or get_scheduler(
        config.scheduler,
        timeout_s=config.scheduler_timeout_s,
        options=config.scheduler_options,
        scheduler_args=config.scheduler_args,
    )
    spool = Spool(config.spool_dir).ensure()
    key = f"{KEY_PREFIX}{uuid.uuid4().hex[:12]}"
    job_dir = spool.job_dir(key)
    job_dir.mkdir(parents=True, mode=0o700)
    settings = RequestSettings(max_time=format_duration(BUILD_MINUTES), max_memory_mb=BUILD_MEMORY_MB, cpus=1)
    spec = replace(
        rodan_job_spec(config, spool, settings, key),
        warn_seconds=0,  # a build that runs out of time is not continued: the upgrade fails
        command=("/bin/sh", str(job_dir / SCRIPT_FILE)),
    )
    script = build_script(new, target, extra, python, pip_args, job_dir)
    if contains_secret(script, config.secrets):
        shutil.rmtree(job_dir, ignore_errors=True)
        raise NodeBuildFailed("the build job would carry a password of the settings (in --pip-arg?): not submitted")
    atomic_write(job_dir / SCRIPT_FILE, script.encode("utf-8"), mode=0o700)
    batch = job_dir / "job.sh"
    atomic_write(batch, scheduler.render(spec).encode("utf-8"), mode=0o700)
    label = scheduler.display_name
    try:
        job_id = scheduler.submit(batch, spec)
    except (SchedulerRejected, SchedulerUnavailable) as exc:
        raise NodeBuildFailed(f"{label} did not take the build job: {exc}; its folder: {job_dir}") from exc
    say(f"{label} job {job_id} builds {new.name} on a compute node (its folder: {job_dir})")
    info = _wait(scheduler, job_id, timeout_s, poll_s, say)
    version_file = job_dir / VERSION_FILE
    built = version_file.read_text().split() if version_file.is_file() else []
    if info is None or info.state is not JobState.COMPLETED or not built:
        log = scheduler.log_file(job_dir, job_id)
        how = "did not end in time (cancelled)" if info is None else f"ended {info.state.value} ({info.native_state})"
        raise NodeBuildFailed(f"{label} job {job_id} {how}; the end of its log {log}:\n{_tail(log)}")
    shutil.rmtree(job_dir, ignore_errors=True)
    return built[-1]


def _wait(
    scheduler: Scheduler, job_id: str, timeout_s: float, poll_s: float, say: Callable[[str], None]
) -> JobInfo | None:
    """The job's final state, or None when it had not ended by the deadline (it is cancelled then)."""
    deadline = time.monotonic() + timeout_s
    shown = ""
    while time.monotonic() < deadline:
        try:
            info = scheduler.query([job_id]).get(job_id)
        except SchedulerUnavailable:
            info = None  # a busy controller: ask again until the deadline
        if info is not None:
            if info.state.is_terminal:
                return info
            now = f"{info.state.value}{': ' + info.reason if info.reason else ''}"
            if now != shown:
                shown = now
                say(f"job {job_id}: {now}")
        time.sleep(poll_s)
    with contextlib.suppress(SchedulerUnavailable, ValueError):
        scheduler.cancel(job_id)
    return None


def _tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) or "(empty)"
    except OSError as exc:
        return f"(unreadable: {exc.strerror})"
