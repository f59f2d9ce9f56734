"""Peak memory of training (benchmark 2): our trainer against the original trainer's materialised patches.

The request: 10,000 samples per label, 4 layers, 256x256 patches, batch 16. Each number
below comes from a fresh interpreter (a subprocess), on a synthetic page the size of a real
manuscript page (default 6496x4872, like one page of the Einsiedeln scan the other benchmarks read),
whose 4 layers each cover a quarter of the area where patches may be centred, so that the
sampler draws the full 10,000 centres per layer.

* **ours, measured.** ``train_page`` itself: samples all 4 layers (the real (n, 2) centres
  arrays), then trains, validates and saves each layer in turn. A full run is hours on a
  CPU (a 256x256 step of 16 takes 10-15 s), so each layer's fit is cut to ``--steps``
  training batches and ``--val-steps`` validation batches (by a PatchDataset whose length
  is capped; everything else is unchanged). A layer reaches its peak in its first steps
  (trace plus one batch's activations) and stays there; the peak does not grow with the
  samples (``tests/test_trainer_scaling.py``) but does creep from layer to layer (0.1-0.9
  GB over 4 layers at 256x256: the allocator's, not the data's). Peak = ``ru_maxrss`` of
  the child; ``per_layer`` gives the RSS and the peak at the end of each layer.
* **original, computed.** What the original trainer's ``getTrain`` keeps for the whole run: per sample a
  float64 X patch (256*256*3*8 bytes: ``(255. - patch) / 255.`` of the uint8 image) and a
  Y patch as the original stores it (slices of ``np.logical_and(...)`` masks: bool, 256*256
  bytes), for 4 x 10,000 samples, plus the TensorFlow training footprint (model, one
  batch's activations, the page), which is the same network and batch as ours: our
  measured float32 peak is used for it.
* **original, measured and extrapolated.** The original trainer's ``getTrain`` (re-implemented faithfully
  below: the per-pixel loop, ``(255. - x) / 255.`` per patch, lists, then ``np.asarray``)
  run on the same page with ``--original-samples`` per label, its peak and retained RSS growth
  measured and scaled linearly to 10,000 per label. This includes the transient copy made
  by ``np.asarray`` while the list of patches is still alive. Its peak is then
  ``max(our RSS before training + getTrain's peak growth, our training peak + retained
  arrays)``.

GB are 10**9 bytes.

    .venv/bin/python benchmarks/bench_memory.py                                   # ~3 min on 2 cores
    .venv/bin/python benchmarks/bench_memory.py --mixed-precision off bfloat16    # also the opt-in bf16
    .venv/bin/python benchmarks/bench_memory.py --quick                           # smoke test: see QUICK
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402

from benchmarks.tables import print_table  # noqa: E402

GB = 1e9
#: ``--quick``: a 640x640 page, 2 layers of at most 64 samples, 32x32 patches, 1 + 1 batches per layer,
#: the original's sampling at 16 per label: that the benchmark still runs, not what it measures.
QUICK = {"height": 640, "width": 640, "layers": 2, "samples": 64, "patch": 32, "steps": 1, "val_steps": 1,
         "original_samples": 16}  # fmt: skip


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def make_page(height: int, width: int, layers: int, patch: int) -> tuple[npt.NDArray[np.uint8], dict[str, Any]]:
    """A uint8 RGB page and ``layers`` bool masks in horizontal bands of 8 rows, cycling.

    The masks cover only the area where patches may be centred (``centre_ranges``), so the
    sampler's expected count is the cap itself.
    """
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    band = (np.arange(height) // 8) % layers
    inside = np.zeros((height, width), dtype=bool)
    inside[patch : height - patch - 1, patch : width - patch - 1] = True
    masks = {f"Layer {i}": inside & (band == i)[:, np.newaxis] for i in range(layers)}
    return image, masks


# --------------------------------------------------------------------------- ours (child)


def child_ours(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import worker.trainer.train as train_module
    from worker.trainer import Page, TrainSettings, train_page
    from worker.trainer.dataset import PatchDataset
    from worker.trainer.distribute import plan_training

    class CappedPatchDataset(PatchDataset):
        """The real dataset (all centres held), cut to a few batches per epoch."""

        def __len__(self) -> int:
            cap = args.steps if self._rng is not None else args.val_steps
            return int(min(super().__len__(), cap))

    train_module.PatchDataset = CappedPatchDataset  # type: ignore[attr-defined]

    found: dict[str, int] = {}

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if str(record.msg).startswith("layer %r: training on"):
                label, train, validation = cast(tuple[str, int, int], record.args)
                found[str(label)] = int(train) + int(validation)

    logger = logging.getLogger("worker.trainer.train")
    logger.addHandler(Grab())
    logger.setLevel(logging.INFO)

    image, masks = make_page(args.height, args.width, args.layers, args.patch)
    page = Page(image, masks)
    settings = TrainSettings(
        epochs=1,
        max_samples_per_label=args.samples,
        patch_height=args.patch,
        patch_width=args.patch,
        batch_size=args.batch,
        patience=3,
        seed=1,
        mixed_precision=args.precision,
    )
    per_layer: list[tuple[str, int, int]] = []  # (label, RSS, peak so far) at the end of each layer's epoch
    before = rss_bytes()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        train_page(
            page, settings, Path(out), on_epoch=lambda e: per_layer.append((e["label"], rss_bytes(), peak_bytes()))
        )
    return {
        "peak": peak_bytes(),
        "per_layer": per_layer,
        "before_training": before,
        "samples": found,
        "page_bytes": image.nbytes + sum(m.nbytes for m in masks.values()),
        "centre_bytes": 16 * sum(found.values()),
        "seconds": time.perf_counter() - start,
        "policy": plan_training(settings).policy,
    }


# ------------------------------------------------------------------ the original trainer (child)


def original_get_train(
    input_image: npt.NDArray[np.uint8], gt: dict[str, Any], patch_height: int, patch_width: int, max_samples: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The original ``getTrain`` (Calvo's patch sampler as Rodan's HPC trainer ran it), verbatim in substance."""
    factor = 100.0
    x_train: dict[str, Any] = {label: [] for label in gt}
    y_train: dict[str, Any] = {label: [] for label in gt}
    count = {label: (gt[label] == 1).sum() for label in gt}
    samples_per_class = max_samples
    for label in gt:
        samples_per_class = min(count[label], samples_per_class)
    ratio = {label: factor * (samples_per_class / float(count[label])) for label in gt}
    height, width, _ = input_image.shape
    for row in range(patch_height, height - patch_height - 1):
        for col in range(patch_width, width - patch_width - 1):
            if random.random() < 1.0 / factor:
                for label in gt:
                    if gt[label][row][col] == 1 and random.random() < ratio[label]:
                        from_x = row - (patch_height // 2)
                        from_y = col - (patch_width // 2)
                        sample_x = input_image[from_x : from_x + patch_height, from_y : from_y + patch_width]
                        normalised = (255.0 - sample_x) / 255.0
                        sample_y = gt[label][from_x : from_x + patch_height, from_y : from_y + patch_width]
                        x_train[label].append(normalised)
                        y_train[label].append(sample_y)
    for label in gt:
        y_train[label] = np.expand_dims(np.asarray(y_train[label]), axis=-1)
        x_train[label] = np.asarray(x_train[label]).reshape(len(x_train[label]), patch_height, patch_width, 3)
    return x_train, y_train


def child_original(args: argparse.Namespace) -> dict[str, Any]:
    image, masks = make_page(args.height, args.width, args.layers, args.patch)
    bgr = np.ascontiguousarray(image[..., ::-1])  # cv2.imread gives BGR; same size
    del image
    random.seed(1)
    before = rss_bytes()
    start = time.perf_counter()
    x, y = original_get_train(bgr, masks, args.patch, args.patch, args.original_samples)
    retained = rss_bytes() - before
    peak = peak_bytes() - before
    samples = {label: len(x[label]) for label in x}
    return {
        "peak_growth": peak,
        "retained_growth": retained,
        "samples": samples,
        "array_bytes": sum(x[k].nbytes + y[k].nbytes for k in x),
        "dtypes": [str(x[next(iter(x))].dtype), str(y[next(iter(y))].dtype)],
        "seconds": time.perf_counter() - start,
    }


# --------------------------------------------------------------------------- parent


def run_child(kind: str, args: argparse.Namespace, precision: str = "off") -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--precision", precision]
    for name in ("samples", "layers", "patch", "batch", "steps", "val_steps", "height", "width", "original_samples"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    if done.returncode != 0:
        raise RuntimeError(f"the {kind} child failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=10_000, help="maximum samples per label")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--patch", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="training batches per layer (ours)")
    parser.add_argument("--val-steps", type=int, default=1, help="validation batches per layer (ours)")
    parser.add_argument("--height", type=int, default=6496)
    parser.add_argument("--width", type=int, default=4872)
    parser.add_argument("--original-samples", type=int, default=250, help="samples per label, original run")
    parser.add_argument(
        "--mixed-precision", nargs="+", default=["off"], choices=["off", "float16", "bfloat16"],
        help="our runs, one per value",
    )  # fmt: skip
    parser.add_argument("--child", choices=["ours", "original"], help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="off", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke test: a 640x640 page, 2 layers, 32x32, 1 step")
    args = parser.parse_args()
    if args.quick:  # QUICK replaces the defaults; options given still win
        parser.set_defaults(**QUICK)
        args = parser.parse_args()

    if args.child == "ours":
        print(json.dumps(child_ours(args)))
        return 0
    if args.child == "original":
        print(json.dumps(child_original(args)))
        return 0

    ours = {p: run_child("ours", args, p) for p in args.mixed_precision}
    for precision, run in ours.items():
        print(f"ours ({precision}): {json.dumps(run)}", flush=True)
    original = run_child("original", args)
    print(f"original getTrain at {args.original_samples} per label: {json.dumps(original)}", flush=True)

    reference = next(iter(ours.values()))  # the first (default "off") run: TF's training footprint
    training_footprint = reference["peak"]
    nominal = args.layers * args.samples
    per_sample = args.patch * args.patch * 3 * 8 + args.patch * args.patch  # float64 X + bool Y
    original_arrays = nominal * per_sample
    original_computed = original_arrays + training_footprint
    measured_samples = sum(original["samples"].values())
    scale = nominal / measured_samples
    original_extrapolated = max(
        reference["before_training"] + original["peak_growth"] * scale,
        training_footprint + original["retained_growth"] * scale,
    )

    rows: list[tuple[str, str, float]] = [
        (
            f"original: float64 X + bool Y, {args.layers} x {args.samples:,} patches",
            f"computed: {original_arrays / GB:.2f} GB of arrays"
            f" + {training_footprint / GB:.2f} GB TF training (measured)",
            original_computed,
        ),
        (
            "original: getTrain measured, extrapolated",
            f"measured at {measured_samples:,} patches ({original['peak_growth'] / measured_samples / 2**20:.2f} MiB "
            f"peak each), x{scale:.1f}, incl. np.asarray's copy",
            original_extrapolated,
        ),
    ]
    for run in ours.values():
        drawn = sum(run["samples"].values())
        rows.append(
            (
                f"ours ({run['policy']}), {args.layers} layers",
                f"measured: {drawn:,} centres drawn, {args.steps}+{args.val_steps} batches/layer, "
                f"page {run['page_bytes'] / GB:.2f} GB",
                float(run["peak"]),
            )
        )
    header = ("approach", "how", "peak RSS (GB)", "original (computed) / this", "original (extrapolated) / this")
    cells = [
        (name, how, f"{peak / GB:.2f}", f"{original_computed / peak:.1f}", f"{original_extrapolated / peak:.1f}")
        for name, how, peak in rows
    ]
    print(
        f"\nPeak RSS, {args.patch}x{args.patch} patches, batch {args.batch}, {args.samples:,} samples per label, "
        f"{args.layers} layers, page {args.width}x{args.height}"
    )
    print_table(header, cells)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
