"""The trainer on both Keras backends: TensorFlow (this process) and JAX (child processes).

Each JAX child runs with TensorFlow made unimportable, so the JAX path is proven to need none
of it (the GPU machines it is meant for have no TensorFlow). Keras 3 seeds TensorFlow too when
it is importable, which is why the block is needed to prove it.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from tests.pages import striped_page
from tests.support.training import last_json, run_python
from worker.trainer import CheckpointStore, TrainingInterrupted, TrainSettings, train_page, train_pages
from worker.trainer.backend import BackendError, choose_backend
from worker.trainer.train import kept_trained_on

pytestmark = pytest.mark.filterwarnings(  # TensorFlow's variables and NumPy 2, inside Keras
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)

#: No fresh starts (``max_fresh_starts=0``): the first-epoch guard is tests/test_fresh_start.py's subject;
#: here it would train each tiny layer's first epoch up to three times.
SETTINGS = TrainSettings(
    epochs=2,
    max_samples_per_label=48,
    patch_height=32,
    patch_width=32,
    batch_size=8,
    patience=5,
    seed=4,
    max_fresh_starts=0,
)

#: Trains SETTINGS on the striped page in a JAX process without TensorFlow (argv: out dir, JSON
#: of label -> starting model, run dir root); prints its epochs and model paths as JSON.
JAX_TRAINING = """
    import dataclasses, json, sys
    from pathlib import Path
    sys.modules["tensorflow"] = None  # importing it now fails: the JAX path must not need it
    from tests.pages import striped_page
    from worker.trainer import TrainSettings, train_pages
    from worker.trainer._keras import BACKEND, keras
    from worker.trainer.rundir import RunDirectory
    assert BACKEND == "jax" == keras.backend.backend()
    settings = TrainSettings(**json.loads(sys.argv[1]))
    out, starting, runs = Path(sys.argv[2]), json.loads(sys.argv[3]), Path(sys.argv[4])
    events = []
    run = RunDirectory.create(runs, "jax")
    paths = train_pages([striped_page()], settings, out, on_epoch=events.append, run_dir=run,
                        initial_models={k: Path(v) for k, v in starting.items()})
    print(json.dumps({"events": events, "paths": {k: str(v) for k, v in paths.items()}, "run": str(run.path)}))
"""


def run_jax(code: str, *args: str, devices: int = 1, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter on Keras' JAX backend, with ``devices`` CPU devices."""
    xla = f"--xla_force_host_platform_device_count={devices}"
    return run_python(code, *args, timeout=timeout, KERAS_BACKEND="jax", XLA_FLAGS=xla)


def hdf5_weights(path: Path) -> dict[str, np.ndarray[Any, Any]]:
    """Every dataset of a Keras 2 HDF5 model file's ``model_weights``, by its path in the file."""
    found: dict[str, np.ndarray[Any, Any]] = {}
    with h5py.File(path, "r") as f:
        f["model_weights"].visititems(
            lambda name, item: found.__setitem__(name, item[()]) if isinstance(item, h5py.Dataset) else None
        )
    return found


def model_config(path: Path) -> Any:
    with h5py.File(path, "r") as f:
        return json.loads(f.attrs["model_config"])


def test_the_backend_is_keras_backend_else_what_is_installed() -> None:
    assert choose_backend({"KERAS_BACKEND": "jax"}) == "jax"
    assert choose_backend({"KERAS_BACKEND": " TensorFlow "}) == "tensorflow"
    assert choose_backend({}) == "tensorflow"  # both are installed here: TensorFlow first
    with pytest.raises(BackendError, match=r"torch.*tensorflow or jax"):
        choose_backend({"KERAS_BACKEND": "torch"})


@pytest.mark.training
@pytest.mark.slow  # four short trainings, then Rodan's two TensorFlow versions open JAX's models
def test_both_backends_train_the_same_models_from_the_same_start(tmp_path: Path) -> None:
    """From the same starting models, on the same samples in the same order, TensorFlow and JAX
    (without TensorFlow) train the same weights and the same validation accuracy, write the same
    Keras 2 HDF5 files, which open and classify in Rodan's TensorFlow 2.5.1 and 2.15.1, and JAX's
    run directory has its history and TensorBoard files."""
    from consumers.verify import verify

    start = train_page(striped_page(), dataclasses.replace(SETTINGS, epochs=1), tmp_path / "start")
    starting = {label: str(path) for label, path in start.items()}
    tf_events: list[dict[str, Any]] = []
    tf_paths = train_pages(
        [striped_page()], SETTINGS, tmp_path / "tf", on_epoch=tf_events.append,
        initial_models={k: Path(v) for k, v in starting.items()},
    )  # fmt: skip
    fields = {f.name: getattr(SETTINGS, f.name) for f in dataclasses.fields(SETTINGS)}
    jax = last_json(
        run_jax(JAX_TRAINING, json.dumps(fields), str(tmp_path / "jax"), json.dumps(starting), str(tmp_path / "runs"))
    )

    assert [(e["label"], e["epoch"]) for e in jax["events"]] == [(e["label"], e["epoch"]) for e in tf_events]
    for ours, theirs in zip(jax["events"], tf_events, strict=True):
        for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-3, abs=1e-3), (key, ours, theirs)
    for label, path in tf_paths.items():
        jax_path = Path(jax["paths"][label])
        assert jax_path.name == path.name
        assert model_config(jax_path) == model_config(path)
        mine, reference = hdf5_weights(jax_path), hdf5_weights(path)
        assert sorted(mine) == sorted(reference)
        for name, value in reference.items():
            assert mine[name].dtype == value.dtype == np.float32 and mine[name].shape == value.shape
            np.testing.assert_allclose(mine[name], value, atol=2e-3, err_msg=f"{label} {name}")
        started = hdf5_weights(Path(starting[label]))
        moved = max(float(np.abs(mine[n] - started[n]).max()) for n in started)
        assert moved > 1e-4  # JAX trained (Adam moves a weight ~1e-4 a step), it did not hand the start back

    jax_models = {f"{label}, trained on JAX": Path(path) for label, path in jax["paths"].items()}
    verdicts = verify(jax_models, striped_page().image, (32, 32))
    assert verdicts and all(v.ok for v in verdicts), [(v.consumer, v.error) for v in verdicts]
    assert {v.consumer for v in verdicts} >= {"tf2.5.1-py3.7", "tf2.15.1-py3.11"}

    run = Path(jax["run"])
    assert (run / "history.csv").is_file()
    import tensorflow as tf  # TensorFlow's own reader, for the event files JAX wrote without it

    tags = set()
    for path in (run / "tensorboard").rglob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            tags.update((path.parent.name, value.tag, event.step) for value in event.summary.value)
    assert {("train", "epoch_loss", step) for step in range(2)} <= tags
    assert {("validation", "epoch_accuracy", step) for step in range(2)} <= tags


@pytest.mark.training
def test_a_run_continues_only_on_the_backend_it_started_on(tmp_path: Path) -> None:
    """A run interrupted on TensorFlow is refused by a JAX worker, saying what to do; the
    checkpoint records the backend and the precision."""
    store = CheckpointStore(tmp_path / "checkpoints")
    with pytest.raises(TrainingInterrupted):
        train_page(striped_page(), SETTINGS, tmp_path / "a", checkpoints=store, stop_requested=lambda: True)
    state = store.load_latest()
    assert state is not None and state.run["trained_on"] == {"backend": "tensorflow", "mixed_precision": "off"}
    code = """
        import sys
        sys.modules["tensorflow"] = None
        from pathlib import Path
        from tests.pages import striped_page
        from worker.trainer import CheckpointStore, TrainingInputError, TrainSettings, train_page
        settings = TrainSettings(epochs=2, max_samples_per_label=48, patch_height=32, patch_width=32,
                                 batch_size=8, patience=5, seed=4, max_fresh_starts=0)
        try:
            train_page(striped_page(), settings, Path(sys.argv[1]), checkpoints=CheckpointStore(Path(sys.argv[2])))
        except TrainingInputError as exc:
            print(exc)
        else:
            print("resumed")
    """
    done = run_jax(code, str(tmp_path / "b"), str(tmp_path / "checkpoints"))
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout.strip().splitlines()[-1]
    assert "written on Keras' tensorflow backend and this worker runs jax" in said, said
    assert "KERAS_BACKEND=tensorflow" in said


def test_a_resumed_run_keeps_its_precision_and_old_checkpoints_are_tensorflows() -> None:
    now = {"backend": "tensorflow", "mixed_precision": "off"}
    saved = {"trained_on": {"backend": "tensorflow", "mixed_precision": "bfloat16"}}
    assert kept_trained_on(saved, now, "here") == {"backend": "tensorflow", "mixed_precision": "bfloat16"}
    assert kept_trained_on({}, now, "here") == now  # written before checkpoints recorded it: TensorFlow's
    with pytest.raises(Exception, match="written on Keras' tensorflow backend and this worker runs jax"):
        kept_trained_on({}, {"backend": "jax", "mixed_precision": "off"}, "here")


@pytest.mark.training
def test_jax_shares_each_batch_over_several_devices_and_trains_the_same(tmp_path: Path) -> None:
    """On two CPU devices (``--xla_force_host_platform_device_count``, what several GPUs are on a
    node), keras.distribution splits every batch and trains what one device trains."""
    code = """
        import json, sys
        sys.modules["tensorflow"] = None
        from pathlib import Path
        import numpy as np
        from tests.pages import striped_page
        from worker.trainer import TrainSettings, train_page
        from worker.trainer._keras import keras
        from worker.trainer.distribute import plan_training
        out = Path(sys.argv[1])
        results = {}
        for name, strategy in (("one", ("cpu:0",)), ("two", ("cpu:0", "cpu:1"))):
            settings = TrainSettings(epochs=1, max_samples_per_label=32, patch_height=32, patch_width=32,
                                     batch_size=8, patience=3, seed=5, strategy=strategy, max_fresh_starts=0)
            events = []
            paths = train_page(striped_page(), settings, out / name, on_epoch=events.append)
            plan = plan_training(settings)
            weights = keras.models.load_model(paths["Layer 0"], compile=False).get_weights()
            np.save(out / f"{name}.npy", np.concatenate([w.ravel() for w in weights]))
            results[name] = {"replicas": plan.replicas, "describe": plan.describe(),
                             "val_accuracy": [e["val_accuracy"] for e in events]}
        print(json.dumps(results))
    """
    found = last_json(run_jax(code, str(tmp_path), devices=2))
    assert found["one"]["replicas"] == 1 and found["two"]["replicas"] == 2
    assert "DataParallel strategy, 2 replica(s) on cpu:0, cpu:1" in found["two"]["describe"]
    # The same batches and gradients, summed in another order across the devices: float differences only.
    assert found["two"]["val_accuracy"] == pytest.approx(found["one"]["val_accuracy"], abs=1e-3)
    np.testing.assert_allclose(np.load(tmp_path / "two.npy"), np.load(tmp_path / "one.npy"), atol=1e-3)


def test_doctor_job_reports_the_backend_and_the_devices_it_sees() -> None:
    """What ``doctor --job`` runs in the worker's Python on a node, here on JAX with two CPU devices."""
    from worker.probe import BACKEND_CODE, BACKEND_MARKER, judge_gpus

    done = run_jax(BACKEND_CODE, devices=2, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith(BACKEND_MARKER)]
    found = json.loads(line[len(BACKEND_MARKER) :])
    assert found["backend"] == "jax" and found["gpus"] == 0 and len(found["devices"]) == 2, found
    assert found["version"] == __import__("jax").__version__
    short = judge_gpus(1, 0, backend="jax", cuda=False)
    assert short.status == "FAIL" and "JAX sees 0 (this JAX is built without CUDA)" in short.found
    assert "hpc-bridge[worker-jax]" in short.fix
    assert "visible to JAX" in judge_gpus(0, 0, backend="jax").found
