"""``hpc-bridge doctor`` against the real broker, the Rodan stand-in and the real Slurm, run as cron would."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pika
import pytest

from bridge.testing.rodan import RodanStandin
from tests.support.bridge import RODAN_PASSWORD, bridge_environ, run_bridge
from tests.support.broker import Queues

pytestmark = [pytest.mark.slurm, pytest.mark.broker, pytest.mark.usefixtures("slurm")]

ALL_CHECKS = [
    "credentials",
    "settings",
    "broker",
    "rodan",
    "scheduler-commands",
    "scheduler",
    "scheduler-accounting",
    "spool",
    "spool-lock",
    "spool-shared",
    "template",
    "worker",
]


@pytest.fixture
def deployment(broker_url: str, standin: RodanStandin, queues: Queues, tmp_path: Path) -> dict[str, str]:
    """A healthy deployment's settings (the doctor reads them from a credentials file)."""
    return bridge_environ(broker_url, standin, queues, tmp_path / "spool")


def write_credentials(path: Path, settings: dict[str, str], mode: int = 0o600) -> Path:
    path.write_text("".join(f"{k}='{v}'\n" for k, v in settings.items()))
    path.chmod(mode)
    return path


def doctor(
    tmp_path: Path, settings: dict[str, str], *args: str, mode: int = 0o600, env: dict[str, str] | None = None
) -> tuple[int, str, dict[str, dict[str, Any]]]:
    """Run ``python -m bridge --credentials FILE doctor ARGS``; with --json also parse the checks by name."""
    credentials = write_credentials(tmp_path / "credentials.env", settings, mode)
    result = run_bridge(env or {}, "--credentials", str(credentials), "doctor", *args, timeout=240)
    checks: dict[str, dict[str, Any]] = {}
    if "--json" in args:
        data = json.loads(result.stdout)
        assert data["ok"] is (result.returncode == 0)
        checks = {c["name"]: c for c in data["checks"]}
    return result.returncode, result.stdout + result.stderr, checks


def lines(output: str, status: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(status)]


def test_healthy_deployment_passes_every_check(tmp_path: Path, deployment: dict[str, str], queues: Queues) -> None:
    rc, output, _ = doctor(tmp_path, deployment)
    assert rc == 0, output
    assert lines(output, "FAIL") == []
    for name in [*ALL_CHECKS, f"queue {queues.request}", f"queue {queues.reply}", f"queue {queues.dead}"]:
        line = next((ln for ln in output.splitlines() if ln.split(":")[0].split(None, 1)[-1] == name), None)
        assert line is not None, f"no line for {name}:\n{output}"
        # The spool lies under /tmp in tests: node-local, which is a warning, not a failure.
        assert line.startswith("warn" if name == "spool-shared" else "ok"), line
    assert "TensorFlow" in output and "GPU(s) visible" in output
    assert "ok   scheduler-accounting: Slurm accounting answers (sacct answers)" in output
    assert RODAN_PASSWORD not in output


def test_healthy_deployment_json(tmp_path: Path, deployment: dict[str, str], queues: Queues) -> None:
    # Queues that exist, declared exactly as Rodan (and the bridge, for dead letters) declare them.
    connection = pika.BlockingConnection(pika.URLParameters(deployment["RABBITMQ_URL"]))
    channel = connection.channel()
    channel.queue_declare(queues.request)
    channel.queue_declare(queues.reply)
    channel.queue_declare(queues.dead, durable=True)
    channel.basic_publish("", queues.request, b"{}")
    connection.close()
    spool = Path(deployment["HPC_SPOOL_DIR"])
    spool.mkdir(mode=0o700)

    rc, output, checks = doctor(tmp_path, deployment, "--json", "--skip-worker")
    assert rc == 0, output
    assert checks[f"queue {queues.request}"]["status"] == "ok"
    assert "1 message(s) waiting" in checks[f"queue {queues.request}"]["found"]
    assert checks[f"queue {queues.dead}"]["status"] == "ok"
    assert checks["spool"]["status"] == "ok" and "writable" in checks["spool"]["found"]
    assert list(spool.iterdir()) == []  # the probe file is gone
    assert checks["rodan"]["status"] == "ok"
    assert checks["worker"]["status"] == "skip"


def test_wrong_broker_password(tmp_path: Path, deployment: dict[str, str]) -> None:
    settings = dict(deployment, RABBITMQ_URL=deployment["RABBITMQ_URL"].replace(":guest@", ":wrong-pw-41@"))
    rc, output, _ = doctor(tmp_path, settings, "--skip-worker")
    assert rc == 1
    (broker,) = [ln for ln in lines(output, "FAIL") if ln.startswith("FAIL broker:")]
    assert "login refused for user 'guest'" in broker and "ACCESS_REFUSED" in broker
    assert "RABBITMQ_PASSWORD" in broker
    assert "wrong-pw-41" not in output
    assert "skip queues: skipped: no broker connection (see broker)" in output
    # The other checks still ran.
    assert any(ln.startswith("ok   rodan:") for ln in output.splitlines())


def test_broker_tls_on_a_plain_port(tmp_path: Path, deployment: dict[str, str]) -> None:
    settings = dict(deployment, RABBITMQ_URL=deployment["RABBITMQ_URL"].replace("amqp://", "amqps://"))
    rc, output, checks = doctor(tmp_path, settings, "--json", "--skip-worker")
    assert rc == 1
    assert checks["broker"]["status"] == "FAIL"
    assert "TLS handshake" in checks["broker"]["found"] and "does not speak TLS" in checks["broker"]["found"]
    assert "amqp://" in checks["broker"]["fix"]


def test_queue_declared_differently_from_rodan(tmp_path: Path, deployment: dict[str, str], queues: Queues) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(deployment["RABBITMQ_URL"]))
    channel = connection.channel()
    channel.queue_declare(queues.request, durable=True)
    channel.queue_declare(queues.reply, arguments={"x-message-ttl": 60000})
    channel.queue_declare(queues.dead)  # ours should be durable
    connection.close()

    rc, output, checks = doctor(tmp_path, deployment, "--json", "--skip-worker")
    assert rc == 1
    request, reply, dead = (checks[f"queue {q}"] for q in (queues.request, queues.reply, queues.dead))
    assert request["status"] == "FAIL"
    assert "durable" in request["found"] and "PRECONDITION_FAILED" in request["found"]
    assert f"rabbitmqctl delete_queue {queues.request}" in request["fix"]
    assert reply["status"] == "FAIL" and "x-message-ttl" in reply["found"]
    assert dead["status"] == "FAIL" and "durable" in dead["found"]
    # The doctor changed nothing: the queues are still as declared (a passive declare still answers).
    connection = pika.BlockingConnection(pika.URLParameters(deployment["RABBITMQ_URL"]))
    channel = connection.channel()
    channel.queue_declare(queues.request, durable=True, passive=True)
    connection.close()


def test_wrong_rodan_credentials(tmp_path: Path, deployment: dict[str, str]) -> None:
    settings = dict(deployment, RODAN_PASSWORD="not-the-password-77")
    rc, output, checks = doctor(tmp_path, settings, "--json", "--skip-worker")
    assert rc == 1
    rodan = checks["rodan"]
    assert rodan["status"] == "FAIL"
    assert "401" in rodan["found"] and "Invalid email or password" in rodan["found"]
    assert "Rodan >= 2.0.15" in rodan["found"]  # the generation the stand-in plays
    assert "RODAN_PASSWORD" in rodan["fix"]
    assert "not-the-password-77" not in output
    assert checks["broker"]["status"] == "ok"


def test_rodan_unreachable(tmp_path: Path, deployment: dict[str, str]) -> None:
    settings = dict(deployment, RODAN_SCHEME="https")  # the stand-in speaks plain HTTP
    rc, _, checks = doctor(tmp_path, settings, "--json", "--skip-worker")
    assert rc == 1
    assert checks["rodan"]["status"] == "FAIL"
    assert "RODAN_SCHEME" in checks["rodan"]["fix"] and "RODAN_HOST" in checks["rodan"]["fix"]


def test_scheduler_commands_missing(tmp_path: Path, deployment: dict[str, str]) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    rc, _, checks = doctor(tmp_path, deployment, "--json", "--skip-worker", env={"PATH": str(empty)})
    assert rc == 1
    commands = checks["scheduler-commands"]
    assert commands["status"] == "FAIL"
    assert "sbatch" in commands["found"] and "squeue" in commands["found"] and "not on PATH" in commands["found"]
    assert "PATH" in commands["fix"]
    assert checks["scheduler"]["status"] == "FAIL"
    accounting = checks["scheduler-accounting"]
    assert accounting["status"] == "skip" and "sacct is not on PATH" in accounting["found"]


def test_scheduler_not_answering(tmp_path: Path, deployment: dict[str, str]) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    hanging = fake / "scontrol"
    hanging.write_text("#!/bin/sh\nexec sleep 60\n")  # exec: the timeout kills the sleep itself
    hanging.chmod(0o755)
    env = {"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "HPC_SCHEDULER_TIMEOUT": "1"}
    rc, _, checks = doctor(tmp_path, deployment, "--json", "--skip-worker", env=env)
    assert rc == 1
    assert checks["scheduler-commands"]["status"] == "ok"
    scheduler = checks["scheduler"]
    assert scheduler["status"] == "FAIL"
    assert "not answering" in scheduler["found"] and "timed out" in scheduler["found"]
    assert "slurmctld" in scheduler["fix"] and "HPC_SCHEDULER_TIMEOUT" in scheduler["fix"]


def test_slurm_accounting_disabled(tmp_path: Path, deployment: dict[str, str]) -> None:
    # What sacct says on a cluster without slurmdbd (AccountingStorageType=accounting_storage/none).
    fake = tmp_path / "bin"
    fake.mkdir()
    sacct = fake / "sacct"
    sacct.write_text("#!/bin/sh\necho 'Slurm accounting storage is disabled' >&2\nexit 1\n")
    sacct.chmod(0o755)
    env = {"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    rc, output, checks = doctor(tmp_path, deployment, "--json", "--skip-worker", env=env)
    assert rc == 1, output
    accounting = checks["scheduler-accounting"]
    assert accounting["status"] == "FAIL", accounting
    assert "Slurm accounting does not answer" in accounting["found"]
    assert "Slurm accounting storage is disabled" in accounting["found"]
    # ... and why it matters: ended jobs cannot be judged, reconciliation stops.
    assert "'sacct failed'" in accounting["found"] and "never answered" in accounting["found"]
    assert "slurmdbd" in accounting["fix"] and "AccountingStorageType" in accounting["fix"]
    assert checks["scheduler"]["status"] == "ok"  # slurmctld itself answers
    assert [name for name, c in checks.items() if c["status"] == "FAIL"] == ["scheduler-accounting"]


def test_spool_unusable(tmp_path: Path, deployment: dict[str, str]) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("in the way\n")
    rc, _, checks = doctor(tmp_path, dict(deployment, HPC_SPOOL_DIR=str(blocker)), "--json", "--skip-worker")
    assert rc == 1
    assert checks["spool"]["status"] == "FAIL"
    assert "not a directory" in checks["spool"]["found"] and "HPC_SPOOL_DIR" in checks["spool"]["fix"]

    below = blocker / "spool"  # cannot be created either
    rc, _, checks = doctor(tmp_path, dict(deployment, HPC_SPOOL_DIR=str(below)), "--json", "--skip-worker")
    assert rc == 1
    assert checks["spool"]["status"] == "FAIL" and "cannot be created" in checks["spool"]["found"]
    assert checks["spool-shared"]["status"] == "skip"

    # A directory where even root cannot create a file: the probe (write, fsync, delete) fails.
    rc, _, checks = doctor(tmp_path, dict(deployment, HPC_SPOOL_DIR="/proc/sys"), "--json", "--skip-worker")
    assert rc == 1
    assert checks["spool"]["status"] == "FAIL" and "is not writable" in checks["spool"]["found"]


def test_spool_readable_by_others(tmp_path: Path, deployment: dict[str, str]) -> None:
    spool = Path(deployment["HPC_SPOOL_DIR"])
    spool.mkdir()
    spool.chmod(0o755)
    rc, _, checks = doctor(tmp_path, deployment, "--json", "--skip-worker")
    assert rc == 1
    assert checks["spool"]["status"] == "FAIL" and "755" in checks["spool"]["found"]
    assert checks["spool"]["fix"] == f"chmod 700 {spool}"


def test_world_readable_credentials(tmp_path: Path, deployment: dict[str, str]) -> None:
    rc, output, _ = doctor(tmp_path, deployment, "--skip-worker", mode=0o644)
    assert rc == 1
    credentials = tmp_path / "credentials.env"
    (line,) = [ln for ln in lines(output, "FAIL") if ln.startswith("FAIL credentials:")]
    assert "mode 644" in line and f"chmod 600 {credentials}" in line
    # The settings are still judged, and the other checks still run.
    assert any(ln.startswith("ok   settings:") for ln in output.splitlines())
    assert any(ln.startswith("ok   broker:") for ln in output.splitlines())
    assert RODAN_PASSWORD not in output


def test_world_readable_credentials_and_a_bad_setting(tmp_path: Path, deployment: dict[str, str]) -> None:
    """The file was given and is read: no line may say it was not ("--credentials (not given)")."""
    settings = dict(deployment, HPC_DRAIN_BATCH="0")
    rc, output, checks = doctor(tmp_path, settings, "--json", "--skip-worker", mode=0o644)
    credentials = tmp_path / "credentials.env"
    assert rc == 1
    assert checks["credentials"]["status"] == "FAIL" and str(credentials) in checks["credentials"]["found"]
    assert checks["credentials"]["fix"] == f"chmod 600 {credentials}"
    assert checks["settings"]["status"] == "FAIL"
    assert checks["settings"]["found"] == "HPC_DRAIN_BATCH must be at least 1, got 0"  # the mode is credentials'
    assert "not given" not in output and "no credentials file was read" not in output
    assert checks["broker"]["status"] == "ok" and checks["template"]["status"] == "ok"


SCHEDULER_NEEDS = ["scheduler-commands", "scheduler", "scheduler-accounting", "template"]


def test_invalid_setting_skips_only_what_needs_it(tmp_path: Path, deployment: dict[str, str], queues: Queues) -> None:
    rc, _, checks = doctor(tmp_path, dict(deployment, HPC_SCHEDULER="pbs"), "--json", "--skip-worker")
    assert rc == 1
    assert checks["settings"]["status"] == "FAIL" and "HPC_SCHEDULER must be" in checks["settings"]["found"]
    for name in SCHEDULER_NEEDS:
        assert checks[name]["status"] == "skip", checks[name]
        assert checks[name]["found"] == "skipped: HPC_SCHEDULER has a problem (see settings)"
    # What needs no scheduler setting still runs, and passes.
    for name in ("credentials", "broker", f"queue {queues.request}", "rodan", "spool", "spool-lock"):
        assert checks[name]["status"] == "ok", checks[name]


def test_a_typo_skips_the_checks_of_the_setting_it_was_meant_for(tmp_path: Path, deployment: dict[str, str]) -> None:
    """HPC_SCHEDULAR=gridengine: the bridge would run on Slurm, the default. The scheduler's checks
    would judge the wrong scheduler, so they are skipped; the broker's, Rodan's and the spool's run."""
    rc, output, checks = doctor(tmp_path, dict(deployment, HPC_SCHEDULAR="gridengine"), "--skip-worker")
    assert rc == 1
    (settings,) = [ln for ln in lines(output, "FAIL") if ln.startswith("FAIL settings:")]
    assert "HPC_SCHEDULAR in" in settings and "did you mean HPC_SCHEDULER?" in settings
    for name in SCHEDULER_NEEDS:
        assert f"skip {name}: skipped: HPC_SCHEDULER has a problem (see settings)" in output.splitlines()
    for name in ("broker", "rodan", "spool", "spool-lock"):
        assert any(ln.startswith(f"ok   {name}: ") for ln in output.splitlines()), name
    assert "skip worker: skipped: --skip-worker" in output.splitlines()


def test_a_newer_versions_setting_is_a_warning_line(tmp_path: Path, deployment: dict[str, str]) -> None:
    settings = dict(deployment, HPC_TENSORBOARD_UPLOAD="yes", HPC_MAX_ATTEMPTS="3")
    rc, _, checks = doctor(tmp_path, settings, "--json", "--skip-worker")
    assert rc == 0, checks  # warnings do not fail
    assert checks["settings"]["status"] == "ok"
    warning = checks["settings-warnings"]
    assert warning["status"] == "warn" and "HPC_TENSORBOARD_UPLOAD" in warning["found"]
    assert "not a setting of this version" in warning["found"] and "HPC_DEFER_LIMIT" in warning["found"]
    # Nothing else is the matter: the spool lies under /tmp in tests (node-local: a warning too).
    assert [name for name, c in checks.items() if c["status"] == "warn"] == ["settings-warnings", "spool-shared"]


def test_broker_over_tls(tmp_path: Path, deployment: dict[str, str], request: pytest.FixtureRequest) -> None:
    port, cert = request.getfixturevalue("tls_proxy")  # a TLS-terminating proxy in front of the real broker
    url = f"amqps://guest:guest@localhost:{port}/%2F"
    rc, _, checks = doctor(
        tmp_path, dict(deployment, RABBITMQ_URL=url, RABBITMQ_CA_FILE=str(cert)), "--json", "--skip-worker"
    )
    assert rc == 0, checks
    assert checks["broker"]["status"] == "ok" and "over TLS" in checks["broker"]["found"]

    rc, _, checks = doctor(tmp_path, dict(deployment, RABBITMQ_URL=url), "--json", "--skip-worker")  # no CA: untrusted
    assert rc == 1
    assert checks["broker"]["status"] == "FAIL" and "TLS handshake" in checks["broker"]["found"]
    assert "RABBITMQ_CA_FILE" in checks["broker"]["fix"]


# --- Grid Engine ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("gridengine")
def test_healthy_grid_engine_deployment_passes(tmp_path: Path, deployment: dict[str, str]) -> None:
    rc, output, checks = doctor(tmp_path, dict(deployment, HPC_SCHEDULER="gridengine"), "--json", "--skip-worker")
    assert rc == 0, output
    assert [c for c in checks.values() if c["status"] == "FAIL"] == []
    commands, scheduler = checks["scheduler-commands"], checks["scheduler"]
    assert commands["status"] == "ok" and "qsub, qstat, qacct, qdel found" in commands["found"], commands
    assert scheduler["status"] == "ok" and scheduler["found"].startswith("Grid Engine answers: "), scheduler
    assert "all.q: " in scheduler["found"] and " slots used" in scheduler["found"], scheduler  # from qstat -g c
    assert checks["template"]["status"] == "ok" and "Grid Engine batch script renders" in checks["template"]["found"]
    accounting = checks["scheduler-accounting"]
    assert accounting["status"] == "ok" and "qacct answers" in accounting["found"], accounting


def _hanging_qstat(tmp_path: Path) -> dict[str, str]:
    fake = tmp_path / "bin"
    fake.mkdir()
    hanging = fake / "qstat"
    hanging.write_text("#!/bin/sh\nexec sleep 60\n")  # exec: the timeout kills the sleep itself
    hanging.chmod(0o755)
    return {"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "HPC_SCHEDULER_TIMEOUT": "1"}


@pytest.mark.usefixtures("gridengine")
@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("qmaster port closed", "unable to send message to qmaster using port 1"),
        ("no such cell", 'cell directory "'),
        ("qstat hangs", "timed out"),
    ],
)
def test_grid_engine_not_answering(tmp_path: Path, deployment: dict[str, str], how: str, says: str) -> None:
    env = {
        "qmaster port closed": {"SGE_QMASTER_PORT": "1"},
        "no such cell": {"SGE_CELL": "no-such-cell"},
        "qstat hangs": _hanging_qstat(tmp_path),
    }[how]
    rc, output, checks = doctor(
        tmp_path, dict(deployment, HPC_SCHEDULER="gridengine"), "--json", "--skip-worker", env=env
    )
    assert rc == 1, output
    assert checks["scheduler-commands"]["status"] == "ok"
    scheduler = checks["scheduler"]
    assert scheduler["status"] == "FAIL", scheduler
    assert scheduler["found"].startswith("Grid Engine is not answering: ") and says in scheduler["found"], scheduler
    assert "sge_qmaster runs" in scheduler["fix"] and "SGE_ROOT, SGE_CELL and SGE_QMASTER_PORT" in scheduler["fix"]
    assert "HPC_SCHEDULER_TIMEOUT" in scheduler["fix"]
    # Only the scheduler failed: the rest of the deployment is judged as healthy.
    assert [name for name, c in checks.items() if c["status"] == "FAIL"] == ["scheduler"]
    assert checks["scheduler-accounting"]["status"] == "skip"  # qacct needs the cell that was not found


def test_settings_lists_every_problem_and_typo(tmp_path: Path, deployment: dict[str, str]) -> None:
    settings = dict(deployment, HPC_SCHEDULER="pbs", HPC_SCHEDULAR="slurm", HPC_DRAIN_BATCH="0")
    rc, _, checks = doctor(tmp_path, settings, "--json", "--skip-worker")
    assert rc == 1
    found = checks["settings"]["found"]
    assert found.startswith("3 problems:"), found
    assert "HPC_SCHEDULER must be" in found and "did you mean HPC_SCHEDULER?" in found
    assert "HPC_DRAIN_BATCH must be at least 1" in found


def test_a_short_password_in_unrelated_script_text_is_not_a_leak(tmp_path: Path, deployment: dict[str, str]) -> None:
    """The sample script asks for --gres=gpu:1; a Rodan password "gpu" is not leaked by that."""
    settings = dict(deployment, RODAN_PASSWORD="gpu", HPC_GPU_RULES="gpu:1")
    _, output, checks = doctor(tmp_path, settings, "--json", "--skip-worker")
    assert checks["template"]["status"] == "ok", checks["template"]
    assert checks["rodan"]["status"] == "FAIL"  # the stand-in knows another password: the check is real
