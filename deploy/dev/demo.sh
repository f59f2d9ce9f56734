#!/usr/bin/env bash
# The whole pipeline end to end on this machine: set-up, then a Rodan 3.x user's training run through
# the real Rodan 3.1.0 (deploy/dev/rodan.sh, with our job package): a workflow run started through
# Rodan's REST API, hpc-bridge passes as cron runs them against the real local Slurm, the worker's
# training in the Slurm job, the models stored in Rodan, and Paco_classifier's own classifier run
# on them in both TensorFlow versions Rodan uses. The last lines say where to look. The demo's
# queues are deleted from the broker when demo.py ends, whether it succeeded or failed (exec: the
# Python process is the one a Ctrl-C or SIGTERM reaches).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
bash deploy/dev/setup.sh
exec .venv/bin/python deploy/dev/demo.py "$@"
