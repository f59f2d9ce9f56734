"""``hpc-bridge doctor --job``: a probe job on the real Slurm and Grid Engine, checking from the node.

One probe job per case: a healthy deployment on each scheduler (through the command line, as an
operator runs it), then deployments broken on purpose, several faults per job, each check naming
its own: Rodan and the broker on closed ports, a run directory that cannot be written, a GPU asked
for that TensorFlow cannot see (the dev Slurm's GPUs are fake devices), too little scratch, a job
that may not requeue itself (``--no-requeue``), a worker environment without TensorFlow, a job that
never leaves the queue, and one whose interpreter does not run the probe at all.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bridge.config import BridgeConfig, load_config
from bridge.handoff import PROBE_CHECKS, PROBE_FILE, ProbeContinueState, ProbeFinding, ProbeParameters, ProbeResult
from bridge.ops.probe import Outcome, ProbeOptions, broker_address, judge, run_probe
from bridge.schedulers import JobInfo, JobState
from bridge.testing.rodan import RodanStandin
from tests.support.bridge import RODAN_PASSWORD, bridge_environ, run_bridge
from tests.support.broker import Queues
from tests.support.cluster import Cluster
from tests.support.tls_proxy import tls_proxy
from tests.support.wait import wait_until
from worker import onednn
from worker.probe import judge_gpus, scratch_candidates

pytestmark = [pytest.mark.broker]

PROBE_LINES = ["probe-job", *(f"node-{name}" for name in PROBE_CHECKS)]


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def job_id_of(found: str) -> str:
    """The job id in a probe-job line: '... job 123 ...'."""
    words = found.split()
    return words[words.index("job") + 1]


@pytest.fixture
def probe_config(broker_url: str, standin: RodanStandin, queues: Queues, tmp_path: Path) -> Callable[..., BridgeConfig]:
    def build(scheduler: str, **extra: str) -> BridgeConfig:
        env = bridge_environ(broker_url, standin, queues, tmp_path / "spool", HPC_SCHEDULER=scheduler)
        env["HPC_GPU_RULES"] = "none"  # this machine has no GPU: a job asking for one fails node-worker
        env.update(extra)
        return load_config(environ=env)

    return build


def by_name(checks: list[Any]) -> dict[str, Any]:
    return {c.name: c for c in checks}


@pytest.fixture
def rodan_https(standin: RodanStandin, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The stand-in behind a TLS-terminating proxy with a self-signed certificate: (host:port, cert)."""
    with tls_proxy(tmp_path, "127.0.0.1", standin.port, name="rodan") as (port, cert):
        yield f"127.0.0.1:{port}", cert


# --- without a scheduler -----------------------------------------------------------------------


def test_gpus_asked_and_seen() -> None:
    assert judge_gpus(0, 0).status == "ok"
    assert judge_gpus(2, 2, gres="gpu:2").status == "ok"
    short = judge_gpus(2, 1, gres="gpu:v100:2", visible="0,1", cuda=True)
    assert short.status == "FAIL"
    assert "asked for 2 GPU(s) (gpu:v100:2)" in short.found and "TensorFlow sees 1" in short.found
    assert "CUDA_VISIBLE_DEVICES=0,1" in short.found and "HPC_JOB_PROLOGUE" in short.fix
    assert "built without CUDA" in judge_gpus(1, 0, cuda=False).found
    extra = judge_gpus(1, 4)
    assert extra.status == "warn" and "ConstrainDevices" in extra.fix


def test_scratch_follows_the_worker_order() -> None:
    env = {"SLURM_TMPDIR": "/scratch/job", "TMPDIR": "/tmp"}
    assert scratch_candidates("/local", env) == [
        ("HPC_NODE_LOCAL_DIR", "/local"),
        ("SLURM_TMPDIR", "/scratch/job"),
        ("TMPDIR", "/tmp"),
    ]
    assert scratch_candidates(None, {"TMPDIR": "/tmp"}) == [("TMPDIR", "/tmp")]


def test_broker_address_carries_no_credentials() -> None:
    assert broker_address("amqp://u:secret-pw@mq.example.org/%2F") == ("mq.example.org", 5672)
    assert broker_address("amqps://u:secret-pw@mq.example.org:5999/v") == ("mq.example.org", 5999)
    assert broker_address("amqps://mq.example.org") == ("mq.example.org", 5671)


def test_a_requeue_that_ended_the_node_process_still_counts() -> None:
    """Slurm may kill the node's process before it writes that the requeue was accepted."""
    result = ProbeResult(
        host="n1", job_id="7", restart="0", python="python3", started_at=0.0, token="t",
        checks={n: ProbeFinding(status="ok", found=n) for n in PROBE_CHECKS if n != "continue"},
        continuation=ProbeContinueState(mode="requeue", state="asking", job_id="7"),
    )  # fmt: skip
    assert ProbeResult.from_json(json.loads(json.dumps(result.to_json()))) == result  # as the file carries it
    info = JobInfo("7", JobState.PENDING, "PENDING", reason="BeginTime")
    requeued = by_name(judge(Outcome("7", result, info, requeued=True), "t", "Slurm", None))
    assert requeued["node-continue"].status == "ok" and "back in the queue" in requeued["node-continue"].found
    lost = by_name(judge(Outcome("7", result, JobInfo("7", JobState.COMPLETED, "COMPLETED")), "t", "Slurm", None))
    assert lost["node-continue"].status == "FAIL"
    # A node that saw another directory at the spool's path read another token.
    other = by_name(judge(Outcome("7", result, info, requeued=True), "not-t", "Slurm", None))
    assert other["node-spool"].status == "FAIL" and "another token" in other["node-spool"].found


# --- a healthy deployment, on both schedulers, as the operator runs it ---------------------------


def test_doctor_job_passes(
    cluster: Cluster,
    broker_url: str,
    standin: RodanStandin,
    rodan_https: tuple[str, Path],
    queues: Queues,
    tmp_path: Path,
) -> None:
    """Rodan over HTTPS with the site's own CA, which the jobs learn from the prologue (as a site would).

    The node-worker check makes the oneDNN record the jobs read (in the prologue's HPC_TUNING_DIR): on
    Slurm, where none exists, it measures; on Grid Engine it finds the one given and does not measure
    again (catches a probe that never tunes, or one that measures what was measured)."""
    host, cert = rodan_https
    env = bridge_environ(broker_url, standin, queues, tmp_path / "spool", HPC_SCHEDULER=cluster.name)
    env.update(RODAN_SCHEME="https", RODAN_HOST=host, HPC_GPU_RULES="none", REQUESTS_CA_BUNDLE=str(cert))
    tuning = tmp_path / "tuning"
    env["HPC_JOB_PROLOGUE"] = f"export REQUESTS_CA_BUNDLE={cert} HPC_TUNING_DIR={tuning}"
    record = tuning / f"onednn-{onednn.cpu_key()}.json"  # this interpreter is HPC_WORKER_PYTHON
    if cluster.name == "gridengine":
        tuning.mkdir()
        versions = {"tensorflow": onednn.tensorflow_version(), "python": onednn.python_version()}
        record.write_text(json.dumps({"setting": "0", "step_s": {"0": 1.0, "1": 2.0}, "measured": 1.0, **versions}))
    result = run_bridge(
        env, "doctor", "--job", "--json", "--skip-worker", "--job-timeout", "240", "--job-memory", "2048", timeout=300
    )
    data = json.loads(result.stdout)
    assert data["ok"] is (result.returncode == 0)
    checks = {c["name"]: c for c in data["checks"]}
    for name in PROBE_LINES:
        assert checks[name]["status"] == "ok", (name, checks[name], result.stderr[-2000:])
    assert "with the bridge's batch template" in checks["probe-job"]["found"]
    assert "0 of the 0 GPU(s) asked visible to TensorFlow" in checks["node-worker"]["found"]
    tuned = json.loads(record.read_text())
    if cluster.name == "gridengine":
        assert (
            f"oneDNN off for this kind of node (a step: 1.000 s off, 2.000 s on), measured before, in {record}"
            in (checks["node-worker"]["found"])
        )
        assert tuned["step_s"] == {"0": 1.0, "1": 2.0}  # not measured again
    else:
        assert f"measured now, in {record}" in checks["node-worker"]["found"], checks["node-worker"]
        assert tuned["setting"] in ("0", "1") and tuned["step_s"]["0"] > 0 and tuned["step_s"]["1"] > 0
    assert f"GET https://{host}/api/auth/me/ answered 401 from the node" in checks["node-rodan"]["found"]
    assert "lock the login node holds is seen from the node" in checks["node-lock"]["found"]
    continued = checks["node-continue"]["found"]
    if cluster.name == "slurm":
        assert "accepted the requeue" in continued or "back in the queue" in continued, continued
    else:
        assert "submitted from the node, held on job" in continued, continued
    assert RODAN_PASSWORD not in result.stdout + result.stderr
    # Nothing left behind: the probe folder is gone, and neither the probe job nor a successor waits.
    assert list((tmp_path / "spool" / "jobs").iterdir()) == []
    # (A running job that doctor cancelled may take a moment to leave: Grid Engine shows it "dr" meanwhile.)
    job_id = job_id_of(checks["probe-job"]["found"])
    wait_until(lambda: not cluster.is_active(job_id), 60, what=f"probe job {job_id} gone")
    if cluster.name == "gridengine":
        successor = job_id_of(continued)
        assert successor != job_id
        wait_until(lambda: not cluster.is_active(successor), 60, what=f"successor {successor} gone")


# --- broken on purpose -------------------------------------------------------------------------


@pytest.mark.slurm
def test_probe_failures_on_slurm(slurm: None, probe_config: Callable[..., BridgeConfig], tmp_path: Path) -> None:
    not_a_dir = tmp_path / "runs-is-a-file"
    not_a_dir.write_text("")
    config = probe_config(
        "slurm",
        RODAN_HOST=f"127.0.0.1:{closed_port()}",
        RABBITMQ_URL=f"amqp://guest:guest@127.0.0.1:{closed_port()}/%2F",
        HPC_RUNS_DIR=str(not_a_dir),
        HPC_GPU_RULES="gpu:1",  # the dev cluster's GPUs are fake devices: TensorFlow sees none
    )
    # sbatch's option overrides the script's --requeue, as a site's policy that strips it would. The
    # configuration refuses it in HPC_SCHEDULER_ARGS (the bridge sets --requeue itself): given here.
    config = dataclasses.replace(config, scheduler_args=("--no-requeue",))
    checks = by_name(run_probe(config, ProbeOptions(timeout_s=240, min_scratch_bytes=1 << 60), say=lambda _: None))
    assert checks["probe-job"].status == "ok", checks["probe-job"]
    assert "is kept: " in checks["probe-job"].found

    spool = checks["node-spool"]
    assert spool.status == "FAIL" and f"runs ({not_a_dir})" in spool.found and "HPC_RUNS_DIR" in spool.fix
    rodan = checks["node-rodan"]
    assert rodan.status == "FAIL" and "/api/auth/me/ from the node failed" in rodan.found
    assert "HTTPS_PROXY" in rodan.fix
    broker = checks["node-broker"]
    assert broker.status == "warn" and "replies will be carried by the outbox" in broker.found
    worker = checks["node-worker"]
    assert worker.status == "FAIL" and "asked for 1 GPU(s) (gpu:1)" in worker.found, worker
    assert "TensorFlow sees 0" in worker.found
    scratch = checks["node-scratch"]
    assert scratch.status == "warn" and "under the" in scratch.found and "HPC_NODE_LOCAL_DIR" in scratch.fix
    cont = checks["node-continue"]
    assert cont.status == "FAIL" and "refused to requeue" in cont.found, cont
    assert "presently disabled" in cont.found and "HPC_SLURM_CONTINUE=successor" in cont.fix
    assert checks["node-lock"].status == "ok"


def python_without_tensorflow(tmp_path: Path) -> Path:
    """A worker interpreter whose TensorFlow is missing: this one, with TensorFlow hidden."""
    hide = tmp_path / "no-tensorflow"
    (hide / "tensorflow").mkdir(parents=True)
    (hide / "tensorflow" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'tensorflow'\", name='tensorflow')\n"
    )
    wrapper = tmp_path / "python-without-tf"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={hide} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


@pytest.mark.slurm
def test_slurm_successor_mode_submits_from_the_node(
    slurm: None, probe_config: Callable[..., BridgeConfig], tmp_path: Path
) -> None:
    """HPC_SLURM_CONTINUE=successor: the probe continues as such a job does (no TensorFlow: a quick job)."""
    config = probe_config(
        "slurm", HPC_SLURM_CONTINUE="successor", HPC_WORKER_PYTHON=str(python_without_tensorflow(tmp_path))
    )
    checks = by_name(run_probe(config, ProbeOptions(timeout_s=240, keep=True), say=lambda _: None))
    assert checks["probe-job"].status == "ok", checks["probe-job"]
    cont = checks["node-continue"]
    assert cont.status == "ok" and "submitted from the node, held on job" in cont.found, cont
    probe_job, successor = job_id_of(checks["probe-job"].found), job_id_of(cont.found)
    assert successor != probe_job and not Cluster("slurm").is_active(successor)
    (folder,) = (tmp_path / "spool" / "jobs").iterdir()
    assert "#SBATCH --requeue" not in (folder / "job.sh").read_text()
    assert f"--dependency=afterany:{probe_job}" in (folder / f"job-after-{probe_job}.sh").read_text()


@pytest.mark.gridengine
def test_probe_failures_on_gridengine(
    gridengine: None, probe_config: Callable[..., BridgeConfig], rodan_https: tuple[str, Path], tmp_path: Path
) -> None:
    config = probe_config(
        "gridengine",
        HPC_WORKER_PYTHON=str(python_without_tensorflow(tmp_path)),
        HPC_NODE_LOCAL_DIR=str(tmp_path / "no-such-scratch"),
        RODAN_SCHEME="https",
        RODAN_HOST=rodan_https[0],  # a certificate the node does not trust
    )
    checks = by_name(run_probe(config, ProbeOptions(timeout_s=240), say=lambda _: None))
    assert checks["probe-job"].status == "ok", checks["probe-job"]
    worker = checks["node-worker"]
    assert worker.status == "FAIL" and "No module named 'tensorflow'" in worker.found, worker
    assert "hpc-bridge[worker]" in worker.fix
    scratch = checks["node-scratch"]
    assert scratch.status == "warn" and "does not exist on this node" in scratch.found, scratch
    rodan = checks["node-rodan"]
    assert rodan.status == "FAIL" and "TLS failed" in rodan.found and "REQUESTS_CA_BUNDLE" in rodan.fix, rodan
    for name in ("node-spool", "node-lock", "node-broker", "node-continue"):
        assert checks[name].status == "ok", checks[name]


def test_probe_that_never_starts_is_cancelled(cluster: Cluster, probe_config: Callable[..., BridgeConfig]) -> None:
    hold = "--hold" if cluster.name == "slurm" else "-h"
    config = probe_config(cluster.name, HPC_SCHEDULER_ARGS=hold)
    said: list[str] = []
    checks = by_name(run_probe(config, ProbeOptions(timeout_s=8, poll_s=0.5), say=said.append))
    first = checks["probe-job"]
    assert first.status == "FAIL" and "still waiting in the queue after the timeout" in first.found, first
    assert "it was cancelled" in first.found and "--job-timeout" in first.fix
    if cluster.name == "slurm":
        assert "JobHeldUser" in first.found
        assert any("pending: JobHeldUser" in line for line in said)
    else:
        assert "(hqw)" in first.found or "hold" in first.found, first
    assert all(checks[f"node-{n}"].status == "skip" for n in PROBE_CHECKS)
    assert not cluster.is_active(job_id_of(first.found))


@pytest.mark.slurm
def test_probe_that_cannot_run_says_so(slurm: None, probe_config: Callable[..., BridgeConfig]) -> None:
    config = probe_config("slurm", HPC_WORKER_PYTHON="/bin/false")
    checks = by_name(run_probe(config, ProbeOptions(timeout_s=120, poll_s=0.5), say=lambda _: None))
    first = checks["probe-job"]
    assert first.status == "FAIL" and "without leaving its findings in the spool" in first.found, first
    assert "hpc-bridge job rodan-doctor-probe-" in first.found  # the tail of the job's output
    assert "HPC_WORKER_PYTHON" in first.fix
    assert all(checks[f"node-{n}"].status == "skip" for n in PROBE_CHECKS)


def test_no_secret_reaches_the_probe_folder(
    probe_config: Callable[..., BridgeConfig], tmp_path: Path, slurm: None
) -> None:
    """The probe file and script hold Rodan's address and the broker's host and port, never a password."""
    config = probe_config("slurm", HPC_SCHEDULER_ARGS="--hold")
    run_probe(config, ProbeOptions(timeout_s=3, poll_s=0.5, keep=True), say=lambda _: None)
    (folder,) = (tmp_path / "spool" / "jobs").iterdir()
    for path in folder.iterdir():
        text = path.read_text(errors="replace")
        assert RODAN_PASSWORD not in text and "guest:guest" not in text, path
    params = ProbeParameters.from_json(json.loads((folder / PROBE_FILE).read_text()))  # the typed hand-off
    host, port = broker_address(config.broker_url)
    assert (params.broker.host, params.broker.port) == (host, port)
    assert params.dir == folder and params.continuation is not None and params.continuation.mode == "requeue"
    assert os.stat(folder / PROBE_FILE).st_mode & 0o077 == 0
