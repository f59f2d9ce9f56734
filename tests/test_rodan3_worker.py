"""A Rodan 3.x request trained for real: two pages' sample zips and a starting model, through the
bridge, a Slurm job running the worker, the reply in parts on the run's own queue.

What comes back is what Rodan 3.x's job writes into its outputs: ``Background Model``, ``Model 1``,
``Model 2`` (one per layer of the samples, 1-based as Rodan 3's trainer names them) and the ``Log
File``. Each model opens and classifies the page with Paco_classifier's own ``process_image_msae``
in Rodan's TensorFlow 2.15.1 (consumers/), and the Log File tells the training's story.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("keras")  # the worker extra is not installed on login nodes

from bridge.testing.rodan import RodanStandin
from bridge.testing.samples import make_sample_page, make_sample_zip, resource_path
from consumers import by_name, classify
from tests.support.bridge import bridge_environ
from tests.support.broker import Queues, Rodan
from tests.support.cluster import Cluster
from tests.support.harness import Harness
from tests.support.rodan3 import Rodan3Job, joined, take_all, wait_for_reply

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.broker,
    pytest.mark.slurm,
    pytest.mark.training,
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
]

SETTINGS = {
    "Batch Size": 8,
    "Maximum number of training epochs": 2,
    "Maximum number of samples per label": 100,
    "Patience": 15,
    "Patch height": 32,
    "Patch width": 32,
    "Maximum time (D-HH:MM)": "0-00:15",
    "Maximum memory (MB)": 4096,
    "CPUs": 1,
    "Slurm Notification Email": "",
}
PROJECT = "5" * 32


def upload(uploads: Path, name: str, data: bytes) -> str:
    """A Rodan resource holding ``data``; returns its path as Rodan sends it."""
    file, path = resource_path(uploads, PROJECT, name.encode().hex().ljust(32, "0")[:32])
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_bytes(data)
    return path


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


@pytest.fixture
def job(broker_url: str, queues: Queues) -> Iterator[Rodan3Job]:
    j = Rodan3Job(broker_url, queues)
    yield j
    j.delete()


@pytest.fixture
def harness(
    broker_url: str, standin: RodanStandin, queues: Queues, rodan: Rodan, tmp_path: Path, slurm: None
) -> Iterator[Harness]:
    spool = tmp_path / "spool"
    env = bridge_environ(
        broker_url,
        standin,
        queues,
        spool,
        HPC_LOG_FILE=str(tmp_path / "bridge.log"),
        HPC_SCHEDULER="slurm",
        HPC_GPU_RULES="none",
        HPC_REPLY_QUEUE=f"{queues.reply}, {queues.reply}.*",  # as the default, for this test's queue names
    )
    h = Harness(env, spool, rodan, Cluster("slurm"))
    yield h
    h.teardown()


def test_two_sample_zips_and_a_starting_model_train_into_rodan3s_outputs(
    harness: Harness, job: Rodan3Job, standin: RodanStandin, broker_url: str, tmp_path: Path
) -> None:
    uploads = standin.uploads_dir
    pages = [
        make_sample_page(tmp_path / "pages", generation="new", n_layers=2, height=256, width=256, seed=s)
        for s in (1, 2)
    ]
    zips = [make_sample_zip(tmp_path / f"sample-{i}.zip", tmp_path / "pages", page) for i, page in enumerate(pages, 1)]
    inputs = {
        "Sample 1": upload(uploads, "sample 1", zips[0].read_bytes()),
        "Sample 2": upload(uploads, "sample 2", zips[1].read_bytes()),
        "Background Model": upload(uploads, "background", starting_model(tmp_path / "start.hdf5", 32)),
    }
    corr, reply_to = job.publish(inputs, SETTINGS)

    messages = wait_for_reply(harness, broker_url, reply_to, timeout=900)
    reply = json.loads(joined(messages, corr))
    assert "error" not in reply, reply.get("error")
    assert list(reply) == ["Background Model", "Model 1", "Model 2", "Log File"]
    files = {key: base64.decodebytes(value.encode("ascii")) for key, value in reply.items()}  # as Rodan decodes

    story = files["Log File"].decode("utf-8")
    lines = story.splitlines()
    assert lines[0] == f"HPC training of request {corr}"
    assert "pages (2): Sample 1 (256x256 pixels); Sample 2 (256x256 pixels)" in story
    assert "training starts from: Background Model" in story
    for label in ("Background", "Layer 1", "Layer 2"):
        assert f"layer {label}\n" in story
        assert any(line.startswith(f"  layer {label}: best val_accuracy ") for line in lines), story
    assert lines[-1].endswith("over 1 job") and "finished: 3 models (Background Model, Model 1, Model 2)" in lines[-1]

    models = []
    for key in ("Background Model", "Model 1", "Model 2"):
        assert files[key].startswith(b"\x89HDF\r\n\x1a\n"), key
        path = tmp_path / "out" / f"{key}.hdf5"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(files[key])
        models.append(path)
    page_file = tmp_path / "pages" / pages[0]["Image"].removeprefix("/uploads/")
    labels_file = tmp_path / "labels.npy"
    info = classify(by_name("tf2.15.1-py3.11"), page_file, models, (128, 128), labels_file)
    labels = np.load(labels_file)
    assert info["tensorflow"] == "2.15.1"
    assert labels.shape == (256, 256) and set(np.unique(labels)) <= {0, 1, 2}

    harness.settle([corr])
    assert harness.ledger(corr)["state"] == "replied"
    assert take_all(broker_url, reply_to) == []  # one reply, nothing more
