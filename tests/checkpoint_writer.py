"""Child process of the kill test (tests/test_checkpoint.py): saves checkpoints until it is killed.

    python tests/checkpoint_writer.py DIRECTORY MEGABYTES

Opens a CheckpointStore on DIRECTORY (which removes what a killed predecessor left
unfinished), prints ``ready``, then saves checkpoint after checkpoint through the real
writer, each holding about MEGABYTES of float32 weights all equal to a counter ``k`` that
is also in its records, and prints ``saved <file name> <k>`` after each save returns.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from worker.trainer.checkpoint import CheckpointStore, LayerState, TrainingState


def state_for(k: int, megabytes: float) -> TrainingState:
    values = int(megabytes * (1 << 20)) // 4
    layer = LayerState(
        label="Layer 0",
        epoch=k,
        sample_offset=0,
        batch=0,
        batches=1,
        batch_size=16,
        weights=[np.full(values // 2, k, np.float32), np.full(values - values // 2, -k, np.float32)],
        optimizer_variables=[np.array(k, np.int64)],
        metric_variables=[],
        early_stopping={"best": None, "best_epoch": 0, "wait": 0, "stopped_epoch": 0},
        best={"best": float(k), "best_epoch": k},
        best_weights=None,
        best_optimizer_variables=None,
        rng_state=dict(np.random.default_rng(k).bit_generator.state),
        permutation=None,
        history={"loss": [float(k)]},
    )
    return TrainingState(
        run={"writer": "kill test"},
        seed=k,
        centres={"Layer 0": np.full((k % 7 + 1, 2), k, np.int64)},
        current=layer,
        records=[{"label": "Layer 0", "epoch": k}],
    )


def main() -> None:
    directory, megabytes = Path(sys.argv[1]), float(sys.argv[2])
    store = CheckpointStore(directory)
    latest = store.load_latest()
    k = latest.seed if latest is not None else 0
    print("ready", flush=True)
    while True:
        k += 1
        path = store.save(state_for(k, megabytes))
        print(f"saved {path.name} {k}", flush=True)


if __name__ == "__main__":
    main()
