"""HPC_RUNS_SHARED: run directories the lab's group can read (``group``) or nobody else (``private``).

The lab's group here is the second dev user's own group (``hpcother``): the runs folder belongs
to it with the setgid bit, as the operator guide says to set one up, and ``runuser -u hpcother``
shows what a researcher of that group can open. Tests run as root, who may read anything, so the
modes themselves are checked too.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bridge.ops.doctor import check_spool
from bridge.ops.metrics import write_metrics
from bridge.spool import Spool, atomic_write_json
from tests.support.bridge import FAST_SETTINGS, NO_FRESH_STARTS, bridge_environ, run_bridge
from tests.support.broker import Queues, Rodan
from tests.support.cluster import cancel_spool_jobs, require_other_user
from tests.support.worker import run, write_params
from worker.trainer.rundir import PRIVATE_FOLDERS, RunDirectory

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)

GROUP = {"dir": 0o750, "file": 0o640}
PRIVATE = {"dir": 0o700, "file": 0o600}


@pytest.fixture
def other() -> str:
    return require_other_user("slurm.sh")


@pytest.fixture
def lab_runs(other: str) -> Iterator[Path]:
    """A runs folder as the operator guide sets one up: the lab's group, setgid, 2750; reachable."""
    base = Path(tempfile.mkdtemp(prefix="hpc-lab-"))
    base.chmod(0o711)
    runs = base / "runs"
    runs.mkdir()
    os.chown(runs, -1, pwd.getpwnam(other).pw_gid)
    runs.chmod(0o2750)
    yield runs
    shutil.rmtree(base, ignore_errors=True)


def as_user(user: str, *command: str) -> bool:
    """Whether ``command`` succeeds when ``user`` runs it."""
    return subprocess.run(["runuser", "-u", user, "--", *command], capture_output=True, timeout=30).returncode == 0


def modes(run: Path) -> dict[str, int]:
    """Path inside ``run`` -> permission bits (setgid aside) of everything in it, links excepted."""
    return {
        str(path.relative_to(run)): stat.S_IMODE(path.lstat().st_mode) & 0o777
        for path in run.rglob("*")
        if not path.is_symlink()
    }


def expected(run: Path, shared: bool) -> dict[str, int]:
    """What ``modes(run)`` must be: group modes with ``shared`` except in the private folders."""
    want = {}
    for name in modes(run):
        path = run / name
        private = not shared or Path(name).parts[0] in PRIVATE_FOLDERS
        want[name] = (PRIVATE if private else GROUP)["dir" if path.is_dir() else "file"]
    return want


def umask(mask: int) -> Callable[[], None]:
    """Set the process's umask; returns what puts the old one back."""
    old = os.umask(mask)

    def restore() -> None:
        os.umask(old)

    return restore


# --------------------------------------------------------------------------------------- no services


def test_share_opens_the_run_to_its_group_but_not_the_private_folders(tmp_path: Path) -> None:
    restore = umask(0o077)  # as in the batch job
    try:
        root = tmp_path / "runs"
        root.mkdir(mode=0o700)
        root.chmod(0o2700)  # setgid: the run directory inherits the folder's group
        run = RunDirectory.create(root, "key", shared=True)
        outside = tmp_path / "outside.txt"
        outside.write_text("not the run's")
        (run.path / "job.log").write_text("{}\n")
        (run.path / "tensorboard" / "Layer" / "train").mkdir(parents=True)
        (run.path / "tensorboard" / "Layer" / "train" / "events.out.tfevents.1").write_bytes(b"x")
        for folder in PRIVATE_FOLDERS:
            (run.path / folder / "sub").mkdir(parents=True)
            (run.path / folder / "sub" / "file").write_bytes(b"secret")
            (run.path / folder).chmod(0o755)  # even where something opened it
        (run.path / "link").symlink_to(outside)
        run.write_settings({"epochs": 1})
        run.share()
    finally:
        restore()
    assert stat.S_IMODE(root.stat().st_mode) == 0o2750  # the group may enter the runs folder
    assert stat.S_IMODE(run.path.stat().st_mode) == 0o2750  # setgid kept
    got = modes(run.path)
    assert got == expected(run.path, shared=True), got
    assert got["settings.json"] == 0o640 and got["inputs/sub/file"] == 0o600 and got["checkpoints"] == 0o700
    assert stat.S_IMODE(outside.stat().st_mode) == 0o600, "a symbolic link was followed"


def test_private_run_directories_stay_as_they_were(tmp_path: Path) -> None:
    restore = umask(0o077)
    try:
        run = RunDirectory.create(tmp_path / "runs", "key")
        (run.path / "job.log").write_text("{}\n")
        run.write_settings({"epochs": 1})
        run.tensorboard_dir("Layer")
        run.share()
    finally:
        restore()
    assert stat.S_IMODE(run.path.stat().st_mode) == 0o700
    assert modes(run.path) == expected(run.path, shared=False)


def test_the_spool_keeps_the_groups_way_through_and_nothing_else(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool").ensure()
    assert stat.S_IMODE(spool.root.stat().st_mode) == 0o700
    spool.root.chmod(0o710)  # what a worker in group mode sets when SPOOL/runs is the runs folder
    spool.ensure()
    assert stat.S_IMODE(spool.root.stat().st_mode) == 0o710
    assert check_spool(spool.root)[0].status == "ok"
    for sub in ("ledger", "params", "jobs", "outbox", "replies"):
        assert stat.S_IMODE((spool.root / sub).stat().st_mode) == 0o700
    spool.root.chmod(0o755)
    assert check_spool(spool.root)[0].status == "FAIL"  # readable: the doctor says so
    spool.ensure()
    assert stat.S_IMODE(spool.root.stat().st_mode) == 0o710  # tightened to the way through


def test_the_metrics_folder_the_bridge_makes_is_readable_by_node_exporter(tmp_path: Path) -> None:
    existing = tmp_path / "existing"
    existing.mkdir(mode=0o700)
    restore = umask(0o077)  # as under cron's run_check
    try:
        write_metrics(tmp_path / "made" / "textfile" / "hpc.prom", [], outbox=0, reconciliations=0, broker_reconnects=0)
        write_metrics(existing / "hpc.prom", [], outbox=0, reconciliations=0, broker_reconnects=0)
    finally:
        restore()
    for folder in (tmp_path / "made", tmp_path / "made" / "textfile"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755, folder
    assert stat.S_IMODE((tmp_path / "made" / "textfile" / "hpc.prom").stat().st_mode) == 0o644
    assert stat.S_IMODE(existing.stat().st_mode) == 0o700, "an existing folder is the operator's"
    assert stat.S_IMODE((existing / "hpc.prom").stat().st_mode) == 0o644


# --------------------------------------------------------------------- the worker's real writing


@pytest.mark.broker
@pytest.mark.training
@pytest.mark.parametrize("mode", ["group", "private"])
def test_the_mode_reaches_the_job_and_the_training_writes_with_it(
    tmp_path: Path,
    make_config: Callable[..., Any],
    queues: Queues,
    rodan: Rodan,
    sample_inputs: Callable[..., dict[str, str]],
    lab_runs: Path,
    other: str,
    mode: str,
) -> None:
    """Intake writes the mode into the parameter file (0600 in every mode); the worker's download,
    checkpoints, TensorBoard and history files (in this process, under the job's umask) get the
    mode's permissions, and the lab's group reads what it may and nothing else."""
    from bridge.handoff import JobParameters
    from bridge.intake import Intake, Message, Outcome
    from bridge.ledger import Ledger
    from bridge.replies import ReplyBox
    from bridge.rodan import RodanClient
    from bridge.schedulers import get_scheduler
    from worker.continuation import TimeLimitWarning
    from worker.job import train_or_stop

    corr = f"corr-shared-{mode}"
    config = make_config(HPC_RUNS_SHARED=mode, HPC_RUNS_DIR=str(lab_runs))
    spool = Spool(config.spool_dir).ensure()
    scheduler = get_scheduler("slurm", timeout_s=5, options=config.scheduler_options)
    submitted: list[tuple[dict[str, Any], int]] = []

    def submit(*_args: object) -> str:  # the parameter file as the job would find it
        path = spool.params_path(corr)
        submitted.append((json.loads(path.read_text()), stat.S_IMODE(path.stat().st_mode)))
        return "4242"

    scheduler.submit = submit  # type: ignore[method-assign]
    scheduler.find_by_name = lambda _name: []  # type: ignore[method-assign]
    client = RodanClient(config.rodan_base_url, email=config.rodan_email, password=config.rodan_password)
    intake = Intake(config, spool, Ledger(spool), scheduler, client, ReplyBox(spool))
    rodan.publish(b"{}")  # Rodan's queues exist
    rodan.drain(queues.request)
    body = json.dumps({"inputs": sample_inputs("new", n_layers=1), "settings": FAST_SETTINGS}).encode()
    message = Message(body=body, correlation_id=corr, reply_to=queues.reply, redelivered=False, delivery_tag=1)
    assert intake.process(message).outcome is Outcome.SUBMITTED
    ((raw, params_mode),) = submitted
    assert params_mode == 0o600 and raw["runs_shared"] is (mode == "group") and raw["runs_dir"] == str(lab_runs)
    assert stat.S_IMODE(spool.job_dir(corr).stat().st_mode) == 0o700

    raw["settings"].update(patch_height=16, patch_width=16, epochs=2)
    params = JobParameters.from_json(raw)
    assert params.runs_shared is (mode == "group")
    workdir = tmp_path / "work"
    workdir.mkdir()
    restore = umask(0o077)  # the batch script's
    try:
        run = RunDirectory.create(params.runs_dir, params.key, shared=params.runs_shared)
        outcome = train_or_stop(params, workdir, run, TimeLimitWarning(None))
    finally:
        restore()
    assert isinstance(outcome, dict) and sorted(outcome) == ["Background Model", "Model 0"], outcome
    got = modes(run.path)
    assert got == expected(run.path, shared=mode == "group"), got
    events = sorted(run.path.glob("tensorboard/*/train/events.out.tfevents.*"))
    inputs = sorted((run.path / "inputs").iterdir())
    checkpoints = sorted((run.path / "checkpoints").iterdir())
    assert events and inputs and checkpoints, got
    assert (run.path / "history.csv").exists() and (run.path / "training_curves.png").exists()
    shared = mode == "group"
    if shared:  # the lab's group, from the runs folder's setgid bit (a private run clears it)
        assert stat.S_ISGID & run.path.stat().st_mode
        assert {path.stat().st_gid for path in [run.path, *run.path.rglob("*")]} == {pwd.getpwnam(other).pw_gid}

    # What a researcher of the lab's group can open.
    readable = [run.path / "settings.json", run.path / "history.csv", run.path / "training_curves.png", events[0]]
    assert as_user(other, "ls", str(run.path / "tensorboard")) is shared
    for path in readable:
        assert as_user(other, "cat", str(path)) is shared, path
    for path in (inputs[0], checkpoints[0]):
        assert not as_user(other, "cat", str(path)), path
    for folder in PRIVATE_FOLDERS:
        assert not as_user(other, "ls", str(run.path / folder)), folder


@pytest.mark.broker
def test_runs_inside_the_spool_open_a_way_through_it_and_nothing_more(
    tmp_path: Path, broker_url: str, queues: Queues, standin: Any, sample_inputs: Callable[..., Any], rodan: Rodan
) -> None:
    """The default runs folder, SPOOL/runs, in group mode: the worker (here a job whose input is
    gone: it only starts, logs and replies) lets the group through the spool (0710), into runs/
    and its run; the bridge's next pass and ``doctor`` keep the spool so."""
    spool = Spool(tmp_path / "spool").ensure()
    rodan.publish(b"{}", declare=True)
    rodan.drain(queues.request)
    inputs = {**sample_inputs("new", n_layers=1), "Image": "/uploads/projects/missing/original_file"}
    path = write_params(spool, "corr-spool-runs", queues.reply, inputs, standin, broker_url)
    atomic_write_json(path, {**json.loads(path.read_text()), "runs_shared": True})  # HPC_RUNS_SHARED=group
    restore = umask(0o077)
    try:
        code, _logs = run(path)
    finally:
        restore()
    assert code == 1 and "while downloading 'Image'" in json.loads(rodan.drain()[0][1])["error"]
    (run_dir,) = (spool.root / "runs").iterdir()
    assert stat.S_IMODE(spool.root.stat().st_mode) == 0o710
    assert stat.S_IMODE((spool.root / "runs").stat().st_mode) == 0o750
    assert modes(run_dir) == expected(run_dir, shared=True) and modes(run_dir)["job.log"] == 0o640
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o750
    for sub in ("ledger", "params", "jobs", "outbox", "replies"):
        assert stat.S_IMODE((spool.root / sub).stat().st_mode) == 0o700, sub
    Spool(spool.root).ensure()  # the bridge's next pass
    assert stat.S_IMODE(spool.root.stat().st_mode) == 0o710
    assert check_spool(spool.root)[0].status == "ok"


# --------------------------------------------------------------- a real job through hpc-bridge check


@pytest.mark.broker
@pytest.mark.slurm
@pytest.mark.training
def test_a_slurm_job_in_group_mode_leaves_a_run_the_group_reads(
    tmp_path: Path,
    broker_url: str,
    standin: Any,
    queues: Queues,
    rodan: Rodan,
    sample_inputs: Callable[..., dict[str, str]],
    lab_runs: Path,
    other: str,
    slurm: None,
) -> None:
    """HPC_RUNS_SHARED=group through the real chain: the bridge's parameter file, a Slurm job
    under the template's umask 077, the worker's log and run files, the final reply.
    (Private mode on a real job: tests/test_e2e.py's runs; its modes: the test above.)"""
    spool = tmp_path / "spool"
    env = bridge_environ(
        broker_url,
        standin,
        queues,
        spool,
        HPC_LOG_FILE=str(tmp_path / "bridge.log"),
        HPC_SCHEDULER="slurm",
        HPC_RUNS_DIR=str(lab_runs),
        HPC_RUNS_SHARED="group",
        HPC_JOB_PROLOGUE=NO_FRESH_STARTS,
    )
    settings = {**FAST_SETTINGS, "Maximum number of training epochs": 1}
    corr = rodan.publish_request(sample_inputs("new", n_layers=1, height=256, width=320), settings)
    replies: list[bytes] = []
    deadline = time.monotonic() + 300
    try:
        while not replies and time.monotonic() < deadline:
            result = run_bridge(env, "check")
            assert result.returncode == 0, result.stderr[-2000:]
            replies += [body for c, body, _h in rodan.drain() if c == corr]
            time.sleep(2)
    finally:
        cancel_spool_jobs(spool)
    assert len(replies) == 1, "no reply within 300 s"
    reply = json.loads(replies[0])
    assert sorted(reply) == ["Background Model", "Model 0"], reply.get("error")

    (run,) = lab_runs.iterdir()
    got = modes(run)
    assert got == expected(run, shared=True), got
    assert stat.S_IMODE(run.stat().st_mode) == 0o2750
    assert not any(name in got for name in PRIVATE_FOLDERS), "the answered run keeps no inputs or checkpoints"
    assert {"job.log", "settings.json", "history.csv", "history.npz", "training_curves.png"} <= set(got), got
    assert {path.stat().st_gid for path in [run, *run.rglob("*")]} == {pwd.getpwnam(other).pw_gid}
    events = sorted(run.glob("tensorboard/*/*/events.out.tfevents.*"))
    assert events
    for path in (run / "job.log", run / "history.npz", events[-1]):
        assert as_user(other, "cat", str(path)), path
    assert '"event": "epoch"' in (run / "job.log").read_text()
    # The prologue's test hook reached the worker through the real job: no layer started again.
    assert json.loads((run / "settings.json").read_text())["max_fresh_starts"] == 0
    assert '"event": "layer_fresh_start"' not in (run / "job.log").read_text()
    assert not (spool / "params" / f"{corr}.json").exists()
