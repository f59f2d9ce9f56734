"""Scheduler trouble (fault suite item 4: docs/reliability.md): controller and accounting outages.

Every test stops a shared daemon, so every test is ``exclusive`` (deploy/dev/test.sh runs these
after the scheduler tests, one at a time per cluster: the Slurm tests beside the Grid Engine ones,
each cluster's in its own ``xdist_group``, and beside the tests that need no scheduler) and
restores the daemons in its fixture's teardown (``deploy/dev/slurm.sh up`` / ``gridengine.sh up``,
both idempotent), even when it fails.

The bridge runs as cron runs it (``hpc-bridge check``, a fresh process per pass) against the real
broker and the real cluster. The worker is a stand-in that replies nothing (``/bin/true``, or a
script that runs a few seconds): the job then ends COMPLETED without a reply, and the bridge's
own error reply ("... finished without sending its models") is the request's one, deterministic,
final reply. Jobs ending in each terminal state are covered by tests/test_e2e.py
(test_jobs_ending_without_a_reply_get_one_error_naming_the_state) and tests/test_reconcile.py.

Outcomes asserted: while the controller is down, requests are deferred (kept in the queue, no
reply, nothing judged); once it is back, each request is submitted once and gets exactly one
reply with its job's real outcome. A job the scheduler forgets (or accounting has not recorded)
is never judged before HPC_MISSING_TIMEOUT, and nothing at all while accounting is unreachable.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image as PILImage

from bridge.testing.rodan import RodanStandin
from tests.support.bridge import FAST_SETTINGS, REPO, bridge_environ
from tests.support.broker import Queues, Rodan
from tests.support.cluster import Cluster
from tests.support.harness import Harness
from tests.support.wait import wait_until

pytestmark = [pytest.mark.exclusive, pytest.mark.broker]
#: One outage at a time per cluster (an outage of the other cluster's daemons may run beside it).
ON_SLURM = [pytest.mark.slurm, pytest.mark.xdist_group("slurm-outages")]
ON_GRIDENGINE = [pytest.mark.gridengine, pytest.mark.xdist_group("gridengine-outages")]

PAGE = {
    "Image": "/uploads/projects/p/resources/img/original_file",
    "Background": "/uploads/projects/p/resources/bg/original_file",
    "Selected Regions": "/uploads/projects/p/resources/sel/original_file",
    "rgba PNG - Layer 0": "/uploads/projects/p/resources/l0/original_file",
}
DEV = {"slurm": REPO / "deploy/dev/slurm.sh", "gridengine": REPO / "deploy/dev/gridengine.sh"}
#: The controller each parameter stops, on the cluster it belongs to.
CONTROLLERS = [
    pytest.param("slurmctld", marks=ON_SLURM),
    pytest.param("sge_qmaster", marks=ON_GRIDENGINE),
]
#: The bridge's own reply for a job that ended without sending its models.
NO_MODELS = ("ended without a result: COMPLETED", "the job finished without sending its models")


def dev(cluster: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(DEV[cluster]), *args], capture_output=True, text=True, timeout=300)


def stop(daemon: str) -> None:
    cluster = "gridengine" if daemon.startswith("sge_") else "slurm"
    result = dev(cluster, "stop", daemon)
    assert result.returncode == 0, result.stderr


def restore(cluster: str) -> None:
    """``up`` (idempotent; on Grid Engine it also restarts the execd that outlived its qmaster)."""
    result = dev(cluster, "up")
    assert result.returncode == 0, f"{cluster} up failed:\n{result.stdout[-1500:]}\n{result.stderr[-1500:]}"


def slow_worker(tmp_path: Path, seconds: int) -> str:
    """A worker that runs ``seconds`` s, notes that it ended, and replies nothing."""
    done = tmp_path / "worker-ended"
    done.mkdir()
    script = tmp_path / "slow-worker.sh"
    script.write_text(f'#!/bin/sh\nsleep {seconds}\ntouch "{done}/$(basename "$4")"\nexit 0\n')
    script.chmod(0o755)
    return str(script)


def ended(tmp_path: Path, corr: str) -> bool:
    return (tmp_path / "worker-ended" / f"{corr}.json").exists()


def make_bridge(
    cluster: str, broker_url: str, standin: RodanStandin, queues: Queues, rodan: Rodan, tmp_path: Path
) -> Iterator[Harness]:
    spool = tmp_path / "spool"
    env = bridge_environ(
        broker_url,
        standin,
        queues,
        spool,
        HPC_LOG_FILE=str(tmp_path / "bridge.log"),
        HPC_SCHEDULER=cluster,
        HPC_WORKER_PYTHON="/bin/true",
        HPC_DEFER_LIMIT="3600",
        HPC_SCHEDULER_TIMEOUT="60",
    )
    for resource in PAGE.values():  # the bridge checks every input at Rodan before it submits
        file = standin.uploads_dir / resource.removeprefix("/uploads/")
        file.parent.mkdir(parents=True, exist_ok=True)
        PILImage.new("RGBA", (8, 8)).save(file, format="PNG")
    bridge = Harness(env, spool, rodan, Cluster(cluster))
    try:
        yield bridge
    finally:
        restore(cluster)  # first: the jobs can only be cancelled with the controller up
        bridge.teardown()


@pytest.fixture
def slurm_bridge(
    slurm: None, broker_url: str, standin: RodanStandin, queues: Queues, rodan: Rodan, tmp_path: Path
) -> Iterator[Harness]:
    yield from make_bridge("slurm", broker_url, standin, queues, rodan, tmp_path)


@pytest.fixture
def sge_bridge(
    gridengine: None, broker_url: str, standin: RodanStandin, queues: Queues, rodan: Rodan, tmp_path: Path
) -> Iterator[Harness]:
    yield from make_bridge("gridengine", broker_url, standin, queues, rodan, tmp_path)


def publish(rodan: Rodan, n: int) -> list[str]:
    return [rodan.publish_request(PAGE, FAST_SETTINGS) for _ in range(n)]


# --- controller down at submit time ------------------------------------------------------------------


@pytest.mark.parametrize("daemon", CONTROLLERS)
def test_controller_down_at_submit_defers_then_submits_once_and_answers_once(
    daemon: str, request: pytest.FixtureRequest, rodan: Rodan
) -> None:
    bridge: Harness = request.getfixturevalue("slurm_bridge" if daemon == "slurmctld" else "sge_bridge")
    corrs = publish(rodan, 2)
    stop(daemon)
    bridge.check()
    # Deferred: no reply, no job, the requests back in the queue, the reason on record.
    assert not any(bridge.replies.values())
    assert rodan.depth(rodan.queues.request) == 2
    for corr in corrs:
        record = bridge.ledger(corr)
        # SUBMITTING: the submit command may have reached the controller; the next pass looks the job
        # up by name before it submits again.
        assert record["state"] == "submitting" and record["job_id"] == "" and record["attempts"] == 1, record
        assert bridge.cluster.submit_command in record["reason"], record["reason"]
    assert len(bridge.log_events("request_deferred")) == 2
    restore(bridge.cluster.name)
    bridge.drive(corrs, timeout=240)
    bridge.assert_one_reply_each(corrs, NO_MODELS)


# Regression: the lookup of a job left by an earlier pass (find_by_name) ran outside the intake's
# try, so SchedulerUnavailable crashed every `check` pass until the controller was back.
@pytest.mark.parametrize("daemon", CONTROLLERS)
def test_a_second_pass_during_the_outage_defers_again(
    daemon: str, request: pytest.FixtureRequest, rodan: Rodan
) -> None:
    bridge: Harness = request.getfixturevalue("slurm_bridge" if daemon == "slurmctld" else "sge_bridge")
    (corr,) = publish(rodan, 1)
    stop(daemon)
    bridge.check()
    bridge.check()  # the lookup of a possible job of the first pass fails too: deferred again
    record = bridge.ledger(corr)
    assert not bridge.replies.get(corr) and record["attempts"] == 2 and record["job_id"] == "", record
    assert rodan.depth(rodan.queues.request) == 1


# --- controller down during reconciliation ------------------------------------------------------------


@pytest.mark.parametrize("daemon", CONTROLLERS)
def test_controller_down_during_reconciliation_judges_nothing_then_the_real_outcome(
    daemon: str, request: pytest.FixtureRequest, rodan: Rodan, tmp_path: Path
) -> None:
    bridge: Harness = request.getfixturevalue("slurm_bridge" if daemon == "slurmctld" else "sge_bridge")
    worker = slow_worker(tmp_path, 6)
    (corr,) = publish(rodan, 1)
    bridge.check(HPC_WORKER_PYTHON=worker)
    job_id = bridge.ledger(corr)["job_id"]
    assert job_id
    wait_until(lambda: bridge.cluster.is_running(job_id), 180, what=f"job {job_id} running")
    stop(daemon)
    bridge.check()  # the job is still running
    wait_until(lambda: ended(tmp_path, corr), 60, what="the job's worker to end")
    bridge.check()  # the job has ended, and the controller cannot say so
    assert not bridge.replies.get(corr)
    record = bridge.ledger(corr)
    assert record["state"] == "submitted" and not record["job_ended"] and not record["missing_since"], record
    assert bridge.log_events("reconcile_scheduler_unavailable")
    restore(bridge.cluster.name)
    bridge.drive([corr], timeout=240)
    bridge.assert_one_reply_each([corr], NO_MODELS)


# --- accounting down or lagging -------------------------------------------------------------------------


@pytest.mark.xdist_group("slurm-outages")
def test_accounting_down_a_finished_job_still_gets_its_outcome(slurm_bridge: Harness, rodan: Rodan) -> None:
    """slurmdbd down: submission works (slurmctld queues the records), and a job that just ended is
    judged from the live queue (MinJobAge) with its real state; accounting catches up afterwards."""
    stop("slurmdbd")
    corrs = publish(rodan, 1)
    slurm_bridge.drive(corrs, timeout=180)
    restore("slurm")
    slurm_bridge.assert_one_reply_each(corrs, NO_MODELS)


def _forget_job(bridge: Harness, corr: str) -> str:
    """Point the request's record at a job id no scheduler component knows: a finished job that is
    neither in the queue any more nor (yet) in accounting."""
    path = bridge.spool / "ledger" / f"{corr}.json"
    record = json.loads(path.read_text())
    bridge.cluster.cancel(record["job_id"])
    ghost = str(int(record["job_id"]) + 5_000_000)
    record.update(job_id=ghost, job_ids=[ghost])
    path.write_text(json.dumps(record))
    return ghost


@pytest.mark.xdist_group("slurm-outages")
def test_a_job_missing_from_accounting_is_never_judged_before_the_timeout(
    slurm_bridge: Harness, rodan: Rodan, tmp_path: Path
) -> None:
    """A finished job that neither the queue nor accounting knows: nothing is judged while accounting
    is unreachable (regression: with another job still in the queue, a failed sacct was ignored and
    the forgotten job's missing clock started), it is waited for while accounting does not know it,
    and only HPC_MISSING_TIMEOUT later does it get its one error reply."""
    ghost_corr, live_corr = publish(rodan, 2)
    slurm_bridge.check(HPC_WORKER_PYTHON=slow_worker(tmp_path, 20))
    assert slurm_bridge.ledger(ghost_corr)["state"] == slurm_bridge.ledger(live_corr)["state"] == "submitted"
    ghost = _forget_job(slurm_bridge, ghost_corr)
    stop("slurmdbd")
    for _ in range(2):
        slurm_bridge.check(HPC_MISSING_TIMEOUT="1")
    record = slurm_bridge.ledger(ghost_corr)
    assert not slurm_bridge.replies.get(ghost_corr) and record["state"] == "submitted", record
    assert not record["missing_since"] and not record["job_ended"], record
    assert slurm_bridge.log_events("reconcile_scheduler_unavailable")
    restore("slurm")
    # Accounting answers and does not know it: missing, waited for (not read as done or failed).
    for _ in range(3):
        slurm_bridge.check(HPC_MISSING_TIMEOUT="3600")
    record = slurm_bridge.ledger(ghost_corr)
    assert not slurm_bridge.replies.get(ghost_corr)
    assert record["state"] == "submitted" and record["missing_since"] and not record["job_ended"], record
    assert len(slurm_bridge.log_events("job_missing")) == 1
    # Only after HPC_MISSING_TIMEOUT: one error reply that says what happened; the live job its own.
    slurm_bridge.drive([ghost_corr, live_corr], timeout=120, HPC_MISSING_TIMEOUT="1")
    slurm_bridge.check(HPC_MISSING_TIMEOUT="1")
    reply = slurm_bridge.reply(ghost_corr)
    assert f"Slurm job {ghost} vanished" in reply["error"] and "resubmit" in reply["error"]
    assert slurm_bridge.ledger(ghost_corr)["state"] == "replied"
    slurm_bridge.assert_one_reply_each([live_corr], NO_MODELS)
