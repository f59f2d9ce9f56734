"""The Rodan 3.x job package (rodan_job/) in the interpreter it runs in: Rodan's Python 3.7 with
pika 1.1.0 (rodan_job/requirements-tests.txt). This builds that environment once under
~/.cache/hpc-bridge/rodan-job-tests/<fingerprint>/ and runs rodan_job/tests in it against the real
broker: reply assembly, the silence bound, publish and poll, broker down, TLS, secrets in logs.
rodan_job/README.md says what each proves. A missing Python 3.7 fails the test (never a skip)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from consumers import find_python
from tests.support.rodan_job import GROUP, JOB_NAME, RodanWithJob

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rodan_job"
REQUIREMENTS = PACKAGE / "requirements-tests.txt"


def job_test_env() -> Path:
    """The Python 3.7 virtualenv of rodan_job/tests (built once per requirements file)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpc-bridge" / "rodan-job-tests"
    venv = base / hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]
    python = venv / "bin" / "python"
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / ".complete").exists():
            subprocess.run([str(find_python("3.7")), "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
            subprocess.run(
                [str(python), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)],
                check=True,
                timeout=600,
            )
            (venv / ".complete").write_text("ok\n")
    return python


def test_the_job_package_tests_pass_in_rodans_python(broker_url: str) -> None:
    python = job_test_env()
    version = subprocess.run(
        [str(python), "-c", "import sys, pika; print('%d.%d' % sys.version_info[:2], pika.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert version == ["3.7", "1.1.0"]
    env = {**os.environ, "RABBITMQ_URL": broker_url}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:logging", "-rfE"],
        cwd=PACKAGE,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary


# --- the job inside a real Rodan 3.1.0 (deploy/dev/rodan.sh with this package) -------------------
# The session's Rodan with the job package: tests/support/rodan_job.py. Workflow runs of the job
# through Rodan's REST API and its Celery worker (waiting through a killed worker, error replies,
# the silence bound) are tests/test_rodan3_e2e.py's scenario, with the real bridge answering.


@pytest.mark.slow
@pytest.mark.rodan
@pytest.mark.heavy
@pytest.mark.xdist_group(GROUP)  # one worker under --dist loadgroup: the Rodan of tests/test_rodan3_e2e.py
def test_rodans_own_job_tests_pass_for_the_job(rodan_with_job: RodanWithJob) -> None:
    """``manage.py test rodan.test.test_all_jobs`` (Rodan's runner, which calls every job's
    ``test_my_task``) in the worker's own environment: our job's line says it passed. (Two of the
    archive's own jobs fail there: their test files are not in the archive.)"""
    pid = rodan_with_job.worker_pid()
    environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
    python = Path(f"/proc/{pid}/cmdline").read_text().split("\0")[0]
    done = subprocess.run(
        [python, "manage.py", "test", "rodan.test.test_all_jobs", "--noinput"],
        cwd=rodan_with_job.state_dir / "code",
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = (done.stdout + done.stderr).splitlines()
    ours = [i for i, line in enumerate(lines) if f": {JOB_NAME} ..." in line]
    assert len(ours) == 1, "\n".join(lines[-80:])
    assert lines[ours[0] + 1].strip() == "p", "\n".join(lines[ours[0] :][:80])
    assert f"{JOB_NAME} <class" not in done.stdout + done.stderr  # not among the failures listed
