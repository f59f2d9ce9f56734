"""End to end on real services: RabbitMQ, Slurm or Grid Engine, the Rodan stand-in, TensorFlow.

Each test plays Rodan (publishes requests exactly as its task does), runs
``hpc-bridge check`` as cron would (a fresh process each pass), and asserts on
what came back in the reply queue, the dead-letter queue, the scheduler and the
spool. Every test runs once per scheduler (the ``cluster`` fixture).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bridge.testing.rodan import token_for_email
from tests.support.bridge import FAST_SETTINGS, NO_FRESH_STARTS, RODAN_EMAIL, bridge_environ, run_bridge
from tests.support.harness import Harness
from tests.support.wait import wait_until

pytestmark = [pytest.mark.broker]

FAST = FAST_SETTINGS


@pytest.fixture
def harness(broker_url, standin, queues, rodan, tmp_path, cluster):
    spool = tmp_path / "spool"
    env = bridge_environ(
        broker_url, standin, queues, spool, HPC_LOG_FILE=str(tmp_path / "bridge.log"), HPC_SCHEDULER=cluster.name
    )
    h = Harness(env, spool, rodan, cluster)
    yield h
    h.teardown()


@pytest.mark.training
# One scheduler: what is tested here (both generations, the production trainer's run directory, the
# secrets) does not depend on it. Grid Engine's jobs train for real in the enqueue test below, the
# continuation (on JAX) and the continuation limit.
@pytest.mark.parametrize("cluster", ["slurm"], indirect=True)
def test_both_generations_train_and_reply_with_loadable_models(harness, rodan, sample_inputs, tmp_path):
    old = rodan.publish_request(sample_inputs("old", height=256, width=320, seed=1), FAST)
    new = rodan.publish_request(sample_inputs("new", n_layers=2, height=256, width=320, seed=2), FAST)
    harness.drive([old, new], timeout=420)
    harness.settle([old, new])

    import keras

    expected = {
        old: ["Background Model", "Music Symbol Model", "Staff Lines Model", "Text Model"],
        new: ["Background Model", "Model 0", "Model 1"],
    }
    for corr, keys in expected.items():
        reply = harness.reply(corr)
        assert sorted(reply) == sorted(keys), reply.get("error")
        for key in keys:
            path = tmp_path / f"{corr}-{key}.hdf5"
            path.write_bytes(base64.decodebytes(reply[key].encode("ascii")))
            model = keras.models.load_model(path, compile=False)
            out = model.predict(np.zeros((1, 64, 64, 3), "float32"), verbose=0)
            assert out.shape == (1, 64, 64, 1) and 0.0 <= out.min() and out.max() <= 1.0
        record = harness.ledger(corr)
        assert record["state"] == "replied" and record["outcome"] == "ok"
        assert harness.cluster.jobs_named(record["job_name"]) == [record["job_id"]]
        assert not (harness.spool / "params" / f"{corr}.json").exists(), "the worker deletes the parameter file"
        assert '"event": "epoch"' in harness.job_output(corr)
        # The job's run directory on persistent storage: log, history, curves, TensorBoard, settings.
        (run_dir,) = (harness.spool / "runs").glob(f"*-{corr}")
        assert '"event": "epoch"' in (run_dir / "job.log").read_text()
        # Every model's layer is reported as trained, or loudly as having learned nothing, under its reply key.
        events = [json.loads(line) for line in (run_dir / "job.log").read_text().splitlines() if line.startswith("{")]
        reported = [e["model"] for e in events if e.get("event") in ("layer_trained", "layer_learned_nothing")]
        assert sorted(reported) == sorted(keys)
        written = json.loads((run_dir / "settings.json").read_text())
        assert written["patch_height"] == 64 and written["max_fresh_starts"] == 2  # the production path
        history = np.load(run_dir / "history.npz")
        assert len(history[f"{keys[0]}/val_accuracy"]) >= 1
        assert (run_dir / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))

    # Secrets: the token and passwords are nowhere but the (deleted) parameter file.
    secrets = [token_for_email(RODAN_EMAIL), harness.env["RODAN_PASSWORD"]]
    for path in [*harness.spool.rglob("*"), Path(harness.env["HPC_LOG_FILE"])]:
        if path.is_file():
            text = path.read_bytes().decode("utf-8", "replace")
            for secret in secrets:
                assert secret not in text, f"secret found in {path}"
    for argv in harness.argv_seen:
        for secret in secrets:
            assert secret not in argv, f"secret in a process argument list: {argv[:80]}"


@pytest.mark.slow  # waits for a one-minute time limit
@pytest.mark.waits
def test_jobs_ending_without_a_reply_get_one_error_naming_the_state(harness, rodan, sample_inputs, standin):
    cluster = harness.cluster
    slow_page = sample_inputs("new", n_layers=1, height=160, width=192, seed=3)
    slow_prefix = slow_page["Image"].rsplit("/resources/", 1)[0]
    standin.delay(400, paths=slow_prefix, downloads_only=True)  # the job is alive but never replies

    failed = rodan.publish_request(sample_inputs("new", n_layers=1, seed=4), FAST)
    harness.check(HPC_WORKER_PYTHON="/nonexistent/python3")  # the batch script cannot start the worker

    timeout = rodan.publish_request(slow_page, {**FAST, "Maximum time (D-HH:MM)": "0-00:01"})
    cancelled = rodan.publish_request(slow_page, FAST)
    expectations = {
        failed: ["FAILED", "exit code"],
        timeout: ["TIMEOUT", "after 0-00:01", "raise 'Maximum time (D-HH:MM)'"],
        cancelled: ["CANCELLED"],
    }
    if cluster.name == "slurm":
        # The dev Grid Engine schedules memory by mem_free and does not enforce it (h_vmem would,
        # but it limits virtual memory, which TensorFlow reserves far beyond what it uses).
        big = sample_inputs("new", n_layers=1, height=1024, width=1024, seed=5)  # room for 256x256 patch centres
        oom = rodan.publish_request(
            big,
            {
                **FAST,
                "Patch height": 256,
                "Patch width": 256,
                "Maximum number of samples per label": 1000,
                "Maximum memory (MB)": 1024,
            },
        )
        expectations[oom] = ["OUT_OF_MEMORY with 1024 MB", "raise 'Maximum memory (MB)'"]
    harness.check()

    def cancel_when_running() -> None:
        record = harness.ledger(cancelled)
        if record.get("job_id") and not harness.replies.get(cancelled) and cluster.is_running(record["job_id"]):
            cluster.cancel(record["job_id"])

    harness.drive(list(expectations), timeout=300, during=cancel_when_running)
    for corr, fragments in expectations.items():
        error = harness.reply(corr)["error"]
        for fragment in fragments:
            assert fragment in error, f"{fragment!r} not in {error!r}"
    # Settled, after their jobs ended and more passes: still exactly one reply each.
    harness.settle(list(expectations))
    assert all(len(harness.replies[c]) == 1 for c in expectations)


#: The scheduler's words for a job that asks for more memory than any node has.
IMPOSSIBLE_MEMORY = {"slurm": "Memory specification can not be", "gridengine": "no suitable queues"}


def test_invalid_requests_get_one_error_and_are_dead_lettered(harness, rodan, sample_inputs, queues):
    cluster = harness.cluster
    good = sample_inputs("new", n_layers=1, seed=6)
    cases = {
        rodan.publish(b"{this is not json"): "not valid JSON",
        rodan.publish_request(good, {**FAST, "CPUs": "2"}): "'settings/CPUs' must be of type integer",
        rodan.publish_request(good, {**FAST, "Maximum time (D-HH:MM)": "6 hours"}): "must look like 0-06:00",
        rodan.publish_request(good, {**FAST, "Slurm Notification Email": "x@y.org\n#SBATCH --uid=0"}): "e-mail",
        rodan.publish_request({k: v for k, v in good.items() if k != "Background"}, FAST): "missing inputs",
        rodan.publish_request({**good, "Music Layer": good["Image"]}, FAST): "mixes the two Rodan job generations",
        rodan.publish_request(good, {**FAST, "Maximum memory (MB)": 500000}): IMPOSSIBLE_MEMORY[cluster.name],
    }
    no_reply_to = rodan.publish_request(good, FAST, reply_to=None)
    harness.check()
    harness.collect()
    for corr, fragment in cases.items():
        error = harness.reply(corr)["error"]
        assert fragment in error, f"{fragment!r} not in {error!r}"
        record = harness.ledger(corr)
        assert record["state"] == "rejected" and record["job_id"] == "" and record["dead_lettered"]
        assert cluster.jobs_started(f"rodan-{corr}") == []
    dead = {corr: headers for corr, _body, headers in rodan.drain(queues.dead)}
    assert set(dead) == {*cases, no_reply_to}
    assert "no usable reply_to" in dead[no_reply_to]["x-hpc-bridge-reason"]
    assert rodan.depth(queues.request) == 0
    # Rodan refuses the HPC account: error reply, dead letter, nothing submitted, never retried.
    refused = rodan.publish_request(good, FAST)
    harness.check(RODAN_PASSWORD="wrong-password")
    harness.collect()
    assert "Rodan refused the HPC account" in harness.reply(refused)["error"]
    assert cluster.jobs_named(f"rodan-{refused}") == [] and rodan.depth(queues.request) == 0
    assert [c for c, _b, _h in rodan.drain(queues.dead)] == [refused]


def test_rodan_outage_defers_then_bounded_error(harness, rodan, sample_inputs, standin, queues):
    page = sample_inputs("new", n_layers=1, seed=7)
    standin.fail_next(1000, status=503, paths="/api/auth/token/")
    corr = rodan.publish_request(page, FAST)
    behind = rodan.publish_request(page, FAST)
    harness.check(HPC_RODAN_RETRIES="0")
    harness.collect()
    assert not harness.replies, "a transient failure is not an error reply"
    assert rodan.depth(queues.request) == 2, "deferred requests go back to the queue"
    assert harness.ledger(corr)["attempts"] == 1 and harness.ledger(behind)["attempts"] == 1
    standin.clear_faults()
    harness.check()
    assert harness.ledger(corr)["state"] == "submitted" and harness.ledger(behind)["state"] == "submitted"
    # Rodan stays down: once HPC_DEFER_LIMIT has passed since the first failure, an error reply.
    standin.fail_next(1000, status=503, paths="/api/auth/token/")
    stuck = rodan.publish_request(page, FAST)
    harness.check(HPC_RODAN_RETRIES="0", HPC_DEFER_LIMIT="2")
    harness.collect()
    # (The two submitted requests' jobs run meanwhile, and may have replied already: this page is too
    # small for FAST's samples, so their workers stop with an error within seconds.)
    assert not harness.replies.get(stuck) and harness.ledger(stuck)["state"] == "received"
    time.sleep(2.1)
    harness.check(HPC_RODAN_RETRIES="0", HPC_DEFER_LIMIT="2")
    harness.collect()
    error = harness.reply(stuck)["error"]
    assert error.startswith("gave up after retrying for ") and "(2 attempts, HPC_DEFER_LIMIT): Rodan" in error, error
    assert rodan.depth(queues.request) == 0


@pytest.mark.parametrize("cluster", ["slurm"], indirect=True)  # no job is involved: one scheduler is enough
def test_a_deferred_request_the_broker_lost_gets_one_error_reply(harness, rodan, sample_inputs, standin, queues):
    """Rodan's queue is not durable: a broker restart drops a request the bridge had deferred. Its
    ledger record is all that is left; Rodan's task must not wait for ever."""
    page = sample_inputs("new", n_layers=1, seed=7)
    standin.fail_next(1000, status=503, paths="/api/auth/token/")
    try:
        corr = rodan.publish_request(page, FAST)
        harness.check(HPC_RODAN_RETRIES="0")
        assert harness.ledger(corr)["state"] == "received" and rodan.depth(queues.request) == 1
        assert [c for c, _body, _h in rodan.drain(queues.request)] == [corr]  # what a broker restart does
        harness.check(HPC_RODAN_RETRIES="0")  # an hour (HPC_MISSING_TIMEOUT) has not passed: nothing yet
        harness.collect()
        assert not harness.replies and harness.ledger(corr)["state"] == "received"
        time.sleep(2)
        harness.check(HPC_RODAN_RETRIES="0", HPC_MISSING_TIMEOUT="1")
        harness.check(HPC_RODAN_RETRIES="0", HPC_MISSING_TIMEOUT="1")  # and never twice
        harness.collect()
        error = harness.reply(corr)["error"]
        assert error.startswith("the request was lost from the broker's queue") and "run the job again" in error
        assert harness.ledger(corr)["state"] == "rejected"
        assert [e["correlation_id"] for e in harness.log_events() if e["event"] == "request_lost"] == [corr]
    finally:
        standin.clear_faults()


def test_sigkill_between_submit_and_ack_submits_nothing_twice(harness, rodan, sample_inputs, tmp_path):
    # A submit command that submits for real, then SIGKILLs the bridge before it can record or ack.
    cluster = harness.cluster
    bindir = tmp_path / "crashbin"
    bindir.mkdir()
    command = cluster.submit_command
    wrapper = bindir / command
    wrapper.write_text(f'#!/bin/sh\nout=$(/usr/bin/{command} "$@") || exit $?\necho "$out"\nkill -9 $PPID\n')
    wrapper.chmod(0o755)
    # The job itself replies nothing (no training: what counts is how often it was submitted);
    # the bridge's own reply for a job that ended without models is the request's one reply.
    harness.env["HPC_WORKER_PYTHON"] = "/bin/true"
    corr = rodan.publish_request(sample_inputs("new", n_layers=1, seed=8), FAST)
    crashed = run_bridge({**harness.env, "PATH": f"{bindir}:{os.environ['PATH']}"}, "check")
    assert crashed.returncode == -9
    record = harness.ledger(corr)
    assert record["state"] == "submitting" and record["job_id"] == ""
    job_ids = wait_until(lambda: cluster.jobs_named(record["job_name"]), 30, what="the job to be visible")
    assert len(job_ids) == 1
    harness.drive([corr], timeout=300)
    harness.settle([corr])
    assert cluster.jobs_named(record["job_name"]) == job_ids, "the redelivered request was submitted again"
    assert "the job finished without sending its models" in harness.reply(corr)["error"]
    assert harness.ledger(corr)["job_id"] == job_ids[0]
    assert any(e["event"] == "request_adopted_job" for e in harness.log_events())


@pytest.mark.training
# On Grid Engine only: the daemon and enqueue do not depend on the scheduler, and Slurm's jobs train
# through the whole path in the test above (and in the Rodan 3 scenarios, tests/test_rodan3_e2e.py).
@pytest.mark.parametrize("cluster", ["gridengine"], indirect=True)
def test_enqueue_waits_for_the_daemon_and_a_real_training(harness, sample_inputs, tmp_path):
    """Rodan's side as a command (``enqueue --wait``) against the ``run`` daemon."""
    harness.env["HPC_JOB_PROLOGUE"] = NO_FRESH_STARTS  # the path is tested here, not the trainer
    daemon = harness.start_daemon(HPC_RECONCILE_INTERVAL="5")
    try:
        inputs = tmp_path / "inputs.json"
        inputs.write_text(json.dumps(sample_inputs("new", n_layers=1, height=256, width=320, seed=9)))
        settings = [f"{name}={value}" for name, value in FAST.items()]
        result = run_bridge(
            harness.env,
            "enqueue",
            "--inputs",
            str(inputs),
            *[arg for setting in settings for arg in ("--setting", setting)],
            "--wait",
            "--timeout",
            "300",
            "--out",
            str(tmp_path / "models"),
            timeout=330,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        out = json.loads(result.stdout.strip().splitlines()[-1])
        # the worker published the reply itself: the daemon marks it replied on its next reconciliation
        wait_until(lambda: harness.ledger(out["correlation_id"])["state"] == "replied", 30, 0.5, "the ledger")
    finally:
        assert daemon.stop() == 0
    assert sorted(out["models"]) == ["Background Model", "Model 0"]
    import keras

    for name in ("Background_Model.hdf5", "Model_0.hdf5"):
        model = keras.models.load_model(tmp_path / "models" / name, compile=False)
        # One probability per pixel, for windows of the training size and of any other multiple of 4.
        assert model.output_shape == (None, None, None, 1)
        for height, width in ((64, 64), (96, 128)):
            probabilities = model.predict(np.zeros((1, height, width, 3), "float32"), verbose=0)
            assert probabilities.shape == (1, height, width, 1)
            assert 0.0 <= probabilities.min() and probabilities.max() <= 1.0
    record = harness.ledger(out["correlation_id"])
    assert record["state"] == "replied" and record["outcome"] == "ok" and record["scheduler"] == harness.cluster.name
    # accounted once the job has ended, just after the worker's reply
    wait_until(lambda: harness.cluster.jobs_started(record["job_name"]) == [record["job_id"]], 30, what="accounting")


# --- training longer than one job ----------------------------------------------------------------

#: Two epochs per layer: room for cuts inside an epoch and between two (the background layer of the
#: test pages trains in several batches an epoch). 2 GB a job leaves other tests' jobs room on the
#: dev Slurm node (16 GB).
LONG = {
    **FAST,
    "Maximum number of training epochs": 2,
    "Maximum memory (MB)": 2048,
    "Maximum number of samples per label": 100,
    "Patience": 10,  # every epoch runs: the epoch count is the same however the training was cut
}


def status(h: Harness, *args: str) -> tuple[dict[str, dict[str, Any]], dict[str, int], list[str]]:
    """``hpc-bridge status ARGS`` with the harness's settings: (rows by correlation id, counters) of
    its JSON with --json, else the table's lines (at most 80 columns each)."""
    result = run_bridge(h.env, "status", *args, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    if "--json" in args:
        data = json.loads(result.stdout)
        return {r["correlation_id"]: r for r in data["requests"]}, data["counters"], []
    lines = result.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), result.stdout
    return {}, {}, lines


def row_of(lines: list[str], corr: str) -> list[str]:
    """The words of the one table row of this request."""
    (line,) = [line for line in lines if line.startswith(corr[:8])]
    return line.split()


def models_of(reply: dict[str, Any], where: Path) -> dict[str, list[np.ndarray]]:
    import keras

    where.mkdir(parents=True)
    weights = {}
    for key, encoded in reply.items():
        path = where / f"{key}.hdf5"
        path.write_bytes(base64.decodebytes(encoded.encode("ascii")))
        weights[key] = keras.models.load_model(path, compile=False).get_weights()
    return weights


@pytest.mark.training
@pytest.mark.slow
# One variant at a time (pytest-xdist --dist loadgroup): side by side, on 2 busy cores, each of the
# three ran past its 900 s timeout; one after another each takes a few minutes.
@pytest.mark.xdist_group("continuation-e2e")
@pytest.mark.parametrize(
    ("cluster", "slurm_continue"),
    [("slurm", "requeue"), ("slurm", "successor"), pytest.param("gridengine", "successor", id="gridengine")],
    indirect=["cluster"],
)
def test_training_longer_than_one_job_continues_and_equals_an_uninterrupted_run(
    harness, rodan, sample_inputs, tmp_path, slurm_continue
):
    """One request is cut into several jobs; the same request left alone needs one.

    With the same seed both must train the same number of epochs on the same samples, and so
    end with the same models; each gets exactly one reply. On Slurm both ways to continue run:
    requeue (the same job id again) and, as at a site that forbids requeue, a successor held on
    the job (HPC_SLURM_CONTINUE=successor; there every ``scontrol requeue`` is refused). On Grid
    Engine the jobs train on Keras' JAX backend (KERAS_BACKEND=jax in the job prologue, as a site
    would set it), so a JAX run is continued, checkpoints and all, across jobs too.
    """
    cluster = harness.cluster
    backend = "jax" if cluster.name == "gridengine" else "tensorflow"
    prologue = f"export KERAS_BACKEND={backend}"
    if backend == "jax" and os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        # As a site would: every job of the run shares JAX's compilation cache (deploy/dev/test.sh's),
        # so a continuation's job does not compile the training step its predecessor compiled.
        prologue += f"; export JAX_COMPILATION_CACHE_DIR={os.environ['JAX_COMPILATION_CACHE_DIR']}"
    harness.env["HPC_JOB_PROLOGUE"] = prologue
    harness.env["HPC_SLURM_CONTINUE"] = slurm_continue
    # Every scontrol of the bridge and of its jobs (they inherit PATH) goes through a wrapper
    # that records it, and refuses a requeue where the site does not allow one.
    scontrol_calls = tmp_path / "scontrol-calls.txt"
    if cluster.name == "slurm":
        refuse = "echo 'scontrol: error: Access/permission denied' >&2; exit 1"
        refuse = refuse if slurm_continue == "successor" else ":"
        wrapper = tmp_path / "site-bin" / "scontrol"
        wrapper.parent.mkdir()
        wrapper.write_text(
            f'#!/bin/sh\necho "$*" >> "{scontrol_calls}"\nif [ "$1" = requeue ]; then {refuse}; fi\n'
            f'exec {shutil.which("scontrol")} "$@"\n'
        )
        wrapper.chmod(0o755)
        harness.env["PATH"] = f"{wrapper.parent}:{os.environ['PATH']}"
    # Each job of the continued request is warned after a fixed amount of work (8 looks at the
    # flag: batches and epoch ends; the whole training takes about 20, so three jobs, one cut inside
    # an epoch and one between two), not by the clock: the number of jobs is the same however fast or
    # loaded the machine is. What follows the warning
    # (checkpoint, requeue or successor, resume) is the real path. The warning's other sources
    # (the scheduler's signal, the job's own deadline) are tested in test_continuation.py,
    # test_dev_slurm.py and test_dev_gridengine.py.
    harness.env.update(HPC_WARN_SECONDS="60", HPC_TRAINING_SEED="20261126", HPC_MAX_CONTINUATIONS="10")
    metrics = tmp_path / "hpc_bridge.prom"
    harness.env["HPC_METRICS_FILE"] = str(metrics)
    page = sample_inputs("new", n_layers=1, height=256, width=320, seed=12)
    work = {**LONG, "Maximum time (D-HH:MM)": "0-00:15"}
    # The reference must never be warned: an hour, past any time this test may take (on a loaded
    # machine the training alone took more than the 14 minutes a 15-minute job trains).
    reference = rodan.publish_request(page, {**work, "Maximum time (D-HH:MM)": "0-01:00"})
    harness.check()  # the reference's job is submitted without the cut: the prologue below is for later jobs
    assert harness.ledger(reference)["state"] == "submitted"
    harness.env["HPC_JOB_PROLOGUE"] = f"{prologue}; export HPC_TEST_WARN_AFTER_POLLS=8"
    continued = rodan.publish_request(page, work)
    # Between cron passes, ``status`` as an operator runs it, once the ledger has counted a
    # continuation and until status has shown it (the state stays "continued" until the reply).
    # Not before: every process takes its share of the 2 cores.
    shown_continued: list[tuple[dict[str, Any], dict[str, Any], list[str]]] = []

    def watch_status() -> None:
        if shown_continued or not harness.ledger(continued)["continuations"]:
            return
        rows, _counters, _lines = status(harness, "--json")
        record = harness.ledger(continued)  # no pass runs meanwhile: the ledger is what status read
        assert rows[continued]["continuations"] == record["continuations"], (rows[continued], record)
        assert rows[reference]["continuations"] == 0 and rows[reference]["state"] != "continued", rows[reference]
        if rows[continued]["state"] == "continued":
            shown_continued.append((rows[continued], record, status(harness)[2]))

    harness.drive([continued, reference], timeout=900, during=watch_status)
    harness.settle([continued, reference])

    runs = {}
    for corr in (continued, reference):
        record = harness.ledger(corr)
        assert record["state"] == "replied" and record["outcome"] == "ok", record.get("reason")
        (runs[corr],) = (harness.spool / "runs").glob(f"*-{corr}")
        assert not (harness.spool / "params" / f"{corr}.json").exists()
        assert not (runs[corr] / "checkpoints").exists() and not (runs[corr] / "inputs").exists()
    record = harness.ledger(continued)
    assert record["continuations"] >= 1 and harness.ledger(reference)["continuations"] == 0
    # No job start measures oneDNN (hpc-worker tune does, outside the jobs: worker/onednn.py), and
    # on JAX none even reads a record (catches a job that pays for the measurement, or a JAX one
    # that sets TensorFlow's switch).
    for corr in (continued, reference):
        lines = [json.loads(line) for line in harness.job_output(corr).splitlines() if line.startswith("{")]
        onednn = [line["event"] for line in lines if str(line.get("event", "")).startswith("onednn")]
        assert onednn and "onednn_measured" not in onednn, onednn
        if backend == "jax":
            assert set(onednn) == {"onednn_skipped"}, onednn
    calls = scontrol_calls.read_text().splitlines() if scontrol_calls.exists() else []
    requeued = [line for line in calls if line.startswith("requeue")]
    scripts = {p.name: p.read_text() for p in (harness.spool / "jobs" / continued).glob("job*.sh")}
    if cluster.name == "slurm" and slurm_continue == "requeue":  # one job id that ran several times
        assert cluster.jobs_started(record["job_name"]) == [record["job_id"]]
        assert "restart 1" in harness.job_output(continued)
        assert len(requeued) >= record["continuations"] and set(requeued) == {f"requeue {record['job_id']}"}
        assert list(scripts) == ["job.sh"] and "#SBATCH --requeue\n" in scripts["job.sh"]
    else:  # one held successor per continuation (accounted once it has ended, just after its reply)
        assert len(set(record["job_ids"])) == len(record["job_ids"]) == record["continuations"] + 1
        wait_until(lambda: cluster.jobs_started(record["job_name"]) == record["job_ids"], 30, what="accounting")
        assert sorted(scripts) == sorted(["job.sh", *(f"job-after-{j}.sh" for j in record["job_ids"][:-1])])
        assert not any("--requeue" in text for text in scripts.values()) and requeued == []
    for corr in runs:  # each job of both requests trained on the backend its prologue chose
        trained_on = [line for line in (runs[corr] / "job.log").read_text().splitlines() if "training with the" in line]
        assert trained_on and all(f"{backend} backend" in line for line in trained_on), trained_on
    events = [json.loads(line)["event"] for line in (runs[continued] / "job.log").read_text().splitlines()]
    assert events.count("training_stopped") == record["continuations"] == events.count("job_resume")
    assert events.count("job_continuing") == record["continuations"]

    # Same epochs, same samples, same models.
    histories = {corr: np.load(runs[corr] / "history.npz") for corr in runs}
    for key in ("Background Model", "Model 0"):
        epochs = [list(histories[corr][f"{key}/epoch"]) for corr in (continued, reference)]
        assert epochs[0] == epochs[1] == [1.0, 2.0]
    got = models_of(harness.reply(continued), tmp_path / "continued")
    want = models_of(harness.reply(reference), tmp_path / "reference")
    assert sorted(got) == sorted(want) == ["Background Model", "Model 0"]
    for key in want:
        for a, b in zip(got[key], want[key], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=key)

    # What ``status`` showed while the training went on in its next job.
    assert shown_continued, "status never showed the continued request as continued"
    (row, seen, lines) = shown_continued[0]
    assert row["continuations"] == seen["continuations"] >= 1
    assert (row["scheduler"], row["job_id"], row["job_ids"]) == (cluster.name, seen["job_id"], seen["job_ids"])
    short = {"slurm": "slurm", "gridengine": "sge"}[cluster.name]
    assert row_of(lines, continued)[2:6] == [short, seen["job_id"], "continued", f"{seen['continuations']}x"]
    # ... and once both replied: status, its counters and the metrics file say what happened.
    rows, counters, lines = status(harness, "--json")
    ledgers = {corr: harness.ledger(corr) for corr in (continued, reference)}
    assert {corr: (r["state"], r["continuations"], r["scheduler"], r["job_id"]) for corr, r in rows.items()} == {
        corr: ("replied-ok", ledgers[corr]["continuations"], cluster.name, ledgers[corr]["job_id"]) for corr in ledgers
    }
    assert rows[continued]["continuations"] == record["continuations"] >= 1 and rows[reference]["continuations"] == 0
    assert counters == {
        "received": 2,
        "submitted": 2,
        "replied_ok": 2,
        "replied_error": 0,
        "reply_expired": 0,
        "rejected": 0,
        "dead_lettered": 0,
        "continuations": record["continuations"],
        "cancelled_by_rodan": 0,
    }
    lines = status(harness)[2]
    for corr in (continued, reference):
        assert row_of(lines, corr)[2:5] == [short, ledgers[corr]["job_id"], "replied-ok"], lines
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.read_text())
        for s in family.samples
    }
    assert samples[("hpc_bridge_requests_total", (("outcome", "replied_ok"),))] == 2
    assert samples[("hpc_bridge_requests_total", (("outcome", "replied_error"),))] == 0
    assert samples[("hpc_bridge_requests_total", (("outcome", "submitted"),))] == 2
    assert samples[("hpc_bridge_continuations_total", ())] == record["continuations"]
    assert samples[("hpc_bridge_ledger_requests", (("state", "replied-ok"),))] == 2
    assert samples[("hpc_bridge_ledger_requests", (("state", "continued"),))] == 0
    assert samples[("hpc_bridge_reply_latency_seconds_count", ())] == 2


@pytest.mark.training
# The limit is the worker's and the same on every scheduler: checked where a continuation is quick
# (a Grid Engine successor starts as soon as its predecessor ends; a Slurm requeue waits ~12 s).
@pytest.mark.parametrize("cluster", ["gridengine"], indirect=True)
def test_a_training_needing_more_jobs_than_allowed_gets_one_error_reply(harness, rodan, sample_inputs):
    # Every job is warned after a fixed amount of work (5 looks at the flag; the training takes
    # about 15), so two jobs can never finish it, however fast the machine.
    harness.env.update(HPC_MAX_CONTINUATIONS="1", HPC_JOB_PROLOGUE="export HPC_TEST_WARN_AFTER_POLLS=5")
    page = sample_inputs("new", n_layers=1, height=256, width=320, seed=13)
    corr = rodan.publish_request(page, LONG)
    harness.drive([corr], timeout=400)
    harness.settle([corr])  # the worker replies before its job ends; the ledger is written after
    error = harness.reply(corr)["error"]
    assert "training needs more time than 2 jobs of 900 s each: it stopped at layer" in error
    assert "after 1 continuations; raise 'Maximum time (D-HH:MM)' or the bridge's HPC_MAX_CONTINUATIONS" in error
    record = harness.ledger(corr)
    assert record["outcome"] == "error" and record["continuations"] == 1 and len(record["job_ids"]) == 2
    wait_until(lambda: harness.cluster.jobs_started(record["job_name"]) == record["job_ids"], 30, what="accounting")
    assert not (harness.spool / "params" / f"{corr}.json").exists()
