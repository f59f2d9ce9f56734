"""Can the input pipeline keep a GPU fed? Batches per second with the model replaced by nothing.

A fast GPU steps the SAE in a few milliseconds (8 ms at 128x128, 27 ms at 256x256, batch
16, on an H100: ``benchmarks/README.md``, "Precision"), so whatever the host needs per
batch becomes the step time once it is longer. This measures, on a page the size of a real
manuscript page (4872 x 6496, random pixels, 10 000 sampled centres), how many batches per
second each way of producing batches delivers:

* ``numpy, one thread``: ``PatchDataset[i]``, cutting and converting in NumPy (the
  conversion, a lookup per pixel, is what costs);
* ``keras PyDataset (before)``: what ``fit`` read until this change: Keras' adapter around
  the ``PyDataset`` (``from_generator`` over ``PatchDataset[i]``, ``prefetch(AUTOTUNE)``);
* ``keras PyDataset, 2 workers``: the same with ``PyDataset(workers=2)`` (Keras' thread pool
  of workers instead of tf.data's prefetching);
* ``training_input``: what ``fit`` reads now (uint8 cut in Python, converted by
  ``tf.data`` in TensorFlow ops on 2 batches at once, 4 prefetched; see
  :mod:`worker.trainer.dataset`);
* ``training_input -> fit, no-op model``: the same through Keras' ``fit`` loop with a
  model whose train step only reads its batch, so Keras' own per-step cost counts too;
* ``constant batch -> fit, no-op model``: Keras' loop alone (one batch repeated, no pipeline).

Batches are 16 patches; the first batches of each run (start-up) are not counted.

    .venv/bin/python benchmarks/bench_input.py            # ~1 minute
    .venv/bin/python benchmarks/bench_input.py --quick    # smoke test: 64x64 only, a small page, few batches
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from benchmarks.tables import print_table  # noqa: E402
from worker.trainer._keras import keras  # noqa: E402
from worker.trainer.dataset import PatchDataset, training_input  # noqa: E402

BATCH = 16
WARMUP = 5


def rate(batches: Iterable[Any], count: int) -> float:
    """Batches per second over ``count`` batches of ``batches``, after WARMUP."""
    iterator = iter(batches)
    for _ in range(WARMUP):
        next(iterator)
    start = time.perf_counter()
    for _ in range(count):
        next(iterator)
    return count / (time.perf_counter() - start)


def forever(data: PatchDataset, epoch: Callable[[PatchDataset], Iterable[Any]]) -> Iterable[Any]:
    """Epoch after epoch of ``data``'s batches, a new order (and iterator) each time, as in fit."""
    while True:
        data.shuffle()
        yield from epoch(data)


class AsPyDataset(keras.utils.PyDataset):  # type: ignore[misc]
    """A PatchDataset as the Keras ``PyDataset`` the trainer used to hand ``fit`` (``workers``:
    Keras' own threads fetch its batches)."""

    def __init__(self, data: PatchDataset, workers: int = 1) -> None:
        super().__init__(workers=workers)
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        return self.data[index]


class NoOpModel(keras.Model):  # type: ignore[misc]
    """A model whose training step reads one value of its batch and does nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = keras.Variable(0.0, trainable=False)

    def call(self, inputs: Any) -> Any:
        return inputs

    def train_step(self, data: Any) -> dict[str, Any]:
        x = data[0]
        self.seen.assign_add(x[0, 0, 0, 0])
        return {"seen": self.seen}


def fit_rate(data: PatchDataset, steps: int, constant: bool = False) -> float:
    """Steps per second of ``fit`` over ``training_input(data)``, or over one batch of it repeated."""
    import tensorflow as tf

    model = NoOpModel()
    model.compile()
    timer = StepTimer()
    epochs = max(2, -(-(steps + WARMUP) // len(data)))
    source = training_input(data)
    if constant:
        source = tf.data.Dataset.from_tensors(next(iter(source))).repeat(len(data))
    model.fit(source, epochs=epochs, verbose=0, shuffle=False, callbacks=[timer])
    times = timer.ends[WARMUP:]
    return (len(times) - 1) / (times[-1] - times[0])


class StepTimer(keras.callbacks.Callback):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.ends: list[float] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.ends.append(time.perf_counter())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: a small page, few batches, 64x64 only")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args()
    if args.quick:  # a smaller default; --sizes given still wins
        parser.set_defaults(sizes=[64])
        args = parser.parse_args()
    height, width, samples = (1200, 1600, 2000) if args.quick else (4872, 6496, 10_000)
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    mask = rng.random((height, width)) < 0.3
    rows = []
    for patch in args.sizes:
        centres = np.stack(
            [rng.integers(patch, height - patch - 1, samples), rng.integers(patch, width - patch - 1, samples)], axis=1
        )
        data = PatchDataset(image, mask, centres, patch, patch, BATCH, shuffle_rng=np.random.default_rng(1))
        count = (60 if patch >= 256 else 300) if args.quick else (400 if patch >= 256 else 2000)
        from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

        ways: list[tuple[str, Callable[[PatchDataset], Iterable[Any]] | None]] = [
            ("numpy, one thread", lambda d: (d[i] for i in range(len(d)))),
            ("keras PyDataset (before)", lambda d: PyDatasetAdapter(AsPyDataset(d)).get_tf_dataset()),
            ("keras PyDataset, 2 workers", lambda d: PyDatasetAdapter(AsPyDataset(d, workers=2)).get_tf_dataset()),
            ("training_input", training_input),
            ("training_input -> fit, no-op model", None),
            ("constant batch -> fit, no-op model", None),
        ]
        for name, epoch in ways:
            load = os.getloadavg()[0]
            if epoch is None:
                per_s = fit_rate(data, count, constant=name.startswith("constant"))
            else:
                per_s = rate(forever(data, epoch), count)
            mb = BATCH * patch * patch * (3 * 4 + 4) / 1e6
            rows.append([f"{patch}x{patch}x{BATCH}", name, f"{per_s:,.0f}", f"{per_s * mb / 1000:.2f}", f"{load:.2f}"])
    print_table(["batch", "pipeline", "batches/s", "GB/s of float32 x+y", "load"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
