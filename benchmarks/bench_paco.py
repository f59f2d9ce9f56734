"""Our multi-page trainer against Paco_classifier's own ``train_msae`` (what Rodan 3.1.0 runs), same samples.

Both sides train on the same two sample zips (as Pixel.js writes them: ``Image.png``, ``rgba PNG -
Selected regions.png``, ``rgba PNG - Layer 0 (Background).png``, ``rgba PNG - Layer 1.png`` (neumes),
``rgba PNG - Layer 2.png`` (staff lines)), each a 1024 x 1024 crop of the real Einsiedeln masks
(``HPC_EINSIEDELN_DIR``, by default ``bridge.testing.samples.EINSIEDELN_DIR``) with an image
synthesized from them, whose selected region is the top :data:`TRAIN_ROWS` rows only. The rows
from :data:`EVAL_TOP` down are the held-out evaluation neither side trains on (the gap between
keeps our patches, centred on selected pixels, out of it; Paco crops the page to the region).

* **paco**: ``paco_side.py train`` in the TensorFlow 2.15.1 consumer environment
  (``consumers.by_name("tf2.15.1-py3.11")``, Paco_classifier from ``consumers.paco.paco_source()``):
  ``preprocess`` and ``PacoTrainer.runTrainer`` → ``train_msae`` as Rodan 3.1.0's FastPacoTrainer
  calls them (file selection SHUFFLE, sample extraction RANDOM), with Paco's cgroup-v1 memory probe
  replaced by a function returning this machine's MemTotal (see ``paco_side.py``).
* **ours**: ``worker.sample_zips.read_samples`` and ``worker.trainer.train_pages`` in ``.venv``, with
  the worker's oneDNN choice first, as the worker runs them.

Two parts:

* **speed** at Rodan 3.1.0's default patch and batch (256 x 256, batch 8) over a fixed, small number
  of steps (one epoch: a default run of 1 000 samples x 50 epochs takes hours on 2 cores). The
  samples per label differ here (``--speed-samples`` for Paco, ``--speed-samples-ours`` for ours),
  only so that each side runs a few steady steps per layer: Paco runs samples // batch steps
  whatever the page, while ours (the original trainer's sampler) centres 256 x 256 patches at
  least 256 px from the page's edges and draws about a quarter to a half of the cap on these
  1024 x 1024 pages (5, 6 and 9 of 24; 41, 24 and 39 of 100). A step's work (patch, batch, network)
  is the same on both sides. Every step's end is noted by an observing Keras callback on both sides;
  "steady" steps are those after each fit's first step (tracing) and before each epoch's last (ours
  may be a partial batch). Peak RSS is each child's own ``getrusage`` maximum.
* **accuracy** at a small setting that learns (``--patch``/``--samples``/``--epochs``/``--batch``),
  ``--seeds`` seeds per side. Every model of both sides is scored by one ``paco_side.py score``
  process (TensorFlow 2.15.1's ``load_model``, as Rodan opens the files) on the held-out rows of both
  pages: pixel accuracy and F1 against the layer's mask; a layer is stuck where the prediction is
  constant or its F1 is below 0.01 (the model never left "all background" / "all layer"). Beside them the best
  ``val_accuracy`` as each side reports it (Paco: 2 random batches per epoch, one per page; ours:
  the held-out fifth of its samples).

Every subprocess goes through ``bridge.shell.run_command``; runs alternate sides, with the
1-minute load average noted.

    .venv/bin/python benchmarks/bench_paco.py --skip-speed   # accuracy only: ~35 min at load 4-9 on 2 cores
    .venv/bin/python benchmarks/bench_paco.py                # + speed, 256x256: over 13 min a side at load 4-9
    .venv/bin/python benchmarks/bench_paco.py --quick     # smoke test: tiny settings, one run per side
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STARTED = time.time()
REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
PACO_SIDE = HERE / "paco_side.py"
CONSUMER = "tf2.15.1-py3.11"
#: Two 1024 x 1024 crops (left, top, right, bottom) of the 4872 x 12992 masks, with neumes and staff lines.
CROPS = ((1024, 2048, 2048, 3072), (1024, 3072, 2048, 4096))
#: The selected region (what both sides train on): rows 0 .. TRAIN_ROWS of every page.
TRAIN_ROWS = 640
#: The held-out evaluation: rows EVAL_TOP .. the bottom of every page (256 rows).
EVAL_TOP = 640 + 128
#: The layers in the zips' order (Layer 0 is the background), as each side numbers its models.
LAYER_NAMES = ("Background", "Neumes (Layer 1)", "StaffLines (Layer 2)")
MiB = 1 << 20
#: A model whose held-out F1 is below this counts as stuck (see :func:`stuck`).
STUCK_F1 = 0.01


@dataclass(frozen=True)
class Setting:
    patch: int
    batch: int
    samples: int  # per label: Rodan's "Maximum number of samples per label"
    epochs: int
    patience: int = 15  # Rodan's default

    def describe(self) -> str:
        return (
            f"{self.patch}x{self.patch}, batch {self.batch}, {self.samples} samples per label, "
            f"{self.epochs} epoch(s), patience {self.patience}"
        )


# ----------------------------------------------------------------------------- the child: ours


def child(spec_path: Path) -> int:
    """Train the spec's sample zips with read_samples + train_pages as the worker does; print one JSON line."""
    spec = json.loads(spec_path.read_text())
    sys.path.insert(0, str(REPO))
    from worker import memory, onednn

    onednn.choose(onednn.tuning_dir())  # before TensorFlow is imported, as the worker does
    from worker.trainer._keras import keras

    memory.release_library_pages()
    from worker.sample_zips import read_samples
    from worker.trainer import TrainSettings, train_pages
    from worker.trainer.rundir import RunDirectory

    imported = time.time()
    layers: list[dict[str, Any]] = []

    from timeline import timeline_class

    Timeline = timeline_class(keras.callbacks.Callback)

    class TimedRunDirectory(RunDirectory):
        def keras_callbacks(self, label: str) -> list[Any]:
            layer: dict[str, Any] = {"label": label, "events": [], "history": []}
            layers.append(layer)
            return [*super().keras_callbacks(label), Timeline(layer["events"])]

    out = Path(spec["out_dir"])
    training_started = time.time()
    pages = read_samples({f"Sample {i}": Path(z) for i, z in enumerate(spec["zips"], 1)}, {}, out / "unpack")
    settings = TrainSettings(
        epochs=spec["epochs"],
        max_samples_per_label=spec["max_samples"],
        patch_height=spec["patch"],
        patch_width=spec["patch"],
        batch_size=spec["batch_size"],
        patience=spec["patience"],
        seed=spec["seed"],
    )
    records: list[dict[str, Any]] = []
    run_dir = TimedRunDirectory.create(out / "runs", "bench")
    paths = train_pages([p.page for p in pages], settings, out / "models", on_epoch=records.append, run_dir=run_dir)
    training_s = time.time() - training_started
    for layer in layers:
        layer["history"] = [
            {k: float(r[k]) for k in ("loss", "accuracy", "val_loss", "val_accuracy")}
            for r in records
            if r["label"] == layer["label"]
        ]
    result = {
        "side": "ours",
        "import_s": imported - STARTED,
        "training_s": training_s,
        "layers": layers,
        "models": [str(paths[label]) for label in pages[0].page.masks],
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "TensorFlow's default"),
    }
    print(json.dumps(result))
    return 0


# ----------------------------------------------------------------------------- the parent


def prepare(work: Path) -> tuple[list[Path], Path]:
    """Write the two sample zips (selected region: the top rows) and the held-out evaluation npz."""
    import numpy as np
    from PIL import Image

    from bridge.testing.samples import EINSIEDELN_DIR, make_sample_zip, synthesize_page_from_masks

    data_dir = Path(os.environ.get("HPC_EINSIEDELN_DIR", str(EINSIEDELN_DIR)))
    zips: list[Path] = []
    arrays: dict[str, Any] = {}
    for index, crop in enumerate(CROPS):
        uploads = work / f"uploads-{index}"
        inputs = synthesize_page_from_masks(data_dir, uploads, crop, generation="new", seed=index)

        def file(name: str, uploads: Path = uploads, inputs: dict[str, str] = inputs) -> Path:
            return uploads / inputs[name].removeprefix("/uploads/")

        height, width = crop[3] - crop[1], crop[2] - crop[0]
        region = np.zeros((height, width, 4), dtype=np.uint8)
        region[:TRAIN_ROWS, :, :3] = (120, 116, 114)
        region[:TRAIN_ROWS, :, 3] = 255
        Image.fromarray(region).save(file("Selected Regions"), format="PNG")
        zips.append(make_sample_zip(work / f"sample-{index}.zip", uploads, inputs))
        with Image.open(file("Image")) as image:
            rgb = np.asarray(image.convert("RGB"))
        arrays[f"image_{index}"] = np.ascontiguousarray(rgb[EVAL_TOP:, :, ::-1])  # BGR, as cv2.imread gives Rodan
        for layer, name in enumerate(("Background", "rgba PNG - Layer 0", "rgba PNG - Layer 1")):
            with Image.open(file(name)) as mask:
                alpha = np.asarray(mask.convert("RGBA").getchannel("A"))
            arrays[f"mask_{index}_{layer}"] = alpha[EVAL_TOP:] == 255
    evaluation = work / "evaluation.npz"
    np.savez(evaluation, **arrays)
    return zips, evaluation


def memory_limit_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / (1 << 20)
    raise RuntimeError("no MemTotal in /proc/meminfo")


def run_side(
    side: str, setting: Setting, seed: int, zips: list[Path], work: Path, paco: tuple[Path, Path]
) -> dict[str, Any]:
    from bridge.shell import run_command

    out = Path(tempfile.mkdtemp(prefix=f"{side}-{seed}-", dir=work))
    spec = {
        "zips": [str(z) for z in zips],
        "patch": setting.patch,
        "batch_size": setting.batch,
        "max_samples": setting.samples,
        "epochs": setting.epochs,
        "patience": setting.patience,
        "seed": seed,
        "out_dir": str(out),
        "memory_limit_gb": memory_limit_gb(),
    }
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update({"CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "3"})
    if side == "paco":
        python, source = paco
        command = [str(python), str(PACO_SIDE), "train", str(spec_path)]
        env.update({"PYTHONPATH": str(source), "PYTHONWARNINGS": "ignore"})
    else:
        command = [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)]
    load = os.getloadavg()[0]
    done = run_command(command, timeout=3600, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"{side} failed ({done.returncode}): {done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    result.update({"load": load, "load_after": os.getloadavg()[0], "seed": seed, "setting": asdict(setting)})
    return result


def score_all(runs: list[dict[str, Any]], evaluation: Path, patch: int, paco: tuple[Path, Path]) -> None:
    """Score every model of ``runs`` in one paco_side.py process; add ``scores`` (per layer) to each run."""
    from bridge.shell import run_command

    python, source = paco
    entries = [f"{layer}:{path}" for run in runs for layer, path in enumerate(run["models"])]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update({"PYTHONPATH": str(source), "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "3"})
    done = run_command(
        [str(python), str(PACO_SIDE), "score", str(evaluation), str(patch), *entries], timeout=1800, env=env
    )
    scores = {s["model"]: s for s in json.loads(done.stdout.splitlines()[-1])["scores"]}
    for run in runs:
        run["scores"] = [scores[f"{layer}:{path}"] for layer, path in enumerate(run["models"])]


# ----------------------------------------------------------------------------- the tables


def steps(run: dict[str, Any]) -> dict[str, Any]:
    """Steady step intervals and first steps from a run's timelines (the module docstring says which)."""
    steady: list[float] = []
    first: list[float] = []
    for layer in run["layers"]:
        epoch_begin = None
        ends: list[float] = []
        traced = False
        for what, _index, t in layer["events"]:
            if what == "epoch_begin":
                epoch_begin, ends = t, []
            elif what == "batch_end":
                if epoch_begin is not None and not traced:
                    first.append(t - epoch_begin)  # the fit's first step: tracing, once per layer
                    traced = True
                ends.append(t)
            elif what == "epoch_end":  # each epoch's last step left out: ours may be a partial batch
                steady.extend(b - a for a, b in itertools.pairwise(ends[:-1]))
    samples = run["setting"]["batch"] * len(steady)
    return {
        "steady": steady,
        "first": first,
        "samples_per_s": samples / sum(steady) if steady else float("nan"),
        "ms_per_step": 1000 * statistics.median(steady) if steady else float("nan"),
    }


def speed_table(runs: list[dict[str, Any]]) -> None:
    from benchmarks.tables import print_table

    rows = []
    for run in runs:
        s = steps(run)
        rows.append(
            [
                run["side"],
                Setting(**run["setting"]).describe(),
                f"{s['samples_per_s']:.2f}",
                f"{s['ms_per_step']:.0f}",
                str(len(s["steady"])),
                f"{statistics.median(s['first']):.1f}" if s["first"] else "-",
                f"{run['training_s']:.1f}",
                f"{run['import_s']:.1f}",
                f"{run['peak_rss'] / MiB:.0f}",
                f"{run['load']:.2f}/{run['load_after']:.2f}",
            ]
        )
    print_table(
        [
            "side",
            "setting",
            "samples/s",
            "ms / step",
            "steady steps",
            "first step s",
            "training s",
            "import s",
            "peak RSS MiB",
            "load before/after",
        ],
        rows,
    )
    rates = {side: [steps(r)["samples_per_s"] for r in runs if r["side"] == side] for side in ("ours", "paco")}
    if rates["ours"] and rates["paco"]:
        ratio = statistics.median(rates["ours"]) / statistics.median(rates["paco"])
        print(f"\nours vs paco, steady samples/s (medians): {ratio:.2f}x (goal: at least 1.5x)")


def best_val(layer: dict[str, Any]) -> float:
    values = [h["val_accuracy"] for h in layer["history"] if "val_accuracy" in h]
    return max(values) if values else float("nan")


def stuck(score: dict[str, Any]) -> bool:
    """The model never left "all background" (or "all layer"): a constant prediction, or one whose positives
    hardly touch the layer (F1 below STUCK_F1: the accuracy is then that of predicting nothing)."""
    return bool(score["constant"]) or score["f1"] < STUCK_F1


def accuracy_tables(runs: list[dict[str, Any]]) -> None:
    from benchmarks.tables import print_table

    rows = []
    for run in runs:
        for index, name in enumerate(LAYER_NAMES[: len(run["scores"])]):
            score = run["scores"][index]
            layer = run["layers"][index]
            rows.append(
                [
                    run["side"],
                    str(run["seed"]),
                    name,
                    f"{best_val(layer):.4f}",
                    str(len(layer["history"])),
                    f"{score['accuracy']:.4f}",
                    f"{score['non_layer_share']:.4f}",
                    f"{score['f1']:.4f}",
                    f"{score['positive_share']:.4f}",
                    "STUCK" if stuck(score) else "no",
                    f"{run['load']:.2f}",
                ]
            )
    print_table(
        [
            "side",
            "seed",
            "layer",
            "best val_accuracy (own)",
            "epochs",
            "held-out accuracy",
            "non-layer share",
            "held-out F1",
            "predicted layer share",
            "stuck",
            "load",
        ],
        rows,
    )
    print()
    summary = []
    for side in ("ours", "paco"):
        mine = [r for r in runs if r["side"] == side]
        if not mine:
            continue
        for index, name in enumerate(LAYER_NAMES[: len(mine[0]["scores"])]):
            acc = [r["scores"][index]["accuracy"] for r in mine]
            f1 = [r["scores"][index]["f1"] for r in mine]
            n_stuck = sum(stuck(r["scores"][index]) for r in mine)
            summary.append(
                [
                    side,
                    name,
                    f"{statistics.mean(acc):.4f} ({min(acc):.4f}-{max(acc):.4f})",
                    f"{statistics.mean(f1):.4f} ({min(f1):.4f}-{max(f1):.4f})",
                    f"{n_stuck}/{len(mine)}",
                ]
            )
    print_table(["side", "layer", "held-out accuracy, mean (min-max)", "held-out F1, mean (min-max)", "stuck"], summary)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny settings, one run per side")
    parser.add_argument("--speed-samples", type=int, default=24, help="speed runs: samples per label (paco)")
    parser.add_argument(
        "--speed-samples-ours", type=int, default=160, help="speed runs: samples per label (ours; see the docstring)"
    )
    parser.add_argument("--speed-sides", nargs="+", default=["ours", "paco"], choices=["ours", "paco"])
    parser.add_argument("--patch", type=int, default=32, help="accuracy runs: patch size")
    parser.add_argument("--batch", type=int, default=16, help="accuracy runs: batch size")
    parser.add_argument("--samples", type=int, default=160, help="accuracy runs: samples per label")
    parser.add_argument("--epochs", type=int, default=3, help="accuracy runs: epochs")
    parser.add_argument("--seeds", type=int, default=3, help="accuracy runs per side")
    parser.add_argument("--skip-speed", action="store_true", help="only the accuracy runs")
    parser.add_argument("--skip-accuracy", action="store_true", help="only the speed runs")
    parser.add_argument("--json", type=Path, help="also write every run's raw record here (after every run)")
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    sys.path.insert(0, str(REPO))
    import consumers
    from consumers.paco import paco_source

    paco = (consumers.by_name(CONSUMER).python(), paco_source())
    if args.quick:
        speed: Setting | None = None
        accuracy: Setting | None = Setting(patch=32, batch=8, samples=32, epochs=1)
        seeds = [1]
    else:
        speed = None if args.skip_speed else Setting(patch=256, batch=8, samples=args.speed_samples, epochs=1)
        accuracy = None if args.skip_accuracy else Setting(args.patch, args.batch, args.samples, args.epochs)
        seeds = list(range(1, args.seeds + 1))
    speed_runs: list[dict[str, Any]] = []
    accuracy_runs: list[dict[str, Any]] = []

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps({"speed": speed_runs, "accuracy": accuracy_runs}))

    with tempfile.TemporaryDirectory(prefix="bench-paco-") as scratch:
        work = Path(scratch)
        zips, evaluation = prepare(work)
        if speed is not None:
            for side in args.speed_sides:
                print(f"[bench] speed: {side}", file=sys.stderr, flush=True)
                mine = speed if side == "paco" else dataclasses.replace(speed, samples=args.speed_samples_ours)
                speed_runs.append(run_side(side, mine, 1, zips, work, paco))
                save()
        for seed in seeds if accuracy is not None else []:
            assert accuracy is not None
            pair = []
            for side in ("ours", "paco"):
                print(f"[bench] accuracy seed {seed}: {side}", file=sys.stderr, flush=True)
                pair.append(run_side(side, accuracy, seed, zips, work, paco))
            score_all(pair, evaluation, accuracy.patch, paco)  # the same scorer for both sides' files
            accuracy_runs.extend(pair)
            save()
    if speed is not None:
        print(f"### Speed: {speed.describe()} (ours: {args.speed_samples_ours} samples per label), 2 pages, 3 layers\n")
        speed_table(speed_runs)
    if accuracy is not None:
        print(f"\n### Speed of the accuracy runs: {accuracy.describe()}\n")
        speed_table(accuracy_runs)
        print(f"\n### Accuracy: {accuracy.describe()}, {len(seeds)} seed(s) per side, held-out rows {EVAL_TOP}-1024\n")
        accuracy_tables(accuracy_runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
