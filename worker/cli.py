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
    args = parser.parse_args(argv)

    configure_logging(level=args.log_level, stream=sys.stdout, component="worker")
    # TensorFlow's C++ start-up lines (and any other write to file descriptor 2) become JSON events.
    capture_native_stderr()
    from worker.job import run_job  # after logging is set up

    return run_job(args.params)
