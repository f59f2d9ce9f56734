"""Smoke tests against the local dev Slurm cluster (``bash deploy/dev/slurm.sh up``).

They submit real jobs and read their final state from ``sacct``, so they check the whole chain
the bridge relies on: submission, accounting (slurmdbd), memory enforcement (task/cgroup) and
the fake GPU GRES.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# The `slurm` fixture (conftest.py) fails, never skips, when the cluster is down.
pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm")]

# Final states as printed by ``sacct -o State`` (a cancel prints "CANCELLED by <uid>").
TERMINAL = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}
# Generous: a job runs in ~1 s, but the cluster is shared with the other Slurm tests (e.g. both
# fake GPUs can be held by end-to-end jobs), so a job may sit PENDING (Resources) for a while.
JOB_DEADLINE_S = 240.0
POLL_S = 0.25


def _run(*cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


class Jobs:
    """Submits jobs with their output under one directory; remembers them for cleanup."""

    def __init__(self, outdir: Path) -> None:
        self.outdir = outdir
        self.ids: list[str] = []

    def submit(self, *sbatch_args: str, wrap: str) -> tuple[str, Path]:
        out = self.outdir / "job-%j.out"
        res = _run(
            "sbatch",
            "--parsable",
            "-J",
            "hpc-dev-test",
            f"--chdir={self.outdir}",
            f"--output={out}",
            *sbatch_args,
            "--wrap",
            wrap,
        )
        assert res.returncode == 0, f"sbatch failed: {res.stderr}"
        job_id = res.stdout.strip().split(";")[0]
        assert job_id.isdigit(), res.stdout
        self.ids.append(job_id)
        return job_id, self.outdir / f"job-{job_id}.out"

    @staticmethod
    def wait(job_id: str, deadline_s: float = JOB_DEADLINE_S) -> tuple[str, str]:
        """Polls sacct until the job is in a final state; returns (state, exit code)."""
        deadline = time.monotonic() + deadline_s
        last = ""
        while time.monotonic() < deadline:
            res = _run("sacct", "-X", "-n", "-P", "-j", job_id, "-o", "JobIDRaw,State,ExitCode")
            for line in res.stdout.splitlines():
                fields = line.split("|")
                if len(fields) == 3 and fields[0] == job_id:
                    last = line
                    state = fields[1].split()[0] if fields[1] else ""
                    if state in TERMINAL:
                        return state, fields[2]
            time.sleep(POLL_S)
        reason = _run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T %r").stdout.strip()
        pytest.fail(f"job {job_id} not finished after {deadline_s:.0f} s (sacct: {last!r}, squeue: {reason!r})")


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[Jobs]:
    j = Jobs(tmp_path)
    try:
        yield j
    finally:
        if j.ids:
            # Harmless for jobs that already ended.
            _run("scancel", *j.ids)


def test_completed_job_is_recorded_by_sacct(jobs: Jobs) -> None:
    job_id, out = jobs.submit(wrap="echo hi")
    assert jobs.wait(job_id) == ("COMPLETED", "0:0")
    assert out.read_text().strip() == "hi"


def test_exit_3_is_failed(jobs: Jobs) -> None:
    job_id, _ = jobs.submit(wrap="exit 3")
    assert jobs.wait(job_id) == ("FAILED", "3:0")


def test_exceeding_mem_is_out_of_memory(jobs: Jobs) -> None:
    # 400 MB really written (bytearray zero-fills) against a 100 MB cgroup limit.
    alloc = "b = bytearray(400 * 1024 * 1024); import time; time.sleep(5)"
    job_id, _ = jobs.submit("--mem=100M", wrap=f"{shlex.quote(sys.executable)} -c {shlex.quote(alloc)}")
    state, _exit_code = jobs.wait(job_id)
    assert state == "OUT_OF_MEMORY"


def test_gpu_gres_sets_cuda_visible_devices(jobs: Jobs) -> None:
    job_id, out = jobs.submit("--gres=gpu:1", wrap='echo "CVD=${CUDA_VISIBLE_DEVICES:-unset}"')
    assert jobs.wait(job_id) == ("COMPLETED", "0:0")
    value = out.read_text().strip().removeprefix("CVD=")
    assert value.isdigit(), f"CUDA_VISIBLE_DEVICES={value!r}"
