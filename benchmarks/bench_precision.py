"""Does mixed precision train models as accurate as float32? Validation accuracy per layer and policy.

The question behind ``HPC_MIXED_PRECISION`` (default off: float32, the original trainer's precision). For
each layer of one real page (a crop of the Einsiedeln masks, with a page image synthesized from
them: ``bridge.testing.samples.synthesize_page_from_masks``) and each dtype policy, the layer is
trained from the same initial weights on the same sampled patches in the same order, with the
trainer's own pieces: ``build_sae``/``compile_sae`` (Adam 1e-4, binary cross-entropy),
``sample_centres``, ``split_validation`` and ``PatchDataset`` (the last fifth validates), a fixed
number of epochs and no early stopping. ``float32 (seed 2)`` trains float32 again from other
initial weights and shuffles: the spread of float32 against itself, the yardstick for "the same
accuracy".

It uses Keras alone (no ``tf.distribute``), and ``fit`` reads the trainer's own input pipeline
(``worker.trainer.dataset.training_input``, on either backend), so it runs on any Keras backend that
pipeline supports: TensorFlow here, JAX on a GPU machine that has no TensorFlow (``--backend jax``, or
``KERAS_BACKEND=jax``; without ``--backend`` the environment's choice stands). The page's masks come
from ``HPC_EINSIEDELN_DIR`` (default: the data set beside the checkout,
``bridge.testing.samples.EINSIEDELN_DIR``).

    .venv/bin/python benchmarks/bench_precision.py --quick                                # smoke test, CPU: ~20 s
    .venv/bin/python benchmarks/bench_precision.py --patch 32 --samples 200 --epochs 2   # a small run, CPU
    python benchmarks/bench_precision.py --backend jax                                    # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: The Keras backends ``--backend`` offers.
BACKENDS = ("tensorflow", "jax")


def chosen_backend(argv: list[str]) -> str | None:
    """``--backend`` of ``argv`` (None when absent), read before anything imports Keras."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--backend", choices=BACKENDS)
    return early.parse_known_args(argv)[0].backend  # type: ignore[no-any-return]


if __name__ == "__main__" and (_backend := chosen_backend(sys.argv[1:])) is not None:
    os.environ["KERAS_BACKEND"] = _backend  # Keras reads it once, when first imported
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from benchmarks.tables import print_table  # noqa: E402
from bridge.testing.samples import EINSIEDELN_DIR, synthesize_page_from_masks  # noqa: E402
from worker.trainer import load_page  # noqa: E402
from worker.trainer._keras import keras  # noqa: E402
from worker.trainer.callbacks import EpochShuffle  # noqa: E402
from worker.trainer.dataset import PatchDataset, split_validation, training_input  # noqa: E402
from worker.trainer.distribute import dtype_policy  # noqa: E402
from worker.trainer.model import build_sae, compile_sae  # noqa: E402
from worker.trainer.sampling import sample_centres  # noqa: E402

#: (label shown, Keras dtype policy, seed offset): float32 twice, to see its own spread.
RUNS = {
    "float32": ("float32", 0),
    "float32 (seed 2)": ("float32", 1),
    "float16": ("mixed_float16", 0),
    "bfloat16": ("mixed_bfloat16", 0),
}
#: The old generation's inputs of synthesize_page_from_masks, by the mask they come from.
LAYERS = {"Background": "Background", "Neumes": "Music Layer", "StaffLines": "Staff Layer"}
#: ``--quick``: a 512x512 crop with all three layers, one layer, float32 only (mixed precision is several
#: times slower on a CPU), one epoch of 3 steps: that the benchmark still runs, not what it measures.
QUICK: dict[str, Any] = {
    "patch": 32,
    "samples": 48,
    "epochs": 1,
    "layers": ["Neumes"],
    "runs": ["float32"],
    "crop": [1024, 2048, 1536, 2560],
}
QUICK_DESCRIPTION = "32x32, at most 48 samples, 1 epoch, Neumes, float32, a 512x512 crop"


class EpochTimes(keras.callbacks.Callback):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self._start = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def load_real_page(crop: tuple[int, int, int, int], work: Path) -> Any:
    inputs = synthesize_page_from_masks(EINSIEDELN_DIR, work, crop, generation="old", seed=0, text_layer="empty")

    def file(name: str) -> Path:
        return work / inputs[name].removeprefix("/uploads/")

    layers = {label: file(name) for label, name in LAYERS.items()}
    return load_page(file("Image"), layers, file("Selected Regions"))


def train(page: Any, label: str, centres: Any, policy: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    keras.utils.set_random_seed(seed)
    train_centres, validation_centres = split_validation(centres, 0.2)
    mask = page.masks[label]
    rng = np.random.default_rng(seed)
    data = PatchDataset(page.image, mask, train_centres, args.patch, args.patch, args.batch, shuffle_rng=rng)
    validation = PatchDataset(page.image, mask, validation_centres, args.patch, args.patch, args.batch)
    with dtype_policy(policy):
        model = build_sae(args.patch, args.patch)
        compile_sae(model)
    times = EpochTimes()
    history = model.fit(
        training_input(data),
        validation_data=training_input(validation),
        epochs=args.epochs,
        shuffle=False,
        callbacks=[EpochShuffle(data.shuffle), times],
        verbose=0,
    ).history
    val = [float(v) for v in history["val_accuracy"]]
    keras.backend.clear_session()
    return {
        "val_accuracy": val,
        "best": max(val),
        "best_epoch": int(np.argmax(val)) + 1,
        "final_loss": float(history["loss"][-1]),
        "seconds_per_epoch": float(np.median(times.seconds[1:] or times.seconds)),
        "first_epoch_s": times.seconds[0],
        "train": len(train_centres),
        "validation": len(validation_centres),
        "not_layer_share": float(1.0 - mask.mean()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patch", type=int, default=128, help="square patch side (a multiple of 4)")
    parser.add_argument("--samples", type=int, default=1500, help="maximum samples per label")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", nargs="+", default=["Neumes", "StaffLines"], choices=list(LAYERS))
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--crop", type=int, nargs=4, default=[0, 1024, 2048, 3072], metavar=("L", "T", "R", "B"))
    parser.add_argument(
        "--seeds", type=int, default=1,
        help="train every run from this many seeds (initial weights and shuffles); from 2 on, a second table "
        "judges each policy against float32's own spread across its seeds",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write every run's numbers here")
    parser.add_argument(
        "--backend", choices=BACKENDS, help="the Keras backend (default: KERAS_BACKEND, else Keras' own default)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: " + QUICK_DESCRIPTION)
    args = parser.parse_args()
    if args.quick:  # QUICK's values replace the defaults; options given still win
        parser.set_defaults(**QUICK)
        args = parser.parse_args()
    if args.backend is not None and keras.backend.backend() != args.backend:
        parser.error(f"--backend {args.backend}: Keras was imported on {keras.backend.backend()} already")

    with tempfile.TemporaryDirectory(prefix="bench-precision-") as scratch:
        page = load_real_page(tuple(args.crop), Path(scratch))
    centres = sample_centres(page.masks, args.patch, args.patch, args.samples, np.random.default_rng(0))
    print(
        f"Keras {keras.__version__} on {keras.backend.backend()} ({device()}); page {page.image.shape[1]}x"
        f"{page.image.shape[0]} from the Einsiedeln masks; {args.patch}x{args.patch} patches, batch {args.batch}, "
        f"{args.epochs} epochs, at most {args.samples} samples per label",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    seeded: dict[str, list[dict[str, Any]]] = {}  # "label/run" -> one result per seed
    for label in args.layers:
        for run in args.runs:
            policy, offset = RUNS[run]
            for index in range(args.seeds):
                result = train(page, label, centres[label], policy, 7 + offset + 100 * index, args)
                seeded.setdefault(f"{label}/{run}", []).append(result)
                print(f"{label} {run} seed {index + 1}: {json.dumps(result)}", flush=True)
            results[f"{label}/{run}"] = seeded[f"{label}/{run}"][0]
    rows = []
    for label in args.layers:
        reference = results.get(f"{label}/float32")
        for run in args.runs:
            r = results[f"{label}/{run}"]
            delta = "" if reference is None or run == "float32" else f"{r['best'] - reference['best']:+.4f}"
            rows.append([
                label, run, f"{r['best']:.4f} (epoch {r['best_epoch']})", delta, f"{r['val_accuracy'][-1]:.4f}",
                f"{r['not_layer_share']:.4f}", f"{r['seconds_per_epoch']:.2f}", f"{r['first_epoch_s']:.1f}",
            ])  # fmt: skip
    print()
    print_table(
        ["layer", "precision", "best val_accuracy", "vs float32", "last", "not-layer share", "s/epoch", "1st epoch s"],
        rows,
    )
    if args.seeds > 1 and "float32" in args.runs:
        print()
        print_decision(args.layers, [run for run in args.runs if run != "float32"], seeded)
    if args.json:
        everything = {"args": vars(args) | {"json": str(args.json)}, "results": results, "seeded": seeded}
        args.json.write_text(json.dumps(everything, indent=1))
    return 0


def print_decision(layers: list[str], runs: list[str], seeded: dict[str, list[dict[str, Any]]]) -> None:
    """Per layer and policy: does its mean best val_accuracy over the seeds reach float32's mean,
    within float32's own spread (its best seed minus its worst)?"""
    rows = []
    for label in layers:
        reference = [r["best"] for r in seeded[f"{label}/float32"]]
        spread = max(reference) - min(reference)
        for run in runs:
            bests = [r["best"] for r in seeded[f"{label}/{run}"]]
            gap = float(np.mean(reference)) - float(np.mean(bests))
            rows.append([
                label, run, " ".join(f"{b:.4f}" for b in reference), f"{spread:.4f}",
                " ".join(f"{b:.4f}" for b in bests), f"{gap:+.4f}", "yes" if gap <= spread else "no",
            ])  # fmt: skip
    print_table(
        ["layer", "policy", "float32 best per seed", "float32 spread", "policy best per seed",
         "float32 mean - policy mean", "within float32's spread"],
        rows,
    )  # fmt: skip


def device() -> str:
    """Where Keras computes: JAX's first device by kind, else the first GPU Keras sees, else the CPU."""
    if keras.backend.backend() == "jax":
        import jax

        return str(jax.devices()[0].device_kind)
    gpus = [name for name in keras.distribution.list_devices() if name.lower().startswith("gpu")]
    return f"{len(gpus)} GPU(s)" if gpus else f"CPU ({os.cpu_count()} cores)"


if __name__ == "__main__":
    raise SystemExit(main())
