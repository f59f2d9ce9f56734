"""docs/operator-guide.md, followed exactly by a newcomer's account, gives a working cron deployment.

deploy/dev/follow_guide.py runs every ```bash block of the guide's install sections as a fresh,
unprivileged account, from a wheel of the working tree and no checkout (two venvs, `hpc-bridge
init`, the settings, doctor, a pass by hand, crontab, log rotation). Then Rodan publishes a request
and the reply must come back through what the real cron daemon runs: nobody here calls the bridge.
The guide's Upgrade section then upgrades the live deployment (`hpc-bridge upgrade`), and its
Uninstall section removes it. Needs root (to create the account) and cron (set-up installs it).
The account's pip installs from the wheelhouse set-up fills (var/wheelhouse), as at a site that
installs from its own: the guide's commands are the same either way, and no TensorFlow is downloaded.
The broker account is the bridge's as docs/rodan-guide.md (step 1) gives it, on a vhost of the test's
own with the guides' queue names, so doctor's broker-rights line and every pass run on those rights.
"""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.bridge import FAST_SETTINGS, RODAN_EMAIL, RODAN_PASSWORD
from tests.support.broker import Queues, Rodan, queue_exists
from tests.support.broker_rights import BRIDGE_USER, GUIDES, JOB_USER, RightsVhost, documented_rights, rights_vhost
from tests.support.wait import wait_until

ROOT = Path(__file__).resolve().parents[1]
FOLLOW = ROOT / "deploy" / "dev" / "follow_guide.py"
USER = "hpcguide"
pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.slurm]
#: The guides' queue names (request, the older jobs' reply queue, dead letters), in the test's own vhost.
GUIDE_QUEUES = Queues("hpc-jobs", "hpc-results", "hpc-bridge.dead-letter")


@pytest.fixture
def guide_broker(broker_url: str) -> Iterator[RightsVhost]:
    """A vhost of the test's own with the bridge's account as docs/rodan-guide.md gives it."""
    rights = documented_rights(GUIDES[0]).rights
    with rights_vhost(broker_url, rights[BRIDGE_USER], rights[JOB_USER], tag="guide") as box:
        yield box


def _follow(*args: str, timeout: float = 1500) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(FOLLOW), "--user", USER, *args], capture_output=True, text=True, timeout=timeout
    )


def _as_user(command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-l", USER, "-c", command], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(os.geteuid() != 0, reason="creates a system account and a crontab: run as root (CI does)")
@pytest.mark.timeout(1500)  # two environments installed by pip: 320-420 s here, over 900 s once in a loaded CI
def test_following_the_operator_guide_gives_a_working_cron_deployment(
    guide_broker, standin, sample_inputs, slurm, tmp_path
):
    # The broker account as the Rodan guide gives it (its step 1), on a vhost of the test's own with
    # the guide's queue names; the test plays the older Rodan job with an account that may do anything.
    rodan = Rodan(guide_broker.admin_url, GUIDE_QUEUES)
    settings = {
        "RABBITMQ_URL": guide_broker.bridge_url,
        "RODAN_HOST": standin.host_port,
        "RODAN_SCHEME": "http",
        "RODAN_USER": RODAN_EMAIL,
        "RODAN_PASSWORD": RODAN_PASSWORD,
        "HPC_WORKER_PYTHON": f"/home/{USER}/hpc-bridge/envs/current/bin/python",
        "HPC_LOG_FILE": "~/.local/state/hpc-bridge/default/bridge.log",
        "HPC_METRICS_FILE": "~/hpc-bridge/metrics/hpc_bridge.prom",
        "HPC_SCHEDULER": "slurm",
        # The dev cluster's GPUs are fake: TensorFlow sees none, and `doctor --job` would rightly say so.
        "HPC_GPU_RULES": "none",
    }
    (tmp_path / "settings.json").write_text(json.dumps(settings))
    (tmp_path / "settings.json").chmod(0o600)
    home = Path(f"/home/{USER}")
    try:
        # The account's pip installs from set-up's wheelhouse alone (a site's pip.conf): the guide's
        # pip lines run as written, without downloading TensorFlow for each environment.
        wheelhouse = ROOT / "var" / "wheelhouse"
        followed = _follow(
            "--settings", str(tmp_path / "settings.json"), "--section", "Install", "--wheelhouse", str(wheelhouse)
        )
        assert followed.returncode == 0, followed.stdout[-6000:] + followed.stderr[-2000:]
        out = followed.stdout
        assert "doctor" in out and "FAIL" not in out, out[-4000:]
        for check in ("probe-job", "node-spool", "node-worker", "node-rodan", "node-continue"):
            assert f"ok   {check}:" in out, out[-4000:]  # doctor --job, from a compute node

        # What the guide built, as the guide says.
        credentials = home / ".config" / "hpc-bridge" / "default" / "credentials.env"
        assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
        assert credentials.stat().st_uid == int(subprocess.check_output(["id", "-u", USER]))
        values = [line for line in credentials.read_text().splitlines() if not line.startswith("#")]
        assert not [line for line in values if "CHANGE_ME" in line]  # every placeholder replaced
        crontab = _as_user("crontab -l").stdout
        # install cron names nothing that the package's run_check finds by itself: no checkout anywhere.
        assert f"* * * * * {home}/hpc-bridge/.venv/bin/hpc-bridge-run-check" in crontab.splitlines(), crontab
        assert not (home / "hpc-bridge" / "deploy").exists()
        assert any("logrotate -s" in line for line in crontab.splitlines())
        bridge_python = (home / "hpc-bridge" / ".venv" / "bin" / "python").resolve()
        assert _as_user(f"{bridge_python} -c 'import tensorflow'").returncode != 0  # the login node stays light

        # Rodan asks; only cron's passes and the job answer.
        page = sample_inputs("new", n_layers=1, height=256, width=320, seed=8)
        corr = rodan.publish_request(page, FAST_SETTINGS)
        replies: dict[str, bytes] = {}

        def answered() -> bool:
            replies.update((c, body) for c, body, _ in rodan.drain() if c)
            return corr in replies

        wait_until(answered, timeout=420, interval=3, what="the reply, through cron")
        reply = json.loads(replies[corr])
        assert sorted(reply) == ["Background Model", "Model 0"], reply.get("error")
        assert base64.b64decode(reply["Model 0"])[:8] == b"\x89HDF\r\n\x1a\n"

        spool = home / "hpc-bridge-spool"
        ledger = spool / "ledger" / f"{corr}.json"
        # The worker published the reply; the next pass from cron records it.
        record = wait_until(
            lambda: (r := json.loads(ledger.read_text()))["state"] == "replied" and r,
            timeout=150,
            interval=3,
            what="a pass from cron recording the reply",
        )
        assert record["outcome"] == "ok"

        def accounted() -> list[str]:
            return subprocess.run(
                ["sacct", "-n", "-X", "-P", "-j", str(record["job_id"]), "-o", "User,State"],
                capture_output=True,
                text=True,
            ).stdout.split()

        # The worker replies before its job script exits, and a pass from cron may record the reply first.
        ended = wait_until(
            lambda: (a := accounted()) and not a[0].endswith(("|RUNNING", "|PENDING", "|COMPLETING")) and a,
            timeout=120,
            interval=2,
            what="the job's end in accounting",
        )
        assert ended[0] == f"{USER}|COMPLETED", ended  # the job ran as the operator, not root
        logs = home / ".local" / "state" / "hpc-bridge" / "default"
        events = [json.loads(line) for line in (logs / "run_check.log").read_text().splitlines()]
        done = [e for e in events if e.get("event") == "run_check_done"]
        assert len(done) >= 2 and all(e.get("exit_status") == 0 for e in done), done  # by hand + at least one from cron
        bridge_log = (logs / "bridge.log").read_text()
        assert f'"correlation_id": "{corr}"' in bridge_log and '"request_submitted"' in bridge_log
        assert RODAN_PASSWORD not in bridge_log
        status = _as_user("~/hpc-bridge/.venv/bin/hpc-bridge status")
        assert status.returncode == 0 and "replied-ok" in status.stdout, status.stdout + status.stderr
        assert (home / "hpc-bridge" / "metrics" / "hpc_bridge.prom").is_file()

        # The guide's upgrade section on the live deployment: it ends with doctor passing.
        current = home / "hpc-bridge" / "envs" / "current"
        before = current.resolve()
        upgraded = _follow("--settings", str(tmp_path / "settings.json"), "--section", "Upgrade", "--keep-account")
        assert upgraded.returncode == 0, upgraded.stdout[-4000:] + upgraded.stderr[-2000:]
        assert "FAIL" not in upgraded.stdout
        after = current.resolve()
        assert after != before and after.parent == before.parent, (before, after)  # a new one, beside the old
        assert before.is_dir() and (after / "hpc-bridge-extra").read_text().strip() == "worker"

        # The guide's uninstall: nothing of the bridge is left running or on disk, settings aside.
        removed = _follow("--settings", str(tmp_path / "settings.json"), "--section", "Uninstall", "--keep-account")
        assert removed.returncode == 0, removed.stdout[-4000:] + removed.stderr[-2000:]
        assert "hpc-bridge/" not in _as_user("crontab -l").stdout
        assert not spool.exists() and not (home / "hpc-bridge").exists() and not logs.exists()
        assert not credentials.exists()  # the guide's last line removes the settings too
        assert not queue_exists(guide_broker.admin_url, "hpc-bridge.status")
        assert not queue_exists(guide_broker.admin_url, GUIDE_QUEUES.dead)
    finally:
        # First, so that a timeout in the clean-up cannot leave it: it holds the passwords, like a credentials.env.
        (tmp_path / "settings.json").unlink()
        _follow("--cleanup", timeout=300)
    assert subprocess.run(["id", USER], capture_output=True).returncode != 0
    assert not Path(f"/home/{USER}").exists()  # renamed aside at once, deleted in the background
