"""Training throughput of the SAE (benchmark 3): samples/s in steady state, per patch size.

For each patch size it builds the model as ``train_label`` does (``plan_training``: the
``tf.distribute`` strategy and the dtype policy chosen for this machine, model and optimizer
created inside ``strategy.scope()``) and fits it on real ``PatchDataset`` batches cut from a
synthetic uint8 page through the trainer's input pipeline (``training_input``, what ``fit``
reads in ``train_label``), so the timings include cutting the patches. The first ``--warmup``
steps (the first one traces the ``tf.function``) are excluded; every timed step ends by
reading its loss back, so the GPU has finished it (this forgoes overlapping one step's
dispatch with the next: a slight underestimate on a GPU).

It runs unchanged on a GPU node: with one GPU it trains there (float32, as the product does
unless an operator opts in); with several, under ``MirroredStrategy`` sharing the global
``--batch`` among them (so a step takes the same patches, in less time). ``--strategy`` and
``--mixed-precision`` override the choice as ``TrainSettings`` does. TensorFlow only, as the
trainer's strategies are (``tf.distribute``).

    .venv/bin/python benchmarks/bench_throughput.py                      # 64x64 and 256x256
    .venv/bin/python benchmarks/bench_throughput.py --quick              # smoke test: 32x32, 1 + 3 steps
    .venv/bin/python benchmarks/bench_throughput.py --patch 64 --steps 30
    .venv/bin/python benchmarks/bench_throughput.py --mixed-precision bfloat16 --patch 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from benchmarks.tables import print_table  # noqa: E402
from worker.trainer import TrainSettings  # noqa: E402
from worker.trainer._keras import keras  # noqa: E402
from worker.trainer.dataset import PatchDataset, training_input  # noqa: E402
from worker.trainer.distribute import plan_training, strategy_name  # noqa: E402

PAGE_SIDE = 2048


class StepTimer(keras.callbacks.Callback):  # type: ignore[misc]
    """Wall time of every training step, each ended by reading its loss (a device sync)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        float((logs or {}).get("loss", 0.0))  # waits for the step's result
        self.seconds.append(time.perf_counter() - self._start)


def device_description(gpus: int) -> str:
    import tensorflow as tf

    if gpus:
        devices = tf.config.list_physical_devices("GPU")
        names = {tf.config.experimental.get_device_details(d).get("device_name", "GPU") for d in devices}
        return f"{gpus}x {'/'.join(sorted(names))}"
    return f"CPU ({os.cpu_count()} cores)"


def measure(patch: int, args: argparse.Namespace) -> dict[str, Any]:
    settings = TrainSettings(
        epochs=15,
        max_samples_per_label=10000,
        patch_height=patch,
        patch_width=patch,
        batch_size=args.batch,
        patience=3,
        strategy=tuple(args.strategy.split(",")) if "/" in args.strategy else args.strategy,
        mixed_precision=args.mixed_precision,
    )
    plan = plan_training(settings)
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (PAGE_SIDE, PAGE_SIDE, 3), dtype=np.uint8)
    mask = np.zeros((PAGE_SIDE, PAGE_SIDE), dtype=bool)
    mask[::7] = True
    steps = args.warmup + args.steps
    n = steps * plan.global_batch_size
    low, high = patch, PAGE_SIDE - patch - 1
    centres = np.stack([rng.integers(low, high, n), rng.integers(low, high, n)], axis=1).astype(np.int64)
    data = PatchDataset(image, mask, centres, patch, patch, plan.global_batch_size, shuffle_rng=rng)
    model = plan.build_model(patch, patch)
    timer = StepTimer()
    model.fit(training_input(data), epochs=1, callbacks=[timer], verbose=0)  # n samples: exactly `steps` batches
    timed = timer.seconds[args.warmup :]
    mean = statistics.fmean(timed)
    return {
        "patch": f"{patch}x{patch}",
        "batch": f"{plan.per_replica_batch_size} x {plan.replicas} = {plan.global_batch_size}",
        "device": device_description(plan.gpus),
        "strategy": strategy_name(plan.strategy),
        "replicas": plan.replicas,
        "policy": plan.policy,
        "samples/s": plan.global_batch_size / mean,
        "step s": f"{mean:.3f} ({min(timed):.3f}-{max(timed):.3f})",
        "first step s": f"{timer.seconds[0]:.1f}",
        "steps": len(timed),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patch", type=int, nargs="+", default=[64, 256], help="patch sides (square patches)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per patch size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps (the first one traces)")
    parser.add_argument("--batch", type=int, default=16, help="the batch of one step, shared by the replicas")
    parser.add_argument("--strategy", default="auto", help='"auto", "mirrored", "default" or devices "/cpu:0,..."')
    parser.add_argument("--mixed-precision", default="off", choices=["off", "float16", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="smoke test: 32x32 patches, 1 untimed + 3 timed steps")
    args = parser.parse_args()
    if args.quick:  # these replace the defaults; options given still win
        parser.set_defaults(patch=[32], steps=3, warmup=1)
        args = parser.parse_args()
    if keras.backend.backend() != "tensorflow":
        parser.error(f"the trainer's strategies are tf.distribute's: run on TensorFlow, not {keras.backend.backend()}")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1 (the first step traces the function)")

    rows = [measure(patch, args) for patch in args.patch]
    columns = ["patch", "batch", "device", "strategy", "replicas", "policy", "samples/s", "step s", "first step s"]
    cells = [[f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c]) for c in columns] for row in rows]
    print(f"\nTraining throughput, steady state: {rows[0]['steps']} timed steps after {args.warmup} untimed")
    print_table(columns, cells)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
