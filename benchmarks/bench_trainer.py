"""Our trainer against the original trainer, on its own stack, measured in the same run.

Both sides train the same page on the very same patches: a crop of the real Einsiedeln
masks (``HPC_EINSIEDELN_DIR``, by default ``bridge.testing.samples.EINSIEDELN_DIR``) with a page image
synthesized from them (parchment, dark neumes, red-brown staff lines), 3 layers
(Background, Neumes, StaffLines), the centres drawn once by the project's sampler
(``run_centres``, as ``train_page`` draws them for the random seed given), batch 16, validation
on the last 20 %, fixed epochs (early stopping's patience 3 never triggers in 3 epochs),
and each layer's model starting from the same weights (ours draws them from its seed, and
the original trainer's run of the same round loads them): what differs is what the trainers do, and
the order in which each shuffles the samples.

* **original**: ``original_stack/original_trainer.py``, the original trainer's ``training_engine_sae.py`` ported
  faithfully (its docstring says what differs), in a Python 3.7 + TensorFlow 1.14 + Keras
  2.3.1 environment that this script builds once (``original_stack/requirements-*.txt``, cached
  with the consumer environments in ``~/.cache/hpc-bridge/consumers``).
* **ours**: ``train_page`` as the worker runs it (the oneDNN choice of
  :mod:`worker.onednn` first, then checkpoints every epoch in a checkpoint store, a run
  directory with TensorBoard summaries and curves), in this checkout's ``.venv``.
* **ours (before)**, with ``--before REF``: the same driver on another commit of this
  repository (a temporary ``git worktree``), for the before/after profile.

Each run is a fresh process; sides alternate (ours, original, [before], ours, original, ...) with
the 1-minute load average noted. Every process records when each batch, validation and
epoch begins and ends (a Keras callback on both sides), which gives the profile: import,
preparation, first step of each layer (tracing), steady step, the gap between steps
(input pipeline and per-batch callbacks), the stall before an epoch's first batch,
validation, epoch-end work (checkpoints, TensorBoard), the time between layers.

    .venv/bin/python benchmarks/bench_trainer.py                          # all settings, 2 rounds: ~50 min
    .venv/bin/python benchmarks/bench_trainer.py --settings 64 --rounds 1 # ~3 min
    .venv/bin/python benchmarks/bench_trainer.py --before HEAD~3       # adds the old trainer's profile
    .venv/bin/python benchmarks/bench_trainer.py --quick               # smoke test: one tiny layer per side

Every run, ``--quick`` included, needs the original's stack: the first one builds it (Python 3.7 and
the packages of ``original_stack/requirements-tf1.14-py3.7.txt`` from PyPI), which CI cannot;
``tests/test_benchmarks_stacks.py`` checks there that the options parse and the imports resolve.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STARTED = time.time()
#: The environment before TensorFlow is imported here: TensorFlow 2 adds TF2_BEHAVIOR=1 (and
#: more) to os.environ, which would switch the original trainer's TensorFlow 1.14 to eager execution.
CLEAN_ENVIRONMENT = dict(os.environ)
REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
SEED_REQUIREMENTS = HERE / "original_stack" / "requirements-tf1.14-py3.7.txt"
SEED_TRAINER = HERE / "original_stack" / "original_trainer.py"
#: The layers trained, in order: the page's file names in the stand-in's uploads.
LAYERS = {"Background": "Background", "Neumes": "Music Layer", "StaffLines": "Staff Layer"}


@dataclass(frozen=True)
class Setting:
    patch: int
    samples: int  # at most, per label
    epochs: int
    layers: tuple[str, ...]

    def describe(self) -> str:
        return (
            f"{self.patch}x{self.patch}, up to {self.samples} samples per label, {self.epochs} epoch(s), "
            f"{len(self.layers)} layer(s) ({', '.join(self.layers)}), batch 16"
        )


#: The small settings of the comparison ("64", "256": few steps, the models barely leave
#: "nothing here", so their accuracies mostly say that both start alike), and one where the
#: models learn ("64-learn", where equal accuracy means something).
SETTINGS = {
    "64": Setting(64, 300, 3, tuple(LAYERS)),  # 209-251 samples per layer on this crop
    "256": Setting(256, 300, 1, tuple(LAYERS)),  # 54-65 (fewer 256x256 centres fit the crop)
    "64-learn": Setting(64, 600, 6, ("Neumes", "StaffLines")),
    "quick": Setting(32, 48, 1, ("Neumes",)),  # --quick: that both sides still run, not what they measure
}
#: What runs without ``--settings``.
DEFAULT_SETTINGS = ["64", "256", "64-learn"]
#: A 1024 x 1024 crop with all three layers (left, top, right, bottom of the 4872 x 12992 masks).
CROP = (1024, 2048, 2048, 3072)
GiB = 1 << 30


# ----------------------------------------------------------------------------- the child: ours


def child(spec_path: Path) -> int:
    """Train ``spec``'s page with train_page as the worker does; print one JSON object."""
    spec = json.loads(spec_path.read_text())
    if spec.get("tree"):
        sys.path.insert(0, spec["tree"])
    else:
        sys.path.insert(0, str(REPO))
    try:
        from worker import onednn
    except ImportError:  # a commit before the choice existed
        onednn = None  # type: ignore[assignment]
    if onednn is not None:
        if hasattr(onednn, "remember"):  # since jobs no longer measure: the record doctor --job makes
            onednn.remember(onednn.tuning_dir())
        onednn.choose(onednn.tuning_dir())
    import numpy as np

    from worker.trainer._keras import keras

    try:
        from worker import memory

        memory.release_library_pages()  # as the worker does after importing TensorFlow
    except ImportError:  # a commit before it
        pass

    from worker.trainer import Page, TrainSettings, train_page
    from worker.trainer.checkpoint import CheckpointStore
    from worker.trainer.rundir import RunDirectory

    imported = time.time()
    data = np.load(spec["npz"])
    labels = spec["labels"]
    page = Page(
        image=np.ascontiguousarray(data["image"][..., ::-1]),  # the npz holds BGR, as cv2 gives the original trainer
        masks={label: data[f"mask_{i}"] for i, label in enumerate(labels)},
    )
    settings = TrainSettings(
        epochs=spec["epochs"],
        max_samples_per_label=spec["max_samples"],
        patch_height=spec["patch"],
        patch_width=spec["patch"],
        batch_size=spec["batch_size"],
        patience=3,
        seed=spec["seed"],
    )
    if not spec.get("tree"):  # the same patches as the original trainer's (an older commit draws them the same way)
        from worker.trainer.sampling import run_centres

        drawn = run_centres(page.masks, spec["patch"], spec["patch"], settings.max_samples_per_label, settings.seed)
        assert all(np.array_equal(drawn[label], data[f"centres_{i}"]) for i, label in enumerate(labels))
    from timeline import timeline_class

    Timeline = timeline_class(keras.callbacks.Callback)
    layers: list[dict[str, Any]] = []
    initial: list[list[Any]] = []

    def starting_weights(model: Any) -> None:
        if len(initial) < len(layers):  # the layer's first fit: the weights it starts from
            initial.append(model.get_weights())

    class TimedRunDirectory(RunDirectory):
        def keras_callbacks(self, label: str) -> list[Any]:
            layer: dict[str, Any] = {"label": label, "events": []}
            layers.append(layer)
            return [*super().keras_callbacks(label), Timeline(layer["events"], on_train_begin=starting_weights)]

    out = Path(spec["out_dir"])
    run_dir = TimedRunDirectory.create(out / "runs", "bench")
    store = CheckpointStore(out / "checkpoints")
    records: list[dict[str, Any]] = []
    training_started = time.time()
    train_page(page, settings, out / "models", on_epoch=records.append, run_dir=run_dir, checkpoints=store)
    training_s = time.time() - training_started
    if spec.get("save_initial"):  # for the original trainer's run: the same starting point (see the module docstring)
        np.savez(spec["save_initial"], **{f"{i}_{k}": w for i, ws in enumerate(initial) for k, w in enumerate(ws)})
    for layer in layers:
        mine = [r for r in records if r["label"] == layer["label"]]
        keys = ("loss", "accuracy", "val_loss", "val_accuracy")
        layer["history"] = {key: [float(r[key]) for r in mine] for key in keys}
        layer["train_samples"] = len(run_centres_train(data, labels.index(layer["label"])))
    result = {
        "side": spec["side"],
        "import_s": imported - STARTED,
        "prepare_s": 0.0,  # sampling and checks happen inside train_page: "before the first layer"
        "training_started": training_started,
        "training_s": training_s,
        "layers": layers,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "total_s": time.time() - STARTED,
        "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "TensorFlow's default"),
    }
    print(json.dumps(result))
    return 0


def run_centres_train(data: Any, index: int) -> Any:
    centres = data[f"centres_{index}"]
    return centres[: int(len(centres) * 0.8)]


# ----------------------------------------------------------------------------- the parent


def prepare(name: str, work: Path, seed: int) -> Path:
    """Write the page, masks and centres (npz) shared by both sides; return the npz."""
    import numpy as np

    from bridge.testing.samples import EINSIEDELN_DIR, synthesize_page_from_masks
    from worker.trainer import load_page
    from worker.trainer.sampling import run_centres

    uploads = work / "uploads"
    inputs = synthesize_page_from_masks(EINSIEDELN_DIR, uploads, CROP, generation="old", seed=0, text_layer="empty")

    def file(name: str) -> Path:
        return uploads / inputs[name].removeprefix("/uploads/")

    setting = SETTINGS[name]
    layers = {label: file(LAYERS[label]) for label in setting.layers}
    page = load_page(file("Image"), layers, file("Selected Regions"))
    patch = setting.patch
    centres = run_centres(page.masks, patch, patch, setting.samples, seed)  # train_page's for this seed
    assert "tensorflow" not in sys.modules  # a TensorFlow here would share its pages with the children
    arrays: dict[str, Any] = {"image": np.ascontiguousarray(page.image[..., ::-1])}  # BGR, as cv2.imread
    for i, label in enumerate(setting.layers):
        arrays[f"mask_{i}"] = page.masks[label]
        arrays[f"centres_{i}"] = centres[label]
    path = work / f"page-{name}.npz"
    np.savez(path, **arrays)
    return path


def original_python() -> Path:
    from consumers import Consumer
    from consumers.build import build

    class OriginalStack(Consumer):
        @property
        def requirements(self) -> Path:
            return SEED_REQUIREMENTS

    stack = OriginalStack("original-tf1.14-py3.7", "3.7", "the original trainer's stack")
    return build(stack, say=lambda message: print(message, file=sys.stderr))


@contextmanager
def worktree(ref: str | None) -> Iterator[Path | None]:
    if ref is None:
        yield None
        return
    path = Path(tempfile.mkdtemp(prefix="bench-before-"))
    add = ["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), ref]
    subprocess.run(add, check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False)


def run_side(side: str, npz: Path, name: str, work: Path, python: Path, tree: Path | None, seed: int) -> dict[str, Any]:
    setting = SETTINGS[name]
    out = Path(tempfile.mkdtemp(prefix=f"{side.split()[0]}-", dir=work))
    spec = {
        "side": side,
        "npz": str(npz),
        "labels": list(setting.layers),
        "patch": setting.patch,
        "epochs": setting.epochs,
        "max_samples": setting.samples,
        "batch_size": 16,
        "seed": seed,
        "out_dir": str(out),
        "tree": str(tree) if tree else None,
    }
    initial = work / f"initial-{name}.npz"  # written by ours, read by the original trainer's run after it
    if side == "ours":
        spec["save_initial"] = str(initial)
    elif side == "original":
        spec["initial_weights"] = str(initial)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    if side == "original":
        command = [str(python), str(SEED_TRAINER), str(spec_path)]
        env = {**CLEAN_ENVIRONMENT, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
        env.pop("PYTHONPATH", None)
    else:
        command = [str(python), str(Path(__file__).resolve()), "--child", str(spec_path)]
        env = {**CLEAN_ENVIRONMENT, "CUDA_VISIBLE_DEVICES": ""}
    load = os.getloadavg()[0]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=7200, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"{side} failed ({done.returncode}): {done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    result["load"] = load
    result["setting"] = name
    return result


# ----------------------------------------------------------------------------- the profile


def phases(result: dict[str, Any]) -> dict[str, list[float]]:
    """Seconds per phase, from one run's event timelines (lists: one value per occurrence)."""
    out: dict[str, list[float]] = {k: [] for k in PHASES}
    previous_end = result.get("training_started")
    for layer in result["layers"]:
        events = layer["events"]
        begin = next(t for what, _, t in events if what == "train_begin")
        end = [t for what, _, t in events if what == "train_end"][-1]
        if previous_end is not None:
            out["before each layer's fit"].append(begin - previous_end)
        previous_end = end
        first = True
        for i, (what, _index, t) in enumerate(events):
            later = events[i + 1] if i + 1 < len(events) else None
            if what == "batch_begin" and later and later[0] == "batch_end":
                out["first step (tracing)" if first else "steady step"].append(later[2] - t)
                first = False
            elif what == "batch_end" and later and later[0] == "batch_begin":
                out["between steps"].append(later[2] - t)
            elif what == "epoch_begin" and later and later[0] == "batch_begin":
                out["epoch start to first batch"].append(later[2] - t)
            elif what == "batch_end" and later and later[0] == "test_begin":
                out["last batch to validation"].append(later[2] - t)
            elif what == "test_begin" and later and later[0] == "test_end":
                out["validation"].append(later[2] - t)
            elif what == "test_end" and later and later[0] == "epoch_end":
                out["epoch-end callbacks"].append(later[2] - t)
            elif what == "epoch_end" and later and later[0] in ("epoch_begin", "train_end"):
                out["epoch end to next epoch"].append(later[2] - t)
            elif what == "train_begin" and later and later[0] == "epoch_begin":
                out["fit start to first epoch"].append(later[2] - t)
    if previous_end is not None and result.get("training_started") is not None:
        out["after the last fit"].append(result["training_started"] + result["training_s"] - previous_end)
    return out


PHASES = (
    "before each layer's fit",
    "fit start to first epoch",
    "epoch start to first batch",
    "first step (tracing)",
    "steady step",
    "between steps",
    "last batch to validation",
    "validation",
    "epoch-end callbacks",
    "epoch end to next epoch",
    "after the last fit",
)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    epochs = sum(len(layer["history"].get("val_accuracy", [])) for layer in result["layers"])
    samples = sum(layer["train_samples"] * len(layer["history"].get("loss", [])) for layer in result["layers"])
    return {
        "epochs": epochs,
        "samples": samples,
        "per_epoch": result["training_s"] / epochs,
        "per_sample_ms": 1000 * result["training_s"] / samples,
        "val": {layer["label"]: layer["history"]["val_accuracy"][-1] for layer in result["layers"]},
    }


def fmt(values: Sequence[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} x{len(values)}"


def report(results: list[dict[str, Any]], sides: list[str]) -> None:
    from benchmarks.tables import print_table

    for name, setting in SETTINGS.items():
        runs = [r for r in results if r["setting"] == name]
        if not runs:
            continue
        print(f"\n### {name}: {setting.describe()}\n")
        rows = []
        for r in runs:
            s = summary(r)
            rows.append(
                [
                    r["side"],
                    f"{r['load']:.2f}",
                    f"{r['training_s']:.1f}",
                    f"{s['per_epoch']:.1f}",
                    f"{s['per_sample_ms']:.1f}",
                    f"{r['peak_rss'] / GiB:.2f}",
                    f"{r['import_s']:.1f}",
                    *(f"{s['val'][label]:.4f}" for label in setting.layers),
                ]
            )
        print_table(
            ["side", "load", "training s", "s / epoch", "ms / sample", "peak RSS GiB", "import s"]
            + [f"val_acc {label}" for label in setting.layers],
            rows,
        )
        medians = {}
        for side in sides:
            mine = [summary(r)["per_sample_ms"] for r in runs if r["side"] == side]
            if mine:
                medians[side] = statistics.median(mine)
        if "original" in medians and "ours" in medians:
            print(f"\nours vs original, per sample (medians): {medians['original'] / medians['ours']:.2f}x as fast")
        print("\nProfile (seconds; a median and xN occurrences over the run, the first run of each side):\n")
        first = {side: next((r for r in runs if r["side"] == side), None) for side in sides}
        table = {side: phases(r) for side, r in first.items() if r is not None}
        rows = [[phase, *(fmt(table[side][phase]) for side in table)] for phase in PHASES]
        rows.append(["import", *(f"{first[side]['import_s']:.2f}" for side in table)])  # type: ignore[index]
        print_table(["phase", *table], rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, choices=list(SETTINGS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: --settings quick (32x32, 48 samples, 1 epoch, Neumes) --rounds 1; needs the original's stack",
    )
    parser.add_argument("--before", metavar="REF", help="also run the trainer of this commit (e.g. HEAD~3)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write every run's raw record here")
    args = parser.parse_args()
    if args.quick:  # these replace the defaults; options given still win
        parser.set_defaults(settings=["quick"], rounds=1)
        args = parser.parse_args()
    if args.child:
        return child(args.child)
    sys.path.insert(0, str(REPO))
    original_py = original_python()
    ours_py = Path(sys.executable)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as scratch, worktree(args.before) as before:
        work = Path(scratch)
        sides: list[tuple[str, Path, Path | None]] = [("ours", ours_py, None), ("original", original_py, None)]
        if before is not None:
            sides.append((f"ours before ({args.before})", ours_py, before))
        for name in args.settings:
            npz = prepare(name, work, args.seed)
            for round_ in range(args.rounds):
                for side, python, tree in sides:
                    print(f"[bench] {name} round {round_ + 1}: {side}", file=sys.stderr, flush=True)
                    results.append(run_side(side, npz, name, work, python, tree, args.seed))
    if args.json:
        args.json.write_text(json.dumps(results))
    report(results, [side for side, _, _ in sides])
    return 0


if __name__ == "__main__":
    sys.exit(main())
