"""Starting models: the weights a layer's training begins from instead of a fresh SAE's.

Rodan 3.x's trainer takes optional models on its ``Background Model``, ``Model 1`` ... ports
and trains them further. :func:`read_starting_model` reads such a file, checks it against the
network the trainer builds, and returns its weights in the order of
``build_sae(...).get_weights()``; :func:`worker.trainer.train.train_pages` sets them on the
layer's model before its first epoch.

**What is accepted.** A Keras HDF5 model file (or a weights-only HDF5 file: ``layer_names`` at
its root instead of in ``model_weights``) of at most :data:`MAX_MODEL_BYTES`, whose layers
*that hold weights*, in the file's order, are the SAE's (:func:`worker.trainer.model.build_sae`):
the same number (14 convolutions), each with the same number of weights (kernel and bias) of
the same shapes. Layers are matched by **order, never by name**: Paco's trainer writes Keras'
automatic names (``conv2d``, ``conv2d_1`` ... and a ``masking`` layer without weights), ours
``conv1_1`` ...; both write ``model_weights/<layer>`` groups in the model's layer order with
``weight_names`` in the layer's weight order, which is how Keras 2 itself reads weights back.
Anything else (another network, another filter count, a missing or extra convolution, a
non-float weight, an HDF5 file that is no Keras model, a file that is not HDF5 at all) raises
:class:`~worker.trainer.errors.TrainingInputError` naming the model and what differs.
Only the weights' datasets are read, after their shapes were checked, so a hostile file cannot
make the trainer read more than the SAE's 5.7 MB.

**Another patch size.** A model's saved input shape (Paco saves ``(None, height, width, 3)``
of its own settings) does not matter: the network is fully convolutional, its weights do not
depend on the window size, and Rodan's classifier feeds windows of its own settings' size
anyway. A model trained on other patches is accepted (and the difference logged); the input
must have 3 channels, which the first kernel's shape checks.

**Optimizer state is ignored**: training starts with a fresh Adam (learning rate 1e-4, as
every layer's). A file's Adam state belongs to the run that wrote it: to its data, its own
best epoch and step count (which drives Adam's bias correction), and it comes in two layouts
(Keras 2's legacy ``Adam/iter``, ``m``, ``v``; TensorFlow 2.11+'s ``optimizer_weights/Adam``),
one of which our own files omit by default. A fresh Adam treats every starting model alike,
whichever trainer wrote it, and keeps a checkpointed run's state entirely the trainer's own.
Paco's ``load_model`` restores the state instead; the difference is the size and direction of
the first few steps, not what the training converges to (``docs/researcher-guide.md``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import numpy.typing as npt

from worker.trainer.errors import TrainingInputError

log = logging.getLogger(__name__)

#: The largest starting model file read: the SAE is 5.7 MB of float32 weights, three times
#: that with Adam's state; Paco's files are about 17 MB.
MAX_MODEL_BYTES = 256 << 20
#: The most layers a file may list (the SAE has 22 in Paco's files, 20 in ours).
MAX_LAYERS = 1000
#: The HDF5 signature at the start of a model file.
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


def expected_shapes(patch_height: int, patch_width: int) -> list[list[tuple[int, ...]]]:
    """The weight shapes of every layer with weights of ``build_sae(patch_height, patch_width)``, in order."""
    from worker.trainer.model import build_sae

    model = build_sae(patch_height, patch_width)
    return [[tuple(int(d) for d in w.shape) for w in layer.weights] for layer in model.layers if layer.weights]


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _weight_layers(handle: h5py.File, name: str) -> list[tuple[str, list[h5py.Dataset]]]:
    """``(layer name, weight datasets)`` of every layer with weights, in the file's layer order."""
    group = handle["model_weights"] if "model_weights" in handle else handle
    if not isinstance(group, h5py.Group) or "layer_names" not in group.attrs:
        raise TrainingInputError(f"{name} is an HDF5 file but not a Keras model: it lists no layers (layer_names)")
    layer_names = [_text(n) for n in np.atleast_1d(group.attrs["layer_names"])]
    if len(layer_names) > MAX_LAYERS:
        raise TrainingInputError(f"{name} lists {len(layer_names)} layers: it is not the SAE")
    layers = []
    for layer_name in layer_names:
        layer = group.get(layer_name)
        if not isinstance(layer, h5py.Group):
            raise TrainingInputError(f"{name}: layer {layer_name!r} is listed but has no weights group")
        weight_names = [_text(n) for n in np.atleast_1d(layer.attrs.get("weight_names", []))]
        datasets = []
        for weight_name in weight_names:
            dataset = layer.get(weight_name)
            if not isinstance(dataset, h5py.Dataset):
                raise TrainingInputError(
                    f"{name}: weight {weight_name!r} of layer {layer_name!r} is listed but missing"
                )
            datasets.append(dataset)
        if datasets:
            layers.append((layer_name, datasets))
    return layers


def _describe(shapes: Sequence[tuple[int, ...]]) -> str:
    return ", ".join(str(shape) for shape in shapes) or "none"


def read_starting_model(path: Path, name: str, patch_height: int, patch_width: int) -> list[npt.NDArray[np.float32]]:
    """The weights of the starting model ``path`` in ``build_sae(...).get_weights()`` order (float32).

    ``name`` names the model in errors (e.g. ``"the starting model of layer 'Background' (bg.hdf5)"``).
    Raises TrainingInputError if the file is missing, too large, not HDF5, not a Keras model,
    or not the SAE (see the module docstring); the message says what differs.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            head = handle.read(len(HDF5_MAGIC))
    except FileNotFoundError:
        raise TrainingInputError(f"{name} cannot be read as a starting model: the file does not exist") from None
    except OSError as exc:
        raise TrainingInputError(f"{name} cannot be read as a starting model: {exc.strerror or exc}") from exc
    if size > MAX_MODEL_BYTES:
        raise TrainingInputError(
            f"{name} is {size} bytes, more than the {MAX_MODEL_BYTES >> 20} MiB a starting model may have"
        )
    if head != HDF5_MAGIC:
        raise TrainingInputError(f"{name} is not a Keras HDF5 model file (it starts with {head.hex() or 'nothing'})")
    expected = expected_shapes(patch_height, patch_width)
    try:
        with h5py.File(path, "r") as handle:
            layers = _weight_layers(handle, name)
            if len(layers) != len(expected):
                raise TrainingInputError(
                    f"{name} is not the SAE this trainer trains: it has {len(layers)} layers with weights, "
                    f"the SAE {len(expected)}"
                )
            for index, ((layer_name, datasets), shapes) in enumerate(zip(layers, expected, strict=True)):
                found = [tuple(int(d) for d in dataset.shape) for dataset in datasets]
                if found != shapes:
                    raise TrainingInputError(
                        f"{name} is not the SAE this trainer trains: its layer {index + 1} with weights "
                        f"({layer_name!r}) has weights of shapes {_describe(found)}, the SAE's {_describe(shapes)}"
                    )
                for dataset in datasets:
                    if dataset.dtype.kind != "f":
                        raise TrainingInputError(
                            f"{name}: weight {dataset.name} of layer {layer_name!r} is {dataset.dtype}, "
                            "not a floating-point type"
                        )
            weights = [np.asarray(dataset[()], dtype=np.float32) for _, datasets in layers for dataset in datasets]
            input_shape = _input_shape(handle)
    except TrainingInputError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise TrainingInputError(f"{name} is not a readable Keras HDF5 model file: {exc}") from exc
    for weight in weights:
        if not np.all(np.isfinite(weight)):
            raise TrainingInputError(f"{name} holds weights that are not finite numbers (NaN or infinity)")
    if input_shape is not None and input_shape[:2] not in ((patch_height, patch_width), (None, None)):
        log.info(
            "%s was saved for %sx%s windows; training it on %dx%d patches (the weights do not depend on the size)",
            name, input_shape[1], input_shape[0], patch_width, patch_height,
        )  # fmt: skip
    return weights


def _input_shape(handle: h5py.File) -> tuple[Any, ...] | None:
    """``(height, width, channels)`` of the saved model's input, None when the file does not say."""
    raw = handle.attrs.get("model_config")
    if raw is None:
        return None
    try:
        config = json.loads(_text(raw))
        first = config["config"]["layers"][0]["config"]
        shape = first.get("batch_input_shape") or first.get("batch_shape")
        return tuple(shape[1:]) if shape else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def file_digest(path: Path) -> str:
    """The SHA-256 of a starting model file (it identifies the run in its checkpoints)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
