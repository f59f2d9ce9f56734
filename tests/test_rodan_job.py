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


#: A test module for Rodan's runner: ``test_all_jobs``' set-up and tear-down (Rodan's own
#: ``RodanJobsTestCase``), for one job alone. The base class is reached through its module, so that
#: the loader does not collect it (and its loop over every job) here too.
ONE_JOB_TESTS = """
import rodan.test.test_all_jobs as all_jobs


class OneJobTestCase(all_jobs.RodanJobsTestCase):
    test_all_jobs = None  # not collected: only the job named below runs

    def test_my_task_of_the_job(self):
        import rodan.jobs.load  # noqa: F401  (registers every job, as test_all_jobs does)
        from celery import registry
        from rodan.jobs.base import RodanTask

        tasks = [t for t in registry.tasks.values() if isinstance(t, RodanTask) and t.name == {name!r}]
        self.assertEqual(len(tasks), 1, "the job is not registered")
        print("running test_my_task of", tasks[0].name)
        tasks[0].test_my_task(self)
"""


@pytest.mark.slow
@pytest.mark.rodan
@pytest.mark.heavy
@pytest.mark.xdist_group(GROUP)  # one worker under --dist loadgroup: the Rodan of tests/test_rodan3_e2e.py
def test_rodans_own_job_tests_pass_for_the_job(rodan_with_job: RodanWithJob) -> None:
    """The job's ``test_my_task`` under Rodan's own test runner (``manage.py test``) and test case
    (``rodan.test.test_all_jobs.RodanJobsTestCase``: its test database, media root and API
    client), for our job alone (``test_all_jobs`` would also run jobs whose test files the archive
    lacks), in the Celery worker's own environment: it publishes to the real broker, answers as the
    bridge does (two parts, out of order) and compares every output."""
    pid = rodan_with_job.worker_pid()
    environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
    # test_my_task plays the bridge as well (its own request queue): the job's account may not, so
    # it runs with the admin's account on the same vhost (rodan_job/README.md, Tests).
    environ["HPC_RABBITMQ_URL"] = rodan_with_job.admin_broker_url
    python = Path(f"/proc/{pid}/cmdline").read_text().split("\0")[0]
    code = rodan_with_job.state_dir / "code"
    module = code / "rodan" / "test" / "test_hpc_job_alone.py"
    module.write_text(ONE_JOB_TESTS.format(name=JOB_NAME))
    try:
        done = subprocess.run(
            [python, "manage.py", "test", "rodan.test.test_hpc_job_alone", "--noinput", "-v", "2"],
            cwd=code, env=environ, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        module.unlink()
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert f"running test_my_task of {JOB_NAME}" in output, output[-3000:]
    assert "test_my_task_of_the_job" in output and "\nOK" in output and "Ran 1 test" in output, output[-3000:]
