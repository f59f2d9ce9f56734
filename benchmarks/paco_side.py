"""The Paco_classifier side of ``bench_paco.py``, run in the TensorFlow 2.15.1 consumer environment.

Two commands, each printing one JSON line on stdout (Paco's own progress goes to stderr):

``paco_side.py train SPEC.json``
    Trains Paco_classifier's ``train_msae`` on the sample zips of SPEC as Rodan 3.1.0's
    ``FastPacoTrainer`` does (``../shared/rodan/README.md``): every sample zip unpacked into a folder
    of its own; the inputs keyed by file name without ``.png`` (``Image``, ``rgba PNG - Selected
    regions``, ``rgba PNG - Layer 0 (Background)``, ``rgba PNG - Layer 1`` ...), one entry per page;
    ``preprocess.preprocess`` (crops every page to its selected regions' bounding box, writes the
    ``.npy`` files); ``PacoTrainer`` with file selection SHUFFLE and sample extraction RANDOM, its
    batch size, patch size, epochs, samples per label and patience. Two things are added around it
    and change nothing it computes:

    * ``preprocess.getMemoryLimit`` reads the cgroup-v1 file ``/sys/fs/cgroup/memory/
      memory.limit_in_bytes`` and returns 0 GB where it is missing (cgroup v2, as here), which
      makes ``preprocess`` drop every layer ("ram_limit" = max(limit - 5, 0)). It is replaced by a
      function returning SPEC's ``memory_limit_gb`` (the parent passes this machine's MemTotal).
    * ``tf.keras.Model.fit`` is wrapped to append one observing callback that notes when every
      batch and epoch ends and the epoch logs (``val_accuracy`` as Paco reports it).

    The seed (``random``, NumPy, TensorFlow) is set once before training: Paco itself seeds nothing.

``paco_side.py score EVAL.npz PATCH INDEX:MODEL.hdf5 [INDEX:MODEL.hdf5 ...]``
    Scores models of either side on the held-out evaluation pages with the same code: each model is
    opened with ``tf.keras.models.load_model`` (as Rodan does), each page's held-out image (BGR,
    ``(255 - v) / 255`` as Rodan's classifier feeds it) is cut into PATCHxPATCH tiles (the last row
    and column of tiles aligned with the edge), and the prediction (> 0.5) is compared with the
    mask of the model's layer (``mask_<page>_<INDEX>``, INDEX 0 the background): pixel accuracy,
    F1 of the layer, the share of non-layer pixels, and whether the prediction is constant.

``paco_side.py label EVAL.npz WINDOW RUN:MODEL0.hdf5,MODEL1.hdf5,... [RUN:... ...]``
    What a musicologist gets: each run's models, background first, in port order, go to
    Paco_classifier's own ``recognition_engine.process_image_msae(image, models, WINDOW, WINDOW,
    mode="logical")`` on every held-out page, as Rodan 3.x's classifier job calls it; the label image
    (one label per pixel, the index of the model that won) is compared with every layer's mask: per
    layer, F1 of "labelled k" against ``mask_<page>_<k>``, and the share of pixels labelled k.

    The window must be over 51 pixels (the function pads 25 on every side and steps
    ``WINDOW - 51``), and Paco's own files accept only their training patch (their input is fixed:
    TensorFlow 2.15 refuses a 128 x 128 window for a 32 x 32 model). Such a file is therefore
    re-saved with an input of any size (``clone_model`` on a ``(None, None, 3)`` input, the same
    layers and weights) before classification, as ours are saved; the network is fully
    convolutional, so both sides are classified by the same code with the same window.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import shutil
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
STARTED = time.time()


def _paco_inputs(zips: list[str], work: Path) -> dict[str, list[dict[str, str]]]:
    """Unpack every sample zip into a folder of its own and key its files as FastPacoTrainer does."""
    inputs: dict[str, list[dict[str, str]]] = {}
    for index, zip_path in enumerate(zips):
        folder = work / f"sample-{index}"
        folder.mkdir(parents=True)
        with zipfile.ZipFile(zip_path) as archive:
            archive.extractall(folder)
        for file in sorted(folder.iterdir()):
            if file.suffix == ".png":
                inputs.setdefault(file.stem, []).append({"resource_path": str(file)})
    return inputs


def train(spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    import numpy as np
    import tensorflow as tf
    from Paco_classifier import fast_trainer_lib, preprocess
    from Paco_classifier.data_loader import FileSelectionMode, SampleExtractionMode

    imported = time.time()
    limit_gb = float(spec["memory_limit_gb"])
    preprocess.getMemoryLimit = lambda: limit_gb  # cgroup v2: the cgroup-v1 file is missing (module docstring)

    layers: list[dict[str, Any]] = []

    from timeline import timeline_class

    Timeline = timeline_class(tf.keras.callbacks.Callback)

    original_fit = tf.keras.Model.fit

    def observed_fit(self: Any, *args: Any, callbacks: Any = None, **kwargs: Any) -> Any:
        layer: dict[str, Any] = {"events": [], "history": []}
        layers.append(layer)
        timeline = Timeline(layer["events"], layer["history"])
        return original_fit(self, *args, callbacks=[*(callbacks or []), timeline], **kwargs)

    tf.keras.Model.fit = observed_fit

    seed = int(spec["seed"])
    random.seed(seed)
    np.random.seed(seed)
    tf.random.set_seed(seed)

    work = Path(spec["out_dir"])
    inputs = _paco_inputs(spec["zips"], work / "samples")
    n_layers = len([key for key in inputs if "Layer" in key])
    outputs = {
        ("Background Model" if i == 0 else f"Model {i}"): [{"resource_path": str(work / f"model-{i}")}]
        for i in range(n_layers)
    }
    training_started = time.time()
    with contextlib.redirect_stdout(sys.stderr):  # Paco prints its progress
        container = preprocess.preprocess(inputs, spec["batch_size"], spec["patch"], spec["patch"], spec["max_samples"])
        trainer = fast_trainer_lib.PacoTrainer(
            spec["batch_size"],
            spec["patch"],
            spec["patch"],
            spec["epochs"],
            spec["max_samples"],
            FileSelectionMode.SHUFFLE,
            SampleExtractionMode.RANDOM,
            container,
            outputs,
            {},
            spec["patience"],
        )
        trainer.runTrainer()
    training_s = time.time() - training_started
    shutil.rmtree(work / "samples", ignore_errors=True)
    models = []
    for i in range(n_layers):  # runTrainer renamed "<path>.hdf5" to the output's path; give it its suffix back
        path = work / f"model-{i}"
        path.rename(path.with_suffix(".hdf5"))
        models.append(str(path.with_suffix(".hdf5")))
    result = {
        "side": "paco",
        "import_s": imported - STARTED,
        "training_s": training_s,
        "layers": layers,
        "models": models,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "tensorflow": tf.__version__,
    }
    print(json.dumps(result))
    return 0


def _evaluation(eval_path: Path) -> tuple[Any, list[str]]:
    """The held-out evaluation npz and its page numbers (``image_<page>``)."""
    import numpy as np

    data = np.load(eval_path)
    return data, sorted({key.split("_")[1] for key in data.files if key.startswith("image_")})


def _f1(truth: Any, predicted: Any) -> float:
    """F1 of the boolean ``predicted`` against ``truth`` (1.0 when both are empty)."""
    import numpy as np

    tp = int(np.sum(truth & predicted))
    fp = int(np.sum(~truth & predicted))
    fn = int(np.sum(truth & ~predicted))
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 1.0


def score(eval_path: Path, patch: int, models: list[str]) -> int:
    """Score ``INDEX:PATH`` models on the held-out pages (module docstring); one JSON line per run."""
    import numpy as np
    import tensorflow as tf

    data, pages = _evaluation(eval_path)
    results = []
    for entry in models:
        index_text, path = entry.split(":", 1)
        index = int(index_text)
        model = tf.keras.models.load_model(path, compile=False)
        true_all = []
        pred_all = []
        for page in pages:
            image = data[f"image_{page}"]
            truth = data[f"mask_{page}_{index}"]
            h, w = truth.shape
            rows = sorted({*range(0, h - patch + 1, patch), h - patch})
            cols = sorted({*range(0, w - patch + 1, patch), w - patch})
            tiles = np.stack([image[r : r + patch, c : c + patch] for r in rows for c in cols])
            scaled = ((255.0 - tiles) / 255.0).astype(np.float32)
            chunks = [model(scaled[k : k + 64], training=False).numpy() for k in range(0, len(scaled), 64)]
            predicted = np.concatenate(chunks)[..., 0] > 0.5  # eager calls: no predict() pipeline per model
            out = np.zeros((h, w), dtype=bool)
            for k, (r, c) in enumerate((r, c) for r in rows for c in cols):
                out[r : r + patch, c : c + patch] = predicted[k]
            true_all.append(truth.ravel())
            pred_all.append(out.ravel())
        truth_v = np.concatenate(true_all)
        pred_v = np.concatenate(pred_all)
        results.append(
            {
                "model": entry,
                "accuracy": float(np.mean(truth_v == pred_v)),
                "f1": _f1(truth_v, pred_v),
                "non_layer_share": float(np.mean(~truth_v)),
                "positive_share": float(np.mean(pred_v)),
                "constant": bool(pred_v.all() or not pred_v.any()),
            }
        )
        tf.keras.backend.clear_session()
    print(json.dumps({"scores": results, "tensorflow": tf.__version__}))
    return 0


def _any_window(path: Path) -> str:
    """``path``, or a copy beside it whose input takes windows of any size (see the module docstring)."""
    import tensorflow as tf

    model = tf.keras.models.load_model(path, compile=False)
    if model.input_shape[1] is None:
        return str(path)
    flexible = tf.keras.models.clone_model(model, input_tensors=tf.keras.Input(shape=(None, None, 3)))
    flexible.set_weights(model.get_weights())
    copy = path.with_name(path.stem + "-any-window.hdf5")
    flexible.save(copy, save_format="h5")
    tf.keras.backend.clear_session()
    return str(copy)


def label(eval_path: Path, window: int, runs: list[str]) -> int:
    """Label images of the held-out pages by ``process_image_msae`` (module docstring); one JSON line."""
    import numpy as np
    import tensorflow as tf
    from Paco_classifier import recognition_engine

    data, pages = _evaluation(eval_path)
    results = []
    for entry in runs:
        run_id, paths_text = entry.split(":", 1)
        models = [_any_window(Path(path)) for path in paths_text.split(",")]
        predicted, truths = [], []
        started = time.time()
        for page in pages:
            with contextlib.redirect_stdout(sys.stderr):  # Paco prints every row of windows
                labels = recognition_engine.process_image_msae(
                    np.ascontiguousarray(data[f"image_{page}"]), models, window, window, mode="logical"
                )
            predicted.append(np.asarray(labels).ravel())
            truths.append([data[f"mask_{page}_{k}"].ravel() for k in range(len(models))])
            tf.keras.backend.clear_session()
        labelled = np.concatenate(predicted)
        layers = []
        for k in range(len(models)):
            truth = np.concatenate([t[k] for t in truths])
            mine = labelled == k
            layers.append(
                {
                    "f1": _f1(truth, mine),
                    "labelled_share": float(np.mean(mine)),
                    "truth_share": float(np.mean(truth)),
                }
            )
        results.append({"run": run_id, "layers": layers, "seconds": time.time() - started})
    print(json.dumps({"labels": results, "tensorflow": tf.__version__}))
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["train"] and len(argv) == 2:
        return train(Path(argv[1]))
    if argv[:1] == ["score"] and len(argv) >= 4:
        return score(Path(argv[1]), int(argv[2]), argv[3:])
    if argv[:1] == ["label"] and len(argv) >= 4:
        return label(Path(argv[1]), int(argv[2]), argv[3:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
