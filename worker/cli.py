"""``hpc-worker``: the program a batch job runs on the compute node."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bridge.logs import capture_native_stderr, configure_logging
from bridge.version import package_version


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hpc-worker",
        description="Run one Rodan training request inside a batch job: download the inputs, train one "
        "model per layer, and publish the models (or an error) to the request's reply queue.",
        epilog="example: hpc-worker run ~/hpc-bridge-spool/params/2f1c...json",
    )
    parser.add_argument("--version", action="version", version=f"hpc-worker {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run the job described by a parameter file (the file is deleted)",
        epilog="example (what the batch script runs): hpc-worker run ~/hpc-bridge-spool/params/2f1c...json",
    )
    run.add_argument("params", type=Path, help="the 0600 parameter file written by hpc-bridge")
    run.add_argument("--log-level", default="INFO")
    tune = sub.add_parser(
        "tune",
        help="choose TensorFlow's CPU kernels (oneDNN on or off) for this kind of node by timing a few training "
        "steps with each, and keep the choice for the jobs (HPC_TUNING_DIR); once per kind of node and worker "
        "environment ('hpc-bridge doctor --job' runs it in its probe job)",
        epilog="example (on a compute node, in a job of the account the jobs run as): "
        "srun ~/hpc-bridge/envs/current/bin/hpc-worker tune",
    )
    tune.add_argument("--again", action="store_true", help="measure even if this kind of node has a record")
    tune.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)

    configure_logging(level=args.log_level, stream=sys.stdout, component="worker")
    if args.command == "tune":
        from worker import onednn

        tuning = onednn.remember(onednn.tuning_dir(), again=args.again)
        print(tuning.describe(), file=sys.stderr)
        return 1 if tuning.outcome == "failed" else 0
    # TensorFlow's C++ start-up lines (and any other write to file descriptor 2) become JSON events.
    capture_native_stderr()
    from worker.job import run_job  # after logging is set up

    return run_job(args.params)
