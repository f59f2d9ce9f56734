"""The real training path against the bare Keras step: does the pipeline keep the GPU busy?

For each precision, two measurements on the same machine, the same network, the same patch size
and the same batch:

* **train_page**: the trainer as the worker runs it, on a real page (a crop of the Einsiedeln masks
  with a page image synthesized from them, as in bench_precision.py). It includes the input
  pipeline, every callback, a checkpoint at every epoch end (``CheckpointStore``), the run
  directory (history, curves, TensorBoard), and GPU sampling into ``gpu.csv`` (``GpuMonitor``, one
  sample a second). ms per step = batch / the epochs' samples per second. The first epoch is
  left out: it includes compiling the step.
* **in memory**: ``build_sae`` + ``compile_sae`` under the same dtype policy, ``fit`` on float32
  arrays already in memory. That is the limit the pipeline is judged against (the issue's target
  is train_page within 1.3x of it).

The table names the device, the backend and the date. GPU utilisation is the mean of ``gpu.csv``
during train_page (empty without an NVIDIA GPU). It runs on whichever Keras backend the
environment chose (``KERAS_BACKEND``; a GPU machine with JAX and no TensorFlow runs JAX), and on
the CPU too:

    .venv/bin/python benchmarks/bench_gpu_path.py --quick                      # smoke test on a CPU, ~1 min
    python benchmarks/bench_gpu_path.py                                         # 256x256, batch 16, both precisions
    python benchmarks/bench_gpu_path.py --patch 64 --batch 64 --precisions off  # the other sizes, time allowing
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from benchmarks.bench_precision import LAYERS, load_real_page  # noqa: E402
from benchmarks.tables import print_table  # noqa: E402
from worker.gpumon import GpuMonitor  # noqa: E402
from worker.trainer import CheckpointStore, Page, TrainSettings, train_page  # noqa: E402
from worker.trainer._keras import BACKEND, keras  # noqa: E402
from worker.trainer.dataset import PatchDataset, to_network_batch  # noqa: E402
from worker.trainer.distribute import dtype_policy, precision_policy  # noqa: E402
from worker.trainer.model import build_sae, compile_sae  # noqa: E402
from worker.trainer.rundir import RunDirectory  # noqa: E402
from worker.trainer.sampling import sample_centres  # noqa: E402

QUICK: dict[str, Any] = {
    "patch": 32,
    "batch": 8,
    "samples": 160,
    "epochs": 2,
    "memory_steps": 20,
    "precisions": ["off"],
    "crop": [1024, 2048, 1536, 2560],
}


def layer_page(crop: tuple[int, int, int, int], work: Path, layer: str) -> Page:
    """bench_precision.py's page (a crop of the Einsiedeln masks), ``layer`` alone."""
    page = load_real_page(crop, work)
    return Page(image=page.image, masks={layer: page.masks[layer]})


def device_name() -> str:
    if BACKEND == "jax":
        import jax

        first = jax.devices()[0]
        return f"{first.device_kind} ({first.platform}, {len(jax.devices())} device(s))"
    gpus = keras.distribution.list_devices("gpu") if hasattr(keras.distribution, "list_devices") else []
    return f"{len(gpus)} GPU(s)" if gpus else f"CPU ({os.cpu_count()} cores)"


def real_path(page: Page, args: argparse.Namespace, precision: str, work: Path) -> dict[str, Any]:
    """train_page as the worker runs it; ms per step from the epochs after the first."""
    settings = TrainSettings(
        epochs=args.epochs, max_samples_per_label=args.samples, patch_height=args.patch, patch_width=args.patch,
        batch_size=args.batch, patience=args.epochs, seed=1, mixed_precision=precision,
    )  # fmt: skip
    run = RunDirectory.create(work / "runs", f"bench-{precision}")
    events: list[dict[str, Any]] = []
    monitor = GpuMonitor(run.path / "gpu.csv", interval_s=1.0)
    started = time.perf_counter()
    with monitor:
        train_page(page, settings, work / f"models-{precision}", on_epoch=events.append, run_dir=run,
                   checkpoints=CheckpointStore(work / f"checkpoints-{precision}"))  # fmt: skip
    wall = time.perf_counter() - started
    later = events[1:] or events
    samples_per_s = float(np.median([e["samples_per_second"] for e in later]))
    utilisation = gpu_utilisation(run.path / "gpu.csv")
    return {
        "ms_per_step": args.batch * 1000.0 / samples_per_s,
        "samples_per_s": samples_per_s,
        "first_epoch_s": events[0]["seconds"],
        "wall_s": wall,
        "gpu_util": utilisation,
        "best_val_accuracy": max(e["val_accuracy"] for e in events),
    }


def gpu_utilisation(path: Path) -> str:
    """The mean utilisation in ``gpu.csv`` (every GPU, every sample), or "-" without samples."""
    if not path.is_file():
        return "-"
    with path.open(newline="") as handle:
        values = [float(row["utilization_percent"]) for row in csv.DictReader(handle) if row.get("utilization_percent")]
    return f"{np.mean(values):.0f} %" if values else "-"


def in_memory_step(page: Page, args: argparse.Namespace, precision: str) -> float:
    """ms per step of ``fit`` on float32 batches already in memory (after a warm-up epoch)."""
    label = next(iter(page.masks))
    count = args.memory_steps * args.batch
    centres = sample_centres(page.masks, args.patch, args.patch, count, np.random.default_rng(0))[label][:count]
    data = PatchDataset(page.image, page.masks[label], centres, args.patch, args.patch, len(centres))
    x, y = to_network_batch(data.raw_item(0))[:2]
    with dtype_policy(precision_policy(precision)):
        model = build_sae(args.patch, args.patch)
        compile_sae(model)
    model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0)  # compiles
    started = time.perf_counter()
    model.fit(x, y, batch_size=args.batch, epochs=2, shuffle=False, verbose=0)
    steps = 2 * -(-len(x) // args.batch)
    return (time.perf_counter() - started) * 1000.0 / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patch", type=int, default=256, help="square patch side (a multiple of 4)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2000, help="maximum samples per label (train_page)")
    parser.add_argument("--epochs", type=int, default=3, help="train_page's epochs (the first is left out)")
    parser.add_argument("--memory-steps", type=int, default=100, help="steps per in-memory epoch")
    parser.add_argument("--precisions", nargs="+", default=["off", "bfloat16"], choices=["off", "float16", "bfloat16"])
    parser.add_argument("--layer", default="Neumes", choices=list(LAYERS))
    parser.add_argument("--crop", type=int, nargs=4, default=[0, 1024, 2048, 3072], metavar=("L", "T", "R", "B"))
    parser.add_argument("--quick", action="store_true", help="smoke test: 32x32, batch 8, float32, 2 short epochs")
    args = parser.parse_args()
    if args.quick:  # QUICK's values replace the defaults; options given still win
        parser.set_defaults(**QUICK)
        args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-path-") as scratch:
        work = Path(scratch)
        page = layer_page(tuple(args.crop), work / "page", args.layer)
        print(
            f"{device_name()}, Keras {keras.__version__} on {BACKEND}, {datetime.date.today()}; page "
            f"{page.width}x{page.height} ({args.layer}); {args.patch}x{args.patch} patches, batch {args.batch}",
            flush=True,
        )
        for precision in args.precisions:
            real = real_path(page, args, precision, work)
            memory = in_memory_step(page, args, precision)
            shown = "float32" if precision == "off" else precision
            rows.append([
                f"{args.patch}x{args.patch}", str(args.batch), shown, f"{real['ms_per_step']:.1f}",
                f"{real['samples_per_s']:.0f}", f"{memory:.1f}", f"{real['ms_per_step'] / memory:.2f}",
                real["gpu_util"], f"{real['first_epoch_s']:.1f}", f"{real['best_val_accuracy']:.4f}",
            ])  # fmt: skip
            print(f"{shown}: {real}, in memory {memory:.1f} ms/step", flush=True)
    print()
    print_table(
        ["patch", "batch", "precision", "train_page ms/step", "samples/s", "in-memory ms/step",
         "train_page / in-memory", "GPU util", "1st epoch s", "best val_accuracy"],
        rows,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
