"""The worker's failure paths and reply delivery (in-process, real broker and stand-in)."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import h5py
import pytest

from bridge.replies import ReplyBox
from bridge.spool import Spool, atomic_write_json
from tests.support.bridge import bridge_environ, run_bridge
from tests.support.worker import run, write_params

pytestmark = [
    pytest.mark.broker,
    pytest.mark.filterwarnings(  # TensorFlow's variables and NumPy 2, inside Keras
        "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
    ),
]


def test_missing_resource_is_an_error_reply_naming_the_step(
    tmp_path, broker_url, queues, standin, sample_inputs, rodan
):
    spool = Spool(tmp_path / "spool").ensure()
    rodan.publish(b"{}", declare=True)  # declares the reply queue like Rodan
    rodan.drain(queues.request)
    inputs = {**sample_inputs("new", n_layers=1), "Image": "/uploads/projects/missing/original_file"}
    params = write_params(spool, "corr-404", queues.reply, inputs, standin, broker_url)
    code, logs = run(params)
    assert code == 1
    assert not params.exists(), "the parameter file is deleted once read"
    replies = rodan.drain()
    assert [c for c, _b, _h in replies] == ["corr-404"]
    error = json.loads(replies[0][1])["error"]
    assert "while downloading 'Image'" in error and "404" in error
    assert standin.user("hpc@example.org").token not in logs
    assert ReplyBox(spool).already_replied("corr-404") and not ReplyBox(spool).staged()


def test_resource_that_is_not_an_image(tmp_path, broker_url, queues, standin, sample_inputs, rodan):
    spool = Spool(tmp_path / "spool").ensure()
    rodan.publish(b"{}")
    rodan.drain(queues.request)
    inputs = sample_inputs("new", n_layers=1)
    (standin.uploads_dir / "junk").write_bytes(b"<html>not a png</html>")
    inputs["rgba PNG - Layer 0"] = "/uploads/junk"
    code, _logs = run(write_params(spool, "corr-junk", queues.reply, inputs, standin, broker_url))
    error = json.loads(rodan.drain()[0][1])["error"]
    assert code == 1 and "while reading the input images" in error


def test_reply_waits_in_the_outbox_when_the_broker_is_down(tmp_path, broker_url, queues, standin, sample_inputs, rodan):
    spool_dir = tmp_path / "spool"
    spool = Spool(spool_dir).ensure()
    rodan.publish(b"{}")
    rodan.drain(queues.request)
    inputs = {**sample_inputs("new", n_layers=1), "Image": "/uploads/projects/missing/original_file"}
    params = write_params(spool, "corr-outbox", queues.reply, inputs, standin, "amqp://guest:guest@127.0.0.1:9/%2F")
    code, logs = run(params)
    assert code == 1 and "reply_left_in_outbox" in logs
    assert [e.correlation_id for e in ReplyBox(spool).staged()] == ["corr-outbox"]
    assert rodan.drain() == []
    # The bridge's next pass publishes it, once.
    env = bridge_environ(broker_url, standin, queues, spool_dir)
    for _ in range(2):
        assert run_bridge(env, "check").returncode == 0
    replies = rodan.drain()
    assert [c for c, _b, _h in replies] == ["corr-outbox"]
    assert "downloading 'Image'" in json.loads(replies[0][1])["error"]
    assert not ReplyBox(spool).staged() and ReplyBox(spool).already_replied("corr-outbox")


def test_already_replied_request_is_not_answered_again(tmp_path, broker_url, queues, standin, sample_inputs, rodan):
    spool = Spool(tmp_path / "spool").ensure()
    atomic_write_json(spool.reply_marker("corr-done"), {"outcome": "ok", "published_at": time.time()})
    params = write_params(spool, "corr-done", queues.reply, sample_inputs("new", n_layers=1), standin, broker_url)
    code, logs = run(params)
    assert code == 0 and "already_replied" in logs
    assert rodan.drain() == []


@pytest.mark.training
def test_the_operators_precision_reaches_the_trainer_and_the_models_stay_float32(
    tmp_path, make_config, broker_url, queues, standin, sample_inputs, rodan
):
    """HPC_MIXED_PRECISION goes from the bridge's settings into the job's parameters (intake) and
    into the trainer (worker), which trains under it; the models come back float32 all the same."""
    from bridge.intake import Intake, Message, Outcome
    from bridge.ledger import Ledger
    from bridge.rodan import RodanClient
    from bridge.schedulers import get_scheduler
    from tests.support.bridge import FAST_SETTINGS

    config = make_config(HPC_MIXED_PRECISION="bfloat16")
    spool = Spool(config.spool_dir).ensure()
    scheduler = get_scheduler("slurm", timeout_s=5, options=config.scheduler_options)
    submitted: list[dict[str, Any]] = []

    def submit(*_args: object) -> str:  # the parameter file as the job would find it
        submitted.append(json.loads(spool.params_path("corr-bf16").read_text()))
        return "4242"

    scheduler.submit = submit  # type: ignore[method-assign]
    scheduler.find_by_name = lambda _name: []  # type: ignore[method-assign]
    rodan_client = RodanClient(config.rodan_base_url, email=config.rodan_email, password=config.rodan_password)
    intake = Intake(config, spool, Ledger(spool), scheduler, rodan_client, ReplyBox(spool))
    rodan.publish(b"{}")  # Rodan's queues exist
    rodan.drain(queues.request)
    body = json.dumps({"inputs": sample_inputs("new", n_layers=1), "settings": FAST_SETTINGS}).encode()
    message = Message(body=body, correlation_id="corr-bf16", reply_to=queues.reply, redelivered=False, delivery_tag=1)
    assert intake.process(message).outcome is Outcome.SUBMITTED
    (params,) = submitted
    assert params["mixed_precision"] == "bfloat16"

    # The job, in this process, on 16x16 patches (bfloat16 is slow on CPUs without it).
    params["settings"].update(patch_height=16, patch_width=16, epochs=1)
    params["runs_dir"] = str(tmp_path / "runs")
    atomic_write_json(spool.params_path("corr-bf16"), params)
    code, _logs = run(spool.params_path("corr-bf16"))
    assert code == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "settings.json").read_text())["mixed_precision"] == "bfloat16"
    ((corr, body, _headers),) = rodan.drain()
    reply = json.loads(body)
    assert corr == "corr-bf16" and sorted(reply) == ["Background Model", "Model 0"], reply.get("error")
    for key, encoded in reply.items():
        path = tmp_path / f"{key}.hdf5"
        path.write_bytes(base64.decodebytes(encoded.encode("ascii")))
        with h5py.File(path, "r") as f:
            layers = json.loads(f.attrs["model_config"])["config"]["layers"]
            assert {layer["config"]["dtype"] for layer in layers} == {"float32"}, key
            weights: list[h5py.Dataset] = []
            f["model_weights"].visititems(lambda _n, o: weights.append(o) if isinstance(o, h5py.Dataset) else None)
            assert len(weights) == 2 * 14 and {str(w.dtype) for w in weights} == {"float32"}, key
