"""The original patchwise trainer, ported faithfully, for ``benchmarks/bench_trainer.py`` only.

Runs in its own stack (Python 3.7, TensorFlow 1.14, standalone Keras 2.3.1: see
``requirements-tf1.14-py3.7.txt`` beside this file), never in the product. It is
``training_engine_sae.py`` of DDMAL's hpc-trainer-component (the trainer Rodan's HPC
component ran): the same ``get_sae`` (layers, initialisers, Adam(lr=1e-4), binary
cross-entropy, accuracy), ``getTrain``'s patch cutting (``(255. - patch) / 255.`` per
float64 patch, the masks' slices, lists turned into arrays with ``np.asarray``) and
``train_msae``'s loop (one fresh model per layer; ``fit`` on the arrays with
``validation_split=0.2``, ``batch_size=16``, ModelCheckpoint of the best val_accuracy to
an HDF5 file, EarlyStopping with patience 3), with two differences for the comparison:

* the sample centres are given (the benchmark's, drawn once by the project's sampler)
  instead of drawn by ``getTrain``'s per-pixel loop, so that both trainers train and
  validate on the very same patches (the loop itself is compared in ``bench_sampling.py``);
* with ``initial_weights`` in the spec, each layer's model starts from the weights the
  project's trainer started that layer from (its seed's ``he_normal`` draws), so that the
  two trainers' validation accuracies differ only by what they do, not by their random
  starting points (with 36 steps at lr 1e-4 the starting point decides most of it);
* a callback records when every batch, validation and epoch begins and ends (the benchmarks'
  one ``Timeline``, ``benchmarks/timeline.py``), and ``verbose=0`` replaces ``verbose=2`` (a line
  per epoch on stdout, which carries the JSON).

Usage: ``python original_trainer.py SPEC.json`` where the spec names an ``.npz`` with
``image`` (uint8 H x W x 3 in BGR order, as ``cv2.imread`` gives it), ``mask_<i>`` (bool)
and ``centres_<i>`` (int64 (n, 2)) per layer ``i`` of ``labels``, and ``epochs``,
``batch_size``, ``patch``, ``out_dir``. Prints one JSON object.
"""

import json
import os
import resource
import sys
import time

STARTED = time.time()

import numpy as np  # noqa: E402
from keras.callbacks import Callback, EarlyStopping, ModelCheckpoint  # noqa: E402
from keras.layers import Concatenate, Conv2D, Input, MaxPooling2D, UpSampling2D  # noqa: E402
from keras.models import Model  # noqa: E402
from keras.optimizers import Adam  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for timeline.py
from timeline import timeline_class  # noqa: E402

IMPORTED = time.time()
VALIDATION_SPLIT = 0.2


def get_sae(height, width):
    ff = 32
    inputs = Input(shape=(height, width, 3))

    def conv(filters, size):
        return Conv2D(filters, size, activation="relu", padding="same", kernel_initializer="he_normal")

    conv1 = conv(ff, 3)(inputs)
    conv1 = conv(ff, 3)(conv1)
    pool1 = MaxPooling2D(pool_size=(2, 2))(conv1)
    conv2 = conv(ff * 2, 3)(pool1)
    conv2 = conv(ff * 2, 3)(conv2)
    pool2 = MaxPooling2D(pool_size=(2, 2))(conv2)
    conv3 = conv(ff * 8, 3)(pool2)
    conv7 = conv(ff * 8, 3)(conv3)
    up8 = UpSampling2D(size=(2, 2))(conv7)
    up8 = conv(ff * 4, 2)(up8)
    merge8 = Concatenate(axis=3)([conv2, up8])
    conv8 = conv(ff * 4, 3)(merge8)
    conv8 = conv(ff * 4, 3)(conv8)
    up9 = UpSampling2D(size=(2, 2))(conv8)
    up9 = conv(ff * 2, 2)(up9)
    merge9 = Concatenate(axis=3)([conv1, up9])
    conv9 = conv(ff * 2, 3)(merge9)
    conv9 = conv(ff * 2, 3)(conv9)
    conv9 = conv(2, 3)(conv9)
    conv10 = Conv2D(1, 1, activation="sigmoid")(conv9)
    model = Model(inputs=inputs, outputs=conv10)
    model.compile(optimizer=Adam(lr=1e-4), loss="binary_crossentropy", metrics=["accuracy"])
    return model


def get_train(input_image, gt, centres, patch_height, patch_width):
    """getTrain's cutting, at the given centres (its loop appends in the same row-major order)."""
    x_train, y_train = {}, {}
    for label in gt:
        x_train[label] = []
        y_train[label] = []
        for row, col in centres[label]:
            from_x = row - (patch_height // 2)
            from_y = col - (patch_width // 2)
            sample_x = input_image[from_x : from_x + patch_height, from_y : from_y + patch_width]
            sample_x = (255.0 - sample_x) / 255.0
            sample_y = gt[label][from_x : from_x + patch_height, from_y : from_y + patch_width]
            x_train[label].append(sample_x)
            y_train[label].append(sample_y)
    for label in gt:
        y_train[label] = np.expand_dims(np.asarray(y_train[label]), axis=-1)
        x_train[label] = np.asarray(x_train[label]).reshape(len(x_train[label]), patch_height, patch_width, 3)
    return x_train, y_train


#: Wall-clock times of the fit's events: the same record as the project's side of the benchmark.
Timeline = timeline_class(Callback)


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(spec_path):
    with open(spec_path) as handle:
        spec = json.load(handle)
    data = np.load(spec["npz"])
    labels = spec["labels"]
    image = data["image"]
    gt = {label: data[f"mask_{i}"] for i, label in enumerate(labels)}
    centres = {label: data[f"centres_{i}"] for i, label in enumerate(labels)}
    patch = spec["patch"]
    result = {"side": "original", "import_s": IMPORTED - STARTED, "layers": []}
    began = time.time()
    x_train, y_train = get_train(image, gt, centres, patch, patch)
    result["prepare_s"] = time.time() - began
    result["rss_after_prepare"] = peak_rss_bytes()
    initial = np.load(spec["initial_weights"]) if spec.get("initial_weights") else None
    training_started = time.time()
    result["training_started"] = training_started
    for index, label in enumerate(labels):
        layer = {"label": label, "events": []}
        layer["build_begin"] = time.time()
        model = get_sae(height=patch, width=patch)
        if initial is not None:
            count = len(model.get_weights())
            model.set_weights([initial[f"{index}_{k}"] for k in range(count)])
        callbacks = [
            ModelCheckpoint(
                os.path.join(spec["out_dir"], f"original-{label}.hdf5"),
                save_best_only=True,
                monitor="val_accuracy",
                verbose=0,
                mode="max",
            ),
            EarlyStopping(monitor="val_accuracy", patience=3, verbose=0, mode="max"),
            Timeline(layer["events"]),
        ]
        layer["fit_call"] = time.time()
        history = model.fit(
            x_train[label],
            y_train[label],
            verbose=0,
            batch_size=spec["batch_size"],
            validation_split=VALIDATION_SPLIT,
            callbacks=callbacks,
            epochs=spec["epochs"],
        )
        layer["fit_return"] = time.time()
        layer["history"] = {key: [float(v) for v in values] for key, values in history.history.items()}
        layer["train_samples"] = int(len(x_train[label]) * (1 - VALIDATION_SPLIT))
        result["layers"].append(layer)
    result["training_s"] = time.time() - training_started
    result["peak_rss"] = peak_rss_bytes()
    result["total_s"] = time.time() - STARTED
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
