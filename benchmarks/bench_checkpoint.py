"""What checkpointing costs a training step: none, node-local with background sync, synchronous to slow storage.

Trains the real SAE (``plan_training``, ``PatchDataset`` batches cut from a synthetic uint8
page and read by ``fit`` through ``training_input``, as ``bench_throughput.py``) for ``--warmup``
untimed and ``--steps`` timed steps in three cases:

(a) no checkpoints;
(b) a checkpoint every ``--every`` steps to a node-local directory (this machine's disk),
    copied by :class:`worker.trainer.sync.CheckpointSync` every ``--sync-interval``
    seconds to a deliberately slow "persistent" directory;
(c) a checkpoint every ``--every`` steps written straight to that slow directory.

The slow filesystem is simulated: every MiB written to it (the sync's copies in (b), the
store's writes in (c)) is paced so that the writes average ``--slow-mbps`` MB/s (20 by
default, a loaded shared filesystem); the data still goes to this machine's disk, fsync
included. Checkpoints are the trainer's own: :class:`worker.trainer.train.LayerLoop`
captures the layer's full state (weights, Adam, metrics, best epoch, sample order) and
:class:`worker.trainer.checkpoint.CheckpointStore` writes it, in the training thread, at
a batch end.

A step's time is the wall time from one batch end to the next, so a checkpoint written at
a batch end counts in the following step. The cases run ``--rounds`` times, interleaved,
and their steps are pooled. The table gives p50, p95 and max per case, how many
checkpoints were written, their size, and the time ``save()`` held the training thread.

    .venv/bin/python benchmarks/bench_checkpoint.py                 # 64x64, batch 16, 2 x 40 steps, every 10
    .venv/bin/python benchmarks/bench_checkpoint.py --steps 30 --every 5 --slow-mbps 50
    .venv/bin/python benchmarks/bench_checkpoint.py --quick         # smoke test: 16x16, 1 round of 1 + 3 steps
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import threading
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
from worker.trainer.callbacks import BestEpoch, EarlyStopper, EpochShuffle  # noqa: E402
from worker.trainer.checkpoint import CheckpointStore, TrainingState  # noqa: E402
from worker.trainer.dataset import PatchDataset, training_input  # noqa: E402
from worker.trainer.distribute import plan_training  # noqa: E402
from worker.trainer.sync import CheckpointSync, copy_file_atomic  # noqa: E402
from worker.trainer.train import LayerLoop  # noqa: E402

PAGE_SIDE = 2048
MB = 1e6


class RateLimit:
    """A throttle (``Callable[[int], None]``) that sleeps so that the bytes reported average ``rate`` bytes/s.

    Shared by every writer of the slow directory, as one slow filesystem would be.
    """

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._ready_at = 0.0  # when the bytes reported so far have "arrived"

    def __call__(self, size: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._ready_at = max(self._ready_at, now) + size / self.rate
            wait = self._ready_at - now
        time.sleep(wait)


class StepClock(keras.callbacks.Callback):  # type: ignore[misc]
    """Wall time between consecutive batch ends (the first from the start of the fit)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self._last = 0.0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._last = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        float((logs or {}).get("loss", 0.0))  # waits for the step's result
        now = time.perf_counter()
        self.seconds.append(now - self._last)
        self._last = now


class EverySteps(keras.callbacks.Callback):  # type: ignore[misc]
    """Calls ``loop.save_now()`` after every ``every``-th step from ``first`` on, and times it."""

    def __init__(self, loop: LayerLoop, every: int, first: int) -> None:
        super().__init__()
        self.loop, self.every, self.first = loop, every, first
        self.save_seconds: list[float] = []
        self.paths: list[Path] = []

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.loop.save is not None and batch + 1 >= self.first and (batch + 1 - self.first) % self.every == 0:
            start = time.perf_counter()
            path = self.loop.save_now()
            self.save_seconds.append(time.perf_counter() - start)
            if path is not None:
                self.paths.append(path)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def run_case(case: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    settings = TrainSettings(
        epochs=15,
        max_samples_per_label=10000,
        patch_height=args.patch,
        patch_width=args.patch,
        batch_size=args.batch,
        patience=3,
        seed=1,
    )
    plan = plan_training(settings)
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (PAGE_SIDE, PAGE_SIDE, 3), dtype=np.uint8)
    mask = np.zeros((PAGE_SIDE, PAGE_SIDE), dtype=bool)
    mask[::7] = True
    steps = args.warmup + args.steps
    n = steps * plan.global_batch_size
    low, high = args.patch, PAGE_SIDE - args.patch - 1
    centres = np.stack([rng.integers(low, high, n), rng.integers(low, high, n)], axis=1).astype(np.int64)
    data = PatchDataset(image, mask, centres, args.patch, args.patch, plan.global_batch_size, shuffle_rng=rng)
    model = plan.build_model(args.patch, args.patch)

    slow = RateLimit(args.slow_mbps * MB)
    local, persistent = workdir / case / "local", workdir / case / "persistent"
    sync: CheckpointSync | None = None
    store: CheckpointStore | None = None
    if case == "local + background sync":
        copy = functools.partial(copy_file_atomic, throttle=slow)
        sync = CheckpointSync(local, persistent, args.sync_interval, copy_file=copy)
        store = CheckpointStore(local, flush=sync.flush)
    elif case == "synchronous to slow storage":
        store = CheckpointStore(persistent, throttle=slow)
    run = {"page": {"synthetic": PAGE_SIDE}, "settings": {"patch": args.patch}}
    target = store

    def save(layer: Any) -> Path:
        assert target is not None
        return target.save(TrainingState(run=run, seed=1, centres={"Layer": centres}, current=layer))

    loop = LayerLoop(
        "Layer", data, 1, BestEpoch(keep_optimizer=False), EarlyStopper(3), {}, save if store else None, None
    )
    clock = StepClock()
    saver = EverySteps(loop, args.every, first=args.warmup + args.every)
    callbacks = [clock, EpochShuffle(data.shuffle), loop, saver]
    started = time.perf_counter()
    if sync is not None:
        sync.start()
    model.fit(training_input(data), epochs=1, shuffle=False, callbacks=callbacks, verbose=0)  # `steps` batches
    trained = time.perf_counter() - started
    flushed = 0.0
    if sync is not None:
        start = time.perf_counter()
        sync.close()  # the final sync: what the job waits for at its end
        flushed = time.perf_counter() - start
    size = saver.paths[-1].stat().st_size if saver.paths else 0
    if sync is not None and store is not None:  # the newest (the epoch end's) did reach the slow side
        assert (persistent / store.checkpoints()[-1].name).exists()
    return {
        "steps": clock.seconds[args.warmup :],
        "saves": saver.save_seconds,
        "size": size / MB,
        "final sync": flushed,
        "wall": trained,
    }


def summarise(case: str, runs: list[dict[str, Any]]) -> list[str]:
    steps = [s for run in runs for s in run["steps"]]
    saves = [s for run in runs for s in run["saves"]]
    return [
        case,
        f"{statistics.median(steps):.3f}",
        f"{percentile(steps, 95):.3f}",
        f"{max(steps):.3f}",
        str(len(saves)),
        f"{runs[-1]['size']:.1f}" if saves else "-",
        f"{statistics.fmean(saves):.3f} / {max(saves):.3f}" if saves else "-",
        f"{max(run['final sync'] for run in runs):.2f}" if case.startswith("local") else "-",
        f"{sum(run['wall'] for run in runs):.1f}",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patch", type=int, default=64, help="patch side (square patches)")
    parser.add_argument("--batch", type=int, default=16, help="batch size per replica")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per case and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (the first one traces)")
    parser.add_argument("--every", type=int, default=10, help="a checkpoint every this many steps")
    parser.add_argument("--slow-mbps", type=float, default=20.0, help="the slow filesystem's rate, MB/s")
    parser.add_argument("--sync-interval", type=float, default=1.0, help="seconds between background syncs")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the three cases (their steps are pooled)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 16x16, 1 round of 1 + 3 steps, a checkpoint every 2, 100 MB/s"
    )
    args = parser.parse_args()
    if args.quick:  # these replace the defaults; options given still win
        parser.set_defaults(patch=16, steps=3, warmup=1, every=2, rounds=1, slow_mbps=100.0)
        args = parser.parse_args()
    cases = ["none", "local + background sync", "synchronous to slow storage"]
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for round_number in range(args.rounds):  # interleaved, so that a busy spell hits every case alike
            for case in cases:
                runs[case].append(run_case(case, args, Path(directory) / str(round_number)))
    header = ["case", "step p50 s", "step p95 s", "step max s", "checkpoints", "size MB", "save() mean / max s",
              "final sync s", "wall s"]  # fmt: skip
    cells = [summarise(case, runs[case]) for case in cases]
    print(
        f"\n{args.patch}x{args.patch} patches, batch {args.batch}, {args.rounds} x {args.steps} timed steps "
        f"(after {args.warmup} untimed each time); "
        f"a checkpoint every {args.every} steps; slow storage {args.slow_mbps:g} MB/s, "
        f"background sync every {args.sync_interval:g} s"
    )
    print_table(header, cells)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
