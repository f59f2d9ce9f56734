"""Generation 3 through the bridge (docs/protocol.md §2.5, §3.5), with the real broker, the Rodan
stand-in and Slurm.

A request published as the Rodan 3 job publishes it (reply_to: the run's own durable queue with
``x-expires``, declared by the job) passes intake (sample zips and starting models checked by their
first bytes), becomes a job, and the job's reply, about 78 MB for a 9-layer page, reaches the
run's queue in parts through a broker whose ``max_message_size`` is 16 MiB (RabbitMQ 4.x's
default), which refuses it as one message: a private RabbitMQ node booted with that limit
(tests/support/private_broker.py), that the test's bridge, Rodan side and job all use; the shared
broker's settings are never changed. The jobs run ``tests/stub_worker.py``: the real parameter
file and reply path, no TensorFlow. A sample that is not a zip, an empty zip, a model that is not
HDF5, or an unknown input gets its error reply at once, also in parts.
"""

from __future__ import annotations

import base64
import json
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest

from bridge.amqp import publish
from bridge.errors import PermanentError
from bridge.protocol import success_reply
from bridge.testing.rodan import RodanStandin
from bridge.testing.samples import make_sample_page, resource_path
from tests import stub_worker
from tests.support.bridge import bridge_environ
from tests.support.broker import Queues, Rodan
from tests.support.cluster import Cluster
from tests.support.harness import Harness
from tests.support.private_broker import PrivateBroker, private_node
from tests.support.rodan3 import (
    LIMIT_16_MIB,
    Rodan3Job,
    broker_channel,
    delete_queue,
    joined,
    per_run_queue,
    take_all,
    wait_for_reply,
)

pytestmark = [pytest.mark.broker, pytest.mark.slurm]

SETTINGS = {"Maximum time (D-HH:MM)": "0-00:10", "Maximum memory (MB)": 2048, "CPUs": 1, "Batch Size": 4}
PROJECT = "3" * 32


def put(uploads: Path, name: str, data: bytes) -> str:
    """A Rodan resource holding ``data``; returns its path as Rodan sends it."""
    file, path = resource_path(uploads, PROJECT, uuid.uuid5(uuid.NAMESPACE_URL, name).hex)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_bytes(data)
    return path


def sample_zip(uploads: Path, seed: int) -> bytes:
    """A sample zip as Pixel.js writes it (Image, selected regions, background, two layers)."""
    page = make_sample_page(uploads, generation="new", n_layers=2, height=64, width=64, seed=seed)
    members = {
        "Image.png": page["Image"],
        "rgba PNG - Selected regions.png": page["Selected Regions"],
        "rgba PNG - Layer 0 (Background).png": page["Background"],
        "rgba PNG - Layer 1.png": page["rgba PNG - Layer 0"],
        "rgba PNG - Layer 2.png": page["rgba PNG - Layer 1"],
    }
    out = uploads / f"sample-{seed}.zip"
    with zipfile.ZipFile(out, "w") as archive:
        for member, path in members.items():
            archive.write(uploads / path.removeprefix("/uploads/"), member)
    return out.read_bytes()


def hdf5_model(tmp: Path) -> bytes:
    """A small Keras-like HDF5 file (only its first bytes matter at intake)."""
    file = tmp / "model.hdf5"
    with h5py.File(file, "w") as handle:
        handle.attrs["keras_version"] = "2.15.0"
        handle.create_dataset("model_weights/conv/kernel", data=np.zeros((3, 3, 3, 8), dtype="float32"))
    return file.read_bytes()


def empty_zip(tmp: Path) -> bytes:
    file = tmp / "empty.zip"
    with zipfile.ZipFile(file, "w"):
        pass
    return file.read_bytes()


@pytest.fixture
def job(broker_url: str, queues: Queues) -> Iterator[Rodan3Job]:
    j = Rodan3Job(broker_url, queues, id_prefix="f")
    yield j
    j.delete()


def bridge_harness(broker_url: str, standin: RodanStandin, queues: Queues, tmp_path: Path) -> Harness:
    """One test's bridge (cron passes on Slurm) and Rodan's side, both on the broker at ``broker_url``."""
    spool = tmp_path / "spool"
    env = bridge_environ(
        broker_url,
        standin,
        queues,
        spool,
        HPC_LOG_FILE=str(tmp_path / "bridge.log"),
        HPC_SCHEDULER="slurm",
        HPC_WORKER_PYTHON=str(stub_worker.install(tmp_path / "stub")),
        HPC_GPU_RULES="none",
        # As the default (hpc-results, hpc-results.*), for this test's queue names.
        HPC_REPLY_QUEUE=f"{queues.reply}, {queues.reply}.*",
        HPC_LOG_LEVEL="DEBUG",  # input_checked: the kind each input was found to be
    )
    return Harness(env, spool, Rodan(broker_url, queues), Cluster("slurm"))


@pytest.fixture
def harness(broker_url: str, standin: RodanStandin, queues: Queues, tmp_path: Path, slurm: None) -> Iterator[Harness]:
    h = bridge_harness(broker_url, standin, queues, tmp_path)
    yield h
    h.teardown()


@pytest.fixture
def private_queues(node: PrivateBroker) -> Iterator[Queues]:
    """One test's queues on the private node (deleted afterwards)."""
    q = Queues.fresh()
    yield q
    if node.answers():
        for name in q.all():
            delete_queue(node.url, name)


@pytest.fixture
def private_harness(
    node: PrivateBroker, standin: RodanStandin, private_queues: Queues, tmp_path: Path, slurm: None
) -> Iterator[Harness]:
    """The bridge and Rodan's side on the private node: every message of the test goes through it."""
    h = bridge_harness(node.url, standin, private_queues, tmp_path)
    yield h
    h.teardown()


@pytest.fixture
def private_job(node: PrivateBroker, private_queues: Queues) -> Iterator[Rodan3Job]:
    j = Rodan3Job(node.url, private_queues, id_prefix="f")
    yield j
    if node.answers():
        j.delete()


@pytest.mark.slow
@private_node(max_message_size=LIMIT_16_MIB)
def test_a_rodan3_request_becomes_a_job_whose_78_mb_reply_arrives_in_parts_under_a_16_mib_broker(
    private_harness: Harness, private_job: Rodan3Job, standin: RodanStandin, node: PrivateBroker, tmp_path: Path
) -> None:
    harness, job, url = private_harness, private_job, node.url
    uploads = standin.uploads_dir
    inputs = {
        "Sample 1": put(uploads, "s1", sample_zip(uploads, 1)),
        "Sample 2": put(uploads, "s2", sample_zip(uploads, 2)),
        "Multi-Sample Zip": put(uploads, "multi", sample_zip(uploads, 3)),
        "Background Model": put(uploads, "bg", hdf5_model(tmp_path)),
        "Model 1": put(uploads, "m1", hdf5_model(tmp_path)),
    }
    corr, reply_to = job.publish(inputs, SETTINGS)
    expected = stub_worker.rodan3_models(corr)
    # This broker refuses that reply as one message (sent here to a queue of its own).
    whole = f"{reply_to}.whole"
    job.run_queues.append(whole)
    with broker_channel(url) as channel:
        per_run_queue(channel, whole)
        with pytest.raises(PermanentError, match="larger than configured max size 16777216"):
            publish(channel, whole, success_reply(expected), correlation_id=corr, persistent=True)
    assert take_all(url, whole) == []
    messages = wait_for_reply(harness, url, reply_to, timeout=240)
    body = joined(messages, corr)
    assert 76_000_000 < len(body) < 80_000_000
    assert len(messages) == 10 and all(len(m[1]) <= 8 << 20 for m in messages)  # HPC_REPLY_PART_BYTES
    reply = json.loads(body)
    assert set(reply) == set(expected)
    assert all(reply[k] == base64.encodebytes(v).decode() for k, v in expected.items())
    # Intake: generation 3, each input checked by its first bytes, one job; then the reply marked.
    record = harness.ledger(corr)
    assert record["generation"] == "rodan3" and record["job_id"]
    (valid,) = harness.log_events("request_valid")  # the Multi-Sample Zip is a sample zip too
    assert (valid["sample_zips"], valid["starting_models"]) == (3, 2) and "layers" not in valid
    checked = {e["input"]: e["kind"] for e in harness.log_events("input_checked")}
    assert checked == {
        "Sample 1": "zip",
        "Sample 2": "zip",
        "Multi-Sample Zip": "zip",
        "Background Model": "hdf5",
        "Model 1": "hdf5",
    }
    harness.settle([corr])
    assert harness.ledger(corr)["state"] == "replied"
    assert harness.cluster.jobs_named(record["job_name"]) == [record["job_id"]]
    assert take_all(url, reply_to) == []  # nothing more came
    assert harness.rodan.depth(harness.rodan.queues.request) == 0


def test_rodan3_inputs_of_the_wrong_kind_are_answered_at_once_in_parts(
    harness: Harness, job: Rodan3Job, standin: RodanStandin, broker_url: str, tmp_path: Path
) -> None:
    uploads = standin.uploads_dir
    zip_data = sample_zip(uploads, 4)
    png_path = make_sample_page(uploads, generation="new", n_layers=1, height=64, width=64, seed=5)["Image"]
    cases = {
        "a PNG as a sample": (
            {"Sample 1": png_path},
            "input 'Sample 1' is not a zip file (a sample as Pixel.js writes it) (it starts with 89504e47",
        ),
        "an empty zip": (
            {"Sample 1": put(uploads, "ok", zip_data), "Sample 2": put(uploads, "empty", empty_zip(tmp_path))},
            "input 'Sample 2' is not a zip file (a sample as Pixel.js writes it) (it is an empty zip archive)",
        ),
        "a zip as a model": (
            {"Sample 1": put(uploads, "ok", zip_data), "Model 1": put(uploads, "ok", zip_data)},
            "input 'Model 1' is not an HDF5 file (a Keras model) (it starts with 504b0304",
        ),
        "Sample 0": ({"Sample 0": put(uploads, "ok", zip_data)}, "unknown inputs: ['Sample 0']"),
    }
    sent = {what: job.publish(inputs, SETTINGS) for what, (inputs, _reason) in cases.items()}
    harness.check()
    for what, (corr, reply_to) in sent.items():
        messages = take_all(broker_url, reply_to)
        assert len(messages) == 1, what
        reply = json.loads(joined(messages, corr))  # one part: x-hpc-part 1 of 1
        assert set(reply) == {"error"} and cases[what][1] in reply["error"], (what, reply)
        record = harness.ledger(corr)
        assert record["state"] == "rejected" and record["generation"] == "rodan3" and not record["job_id"]
    dead = harness.rodan.drain(harness.rodan.queues.dead)
    assert sorted(c or "" for c, _b, _h in dead) == sorted(corr for corr, _q in sent.values())
    # The log says what a generation 3 request holds, not "layers": 0 (its layers are inside the
    # zips). Catches a request_valid that logs len(request.layers) for every generation, or that
    # counts the wrong inputs. The unknown input ("Sample 0") is refused before it is valid.
    valid = {e["correlation_id"]: e for e in harness.log_events("request_valid")}
    expected = {"a PNG as a sample": (1, 0), "an empty zip": (2, 0), "a zip as a model": (1, 1)}
    assert set(valid) == {sent[what][0] for what in expected}
    for what, (zips, models) in expected.items():
        event = valid[sent[what][0]]
        assert event["generation"] == "rodan3" and "layers" not in event, (what, event)
        assert (event["sample_zips"], event["starting_models"]) == (zips, models), (what, event)
