"""What the knobs around a training step do to it: oneDNN, XLA, thread pools, steps per execution.

Each case is a fresh interpreter (oneDNN and the thread pools are fixed at TensorFlow's
start) that builds the SAE as the trainer compiles it, feeds ``fit`` a ``tf.data`` of the
same constant batch (so only the step and Keras' loop count), and times the steps after
the first epoch (the first step traces the function; with XLA, compiles it). Cases:

* ``default``: what the trainer runs (TensorFlow's thread pools, Keras' ``jit_compile="auto"``,
  which is off on a machine without GPUs, one step per execution);
* ``oneDNN off`` / ``oneDNN on``: ``TF_ENABLE_ONEDNN_OPTS=0`` / ``1`` (see :mod:`worker.onednn`);
* ``XLA``: ``jit_compile=True``;
* ``1 intra-op thread`` / ``1 inter-op thread``: ``tf.config.threading``;
* ``8 steps per execution``: ``steps_per_execution=8`` (Keras then calls the per-batch
  callbacks once per 8 steps).

* ``original: TF 1.14 fit on NumPy arrays``: the original trainer's own ``get_sae`` and ``fit`` (batch 16,
  shuffled arrays, as ``original_stack/original_trainer.py``) in its Python 3.7 + TensorFlow 1.14 +
  Keras 2.3.1 environment (built by ``bench_trainer.py``'s set-up).

At 8x8 patches the step is almost all overhead, so its time is each stack's per-step cost. A case
that fails is a row saying so, and the script then exits with status 1.

    .venv/bin/python benchmarks/bench_step.py                 # 8x8, 64x64 and 256x256: ~6 minutes
    .venv/bin/python benchmarks/bench_step.py --patch 8 64    # ~2 minutes
    .venv/bin/python benchmarks/bench_step.py --quick         # smoke test: 8x8, the default case, 10 steps
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "oneDNN off": {"env": {"TF_ENABLE_ONEDNN_OPTS": "0"}},
    "oneDNN on": {"env": {"TF_ENABLE_ONEDNN_OPTS": "1"}},
    "XLA": {"jit_compile": True},
    "1 intra-op thread": {"intra": 1},
    "1 inter-op thread": {"inter": 1},
    "8 steps per execution": {"steps_per_execution": 8},
    "original: TF 1.14 fit on NumPy arrays": {"original": True},
}
ORIGINAL_CODE = """
import json, resource, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from keras.callbacks import Callback
from original_trainer import get_sae
patch, steps = int(sys.argv[2]), int(sys.argv[3])
rng = np.random.RandomState(0)
x = rng.rand(16 * steps, patch, patch, 3)
y = (rng.rand(16 * steps, patch, patch, 1) < 0.2).astype("float32")
ends = []
class Ends(Callback):
    def on_epoch_end(self, epoch, logs=None):
        ends.append(time.perf_counter())
model = get_sae(patch, patch)
start = time.perf_counter()
model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[Ends()])
print(json.dumps({"first_epoch_s": ends[0] - start, "step_s": (ends[1] - ends[0]) / steps,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""
BATCH = 16
#: ``--quick``: the trainer's own case (it needs nothing but this checkout's .venv, not the original's stack).
QUICK_CASES = ["default"]


def child(case: dict[str, Any], patch: int, steps: int) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    import numpy as np
    import tensorflow as tf

    if case.get("intra"):
        tf.config.threading.set_intra_op_parallelism_threads(case["intra"])
    if case.get("inter"):
        tf.config.threading.set_inter_op_parallelism_threads(case["inter"])
    from worker.trainer._keras import keras
    from worker.trainer.model import LEARNING_RATE, build_sae

    model = build_sae(patch, patch)
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=LEARNING_RATE),
        loss="binary_crossentropy",
        metrics=["accuracy"],
        jit_compile=case.get("jit_compile", "auto"),
        steps_per_execution=case.get("steps_per_execution", 1),
    )
    rng = np.random.default_rng(0)
    x = rng.random((BATCH, patch, patch, 3), dtype=np.float32)
    y = (rng.random((BATCH, patch, patch, 1)) < 0.2).astype(np.float32)
    data = tf.data.Dataset.from_tensors((x, y)).repeat(steps)
    ends: list[float] = []

    class Ends(keras.callbacks.Callback):  # type: ignore[misc]
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            ends.append(time.perf_counter())

    start = time.perf_counter()
    model.fit(data, epochs=2, verbose=0, callbacks=[Ends()])
    return {
        "first_epoch_s": ends[0] - start,
        "step_s": (ends[1] - ends[0]) / steps,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--patch", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), metavar="CASE",
                        help=f"the cases to run (default: all): {', '.join(map(repr, CASES))}")  # fmt: skip
    parser.add_argument("--steps", type=int, help="timed steps per case (default: 200 at 8x8, 16 to 64x64, else 3)")
    parser.add_argument("--quick", action="store_true", help=f"smoke test: 8x8, 10 steps, cases {QUICK_CASES}")
    args = parser.parse_args()
    if args.quick:  # these replace the defaults; options given still win
        parser.set_defaults(patch=[8], cases=QUICK_CASES, steps=10)
        args = parser.parse_args()
    if args.child:
        name, patch, steps = json.loads(args.child)
        print(json.dumps(child(CASES[name], patch, steps)))
        return 0
    sys.path.insert(0, str(REPO))
    from benchmarks.tables import print_table

    rows = []
    failed = False
    for patch in args.patch:
        steps = args.steps or (200 if patch <= 8 else 16 if patch <= 64 else 3)
        for name in args.cases:
            case = CASES[name]
            env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "", **case.get("env", {})}
            command = [sys.executable, __file__, "--child", json.dumps([name, patch, steps])]
            if case.get("original"):
                from benchmarks.bench_trainer import HERE, original_python

                env["PYTHONWARNINGS"] = "ignore"
                stack = str(HERE / "original_stack")
                command = [str(original_python()), "-c", ORIGINAL_CODE, stack, str(patch), str(steps)]
            load = os.getloadavg()[0]
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800, check=False)
            if done.returncode:
                last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
                rows.append([f"{patch}x{patch}", name, "failed", last[:80], "", ""])
                failed = True
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(
                [f"{patch}x{patch}", name, f"{r['step_s'] * 1000:.1f}", f"{r['first_epoch_s']:.1f}",
                 f"{r['peak_mib']:.0f}", f"{load:.2f}"]
            )  # fmt: skip
    print_table(["patch", "case", "step ms", "first epoch s (incl. trace)", "peak RSS MiB", "load"], rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
