"""A Rodan 3.x user's path, end to end: the real Rodan 3.1.0 with our job package
(tests/support/rodan_job.py), the real broker, the real bridge (cron passes of ``hpc-bridge check``
with ``HPC_SCHEDULER=slurm``), Slurm, the real worker training in a Slurm job, and Rodan's own
classifier code (consumers/) on what comes back. As a site that followed the guides has it: the
HPC traffic on a vhost of its own, the job and the bridge (and the worker's replies) each under the
account with exactly the rights the guides give, and the default queue names (``hpc-jobs``,
``hpc-results.<RunJob uuid>``, ``hpc-bridge.dead-letter``, ``hpc-bridge.status``).

One scenario, run once for the module (``scenario``): through Rodan's REST API a user makes a project,
uploads Pixel.js sample zips (and a starting model) and runs workflows of the job. Six workflow runs
are in flight at once:

- ``two layers``: two pages (256x256), a starting ``Background Model``; outputs ``Log File``, the
  three models and ``Multi-Sample Zip`` (the user's path);
- ``one layer`` and ``three layers``: the same with samples of 1 and 3 layers besides the background
  and pages of other sizes, so that a reply that reached the wrong run shows in the outputs' count
  and in the Log File (request id, page sizes);
- ``no background``: sample zips that lack ``rgba PNG - Layer 0 (Background).png`` (the job counts
  two layers and sends it; the worker refuses it in its Slurm job);
- ``not a model``: a PNG uploaded as the starting ``Background Model`` (the bridge's intake refuses it
  before any job);
- ``bridge down``: published first with ``Maximum time`` 0-00:01 (silence bound 90 s with the
  worker's settings of tests/support/rodan_job.py) and taken off the request queue at once, so no
  bridge pass ever sees it.

While the trainings run in Slurm, Rodan's Celery worker is killed (SIGKILL, its whole session) and
started again. The tests below each check one part of what the scenario left.
"""

from __future__ import annotations

import io
import re
import signal
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("keras")  # the worker extra (the starting model is built with our trainer)

from bridge.testing.rodan_api import FAILED, FINISHED, PROCESSING, Api, Upload
from bridge.testing.samples import make_sample_page, make_sample_zip
from consumers import by_name, classify
from tests.support.harness import Harness
from tests.support.rodan_job import GROUP, JOB_NAME, WORKER_SETTINGS, RodanWithJob, take_request

pytestmark = [
    pytest.mark.broker,
    pytest.mark.slurm,
    pytest.mark.rodan,
    pytest.mark.training,
    pytest.mark.slow,
    pytest.mark.heavy,
    pytest.mark.xdist_group(GROUP),
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
]

#: The trainings: tiny (32x32 patches, 100 samples per label, 1-2 epochs), a long enough bound.
SETTINGS: dict[str, Any] = {
    "Batch Size": 8,
    "Maximum number of training epochs": 1,
    "Maximum number of samples per label": 100,
    "Patience": 15,
    "Patch height": 32,
    "Patch width": 32,
    "Maximum time (D-HH:MM)": "0-00:30",
    "Maximum memory (MB)": 4000,
    "CPUs": 1,
    "Slurm Notification Email": "",
}
#: The run no bridge answers: one minute per job, so its silence bound is 60 s x (1 + 0) + 20 + 10.
SILENT_SETTINGS = {**SETTINGS, "Maximum time (D-HH:MM)": "0-00:01"}
#: The runs that fail: a smaller job (Slurm's node has 16000 MB for every job at once).
REFUSED_SETTINGS = {**SETTINGS, "Maximum memory (MB)": 2000}
#: Each run's settings: the user's run trains two epochs.
SETTINGS_OF = {
    "bridge down": SILENT_SETTINGS,
    "two layers": {**SETTINGS, "Maximum number of training epochs": 2},
    "no background": REFUSED_SETTINGS,
    "not a model": REFUSED_SETTINGS,
}
SILENCE_BOUND_S = 60 * (1 + int(WORKER_SETTINGS["HPC_BRIDGE_MAX_CONTINUATIONS"])) + sum(
    int(WORKER_SETTINGS[k]) for k in ("HPC_BRIDGE_MAX_PENDING", "HPC_SILENCE_SLACK")
)
#: How long the whole scenario may take on 2 busy cores before it fails.
SCENARIO_TIMEOUT_S = 20 * 60
BACKGROUND_FILE = "rgba PNG - Layer 0 (Background).png"
PNG_START = bytes.fromhex("89504e470d0a1a0a")


@dataclass
class Run:
    """One workflow run of the scenario and what became of it."""

    name: str
    layers: int  # besides the background
    sizes: list[tuple[int, int]]  # (height, width) of each page
    outputs: list[str]
    url: str = ""
    paths: dict[str, str] = field(default_factory=dict)
    runjob: dict[str, Any] = field(default_factory=dict)
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
    pages: Path
    page_files: dict[str, Path]  # run name -> its first page's image
    silent_request: dict[str, Any] = field(default_factory=dict)
    killed: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0


def starting_model(path: Path, patch: int) -> bytes:
    """A model file as our trainer writes it: the SAE's fresh weights (a real Keras HDF5 model)."""
    from worker.trainer.model import build_sae
    from worker.trainer.saving import LabelResult, save_model
    from worker.trainer.settings import TrainSettings

    result = LabelResult("Background", build_sae(None, None).get_weights(), None, 1, 0.5, 1, 8, 2)
    settings = TrainSettings(
        epochs=1, max_samples_per_label=100, patch_height=patch, patch_width=patch, batch_size=8, patience=3
    )
    save_model(result, path, settings)
    return path.read_bytes()


def sample_zips(pages: Path, run: Run, seed: int) -> tuple[list[bytes], Path]:
    """Pixel.js sample zips of the run's pages (``bridge.testing.samples``); the first page's image."""
    out, first = [], None
    for n, (height, width) in enumerate(run.sizes, 1):
        page = make_sample_page(
            pages, generation="new", n_layers=max(run.layers, 1), height=height, width=width, seed=seed + n
        )
        first = first or pages / page["Image"].removeprefix("/uploads/")
        out.append(make_sample_zip(pages / f"{run.name}-{n}.zip", pages, page).read_bytes())
    assert first is not None
    return out, first


def without_background(data: bytes) -> bytes:
    """The same sample zip without its background layer file."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            if info.filename != BACKGROUND_FILE:
                target.writestr(info, source.read(info))
    return out.getvalue()


def runjob_of(scenario: Scenario, run: Run) -> dict[str, Any]:
    for _ in range(120):
        runjobs = scenario.session.get(
            f"{scenario.rodan.url}/api/runjobs/", params={"workflow_run": run.url.rstrip("/").split("/")[-1]}
        ).json()["results"]
        if runjobs:
            return dict(runjobs[0])
        time.sleep(1)
    raise AssertionError(f"no RunJob for the workflow run {run.name}")


def training_jobs_running(harness: Harness, corrs: list[str]) -> list[str]:
    """The Slurm jobs of these requests that run now."""
    running = []
    for corr in corrs:
        path = harness.spool / "ledger" / f"{corr}.json"
        if path.exists():
            running += [j for j in harness.ledger(corr)["job_ids"] if harness.cluster.is_running(str(j))]
    return running


def kill_now(scenario: Scenario, corrs: list[str]) -> bool:
    """Whether the worker may be killed now: every run has published (the bridge has a record of
    each request) and no Rodan ``master_task`` is running (killing one loses its workflow run in
    Rodan 3.1.0 itself: it is acknowledged when it starts)."""
    ledger = scenario.harness.spool / "ledger"
    return all((ledger / f"{corr}.json").exists() for corr in corrs) and not scenario.rodan.tasks_in_flight()


@pytest.fixture(scope="module")
def scenario(rodan_with_job: RodanWithJob, slurm: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    t0 = time.monotonic()
    rodan = rodan_with_job
    tmp = tmp_path_factory.mktemp("rodan3-e2e")
    # A site's names (the guides' and the bridge's defaults), on the session's HPC vhost; the bridge
    # runs as the guides' bridge account, the test looks with the admin's.
    harness = rodan.bridge(tmp)
    session = rodan.session()
    pages = tmp / "pages"
    scenario = Scenario(rodan, harness, session, {}, pages, {})
    all_models = ["Background Model", "Model 1", "Model 2", "Model 3"]
    runs = [
        Run("bridge down", 1, [(96, 96)], ["Log File", "Model 1"]),
        Run("two layers", 2, [(256, 256), (256, 256)], ["Log File", *all_models[:3], "Multi-Sample Zip"]),
        Run("one layer", 1, [(224, 256), (224, 256)], ["Log File", *all_models[:2]]),
        Run("three layers", 3, [(256, 224), (256, 224)], ["Log File", *all_models]),
        Run("no background", 2, [(96, 96), (96, 96)], ["Log File", "Model 1"]),
        Run("not a model", 1, [(96, 96)], ["Log File", "Model 1"]),
    ]
    scenario.runs = {run.name: run for run in runs}
    try:
        project = session.create_project()
        model = starting_model(tmp / "start.hdf5", 32)
        for seed, run in enumerate(runs):
            zips, first = sample_zips(pages, run, 10 * seed)
            scenario.page_files[run.name] = first
            if run.name == "no background":
                zips = [without_background(z) for z in zips]
            inputs = {f"Sample {n}": Upload(f"{run.name} {n}.zip", z) for n, z in enumerate(zips, 1)}
            if run.name == "two layers":
                inputs["Background Model"] = Upload("start.hdf5", model, "keras/model+hdf5")
            if run.name == "not a model":
                inputs["Background Model"] = Upload("start.hdf5", first.read_bytes(), "keras/model+hdf5")
            settings = SETTINGS_OF.get(run.name, SETTINGS)
            run.url, run.paths = session.start_workflow(JOB_NAME, inputs, run.outputs, settings, project=project)
            run.runjob = runjob_of(scenario, run)
            rodan.reply_queues.append(f"hpc-results.{run.corr}")
            if run.name == "bridge down":
                # No bridge pass runs while its request is in the queue; it leaves the queue now.
                properties, request = take_request(rodan.admin_broker_url, rodan.request_queue, 180)
                assert properties.correlation_id == run.corr, "the first request is the bridge-down run's"
                scenario.silent_request = {"properties": properties, "body": request}

        training = [scenario.runs[n].corr for n in ("two layers", "one layer", "three layers")]
        answered = [r.corr for r in runs if r.name != "bridge down"]
        deadline = time.monotonic() + SCENARIO_TIMEOUT_S
        pending = dict(scenario.runs)
        while pending and time.monotonic() < deadline:
            harness.check()
            if (
                not scenario.killed
                and kill_now(scenario, answered)
                and (jobs := training_jobs_running(harness, training))
            ):
                states = {name: session.get(r.runjob["url"]).json()["status"] for name, r in scenario.runs.items()}
                pid = rodan.worker_pid()
                new_pid = rodan.kill_and_restart_worker(signal.SIGKILL)
                scenario.killed = {"jobs": jobs, "states": states, "pid": pid, "new_pid": new_pid}
            for name, run in list(pending.items()):
                status = session.get(run.url).json()
                if status["status"] in (FINISHED, FAILED):
                    run.ended = dict(status)
                    (run.runjob,) = session.run_jobs(status)  # the job alone: one RunJob
                    run.files = session.output_files(run.runjob) if status["status"] == FINISHED else {}
                    del pending[name]
            time.sleep(3)
        assert not pending, f"runs still going after {SCENARIO_TIMEOUT_S} s: {sorted(pending)}\n{harness.log_tail()}"
        harness.settle(answered)
        scenario.wall_s = time.monotonic() - t0
        print(f"\nthe Rodan 3 scenario took {scenario.wall_s:.0f} s", file=sys.stderr)
        yield scenario
    finally:
        rodan.forget_bridge(harness)


def model_ports(layers: int) -> list[str]:
    return ["Background Model", *(f"Model {n}" for n in range(1, layers + 1))]


def check_log_file(run: Run, *, starting: bool) -> list[str]:
    """The run's Log File tells its own training: its request, its pages, each layer's best epoch."""
    story = run.files["Log File"].decode("utf-8")
    lines = story.splitlines()
    assert lines[0] == f"HPC training of request {run.corr}"
    pages = "; ".join(f"Sample {n} ({w}x{h} pixels)" for n, (h, w) in enumerate(run.sizes, 1))
    assert f"pages ({len(run.sizes)}): {pages}" in story, story
    assert ("training starts from: Background Model" in story) is starting, story
    labels = ["Background", *(f"Layer {n}" for n in range(1, run.layers + 1))]
    for label in labels:
        assert any(line.startswith(f"  layer {label}: best val_accuracy ") and " at epoch " in line for line in lines)
    assert f"layer Layer {run.layers + 1}" not in story
    ports = model_ports(run.layers)
    finished = lines[-1]
    # These trainings are tiny (one or two epochs of ten steps): a model that marks (almost) one class
    # on every validation pixel is said so, a WARNING per model, counted in the last line.
    nothing = re.fullmatch(r"  (\d+) of the (\d+) models learned nothing \((.*)\): see the WARNING above", lines[-1])
    if nothing is not None:
        names = nothing.group(3).split(", ")
        assert int(nothing.group(1)) == len(names) and int(nothing.group(2)) == len(ports), lines[-1]
        for name in names:
            assert name in ports and any(line.startswith(f"  WARNING: {name} (layer ") for line in lines), story
        finished = lines[-2]
    assert f"finished: {len(ports)} models ({', '.join(ports)})" in finished, finished
    assert finished.endswith("over 1 job"), finished
    return lines


def test_a_users_run_gives_models_that_rodans_classifier_uses(scenario: Scenario, tmp_path: Path) -> None:
    """Project, two sample zips and a starting model, a workflow of our job: the run finishes with
    the models, the Log File and the Multi-Sample Zip; each model opens in Rodan's TensorFlow 2.5.1
    and 2.15.1 and classifies a page through Paco_classifier's own ``process_image_msae``
    (consumers/paco.py runs Paco's source unchanged), to the same labels in both."""
    run = scenario.runs["two layers"]
    assert run.ended["status"] == FINISHED, (run.runjob["error_summary"], run.runjob["error_details"])
    assert run.runjob["status"] == FINISHED
    assert sorted(run.files) == sorted(run.outputs)
    check_log_file(run, starting=True)
    with zipfile.ZipFile(io.BytesIO(run.files["Multi-Sample Zip"])) as archive:
        names = archive.namelist()
    members = {"Image.png", "rgba PNG - Selected regions.png", BACKGROUND_FILE, "rgba PNG - Layer 1.png"}
    members |= {"rgba PNG - Layer 2.png"}
    assert sorted(names) == sorted(f"Sample {n}/{m}" for n in (1, 2) for m in members)

    models = []
    for port in model_ports(2):
        assert run.files[port].startswith(b"\x89HDF\r\n\x1a\n"), port
        models.append(tmp_path / f"{port}.hdf5")
        models[-1].write_bytes(run.files[port])
    pages = {}
    for consumer, version in (("tf2.5.1-py3.7", "2.5.1"), ("tf2.15.1-py3.11", "2.15.1")):
        labels_file = tmp_path / f"labels-{version}.npy"
        # The classifier job's window, not the training patch: Paco's padding of 25 needs more than
        # 51 pixels, and Paco calls predict once per window and model (a larger window: fewer calls).
        info = classify(by_name(consumer), scenario.page_files[run.name], models, (128, 128), labels_file)
        pages[version] = np.load(labels_file)
        assert info["tensorflow"] == version
        assert pages[version].shape == (256, 256) and pages[version].dtype == np.uint8
        assert set(np.unique(pages[version]).tolist()) <= {0, 1, 2}
    # The same weights give the same page in both of Rodan's TensorFlow versions.
    assert float(np.mean(pages["2.5.1"] == pages["2.15.1"])) >= 0.99


def test_concurrent_runs_each_get_their_own_models(scenario: Scenario) -> None:
    """Three runs in flight at once (1, 2 and 3 layers, pages of their own sizes): each finishes
    with one model per layer of its own samples and a Log File of its own request and pages."""
    corrs = set()
    for name in ("one layer", "two layers", "three layers"):
        run = scenario.runs[name]
        assert run.ended["status"] == FINISHED, (name, run.runjob["error_summary"], run.runjob["error_details"])
        assert sorted(run.files) == sorted(run.outputs), name
        check_log_file(run, starting=name == "two layers")
        corrs.add(run.corr)
        record = scenario.harness.ledger(run.corr)
        assert record["state"] == "replied" and len(record["job_ids"]) == 1, record
    assert len(corrs) == 3
    models = [scenario.runs[n].files[p] for n in ("one layer", "two layers", "three layers") for p in ("Model 1",)]
    assert len(set(models)) == 3, "every run has its own Model 1"


def test_the_runs_survive_a_killed_and_restarted_celery_worker(scenario: Scenario) -> None:
    """Rodan's Celery worker was killed (SIGKILL) while a training ran in Slurm and started again:
    every run that was waiting then finished (the trainings) or failed with its own reason."""
    killed = scenario.killed
    assert killed, "the worker was never killed: no training job was seen running"
    assert killed["jobs"] and killed["new_pid"] != killed["pid"]
    waiting = [name for name, status in killed["states"].items() if status == PROCESSING]
    trainings = {"one layer", "two layers", "three layers"}
    assert trainings & set(waiting), killed
    for name in waiting:
        run = scenario.runs[name]
        if name in trainings:
            assert run.ended["status"] == FINISHED and sorted(run.files) == sorted(run.outputs), name
    # One request per run whatever the restart did: the bridge saw each once, one Slurm job each.
    for name in trainings:
        record = scenario.harness.ledger(scenario.runs[name].corr)
        assert scenario.harness.cluster.jobs_named(record["job_name"]) == [str(record["job_id"])]
    assert scenario.harness.rodan.depth(scenario.rodan.request_queue) == 0


def test_error_replies_leave_the_runjob_failed_with_the_reason(scenario: Scenario) -> None:
    """The worker's refusal (a sample zip without its background layer) and the intake's (a PNG as
    the starting model) come back as FAILED RunJobs whose summary and details carry the reason."""
    for name, fragments in (
        ("no background", (BACKGROUND_FILE, "Sample 1")),
        ("not a model", ("'Background Model'", f"it starts with {PNG_START.hex()}")),
    ):
        run = scenario.runs[name]
        runjob = scenario.session.get(run.runjob["url"]).json()
        assert run.ended["status"] == FAILED and runjob["status"] == FAILED, (name, runjob)
        summary, details = runjob["error_summary"] or "", runjob["error_details"] or ""
        assert summary.startswith("The HPC training failed: "), (name, summary)
        assert all(f in summary and f in details for f in fragments), (name, summary, details)
        assert scenario.harness.ledger(run.corr)["state"] in ("replied", "rejected")
        assert "guest:guest" not in summary + details


def test_a_bridge_down_past_the_bound_fails_the_run_clearly(scenario: Scenario) -> None:
    """No bridge pass ever saw the request (it left the queue at once): the run fails once the
    silence bound (Maximum time 0-00:01, no continuation, 20 s pending, 10 s slack) has passed,
    and says so."""
    run = scenario.runs["bridge down"]
    assert scenario.silent_request["body"]["settings"] == SILENT_SETTINGS
    assert not (scenario.harness.spool / "ledger" / f"{run.corr}.json").exists()
    runjob = scenario.session.get(run.runjob["url"]).json()
    assert run.ended["status"] == FAILED and runjob["status"] == FAILED, runjob
    # In minutes, not "after 0 hours" (the job said that before), and never before the bound.
    found = re.fullmatch(r"No reply from the HPC cluster after (\d+) minutes?", runjob["error_summary"])
    assert found and int(found.group(1)) >= round(SILENCE_BOUND_S / 60), runjob["error_summary"]
    details = runjob["error_details"]
    assert f"the bound is {SILENCE_BOUND_S} s" in details and "No part of the reply arrived." in details, details
    assert run.corr in details
