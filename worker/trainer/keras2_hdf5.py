"""The Keras 2 HDF5 model file, written from a Keras 3 model: the schema Rodan's TensorFlow reads.

A ``.hdf5`` model file is a model config (JSON), a training config (JSON), the weights of
every layer and, optionally, the optimizer's state. Readers instantiate the model from
the config, copy the weights into it layer by layer, and compile it from the training
config. Keras 3 writes its own config schema into that file, which no Keras 2 reader
understands (see :mod:`worker.trainer.saving` for who reads our files and why). This module
writes the whole file itself, in the schema TensorFlow 2.5's Keras (``keras_version``
2.5.0) writes, the oldest one Rodan runs:

- ``model_config``: :func:`model_config` translates ``model.get_config()`` key by key.
  :data:`LAYER_KEYS` lists, per layer class, the keys a Keras 2 layer's ``__init__``
  takes; :data:`KERAS3_ONLY` the keys Keras 3 adds, each dropped only while it holds the
  value that means "as Keras 2 does". Any other key, class or value raises
  :class:`Keras2SchemaError`: a Keras upgrade that adds to what it writes fails
  ``tests/test_saving.py`` (which also pins the result to a golden file) instead of
  shipping files Rodan cannot open.
- ``training_config``: the loss and the metrics by name (``"binary_crossentropy"``,
  ``["accuracy"]``: every reader resolves ``accuracy`` to binary accuracy for this loss)
  and the optimizer in the *legacy* Keras 2 optimizer schema. Without
  ``is_legacy_optimizer`` in that config, TensorFlow 2.11 to 2.15 build their legacy
  ``Adam``, whose state has 2.5's variable order, so one file restores in both.
- ``model_weights``: one group per layer (``layer_names`` in model order), each weight at
  ``<layer>/<layer>/<weight>:0``, float32. Readers assign weights by position; the names
  are what Keras 2 wrote and what tools show.
- ``optimizer_weights`` (optional): Adam's state in Keras 2's ``OptimizerV2`` order:
  ``iter``, then the first moment of every trainable variable, then the second moment of
  every trainable variable. Keras 3 keeps ``[iteration, learning_rate, m_1, v_1, m_2, v_2,
  ...]``; :func:`adam_state` checks that layout by the variables' paths before reordering.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import numpy.typing as npt

from worker.trainer._keras import keras

#: The Keras version whose schema the file follows (TensorFlow 2.5.1 bundles Keras 2.5.0).
KERAS2_VERSION = "2.5.0"

#: Per layer class: the keys of its Keras 2 config, in the order Keras 2.5 writes them.
_BASE = ("name", "trainable", "dtype")
LAYER_KEYS: dict[str, tuple[str, ...]] = {
    "InputLayer": ("batch_input_shape", "dtype", "sparse", "ragged", "name"),
    "Conv2D": (
        *_BASE,
        "filters",
        "kernel_size",
        "strides",
        "padding",
        "data_format",
        "dilation_rate",
        "groups",
        "activation",
        "use_bias",
        "kernel_initializer",
        "bias_initializer",
        "kernel_regularizer",
        "bias_regularizer",
        "activity_regularizer",
        "kernel_constraint",
        "bias_constraint",
    ),
    "MaxPooling2D": (*_BASE, "pool_size", "padding", "strides", "data_format"),
    "UpSampling2D": (*_BASE, "size", "data_format", "interpolation"),
    "Concatenate": (*_BASE, "axis"),
}
#: Per initializer class: the keys of its Keras 2 config.
INITIALIZER_KEYS: dict[str, tuple[str, ...]] = {
    "HeNormal": ("seed",),
    "GlorotUniform": ("seed",),
    "Zeros": (),
}
#: Keys Keras 3 writes that Keras 2 does not know, with the one value that may be dropped.
KERAS3_ONLY: dict[str, Any] = {"optional": False, "input_axes": None, "output_axes": None}
#: Keras 3 keys renamed in Keras 2.
_RENAMED = {"batch_shape": "batch_input_shape"}
#: Adam's Keras 2 (legacy) config keys; then the Keras 3 keys that must hold these values
#: (features Keras 2's legacy Adam does not have).
ADAM_KEYS = ("learning_rate", "beta_1", "beta_2", "epsilon", "amsgrad")
ADAM_UNUSED: dict[str, Any] = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}
#: Keras 3 Adam keys with no effect while ``ADAM_UNUSED`` holds (ema_momentum needs use_ema).
_ADAM_IGNORED = ("name", "ema_momentum")


class Keras2SchemaError(ValueError):
    """The Keras 3 model holds something this writer cannot express in the Keras 2 schema."""


def _fail(where: str, what: str) -> Keras2SchemaError:
    return Keras2SchemaError(
        f"{where}: {what}; a Keras 2 reader (Rodan's TensorFlow) would not load it. "
        "Keras may have changed what it writes: see worker/trainer/keras2_hdf5.py"
    )


def _dtype(value: Any, where: str) -> str:
    """A Keras 3 dtype policy (a name or a serialized DTypePolicy) as Keras 2's dtype name."""
    name = value
    if isinstance(value, Mapping):
        if value.get("class_name") != "DTypePolicy":
            raise _fail(where, f"dtype policy {value.get('class_name')!r}")
        name = value.get("config", {}).get("name")
    if name != "float32":
        raise _fail(where, f"dtype {name!r} (the file holds a float32 model)")
    return "float32"


def _initializer(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping) or value.get("class_name") not in INITIALIZER_KEYS:
        raise _fail(where, f"initializer {value!r}")
    name = str(value["class_name"])
    config = _translate(dict(value.get("config") or {}), INITIALIZER_KEYS[name], f"{where} {name}")
    return {"class_name": name, "config": config}


def _translate(config: dict[str, Any], keys: Sequence[str], where: str) -> dict[str, Any]:
    """``config`` with exactly ``keys`` (renamed, Keras-3-only defaults dropped); else raise."""
    config = {_RENAMED.get(key, key): value for key, value in config.items()}
    for key, value in list(config.items()):
        if key in keys:
            continue
        if key in KERAS3_ONLY and value == KERAS3_ONLY[key]:
            del config[key]
            continue
        raise _fail(where, f"key {key!r} = {value!r}")
    missing = [key for key in keys if key not in config]
    if missing:
        raise _fail(where, f"no {', '.join(missing)}")
    return {key: config[key] for key in keys}


def _layer_config(class_name: str, config: dict[str, Any], where: str) -> dict[str, Any]:
    if class_name not in LAYER_KEYS:
        raise _fail(where, f"layer class {class_name!r}")
    out = _translate(config, LAYER_KEYS[class_name], where)
    out["dtype"] = _dtype(out["dtype"], where)
    for key in ("kernel_initializer", "bias_initializer"):
        if key in out:
            out[key] = _initializer(out[key], f"{where}.{key}")
    if "activation" in out and not isinstance(out["activation"], str):
        raise _fail(where, f"activation {out['activation']!r} (only built-in activations by name)")
    return out


def _tensor(value: Any, where: str) -> list[Any]:
    """A Keras 3 serialized tensor as a Keras 2 node input: ``[layer, node, tensor, {}]``."""
    if not isinstance(value, Mapping) or value.get("class_name") != "__keras_tensor__":
        raise _fail(where, f"node input {value!r}")
    layer, node, tensor = value["config"]["keras_history"]
    return [str(layer), int(node), int(tensor), {}]


def _nodes(nodes: Sequence[Any], where: str) -> list[list[list[Any]]]:
    out = []
    for node in nodes:
        if not isinstance(node, Mapping) or node.get("kwargs") or len(node.get("args", ())) != 1:
            raise _fail(where, f"inbound node {node!r} (one positional input, no keyword arguments)")
        (inputs,) = node["args"]
        many = isinstance(inputs, (list, tuple))
        out.append([_tensor(t, where) for t in inputs] if many else [_tensor(inputs, where)])
    return out


def _endpoints(value: Sequence[Any]) -> list[list[Any]]:
    """Keras 3 writes one input or output as ``[name, 0, 0]``, Keras 2 always a list of them."""
    items = [value] if value and isinstance(value[0], str) else list(value)
    return [[str(name), int(node), int(tensor)] for name, node, tensor in items]


def model_config(model: Any) -> dict[str, Any]:
    """The Keras 2 config of the functional ``model``: what ``model.to_json()`` gave in Keras 2.5."""
    config = model.get_config()
    layers = []
    for layer in config["layers"]:
        class_name, name = str(layer["class_name"]), str(layer["name"])
        where = f"layer {name!r} ({class_name})"
        layers.append(
            {
                "class_name": class_name,
                "config": _layer_config(class_name, dict(layer["config"]), where),
                "name": name,
                "inbound_nodes": _nodes(layer.get("inbound_nodes", []), where),
            }
        )
    translated = {
        "class_name": "Functional",
        "config": {
            "name": str(config["name"]),
            "layers": layers,
            "input_layers": _endpoints(config["input_layers"]),
            "output_layers": _endpoints(config["output_layers"]),
        },
    }
    return dict(json.loads(json.dumps(translated)))  # as stored: JSON lists where Keras 3 has tuples


def training_config(model: Any) -> dict[str, Any]:
    """The Keras 2 training config of the compiled ``model``: loss, metrics, legacy Adam."""
    compiled = model.get_compile_config() if getattr(model, "optimizer", None) is not None else None
    if not compiled:
        raise _fail("training config", "the model is not compiled")
    loss, metrics = compiled.get("loss"), compiled.get("metrics")
    if not isinstance(loss, str) or not (isinstance(metrics, list) and all(isinstance(m, str) for m in metrics)):
        raise _fail("training config", f"loss {loss!r} and metrics {metrics!r} (only built-ins by name)")
    for key in ("loss_weights", "weighted_metrics"):
        if compiled.get(key) is not None:
            raise _fail("training config", f"{key} {compiled[key]!r}")
    return {
        "loss": loss,
        "metrics": metrics,
        "weighted_metrics": None,
        "loss_weights": None,
        "optimizer_config": _adam_config(model.optimizer),
    }


def _adam_config(optimizer: Any) -> dict[str, Any]:
    if type(optimizer).__name__ != "Adam":
        raise _fail("optimizer", f"{type(optimizer).__name__} (this writer knows Adam)")
    config = dict(optimizer.get_config())
    for key, unused in ADAM_UNUSED.items():
        value = config.pop(key, unused)
        if value != unused:
            raise _fail("optimizer", f"Adam {key} = {value!r}")
    for key in _ADAM_IGNORED:
        config.pop(key, None)
    adam = _translate(config, ADAM_KEYS, "optimizer Adam")
    if not isinstance(adam["learning_rate"], float):
        raise _fail("optimizer", f"learning rate {adam['learning_rate']!r} (a constant)")
    # No "decay" (Keras 2.5 writes 0.0; absent is the same there, and Keras 3 warns that it ignores it).
    return {"class_name": "Adam", "config": {"name": "Adam", **adam}}


def adam_state(model: Any, values: Sequence[npt.NDArray[Any]]) -> list[tuple[str, npt.NDArray[Any]]]:
    """Keras 3 Adam variable ``values`` as Keras 2's ``(name, value)`` list, in its order.

    ``values`` are those of ``model.optimizer.variables`` (a Keras 3 Adam built for
    ``model.trainable_variables``): ``[iteration, learning_rate, m_1, v_1, ...]``. The
    result is ``[("Adam/iter:0", ...), ("Adam/<var>/m:0", ...) for each variable,
    ("Adam/<var>/v:0", ...) for each variable]``.
    """
    paths = [v.path for v in model.optimizer.variables]
    trainable = model.trainable_variables
    if len(values) != len(paths) or len(paths) != 2 + 2 * len(trainable):
        raise _fail("optimizer state", f"{len(values)} values for {len(paths)} Adam variables")
    if not (paths[0].endswith("/iteration") and paths[1].endswith("/learning_rate")):
        raise _fail("optimizer state", f"Adam variables start with {paths[:2]}")
    moments: dict[str, list[tuple[str, npt.NDArray[Any]]]] = {"m": [], "v": []}
    for i, variable in enumerate(trainable):
        stem = variable.path.replace("/", "_")
        for offset, (moment, suffix) in enumerate((("m", "_momentum"), ("v", "_velocity"))):
            position = 2 + 2 * i + offset
            value = np.asarray(values[position])
            if not paths[position].endswith(stem + suffix) or value.shape != tuple(variable.shape):
                raise _fail("optimizer state", f"{paths[position]} {value.shape} where {stem}{suffix} was expected")
            moments[moment].append((f"Adam/{variable.path}/{moment}:0", value.astype(np.float32)))
    iterations = np.asarray(values[0]).astype(np.int64)
    return [("Adam/iter:0", iterations), *moments["m"], *moments["v"]]


def _bytes_list(names: Sequence[str]) -> npt.NDArray[Any]:
    # What Keras 2 stores (fixed-length bytes); an empty list stays an empty array.
    return np.array([n.encode("utf-8") for n in names]) if names else np.array([], dtype=np.float64)


def _datasets(group: h5py.Group, named: Sequence[tuple[str, npt.NDArray[Any]]]) -> None:
    group.attrs["weight_names"] = _bytes_list([name for name, _ in named])
    for name, value in named:
        group.create_dataset(name, data=value)


def write(path: Path, model: Any, optimizer_state: Sequence[npt.NDArray[Any]] | None = None) -> None:
    """Write the compiled float32 ``model`` to ``path`` as a Keras 2.5 HDF5 model file.

    With ``optimizer_state`` (the values of ``model.optimizer.variables``), the file also
    holds Adam's state (see :func:`adam_state`).
    """
    config, training = model_config(model), training_config(model)
    optimizer = adam_state(model, optimizer_state) if optimizer_state is not None else None
    layers: list[tuple[str, list[tuple[str, npt.NDArray[Any]]]]] = []
    for layer in model.layers:
        weights = []
        for variable in layer.weights:
            if variable.dtype != "float32":
                raise _fail(f"layer {layer.name!r}", f"weight {variable.path} is {variable.dtype}")
            weights.append((f"{layer.name}/{variable.name}:0", np.asarray(variable.numpy(), dtype=np.float32)))
        layers.append((layer.name, weights))
    with h5py.File(path, "w") as f:
        f.attrs["keras_version"] = KERAS2_VERSION
        f.attrs["backend"] = "tensorflow"
        f.attrs["model_config"] = json.dumps(config).encode("utf-8")
        f.attrs["training_config"] = json.dumps(training).encode("utf-8")
        f.attrs["written_by"] = f"hpc-bridge worker (Keras {keras.__version__})"
        weights_group = f.create_group("model_weights")
        weights_group.attrs["layer_names"] = _bytes_list([name for name, _ in layers])
        weights_group.attrs["backend"] = b"tensorflow"
        weights_group.attrs["keras_version"] = KERAS2_VERSION.encode("utf-8")
        for name, weights in layers:
            _datasets(weights_group.create_group(name), weights)
        if optimizer is not None:
            _datasets(f.create_group("optimizer_weights"), optimizer)
