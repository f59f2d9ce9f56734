"""Every model we return opens in the TensorFlow Rodan runs: TF 2.5.1 on Python 3.7, TF 2.15.1 on
Python 3.11, and the worker's own Keras 3 (consumers/, built by deploy/dev/setup.sh).

The models come from a real training through the whole path (a request published as Rodan does,
``hpc-bridge check`` passes, a Slurm job running the worker, the reply on the broker), one request
of each generation, one of them with ``HPC_SAVE_OPTIMIZER``. Each consumer runs as a subprocess:
``tensorflow.keras.models.load_model(path)`` as Rodan calls it, ``predict`` on windows of the page
at the training size and at a larger one, one ``fit`` step (consumers/verify.py compares both
with what the file's weights give in Keras 3, and with the original trainer's loss, metric and optimizer).
A consumer that is not built fails the test (never a skip): set-up builds them.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest

pytest.importorskip("keras")  # the worker extra is not installed on login nodes

import h5py
import numpy as np

from consumers import CONSUMERS, ConsumerUnavailable, by_name, find_python
from consumers.verify import PREDICTION_TOLERANCE, STATE_MARGIN, STEP_TOLERANCE, Verdict, page_image, verify
from tests.support.bridge import FAST_SETTINGS, NO_FRESH_STARTS, bridge_environ, run_bridge
from tests.support.cluster import cancel_spool_jobs

pytestmark = [
    pytest.mark.broker,
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
]

OLD_KEYS = ["Background Model", "Music Symbol Model", "Staff Lines Model", "Text Model"]
NEW_KEYS = ["Background Model", "Model 0"]
#: A training of seconds per layer: what a file holds does not depend on how long it trained.
SETTINGS = {**FAST_SETTINGS, "Maximum number of training epochs": 1}


def versions(verdicts: list[Verdict]) -> dict[str, dict[str, str]]:
    return {v.consumer: v.environment for v in verdicts}


@pytest.mark.training
@pytest.mark.slurm
def test_every_model_of_a_real_training_loads_predicts_and_trains_in_rodans_tensorflow(
    slurm, broker_url, standin, queues, rodan, sample_inputs, tmp_path
):
    spool = tmp_path / "spool"
    # What a file holds does not depend on how the training went: no fresh starts (NO_FRESH_STARTS).
    env = bridge_environ(
        broker_url, standin, queues, spool, HPC_LOG_FILE=str(tmp_path / "bridge.log"), HPC_JOB_PROLOGUE=NO_FRESH_STARTS
    )
    old_inputs = sample_inputs("old", height=256, width=320, seed=11)
    new_inputs = sample_inputs("new", n_layers=1, height=256, width=320, seed=12)
    try:
        # The older generation as configured by default; the newer with Adam's state in the files
        # (the bridge writes HPC_SAVE_OPTIMIZER into the job's parameters when it submits).
        old = rodan.publish_request(old_inputs, SETTINGS)
        assert run_bridge(env, "check").returncode == 0
        new = rodan.publish_request(new_inputs, SETTINGS)
        assert run_bridge({**env, "HPC_SAVE_OPTIMIZER": "true"}, "check").returncode == 0
        replies: dict[str, bytes] = {}
        deadline = time.monotonic() + 600
        while len(replies) < 2 and time.monotonic() < deadline:
            time.sleep(3)
            assert run_bridge(env, "check").returncode == 0
            replies.update({corr or "": body for corr, body, _ in rodan.drain()})
    finally:
        cancel_spool_jobs(spool)
    assert set(replies) == {old, new}, f"replies for {sorted(replies)}"

    models: dict[str, Path] = {}
    for corr, keys, tag in ((old, OLD_KEYS, "old"), (new, NEW_KEYS, "new+optimizer")):
        reply = json.loads(replies[corr])
        assert sorted(reply) == sorted(keys), reply.get("error")
        for key in keys:
            path = tmp_path / "models" / tag / f"{key}.hdf5"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(base64.decodebytes(reply[key].encode("ascii")))  # as Rodan decodes it
            models[f"{tag}: {key}"] = path
    for name, path in models.items():
        with h5py.File(path, "r") as f:
            assert ("optimizer_weights" in f) == name.startswith("new"), name

    # The windows come from the page the models trained on.
    image_path = standin.uploads_dir / old_inputs["Image"].removeprefix("/uploads/")
    verdicts = verify(models, page_image(image_path), (64, 64))
    assert len(verdicts) == len(models) * len(CONSUMERS)
    env_of = versions(verdicts)
    assert env_of["tf2.5.1-py3.7"]["python"].startswith("3.7.")
    assert (env_of["tf2.5.1-py3.7"]["tensorflow"], env_of["tf2.5.1-py3.7"]["keras"]) == ("2.5.1", "2.5.0")
    assert env_of["tf2.15.1-py3.11"]["python"].startswith("3.11.")
    assert (env_of["tf2.15.1-py3.11"]["tensorflow"], env_of["tf2.15.1-py3.11"]["keras"]) == ("2.15.1", "2.15.0")
    assert env_of["worker"]["keras"].startswith("3.")

    table = "\n".join(f"{v.model:<40} {v.consumer:<16} {v.summary()}" for v in verdicts)
    for verdict in verdicts:
        where = f"{verdict.model} in {verdict.consumer}"
        # Loaded (compiled, as Rodan loads it) with an input of any height and width, and predicts
        # what the weights predict at 64x64 and at 96x128.
        assert verdict.input_shape == [None, None, None, 3], f"{where}\n{table}"
        assert verdict.prediction_diff is not None and verdict.prediction_diff <= PREDICTION_TOLERANCE, table
        if verdict.consumer == "tf2.5.1-py3.7":
            # Re-serialized by TF 2.5.1's Keras, the model gives our config back: we wrote its schema.
            assert verdict.own_serialization, where
        if verdict.consumer == "worker" and verdict.optimizer_state:
            # Keras 3 cannot fit any HDF5 file holding optimizer state (its own neither): the one
            # known failure, reported as such (see worker/trainer/saving.py).
            assert verdict.known_defect and not verdict.ok, f"{where}: {verdict.error}"
            continue
        # One fit step with the original trainer's loss, metric and Adam: the same step as ours, from the file's
        # Adam state where it holds one (and clearly not from a fresh Adam).
        assert verdict.ok, f"{where}: {verdict.error}\n{table}"
        assert verdict.step_error is not None and verdict.step_error <= STEP_TOLERANCE
        if verdict.optimizer_state:
            assert verdict.fresh_step_error is not None
            assert verdict.fresh_step_error > STATE_MARGIN * max(verdict.step_error, 1e-9), where


def keras3_save(path: Path) -> Path:
    """A model file the way the worker wrote them before: Keras 3's own HDF5 writer."""
    from worker.trainer.model import build_sae

    build_sae(64, 64).save(str(path))
    return path


def layers_swapped(path: Path) -> Path:
    """Our file, with two layers of equal shapes listed in each other's place."""
    from worker.trainer.model import build_sae
    from worker.trainer.saving import LabelResult, save_model
    from worker.trainer.settings import TrainSettings

    result = LabelResult("Layer", build_sae(None, None).get_weights(), None, 1, 0.5, 1, 8, 2)
    request = dict(epochs=15, max_samples_per_label=10000, patch_height=256, patch_width=256, batch_size=16, patience=3)
    save_model(result, path, TrainSettings(**request))  # Rodan's defaults
    with h5py.File(path, "r+") as f:
        names = [n.decode() for n in f["model_weights"].attrs["layer_names"]]
        a, b = names.index("conv2_2"), names.index("conv9_2")  # both 3x3, 64 -> 64 filters
        names[a], names[b] = names[b], names[a]
        f["model_weights"].attrs["layer_names"] = np.array([n.encode() for n in names])
    return path


def test_the_consumers_refuse_what_rodan_would_refuse(tmp_path: Path) -> None:
    """The check has teeth against the real readers: Keras 3's own HDF5 (what the worker sent
    before) fails in both Rodan TensorFlows with the errors Rodan showed, and a file whose layers
    are listed out of order loads everywhere but predicts something else."""
    verdicts = verify(
        {"keras3": keras3_save(tmp_path / "keras3.hdf5"), "swapped": layers_swapped(tmp_path / "swapped.hdf5")},
        page_image(None),
        (64, 64),
    )
    got = {(v.model, v.consumer): v for v in verdicts}
    assert "Unrecognized keyword arguments" in (got["keras3", "tf2.5.1-py3.7"].error or "")
    assert "batch_shape" in (got["keras3", "tf2.5.1-py3.7"].error or "")
    assert "Error when deserializing class 'InputLayer'" in (got["keras3", "tf2.15.1-py3.11"].error or "")
    assert got["keras3", "worker"].loads  # Keras 3 reads its own files: why nobody saw it
    for consumer in ("tf2.5.1-py3.7", "tf2.15.1-py3.11", "worker"):
        swapped = got["swapped", consumer]
        assert swapped.loads and not swapped.ok and "predictions differ" in (swapped.error or ""), consumer


def test_a_consumer_that_is_not_built_fails_with_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPC_CONSUMERS_DIR", str(tmp_path / "empty"))
    consumer = by_name("tf2.5.1-py3.7")
    with pytest.raises(ConsumerUnavailable, match=r"not built .* run deploy/dev/setup\.sh"):
        consumer.python()
    # Built from other requirements (an upgrade changed them): rebuild, do not use it.
    (consumer.directory / "bin").mkdir(parents=True)
    (consumer.directory / "bin" / "python").symlink_to("/bin/true")
    (consumer.directory / ".hpc-bridge-consumer").write_text("0" * 64 + "\n")
    with pytest.raises(ConsumerUnavailable, match="other requirements"):
        consumer.python()


def test_a_missing_python_version_fails_with_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "no-pyenv"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("HPC_PYTHON_3_7", raising=False)
    with pytest.raises(ConsumerUnavailable, match=r"no Python 3\.7 found .*pyenv install 3\.7.*HPC_PYTHON_3_7"):
        find_python("3.7")
    monkeypatch.setenv("HPC_PYTHON_3_7", "/bin/true")
    with pytest.raises(ConsumerUnavailable, match=r"not a working Python 3\.7"):
        find_python("3.7")
