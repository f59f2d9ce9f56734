"""Smoke tests against the local dev Grid Engine cluster (``bash deploy/dev/gridengine.sh up``).

They submit real jobs with the plain ``/usr/bin`` commands (no SGE environment, as a user would) and
read the outcome from the job's files and from ``qacct``: submission, output files, accounting of
exit codes, ``h_rt`` enforcement, ``-hold_jid`` chains, the consumable ``gpu`` complex and
``-notify``. The module fixture runs ``up`` (idempotent, ~1.5 s when the cluster already runs);
it skips only where the script cannot work at all (not root, or no apt-get), never in CI (root,
Debian 12).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "deploy" / "dev" / "gridengine.sh"
# One tag per test run: -hold_jid by name waits for *every* job of that name, so names must be unique.
RUN_TAG = f"hpcdev{uuid.uuid4().hex[:8]}"
# Generous: a job starts in ~0.03 s, but the cluster is shared with the other Grid Engine tests
# (e.g. both `gpu` units can be held by end-to-end jobs), so a job may wait in `qw` for a while.
ACCT_DEADLINE_S = 180.0
POLL_S = 0.25


def _run(
    *cmd: str | Path, timeout: float = 60, input: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, check=False, input=input, cwd=cwd
    )


@pytest.fixture(scope="module")
def gridengine_up() -> None:
    if os.geteuid() != 0:
        pytest.skip("the dev Grid Engine cluster needs root (deploy/dev/gridengine.sh)")
    if not shutil.which("apt-get"):
        pytest.skip("the dev Grid Engine cluster needs Debian (apt-get)")
    res = _run("bash", SCRIPT, "up", timeout=900)
    assert res.returncode == 0, f"gridengine.sh up failed:\n{res.stdout}\n{res.stderr}"


pytestmark = [pytest.mark.gridengine, pytest.mark.usefixtures("gridengine_up")]


class Jobs:
    """Submits jobs (script text on stdin) with unique names; remembers their ids for cleanup."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.ids: list[str] = []

    def name(self, label: str) -> str:
        return f"{RUN_TAG}-{label}"

    def submit(self, label: str, script: str, *qsub_args: str) -> str:
        out = self.workdir / f"{label}.out"
        res = _run(
            "qsub", "-terse", "-N", self.name(label), "-o", out, "-j", "y", *qsub_args,
            input=script, cwd=self.workdir,
        )  # fmt: skip
        assert res.returncode == 0, f"qsub failed: {res.stdout} {res.stderr}"
        job_id = res.stdout.strip().split(".")[0]
        assert job_id.isdigit(), res.stdout
        self.ids.append(job_id)
        return job_id

    def out(self, label: str) -> Path:
        return self.workdir / f"{label}.out"

    @staticmethod
    def acct(job_id: str, deadline_s: float = ACCT_DEADLINE_S) -> dict[str, str]:
        """Polls ``qacct -j`` until the job's record is written; returns its fields (first word of each value)."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            res = _run("qacct", "-j", job_id)
            if res.returncode == 0:
                fields = {}
                for line in res.stdout.splitlines():
                    parts = line.split()
                    if len(parts) >= 2:
                        fields[parts[0]] = parts[1]
                return fields
            time.sleep(POLL_S)
        state = _run("qstat", "-j", job_id)
        pytest.fail(f"no qacct record for job {job_id} after {deadline_s:.0f} s; qstat -j: {state.stdout[-500:]}")

    def cleanup(self) -> None:
        if self.ids:
            _run("qdel", *self.ids)  # harmless for jobs that already ended


def wait_for_file(path: Path, deadline_s: float) -> str:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        time.sleep(POLL_S)
    pytest.fail(f"{path} not written after {deadline_s:.0f} s")


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[Jobs]:
    j = Jobs(tmp_path)
    try:
        yield j
    finally:
        j.cleanup()


@pytest.fixture(scope="module")
def slow_jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Jobs, str, str]]:
    """The two jobs that wait for h_rt, submitted together so that their waits overlap."""
    j = Jobs(tmp_path_factory.mktemp("sge-slow"))
    try:
        killed = j.submit("hrt", "echo started\nsleep 60\necho not-killed\n", "-l", "h_rt=0:0:5")
        marker = j.workdir / "usr2.marker"
        notify_script = f"trap 'echo usr2 > {marker}; exit 0' USR2\necho waiting\nsleep 60 &\nwait\necho no-signal\n"
        notified = j.submit("notify", notify_script, "-notify", "-l", "h_rt=0:0:3")
        yield j, killed, notified
    finally:
        j.cleanup()


def test_status_ok_and_second_up_is_fast_and_changes_nothing() -> None:
    status = _run("bash", SCRIPT, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert re.search(r"^sge_qmaster\s+running \(pid \d+\)$", status.stdout, re.M), status.stdout
    assert re.search(r"^sge_execd\s+running \(pid \d+\)$", status.stdout, re.M), status.stdout
    assert "all.q" in status.stdout
    t0 = time.monotonic()
    up = _run("bash", SCRIPT, "up", timeout=120)
    took = time.monotonic() - t0
    assert up.returncode == 0, up.stdout + up.stderr
    assert "(0 changes)" in up.stdout, up.stdout
    assert took < 10, f"second 'up' took {took:.1f} s"


def test_job_runs_and_writes_its_output_file(jobs: Jobs) -> None:
    job_id = jobs.submit("hello", 'echo "hello from $JOB_NAME"\n')
    acct = jobs.acct(job_id)
    assert (acct["failed"], acct["exit_status"]) == ("0", "0")
    assert jobs.out("hello").read_text().strip() == f"hello from {jobs.name('hello')}"


def test_exit_3_is_recorded_by_qacct(jobs: Jobs) -> None:
    job_id = jobs.submit("exit3", "exit 3\n")
    acct = jobs.acct(job_id)
    assert acct["exit_status"] == "3"
    assert acct["failed"] == "0"


def test_h_rt_kills_the_job(slow_jobs: tuple[Jobs, str, str]) -> None:
    j, killed, _ = slow_jobs
    acct = j.acct(killed)
    # failed 37: "qmaster enforced h_rt, h_cpu, or h_vmem limit"; 137 = 128 + SIGKILL.
    assert (acct["failed"], acct["exit_status"]) == ("37", "137")
    assert float(acct["ru_wallclock"].rstrip("s")) < 30
    assert j.out("hrt").read_text().split() == ["started"]


def test_notify_sends_sigusr2_before_h_rt_kill(slow_jobs: tuple[Jobs, str, str]) -> None:
    j, _, notified = slow_jobs
    assert wait_for_file(j.workdir / "usr2.marker", 40).strip() == "usr2"
    acct = j.acct(notified)
    # Still recorded as an h_rt kill (failed 37), but the trap's `exit 0` ended the job within the
    # queue's notify time, before the SIGKILL (which would give exit_status 137).
    assert (acct["failed"], acct["exit_status"]) == ("37", "0"), acct
    assert j.out("notify").read_text().split() == ["waiting"]


def test_hold_jid_chain_runs_in_order(jobs: Jobs) -> None:
    stamp = "date +%s.%N > {d}/{x}.start\nsleep 0.5\ndate +%s.%N > {d}/{x}.end\n"
    d = jobs.workdir
    # A is held until B and C are queued: -hold_jid on a name that matches no job is silently ignored.
    a = jobs.submit("a", stamp.format(d=d, x="a"), "-h")
    jobs.submit("b", stamp.format(d=d, x="b"), "-hold_jid", jobs.name("a"))
    c = jobs.submit("c", stamp.format(d=d, x="c"), "-hold_jid", jobs.name("b"))
    rel = _run("qrls", a)
    assert rel.returncode == 0, rel.stderr
    jobs.acct(c, deadline_s=ACCT_DEADLINE_S)
    t = {f"{x}.{e}": float((d / f"{x}.{e}").read_text()) for x in "abc" for e in ("start", "end")}
    assert t["a.start"] < t["a.end"] <= t["b.start"] < t["b.end"] <= t["c.start"] < t["c.end"], t


def test_gpu_consumable(jobs: Jobs, tmp_path: Path) -> None:
    ok = _run(
        "qsub", "-sync", "y", "-N", jobs.name("gpu1"), "-l", "gpu=1", "-o", tmp_path / "gpu1.out", "-j", "y",
        "-b", "y", "-shell", "no", "/bin/echo", "gpu-job-ran", timeout=ACCT_DEADLINE_S,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert (tmp_path / "gpu1.out").read_text().strip() == "gpu-job-ran"
    refused = _run(
        "qsub", "-terse", "-w", "e", "-N", jobs.name("gpu3"), "-l", "gpu=3", "-o", "/dev/null", "-j", "y",
        "-b", "y", "-shell", "no", "/bin/true",
    )  # fmt: skip
    if refused.returncode == 0:
        jobs.ids.append(refused.stdout.strip())
    assert refused.returncode != 0, f"a 3-GPU job was accepted: {refused.stdout}"
    assert "no suitable queues" in refused.stdout + refused.stderr
