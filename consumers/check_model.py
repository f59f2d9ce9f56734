"""Open model files the way Rodan does, with whatever TensorFlow runs this script.

Run by :mod:`consumers` with each consumer environment's Python (3.7 and later: nothing
newer than 3.7's syntax here, and only TensorFlow, NumPy and h5py). For every model file:

1. ``tensorflow.keras.models.load_model(path)``, exactly as Rodan's classifier and trainer
   jobs call it (no ``custom_objects``, compiled);
2. ``predict`` on every ``x_*`` array of the data file (windows scaled ``(255 - v) / 255``,
   BGR, as Rodan's classifier feeds them);
3. one ``fit`` step on ``x_fit``/``y_fit`` (the whole array as one batch, as Rodan's trainer
   would continue a model it was given).

Prints one JSON line per model; the predictions (``p_*``) and the weights after the step
(``w_0`` ...) go to ``OUT/<index>.npz`` for the caller to compare.

Usage: check_model.py DATA.npz OUT_DIR MODEL.hdf5 [MODEL.hdf5 ...]
"""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import h5py
import numpy as np
import tensorflow as tf

ADAM_KEYS = ("learning_rate", "beta_1", "beta_2", "epsilon", "amsgrad")


def describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0][:400] if text else ""
    return f"{type(exc).__name__}: {first}"


def plain(value: Any) -> Any:
    """A config value as JSON (NumPy and TensorFlow scalars included)."""
    if isinstance(value, (bool, str)) or value is None:
        return value
    try:
        return float(np.asarray(value))
    except (TypeError, ValueError):
        return str(value)


def optimizer_summary(model: Any) -> dict[str, Any] | None:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return None
    config = optimizer.get_config()
    return {
        "class": type(optimizer).__name__,
        "config": {key: plain(config.get(key)) for key in ADAM_KEYS},
        "iterations": int(np.asarray(optimizer.iterations)),
    }


def own_serialization(model: Any, path: str) -> bool:
    """Whether this Keras, serializing the model it loaded, writes the file's config back."""
    with h5py.File(path, "r") as f:
        stored = f.attrs["model_config"]
    stored = json.loads(stored.decode("utf-8") if hasattr(stored, "decode") else stored)
    again = json.loads(model.to_json())
    again.pop("keras_version", None)
    again.pop("backend", None)
    return bool(again == stored)


def check(path: str, data: dict[str, Any], out_path: str) -> dict[str, Any]:
    result: dict[str, Any] = {"model": path}
    try:
        model = tf.keras.models.load_model(path)
    except Exception as exc:  # what Rodan's job would die of
        result["load_error"] = describe(exc)
        return result
    result["input_shape"] = list(model.input_shape)
    loss = getattr(model, "loss", None)
    result["loss"] = None if loss is None else getattr(loss, "__name__", str(loss))
    result["optimizer"] = optimizer_summary(model)
    result["config_is_own_serialization"] = own_serialization(model, path)
    arrays: dict[str, Any] = {}
    try:
        for key in sorted(data):
            if key.startswith("x_"):
                arrays["p_" + key[2:]] = np.asarray(model.predict(data[key], verbose=0), dtype=np.float32)
    except Exception as exc:
        result["predict_error"] = describe(exc)
    try:
        x, y = data["x_fit"], data["y_fit"]
        history = model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
        result["fit"] = {key: float(values[-1]) for key, values in history.history.items()}
        for index, weight in enumerate(model.get_weights()):
            arrays[f"w_{index}"] = np.asarray(weight)
    except Exception as exc:
        result["fit_error"] = describe(exc)
    np.savez(out_path, **arrays)
    result["arrays"] = out_path
    return result


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        sys.stderr.write(__doc__ or "")
        return 2
    data_path, out_dir, models = argv[0], argv[1], argv[2:]
    with np.load(data_path) as loaded:
        data = {key: loaded[key] for key in loaded.files}
    keras_version = getattr(tf.keras, "__version__", None)
    if keras_version is None:  # TensorFlow 2.15: tf.keras is the separate keras 2.15 package
        import keras

        keras_version = keras.__version__
    environment = {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": str(keras_version),
        "numpy": np.__version__,
        "h5py": h5py.__version__,
    }
    print(json.dumps({"environment": environment}), flush=True)
    for index, path in enumerate(models):
        result = check(path, data, os.path.join(out_dir, f"{index}.npz"))
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
