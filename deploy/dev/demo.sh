#!/usr/bin/env bash
# The whole pipeline end to end on this machine: set-up, then a Rodan stand-in with a generated
# page, a request enqueued exactly as Rodan's task does, hpc-bridge passes as cron runs them against
# the real local Slurm, and what came back (model names, sizes, and whether each of Rodan's TensorFlow
# versions loads, predicts with and trains each model).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
bash deploy/dev/setup.sh
exec .venv/bin/python deploy/dev/demo.py "$@"
