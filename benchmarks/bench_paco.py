"""Our multi-page trainer against Paco_classifier's own ``train_msae`` (what Rodan 3.1.0 runs), same samples.

Both sides train on the same two sample zips of a crop pair (:data:`CROP_PAIRS`; ``--pairs``), as
Pixel.js writes them: ``Image.png``, ``rgba PNG - Selected regions.png``, ``rgba PNG - Layer 0
(Background).png``, ``rgba PNG - Layer 1.png`` (neumes), ``rgba PNG - Layer 2.png`` (staff lines),
each a 1024 x 1024 crop of the real Einsiedeln masks (``HPC_EINSIEDELN_DIR``, by default
``bridge.testing.samples.EINSIEDELN_DIR``) with an image synthesized from them, whose selected
region is the top :data:`TRAIN_ROWS` rows only. The rows from :data:`EVAL_TOP` down are the
held-out evaluation neither side trains on (the gap between keeps our patches, centred on selected
pixels, out of it; Paco crops the page to the region). Each pair (one on each folio) is trained and
scored on its own.

* **paco**: ``paco_side.py train`` in the TensorFlow 2.15.1 consumer environment
  (``consumers.by_name("tf2.15.1-py3.11")``, Paco_classifier from ``consumers.paco.paco_source()``):
  ``preprocess`` and ``PacoTrainer.runTrainer`` → ``train_msae`` as Rodan 3.1.0's FastPacoTrainer
  calls them (file selection SHUFFLE, sample extraction RANDOM), with Paco's cgroup-v1 memory probe
  replaced by a function returning this machine's MemTotal (see ``paco_side.py``).
* **ours**: ``worker.sample_zips.read_samples`` and ``worker.trainer.train_pages`` in ``.venv``, with
  the worker's oneDNN choice first, as the worker runs them, with the trainer's defaults.
* **ours (NAME)**, one per ``--variant NAME=JSON``: the same with these ``TrainSettings`` fields
  (what was tried, e.g. ``corner={"patch_anchor": "corner"}``).

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
* **accuracy** at a small setting that learns (``--patch``/``--samples``/``--epochs``/``--batch``,
  the same for every side), ``--seeds`` seeds per side and crop pair. Two scores, each computed by
  one process for all sides' files of a pair (TensorFlow 2.15.1, as Rodan opens them):

  - **the label image**, what the musicologist gets: every run's three models go to Paco_classifier's
    own ``process_image_msae`` (``paco_side.py label``, window ``--window``; Paco's fixed-input
    files are re-saved with an input of any size first, see ``paco_side.py``), and each layer's F1
    is "labelled as this layer" against its mask on the held-out rows of both pages;
  - **each model alone** (``paco_side.py score``): its prediction (> 0.5) on tiles of its patch size,
    pixel accuracy and F1 against its layer's mask; a model is stuck where the prediction is
    constant or its F1 is below 0.01 (it never left "all background" / "all layer").

  Beside them the best ``val_accuracy`` as each side reports it (Paco: 2 random batches per epoch,
  one per page; ours: the held-out fifth of its samples), and each run's training seconds: the
  goal lines compare each of our sides with Paco's per layer (mean label-image F1 at least Paco's,
  worst seed above Paco's worst, nothing stuck).

Every subprocess goes through ``bridge.shell.run_command``; runs alternate sides, with the
1-minute load average noted.

    .venv/bin/python benchmarks/bench_paco.py --skip-speed   # accuracy: 2 pairs x 5 seeds x 2 sides, 32x32, 10 epochs
    .venv/bin/python benchmarks/bench_paco.py --skip-speed --variant 'corner={"patch_anchor": "corner"}'
    .venv/bin/python benchmarks/bench_paco.py                # + speed, 256x256: over 13 min a side at load 4-9
    .venv/bin/python benchmarks/bench_paco.py --quick  # smoke: tiny settings, one pair, a run a side, 256 columns
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
#: Crop pairs: two 1024 x 1024 crops (left, top, right, bottom) of the 4872 x 12992 masks that train
#: together, as a Rodan run's two sample zips. "32r" lies on the first folio, "263v" on the second
#: (its rows from about 6 400 down); each pair is trained and scored on its own.
CROP_PAIRS: dict[str, tuple[tuple[int, int, int, int], ...]] = {
    "32r": ((1024, 2048, 2048, 3072), (1024, 3072, 2048, 4096)),
    "263v": ((2048, 8192, 3072, 9216), (2048, 9216, 3072, 10240)),
}
#: The selected region (what both sides train on): rows 0 .. TRAIN_ROWS of every page.
TRAIN_ROWS = 640
#: The held-out evaluation: rows EVAL_TOP .. the bottom of every page (256 rows).
EVAL_TOP = 640 + 128
#: --quick's held-out evaluation: the first columns only (that the scoring and labelling run).
QUICK_EVAL_WIDTH = 256
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

    onednn.remember(onednn.tuning_dir())  # the record doctor --job makes on a node (once)
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
        **spec.get("trainer_options", {}),
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


def prepare(
    work: Path, crops: tuple[tuple[int, int, int, int], ...], eval_width: int | None = None
) -> tuple[list[Path], Path]:
    """Write the sample zips of ``crops`` (selected region: the top rows) and the held-out evaluation
    npz (its first ``eval_width`` columns only, when given: ``--quick``)."""
    import numpy as np
    from PIL import Image

    from bridge.testing.samples import EINSIEDELN_DIR, make_sample_zip, synthesize_page_from_masks

    data_dir = Path(os.environ.get("HPC_EINSIEDELN_DIR", str(EINSIEDELN_DIR)))
    zips: list[Path] = []
    arrays: dict[str, Any] = {}
    work.mkdir(parents=True, exist_ok=True)
    for index, crop in enumerate(crops):
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
        arrays[f"image_{index}"] = np.ascontiguousarray(rgb[EVAL_TOP:, :eval_width, ::-1])  # BGR, as cv2.imread
        for layer, name in enumerate(("Background", "rgba PNG - Layer 0", "rgba PNG - Layer 1")):
            with Image.open(file(name)) as mask:
                alpha = np.asarray(mask.convert("RGBA").getchannel("A"))
            arrays[f"mask_{index}_{layer}"] = alpha[EVAL_TOP:, :eval_width] == 255
    evaluation = work / "evaluation.npz"
    np.savez(evaluation, **arrays)
    return zips, evaluation


def memory_limit_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / (1 << 20)
    raise RuntimeError("no MemTotal in /proc/meminfo")


def run_side(
    side: str,
    setting: Setting,
    seed: int,
    zips: list[Path],
    work: Path,
    paco: tuple[Path, Path],
    trainer_options: dict[str, Any] | None = None,
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
        "trainer_options": trainer_options or {},
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
    if side == "ours":
        result["trainer_options"] = trainer_options or {}
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


def label_all(runs: list[dict[str, Any]], evaluation: Path, window: int, paco: tuple[Path, Path]) -> None:
    """Classify the held-out pages with every run's models through Paco_classifier's own
    ``process_image_msae`` (``paco_side.py label``, one process for all runs); add ``label`` (per layer)."""
    from bridge.shell import run_command

    python, source = paco
    entries = [f"{index}:{','.join(run['models'])}" for index, run in enumerate(runs)]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update({"PYTHONPATH": str(source), "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "3"})
    done = run_command(
        [str(python), str(PACO_SIDE), "label", str(evaluation), str(window), *entries], timeout=3600, env=env
    )
    labels = {int(entry["run"]): entry for entry in json.loads(done.stdout.splitlines()[-1])["labels"]}
    for index, run in enumerate(runs):
        run["label"] = labels[index]["layers"]


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


def _spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f} ({min(values):.4f}-{max(values):.4f})"


def accuracy_tables(runs: list[dict[str, Any]]) -> None:
    """Per run and layer: the label image's F1 (what the user gets), then each model's own scores."""
    from benchmarks.tables import print_table

    rows = []
    for run in runs:
        for index, name in enumerate(LAYER_NAMES[: len(run["scores"])]):
            score, layer, label = run["scores"][index], run["layers"][index], run["label"][index]
            rows.append(
                [
                    run["side"],
                    str(run["seed"]),
                    name,
                    f"{label['f1']:.4f}",
                    f"{label['labelled_share']:.4f}",
                    f"{label['truth_share']:.4f}",
                    f"{score['f1']:.4f}",
                    f"{score['positive_share']:.4f}",
                    f"{best_val(layer):.4f}",
                    str(len(layer["history"])),
                    "STUCK" if stuck(score) else "no",
                    f"{run['training_s']:.1f}",
                    f"{run['load']:.2f}",
                ]
            )
    print_table(
        [
            "side",
            "seed",
            "layer",
            "label-image F1",
            "labelled share",
            "truth share",
            "model F1",
            "model's predicted share",
            "best val_accuracy (own)",
            "epochs",
            "stuck",
            "training s",
            "load",
        ],
        rows,
    )


def summary_table(runs: list[dict[str, Any]], sides: list[str]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Means (min-max) over seeds per side and layer; returns side -> layer -> measure -> values."""
    from benchmarks.tables import print_table

    found: dict[str, dict[str, dict[str, list[float]]]] = {}
    rows = []
    for side in sides:
        mine = [r for r in runs if r["side"] == side]
        if not mine:
            continue
        for index, name in enumerate(LAYER_NAMES[: len(mine[0]["scores"])]):
            values = {
                "label_f1": [r["label"][index]["f1"] for r in mine],
                "model_f1": [r["scores"][index]["f1"] for r in mine],
                "stuck": [float(stuck(r["scores"][index])) for r in mine],
                "training_s": [r["training_s"] for r in mine],
            }
            found.setdefault(side, {})[name] = values
            rows.append(
                [
                    side,
                    name,
                    _spread(values["label_f1"]),
                    _spread(values["model_f1"]),
                    f"{int(sum(values['stuck']))}/{len(mine)}",
                    f"{statistics.mean(values['training_s']):.1f}",
                ]
            )
    print_table(
        [
            "side",
            "layer",
            "label-image F1, mean (min-max)",
            "model F1, mean (min-max)",
            "stuck",
            "training s, mean",
        ],
        rows,
    )
    return found


def goal_lines(found: dict[str, dict[str, dict[str, list[float]]]]) -> None:
    """Issue #26's goal on one crop pair, layer by layer: each of our sides against Paco's label-image F1
    (mean at least Paco's, worst seed above Paco's worst, no stuck model)."""
    if "paco" not in found:
        return
    for side, layers in found.items():
        if side == "paco":
            continue
        for name, ours in layers.items():
            paco = found["paco"][name]
            mean_gap = statistics.mean(ours["label_f1"]) - statistics.mean(paco["label_f1"])
            worst_gap = min(ours["label_f1"]) - min(paco["label_f1"])
            verdict = "met" if mean_gap >= 0 and worst_gap > 0 and not any(ours["stuck"]) else "NOT met"
            print(
                f"- {side}, {name}: mean label-image F1 {mean_gap:+.4f} against Paco's, worst seed "
                f"{worst_gap:+.4f}, stuck {int(sum(ours['stuck']))}, training "
                f"{statistics.mean(ours['training_s']):.0f} s against {statistics.mean(paco['training_s']):.0f} s: "
                f"{verdict}"
            )


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
    parser.add_argument("--epochs", type=int, default=10, help="accuracy runs: epochs")
    parser.add_argument("--seeds", type=int, default=5, help="accuracy runs per side and crop pair")
    parser.add_argument("--first-seed", type=int, default=1, help="accuracy runs: the first seed")
    parser.add_argument(
        "--pairs", nargs="+", default=list(CROP_PAIRS), choices=list(CROP_PAIRS), help="accuracy runs: crop pairs"
    )
    parser.add_argument("--sides", nargs="+", default=["ours", "paco"], choices=["ours", "paco"])
    parser.add_argument(
        "--window", type=int, default=128, help="the classifier's window (process_image_msae: more than 51)"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help='also train our side with these TrainSettings fields, e.g. \'corner={"patch_anchor": "corner"}\' '
        "(repeatable; each is a side of its own, beside ours with the defaults)",
    )
    parser.add_argument("--skip-speed", action="store_true", help="only the accuracy runs")
    parser.add_argument("--skip-accuracy", action="store_true", help="only the speed runs")
    parser.add_argument("--json", type=Path, help="also write every run's raw record here (after every run)")
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    sys.path.insert(0, str(REPO))
    import consumers
    from consumers.paco import paco_source

    sides: dict[str, dict[str, Any] | None] = {}  # side -> our TrainSettings fields (None: Paco's)
    for side in args.sides:
        sides[side] = {} if side == "ours" else None
    for item in args.variant:
        name, _, value = item.partition("=")
        sides[f"ours ({name})"] = json.loads(value)
    paco = (consumers.by_name(CONSUMER).python(), paco_source())
    pairs = args.pairs
    if args.quick:
        speed: Setting | None = None
        accuracy: Setting | None = Setting(patch=32, batch=8, samples=32, epochs=1)
        seeds, pairs = [1], pairs[:1]
    else:
        speed = None if args.skip_speed else Setting(patch=256, batch=8, samples=args.speed_samples, epochs=1)
        accuracy = None if args.skip_accuracy else Setting(args.patch, args.batch, args.samples, args.epochs)
        seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    speed_runs: list[dict[str, Any]] = []
    accuracy_runs: list[dict[str, Any]] = []

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps({"speed": speed_runs, "accuracy": accuracy_runs}))

    with tempfile.TemporaryDirectory(prefix="bench-paco-") as scratch:
        work = Path(scratch)
        if speed is not None:
            zips, _ = prepare(work / "speed", CROP_PAIRS["32r"])
            for side in args.speed_sides:
                print(f"[bench] speed: {side}", file=sys.stderr, flush=True)
                mine = speed if side == "paco" else dataclasses.replace(speed, samples=args.speed_samples_ours)
                speed_runs.append(run_side(side, mine, 1, zips, work, paco))
                save()
        for pair in pairs if accuracy is not None else []:
            assert accuracy is not None
            # --quick scores and labels a 256-column strip of the held-out rows: the classifier's
            # pass over the whole rows was three quarters of a quick run (155 of 224 s).
            zips, evaluation = prepare(work / pair, CROP_PAIRS[pair], QUICK_EVAL_WIDTH if args.quick else None)
            runs = []
            for seed in seeds:
                for side, options in sides.items():  # alternating sides: the machine's load falls on all
                    print(f"[bench] accuracy {pair} seed {seed}: {side}", file=sys.stderr, flush=True)
                    kind = "paco" if options is None else "ours"
                    run = run_side(kind, accuracy, seed, zips, work, paco, options)
                    run.update({"pair": pair, "side": side})
                    runs.append(run)
            print(f"[bench] scoring {pair}", file=sys.stderr, flush=True)
            score_all(runs, evaluation, accuracy.patch, paco)  # the same scorer for both sides' files
            label_all(runs, evaluation, args.window, paco)
            accuracy_runs.extend(runs)
            save()
    if speed is not None:
        print(f"### Speed: {speed.describe()} (ours: {args.speed_samples_ours} samples per label), 2 pages, 3 layers\n")
        speed_table(speed_runs)
    if accuracy is not None:
        print(f"\n### Speed of the accuracy runs: {accuracy.describe()}\n")
        speed_table(accuracy_runs)
        for side, options in sides.items():
            if options:
                print(f"\n{side}: TrainSettings {json.dumps(options)}")
        for pair in pairs:
            runs = [r for r in accuracy_runs if r["pair"] == pair]
            print(
                f"\n### Accuracy, crop pair {pair}: {accuracy.describe()}, {len(seeds)} seed(s) per side, "
                f"held-out rows {EVAL_TOP}-1024 of both pages"
                f"{f' (first {QUICK_EVAL_WIDTH} columns)' if args.quick else ''}, classifier window {args.window}\n"
            )
            accuracy_tables(runs)
            print()
            goal_lines(summary_table(runs, list(sides)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
