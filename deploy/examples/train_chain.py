#!/usr/bin/env python3
"""A training script that follows the ``hpc-bridge chain`` contract (numpy only).

It fits a linear model by stochastic gradient descent (least squares on synthetic data) for
``--total-steps`` steps, checkpointing atomically into ``$HPC_CHECKPOINT_DIR`` every
``--checkpoint-every`` steps and resuming from the checkpoint when it starts. It stops cleanly,
with a checkpoint, when SIGUSR1 (or SIGTERM) arrives or after ``--max-seconds-per-job``, and
exits 75 if steps remain, 0 when all are done. A run split over several jobs gives exactly the
same weights as one uninterrupted run: the checkpoint holds the random generator's state too.

    hpc-bridge chain --jobs 3 --time 10 --wait -- python deploy/examples/train_chain.py --total-steps 20000
    python deploy/examples/train_chain.py --total-steps 200     # locally: checkpoints in ./checkpoints

See docs/researcher-guide.md for the contract.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

EX_TEMPFAIL = 75  # "more to do": hpc-bridge chain runs the next job
CHECKPOINT = "state.npz"

stop_signal = 0  # set by the signal handler, acted on at the next step


def on_signal(signum: int, _frame: FrameType | None) -> None:
    global stop_signal
    stop_signal = signum  # only a flag: saving happens in the training loop


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--total-steps", type=int, default=2000, help="SGD steps in all (default 2000)")
    p.add_argument("--checkpoint-every", type=int, default=25, help="save every this many steps (default 25)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=0.02)
    p.add_argument("--features", type=int, default=20)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path(os.environ.get("HPC_CHECKPOINT_DIR", "checkpoints")),
        help="where to keep the checkpoint (default $HPC_CHECKPOINT_DIR, else ./checkpoints); "
        "point a new chain at an old run's checkpoints/ to go on from there",
    )
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep this long per step (a stand-in for real work)")
    p.add_argument(
        "--max-seconds-per-job",
        type=float,
        default=0.0,
        help="stop after this many seconds in one job, like a time limit (demos, tests; 0: no limit)",
    )
    return p.parse_args(argv)


def make_data(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same synthetic problem in every job (it comes from --seed, not from the checkpoint)."""
    rng = np.random.default_rng(args.seed)
    x = rng.normal(size=(args.samples, args.features))
    w_true = rng.normal(size=args.features)
    y = x @ w_true + 0.1 * rng.normal(size=args.samples)
    return x, y, w_true


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Atomic: a job killed while saving leaves the previous checkpoint intact.

    Write a temporary file beside it, flush and fsync it, rename it over the checkpoint
    (``os.replace`` is atomic within one filesystem), then fsync the directory so that the
    rename itself survives a crash of the node.
    """
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with temporary.open("wb") as handle:
            np.savez(
                handle,
                w=state["w"],
                step=np.int64(state["step"]),
                total_steps=np.int64(state["total_steps"]),
                config=np.str_(json.dumps(state["config"], sort_keys=True)),
                rng_state=np.str_(json.dumps(state["rng_state"])),
                segments=np.str_(json.dumps(state["segments"])),
            )
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_dir(path.parent)


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    with np.load(path) as data:
        return {
            "w": data["w"].copy(),
            "step": int(data["step"]),
            "total_steps": int(data["total_steps"]),
            "config": json.loads(str(data["config"])),
            "rng_state": json.loads(str(data["rng_state"])),
            "segments": json.loads(str(data["segments"])),
        }


def main(argv: list[str] | None = None) -> int:
    # First of all: until a handler is installed, the chain's warning (SIGUSR1) is ignored.
    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGTERM, on_signal)  # the scheduler's kill at the limit: save if there is time
    started = time.monotonic()
    args = parse_args(argv)
    checkpoint_dir = args.checkpoint_dir
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    path = checkpoint_dir / CHECKPOINT
    restart = int(os.environ.get("HPC_RESTART_COUNT", "0"))
    where = f"link {os.environ.get('HPC_CHAIN_LINK', '-')}/{os.environ.get('HPC_CHAIN_LINKS', '-')}"
    print(f"{where}, restart {restart}, job {os.environ.get('HPC_JOB_ID', '-')}: checkpoints in {path}", flush=True)

    config = {k: getattr(args, k) for k in ("features", "samples", "seed", "batch_size", "learning_rate")}
    x, y, w_true = make_data(args)
    rng = np.random.default_rng(args.seed + 1)  # draws the mini-batches
    state = load_checkpoint(path)
    if state is None:
        state = {"w": np.zeros(args.features), "step": 0, "segments": []}
        print(f"starting from scratch: {args.total_steps} steps", flush=True)
    else:
        if state["config"] != config:
            print(f"the checkpoint was made with other settings: {state['config']} (now {config})", file=sys.stderr)
            return 2
        rng.bit_generator.state = state["rng_state"]
        print(f"resuming from step {state['step']} of {args.total_steps}", flush=True)
    state.update(total_steps=args.total_steps, config=config)
    first_step = state["step"]

    def checkpoint(reason: str) -> None:
        segment = {"restart": restart, "start": first_step, "end": state["step"], "reason": reason}
        segments = [s for s in state["segments"] if s["restart"] != restart] + [segment]
        save_checkpoint(path, {**state, "rng_state": rng.bit_generator.state, "segments": segments})

    reason = "done"
    w = state["w"]
    while state["step"] < args.total_steps:
        if stop_signal:
            reason = signal.Signals(stop_signal).name
            break
        if args.max_seconds_per_job and time.monotonic() - started >= args.max_seconds_per_job:
            reason = "max-seconds-per-job"
            break
        batch = rng.integers(0, args.samples, size=args.batch_size)
        residual = x[batch] @ w - y[batch]
        w -= args.learning_rate * (x[batch].T @ residual) / args.batch_size
        state["step"] += 1
        if args.step_delay:
            time.sleep(args.step_delay)
        if state["step"] % args.checkpoint_every == 0:
            checkpoint("periodic")
            loss = float(np.mean((x @ w - y) ** 2))
            print(f"step {state['step']}: loss {loss:.5f} (checkpoint saved)", flush=True)
    checkpoint(reason)
    error = float(np.linalg.norm(w - w_true))
    if state["step"] >= args.total_steps:
        print(f"finished: {state['step']} steps, |w - w_true| = {error:.4f}", flush=True)
        return 0
    print(f"stopping ({reason}) at step {state['step']} of {args.total_steps}: checkpoint saved, exit 75", flush=True)
    return EX_TEMPFAIL


if __name__ == "__main__":
    sys.exit(main())
