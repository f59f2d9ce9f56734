"""The model file's schema (worker/trainer/keras2_hdf5.py): pinned, strict, float32, Keras 2 layout.

Whether Rodan's TensorFlow actually opens these files is tests/test_consumers.py's question;
this module pins what we write, so that a Keras upgrade that changes Keras 3's config fails
here (the translation refuses what it does not know, or the result leaves the golden file)
instead of shipping files the consumers would refuse.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("keras")  # the worker extra is not installed on login nodes

import h5py
import keras

from worker.trainer import keras2_hdf5
from worker.trainer.distribute import dtype_policy
from worker.trainer.keras2_hdf5 import Keras2SchemaError, model_config, training_config
from worker.trainer.model import build_sae, compile_sae
from worker.trainer.saving import LabelResult, save_model
from worker.trainer.settings import TrainSettings

#: A request's settings, Rodan's defaults (the trainer has none of its own for them).
REQUEST = dict(epochs=15, max_samples_per_label=10000, patch_height=256, patch_width=256, batch_size=16, patience=3)

pytestmark = pytest.mark.filterwarnings(  # TensorFlow's variables and NumPy 2, inside Keras
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)

#: TensorFlow 2.5.1's own serialization of the SAE with an input of any size: ``model.to_json()``
#: of this network built with tf.keras 2.5 gives exactly this (tests/test_consumers.py checks, in
#: TensorFlow 2.5.1, that re-serializing the model it loaded from our file gives our config back).
GOLDEN = Path(__file__).parent / "golden" / "sae_model_config.keras2.json"

#: The training config every model file carries: the original trainer's compile() in Keras 2's schema.
TRAINING_CONFIG = {
    "loss": "binary_crossentropy",
    "metrics": ["accuracy"],
    "weighted_metrics": None,
    "loss_weights": None,
    "optimizer_config": {
        "class_name": "Adam",
        "config": {
            "name": "Adam",
            "learning_rate": pytest.approx(1e-4, rel=1e-6),
            "beta_1": 0.9,
            "beta_2": 0.999,
            "epsilon": 1e-7,
            "amsgrad": False,
        },
    },
}


def compiled_sae() -> Any:
    model = build_sae(None, None)
    compile_sae(model)
    return model


def test_model_config_is_the_golden_keras2_config() -> None:
    assert model_config(build_sae(None, None)) == json.loads(GOLDEN.read_text())


def test_training_config_is_the_original_compile_in_keras2_schema() -> None:
    assert training_config(compiled_sae()) == TRAINING_CONFIG


class Changed:
    """A model whose Keras 3 config or optimizer config a future Keras might write differently."""

    def __init__(self, model: Any, edit: Any) -> None:
        self._model, self._edit = model, edit

    def get_config(self) -> dict[str, Any]:
        config = copy.deepcopy(self._model.get_config())
        self._edit(config)
        return config


def _conv1(config: dict[str, Any]) -> dict[str, Any]:
    return next(layer for layer in config["layers"] if layer["name"] == "conv1_1")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: _conv1(c)["config"].update(lora_rank=None), "key 'lora_rank'"),
        (lambda c: c["layers"][0]["config"].update(optional=True), "key 'optional' = True"),
        (lambda c: _conv1(c)["config"]["dtype"]["config"].update(name="mixed_float16"), "dtype 'mixed_float16'"),
        (lambda c: _conv1(c).update(class_name="SeparableConv2D"), "layer class 'SeparableConv2D'"),
        (lambda c: _conv1(c)["config"]["kernel_initializer"]["config"].update(seed=None, mode="x"), "key 'mode'"),
        (lambda c: _conv1(c)["config"].pop("groups"), "no groups"),
        (lambda c: _conv1(c)["inbound_nodes"][0]["kwargs"].update(training=True), "no keyword arguments"),
    ],
)
def test_what_keras2_cannot_read_is_refused_not_written(edit: Any, message: str) -> None:
    with pytest.raises(Keras2SchemaError, match=message) as caught:
        model_config(Changed(build_sae(None, None), edit))
    assert "Rodan's TensorFlow" in str(caught.value)


def test_keras3_only_keys_at_their_keras2_meaning_are_dropped() -> None:
    config = model_config(build_sae(None, None))
    assert config["config"]["layers"][0]["config"] == {
        "batch_input_shape": [None, None, None, 3],  # Keras 3's batch_shape; "optional": False dropped
        "dtype": "float32",
        "sparse": False,
        "ragged": False,
        "name": "image",
    }
    assert _conv1(config["config"])["config"]["kernel_initializer"] == {
        "class_name": "HeNormal",
        "config": {"seed": None},
    }


def test_an_optimizer_keras2_adam_cannot_express_is_refused() -> None:
    model = build_sae(None, None)
    model.compile(optimizer=keras.optimizers.Adam(1e-4, clipnorm=1.0), loss="binary_crossentropy", metrics=["accuracy"])
    with pytest.raises(Keras2SchemaError, match=r"clipnorm = 1\.0"):
        training_config(model)
    model.compile(optimizer=keras.optimizers.SGD(), loss="binary_crossentropy", metrics=["accuracy"])
    with pytest.raises(Keras2SchemaError, match="SGD"):
        training_config(model)
    with pytest.raises(Keras2SchemaError, match="not compiled"):
        training_config(build_sae(None, None))


def _names(attribute: Any) -> list[str]:
    return [n.decode() if isinstance(n, bytes) else str(n) for n in attribute]


def trained_result(include_optimizer: bool) -> tuple[LabelResult, Any]:
    """A model after two Adam steps, as the trainer hands it to save_model."""
    model = compiled_sae()
    rng = np.random.default_rng(0)
    x = rng.random((4, 16, 16, 3), dtype=np.float32)
    y = (rng.random((4, 16, 16, 1)) > 0.5).astype(np.float32)
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
    state = [np.array(keras.ops.convert_to_numpy(v)) for v in model.optimizer.variables] if include_optimizer else None
    result = LabelResult("Layer", [np.array(w) for w in model.get_weights()], state, 1, 0.5, 1, 4, 1)
    return result, model


@pytest.mark.training  # fits a model (two Adam steps)
@pytest.mark.parametrize("include_optimizer", [False, True])
def test_the_file_has_keras2s_layout_float32_weights_and_adams_order(tmp_path: Path, include_optimizer: bool) -> None:
    result, trained = trained_result(include_optimizer)
    path = save_model(result, tmp_path / "model.hdf5", TrainSettings(**REQUEST, include_optimizer=include_optimizer))
    assert [p.name for p in tmp_path.iterdir()] == ["model.hdf5"], "no temporary file left"
    with h5py.File(path, "r") as f:
        assert f.attrs["keras_version"] == "2.5.0" and f.attrs["backend"] == "tensorflow"
        assert json.loads(f.attrs["model_config"]) == json.loads(GOLDEN.read_text())
        assert json.loads(f.attrs["training_config"]) == TRAINING_CONFIG
        weights = f["model_weights"]
        assert _names(weights.attrs["layer_names"]) == [layer.name for layer in trained.layers]
        for layer in trained.layers:
            names = _names(weights[layer.name].attrs["weight_names"])
            assert names == [f"{layer.name}/{v.name}:0" for v in layer.weights]
            for name, variable in zip(names, layer.weights, strict=True):
                stored = weights[layer.name][name]
                assert stored.dtype == np.float32
                np.testing.assert_array_equal(stored[()], np.asarray(variable))
        if not include_optimizer:
            assert "optimizer_weights" not in f
            return
        group = f["optimizer_weights"]
        names = _names(group.attrs["weight_names"])
        paths = [v.path for v in trained.trainable_variables]
        assert names == ["Adam/iter:0", *[f"Adam/{p}/m:0" for p in paths], *[f"Adam/{p}/v:0" for p in paths]]
        assert group["Adam/iter:0"].dtype == np.int64 and int(group["Adam/iter:0"][()]) == 2
        by_path = {v.path.split("/", 1)[1]: np.asarray(v) for v in trained.optimizer.variables}
        for p in paths:
            np.testing.assert_array_equal(group[f"Adam/{p}/m:0"][()], by_path[f"{p.replace('/', '_')}_momentum"])
            np.testing.assert_array_equal(group[f"Adam/{p}/v:0"][()], by_path[f"{p.replace('/', '_')}_velocity"])


@pytest.mark.training  # fits a model (two Adam steps)
def test_optimizer_state_in_an_unknown_layout_is_refused(tmp_path: Path) -> None:
    result, _ = trained_result(include_optimizer=True)
    assert result.optimizer_variables is not None
    shuffled = [result.optimizer_variables[0], *result.optimizer_variables[2:], result.optimizer_variables[1]]
    with pytest.raises(Keras2SchemaError):
        save_model(
            LabelResult(**{**result.__dict__, "optimizer_variables": shuffled}),
            tmp_path / "model.hdf5",
            TrainSettings(**REQUEST, include_optimizer=True),
        )
    assert not list(tmp_path.iterdir())  # nothing half-written left behind


def test_a_model_that_is_not_float32_is_refused(tmp_path: Path) -> None:
    with dtype_policy("float16"):
        half = build_sae(None, None)
    compile_sae(half)
    with pytest.raises(Keras2SchemaError, match="float16"):
        keras2_hdf5.write(tmp_path / "half.hdf5", half)
