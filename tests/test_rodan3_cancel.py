"""Rodan's Cancel and Retry reach the cluster, end to end: the real Rodan 3.1.0 with our job package
(tests/support/rodan_job.py, the broker accounts its guides document), the real bridge (cron passes of
``hpc-bridge check``, Slurm), the real worker.

One scenario for the module (``scenario``); five workflow runs, each driven through Rodan's REST API as
a user clicks Cancel and Retry in Rodan's web client:

- ``queued``: asks for every CPU of the node while a job of the test's own holds one, so its Slurm job
  waits in the queue; cancelled there;
- ``training``: a long training, cancelled once its job runs and has written a checkpoint;
- ``continuation``: a long training whose jobs stop after five batches and continue (the worker's
  test hook ``HPC_TEST_WARN_AFTER_POLLS``, set for this run's job name only); cancelled once it has
  continued;
- ``retry after cancel``: a tiny training cancelled as soon as its job is submitted, then retried;
- ``retry after failure``: a tiny training whose first job an operator cancels (``scancel``): the
  bridge's error reply fails the run; then retried.

The tests below each check one part of what the scenario left.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("keras")  # the worker extra

from bridge.testing.rodan_api import CANCELLED, FAILED, FINISHED, Api, Upload
from bridge.testing.samples import make_sample_page, make_sample_zip
from tests.support.broker import queue_exists
from tests.support.harness import Harness
from tests.support.rodan_job import GROUP, JOB_NAME, RodanWithJob

pytestmark = [
    pytest.mark.broker,
    pytest.mark.slurm,
    pytest.mark.rodan,
    pytest.mark.training,
    pytest.mark.slow,
    pytest.mark.heavy,
    pytest.mark.xdist_group(GROUP),
    pytest.mark.timeout(1800),  # the session's Rodan comes up in the first test's set-up
]

TINY: dict[str, Any] = {
    "Batch Size": 8,
    "Maximum number of training epochs": 1,
    "Maximum number of samples per label": 100,
    "Patience": 15,
    "Patch height": 32,
    "Patch width": 32,
    "Maximum time (D-HH:MM)": "0-00:30",
    "Maximum memory (MB)": 2000,
    "CPUs": 1,
    "Slurm Notification Email": "",
}
#: Hours of work at this size: the run is still training whenever it is cancelled.
LONG = {**TINY, "Maximum number of training epochs": 10000, "Patience": 1000}
#: Every CPU of the dev node (deploy/dev/slurm.sh: 8): it waits while any other job holds one.
QUEUED = {**TINY, "CPUs": 8}
SCENARIO_TIMEOUT_S = 15 * 60
#: After a Cancel, the job package removes the run's queue and state on the run's next poll.
CLEANUP_TIMEOUT_S = 180


@dataclass
class Run:
    name: str
    settings: dict[str, Any]
    url: str = ""
    runjob: dict[str, Any] = field(default_factory=dict)
    cancelled_at: float = 0.0
    retried_at: float = 0.0
    seen: dict[str, Any] = field(default_factory=dict)  # what the scenario saw when it acted
    ended: dict[str, Any] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict, repr=False)

    @property
    def corr(self) -> str:
        return str(self.runjob["uuid"])


@dataclass
class Scenario:
    rodan: RodanWithJob
    harness: Harness
    session: Api
    runs: dict[str, Run]
    blocker: str = ""


def start_run(session: Api, rodan: RodanWithJob, project: str, pages: Path, run: Run, seed: int) -> None:
    page = make_sample_page(pages, generation="new", n_layers=1, height=256, width=256, seed=seed)
    sample = make_sample_zip(pages / f"{run.name}.zip", pages, page).read_bytes()
    run.url, _ = session.start_workflow(
        JOB_NAME,
        {"Sample 1": Upload(f"{run.name}.zip", sample)},
        ["Log File", "Model 1"],
        run.settings,
        project=project,
    )
    for _ in range(120):
        found = session.json("/api/runjobs/", params={"workflow_run": run.url.rstrip("/").split("/")[-1]})["results"]
        if found:
            run.runjob = dict(found[0])
            return
        time.sleep(1)
    raise AssertionError(f"no RunJob for {run.name}")


def ledger(harness: Harness, corr: str) -> dict[str, Any]:
    path = harness.spool / "ledger" / f"{corr}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def run_dir(harness: Harness, corr: str) -> Path | None:
    found = sorted((harness.spool / "runs").glob(f"*-{corr}"))
    return found[-1] if found else None


def active_jobs(harness: Harness, corr: str) -> list[str]:
    """This request's jobs that Slurm still holds (squeue: pending, running, requeued)."""
    return [j for j in harness.cluster.jobs_named(f"rodan-{corr}") if harness.cluster.is_active(j)]


def wait_for(
    what: str,
    condition: Callable[[], bool],
    timeout_s: float,
    step: Callable[[], None],
    describe: Callable[[], str] = lambda: "",
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        step()
        time.sleep(2)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s\n{describe()}")


@pytest.fixture(scope="module")
def scenario(rodan_with_job: RodanWithJob, slurm: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    t0 = time.monotonic()
    rodan = rodan_with_job
    tmp = tmp_path_factory.mktemp("rodan3-cancel")
    harness = rodan.bridge(tmp, HPC_RODAN_CHECK_INTERVAL="1", HPC_MAX_CONTINUATIONS="3")
    session = rodan.session()
    names = ["queued", "training", "continuation", "retry after cancel", "retry after failure"]
    settings = {"queued": QUEUED, "training": LONG, "continuation": LONG}
    scenario = Scenario(rodan, harness, session, {n: Run(n, settings.get(n, TINY)) for n in names})
    runs = scenario.runs
    blocker_name = f"hpcb-test-blocker-{uuid.uuid4().hex[:8]}"
    try:
        # A job of the test's own holds one CPU, so the 8-CPU run waits in Slurm's queue.
        scenario.blocker = subprocess.run(
            ["sbatch", "--parsable", "-J", blocker_name, "-c", "1", "--mem=100", "-t", "30", "-o", "/dev/null",
             "--wrap", "sleep 1800"],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout.strip().split(";")[0]  # fmt: skip
        project = session.create_project()
        for seed, run in enumerate(runs.values()):
            start_run(session, rodan, project, tmp / "pages", run, 100 + seed)

        def prologue() -> str:
            name = f"rodan-{runs['continuation'].corr}"
            return f'case "$SLURM_JOB_NAME" in {name}) export HPC_TEST_WARN_AFTER_POLLS=5;; esac'

        def status(run: Run) -> int:
            return int(session.json(run.runjob["url"])["status"])

        def cancel(run: Run, **seen: Any) -> None:
            run.seen = {"record": ledger(harness, run.corr), "jobs": active_jobs(harness, run.corr), **seen}
            session.cancel_run(run.url)
            run.cancelled_at = time.monotonic()

        def act() -> None:
            q, t, c = runs["queued"], runs["training"], runs["continuation"]
            rc, rf = runs["retry after cancel"], runs["retry after failure"]
            if not q.cancelled_at and (job := ledger(harness, q.corr).get("job_id")):
                out = subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True)
                if out.stdout.strip() == "PENDING":
                    cancel(q, state="PENDING")
            if not t.cancelled_at and (folder := run_dir(harness, t.corr)) and (folder / "checkpoints").exists():
                if any((folder / "checkpoints").iterdir()):
                    cancel(t, run_dir=str(folder), state="RUNNING")
            if not c.cancelled_at and ledger(harness, c.corr).get("continuations", 0) >= 1:
                cancel(c, run_dir=str(run_dir(harness, c.corr) or ""))
            if not rc.cancelled_at and ledger(harness, rc.corr).get("job_id"):
                cancel(rc)
            if rc.cancelled_at and not rc.retried_at and status(rc) == CANCELLED:
                if ledger(harness, rc.corr).get("state") == "cancelled_by_rodan" and not active_jobs(harness, rc.corr):
                    session.retry_run(rc.url)
                    rc.retried_at = time.monotonic()
            if not rf.seen and (jobs := [j for j in active_jobs(harness, rf.corr) if harness.cluster.is_running(j)]):
                rf.seen = {"operator_cancelled": jobs}
                for job in jobs:
                    harness.cluster.cancel(job)  # an operator's scancel: the bridge answers with an error
            if rf.seen and not rf.retried_at and status(rf) == FAILED:
                rf.seen["failure"] = session.json(rf.runjob["url"])
                session.retry_run(rf.url)
                rf.retried_at = time.monotonic()

        def step() -> None:
            harness.check(HPC_JOB_PROLOGUE=prologue())
            act()

        def done() -> bool:
            # Cancelled, and settled: the pass after the jobs ended removed the run's transient files.
            cancelled = all(
                runs[n].cancelled_at
                and not active_jobs(harness, runs[n].corr)
                and ledger(harness, runs[n].corr).get("job_ended")
                for n in names[:3]
            )
            retried = all(
                runs[n].retried_at and session.json(runs[n].url)["status"] in (FINISHED, FAILED) for n in names[3:]
            )
            return bool(cancelled and retried)

        def describe() -> str:
            lines = []
            for run in runs.values():
                record = ledger(harness, run.corr) if run.runjob else {}
                lines.append(
                    f"{run.name}: cancelled={bool(run.cancelled_at)} retried={bool(run.retried_at)} "
                    f"rodan={session.json(run.url)['status']} ledger={record.get('state')} "
                    f"jobs={record.get('job_ids')} "
                    f"continuations={record.get('continuations')} reason={record.get('reason', '')[:120]!r}"
                )
            return "\n".join(lines) + "\n" + harness.log_tail()

        wait_for("every cancel and retry", done, SCENARIO_TIMEOUT_S, step, describe)
        for run in runs.values():
            run.ended = session.json(run.url)
            (run.runjob,) = session.run_jobs(run.ended)
            if run.ended["status"] == FINISHED:
                run.files = session.output_files(run.runjob)
        print(f"\nthe Rodan 3 cancel scenario took {time.monotonic() - t0:.0f} s", file=sys.stderr)
        yield scenario
    finally:
        rodan.forget_bridge(harness)
        subprocess.run(["scancel", "-n", blocker_name], capture_output=True, timeout=60)
        for run in scenario.runs.values():
            if run.runjob:
                for job in harness.cluster.jobs_named(f"rodan-{run.corr}"):
                    harness.cluster.cancel(job)


def cleaned_up(scenario: Scenario, run: Run) -> None:
    """After a Cancel: no job in squeue, no queue of the run in the broker, no Rodan-side state, no
    reply published, the ledger says cancelled_by_rodan."""
    harness, rodan = scenario.harness, scenario.rodan
    assert active_jobs(harness, run.corr) == [], run.name
    record = ledger(harness, run.corr)
    assert record["state"] == "cancelled_by_rodan" and record["reason"] == "the run was cancelled in Rodan", record
    events = harness.log_events("request_cancelled_by_rodan")
    assert [e["rodan_status"] for e in events if e.get("correlation_id") == run.corr] == ["cancelled"], events
    published = [e for e in harness.log_events("reply_published") if e.get("correlation_id") == run.corr]
    assert published == [], published
    state = rodan.state_dir / "media" / "hpc_paco_trainer" / run.corr
    queue = f"hpc-results.{run.corr}"
    wait_for(
        f"{run.name}: the run's queue and Rodan-side state removed",
        lambda: not queue_exists(rodan.admin_broker_url, queue) and not state.exists(),
        CLEANUP_TIMEOUT_S,
        lambda: None,
    )
    assert run.ended["status"] == CANCELLED and run.runjob["status"] == CANCELLED, (run.ended, run.runjob)
    for folder in (harness.spool / "runs").glob(f"*-{run.corr}"):  # none when the job never started
        assert not (folder / "inputs").exists() and not (folder / "checkpoints").exists(), folder
    assert not harness.spool.joinpath("params", f"{run.corr}.json").exists()


def test_a_cancel_while_the_job_waits_in_the_queue_removes_it(scenario: Scenario) -> None:
    """Mutation caught: a bridge that never asks Rodan (the pending job would wait in squeue until
    the blocker ends, then train for nothing)."""
    run = scenario.runs["queued"]
    assert run.seen["state"] == "PENDING" and run.seen["jobs"], run.seen
    assert scenario.harness.cluster.jobs_started(f"rodan-{run.corr}") == [], "the job never started"
    cleaned_up(scenario, run)


def test_a_cancel_during_training_stops_the_job_and_removes_its_inputs_and_checkpoints(scenario: Scenario) -> None:
    """Mutation caught: cancelling the record without scancel (the job would train on), or leaving the
    run directory's inputs/ and checkpoints/."""
    run = scenario.runs["training"]
    assert run.seen["jobs"] and run.seen["record"]["state"] == "submitted", run.seen
    folder = Path(run.seen["run_dir"])
    cleaned_up(scenario, run)
    assert not (folder / "inputs").exists() and not (folder / "checkpoints").exists()
    assert (folder / "logs").exists() or any(folder.iterdir()), "the operator's log stays"


def test_a_cancel_during_a_continuation_stops_every_job_of_the_run(scenario: Scenario) -> None:
    """The run had continued (requeued job) when it was cancelled: nothing of it is left in squeue.
    Mutation caught: cancelling only the first job id (a successor or requeued job would run on)."""
    run = scenario.runs["continuation"]
    assert run.seen["record"]["continuations"] >= 1, run.seen
    cleaned_up(scenario, run)


def test_a_retry_of_a_cancelled_run_trains_anew_and_finishes(scenario: Scenario) -> None:
    """Rodan's Retry reuses the RunJob: the job package publishes attempt 2 (``<uuid>.2``), which
    trains and finishes; the Log File is attempt 2's. Mutation caught: the 0.4.0 refusal "This run
    already ended", or attempt 2 reusing attempt 1's correlation id (the bridge drops it as a
    duplicate and the run waits until its silence bound)."""
    run = scenario.runs["retry after cancel"]
    assert run.ended["status"] == FINISHED, (run.runjob["error_summary"], run.runjob["error_details"])
    assert ledger(scenario.harness, run.corr)["state"] == "cancelled_by_rodan"
    second = ledger(scenario.harness, f"{run.corr}.2")
    assert second["state"] == "replied" and second["outcome"] == "ok", second
    assert run.files["Log File"].decode().splitlines()[0] == f"HPC training of request {run.corr}.2"
    assert run.files["Model 1"].startswith(b"\x89HDF\r\n\x1a\n")


def test_a_retry_of_a_failed_run_trains_anew_and_the_old_reply_never_lands(scenario: Scenario) -> None:
    """An operator's scancel failed attempt 1 (the bridge's error reply); Rodan's Retry trains attempt
    2 to the end; attempt 1's queue is gone, so a late reply to it cannot reach the run. Mutation
    caught: the job package keeping attempt 1's queue (its reply would be read by attempt 2)."""
    run = scenario.runs["retry after failure"]
    failure = run.seen["failure"]
    assert failure["status"] == FAILED and "cancelled" in failure["error_summary"], failure
    assert run.ended["status"] == FINISHED, (run.runjob["error_summary"], run.runjob["error_details"])
    assert ledger(scenario.harness, run.corr)["outcome"] == "error"
    assert ledger(scenario.harness, f"{run.corr}.2")["outcome"] == "ok"
    assert run.files["Log File"].decode().splitlines()[0] == f"HPC training of request {run.corr}.2"
    assert not queue_exists(scenario.rodan.admin_broker_url, f"hpc-results.{run.corr}")
