#!/usr/bin/env bash
# The whole test suite, as CI runs it: set-up, lint, type-check, import contracts (lint-imports, pyproject.toml),
# then pytest against the real RabbitMQ, the real single-node Slurm and Grid Engine clusters and the Rodan stand-in.
# Extra arguments go to pytest (every phase).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
bash deploy/dev/setup.sh
echo "[test] ruff"
.venv/bin/ruff check .
echo "[test] mypy"
.venv/bin/mypy
echo "[test] import contracts"
.venv/bin/lint-imports --no-cache
echo "[test] pytest"
# Five phases. First, every test that uses a scheduler in parallel (HPC_TEST_WORKERS processes,
# default 4: on 2 cores four overlap the tests' waits on schedulers, while the trainings keep the
# CPUs busy; longest first, see tests/conftest.py). Then the scenarios that load both cores by
# themselves (marker "heavy": the real Rodan end to end, the Paco benchmark), two at a time, so that
# they do not starve the other phases' timed waits. Then the tests that stop a shared scheduler
# (marker "exclusive"), one at a time per cluster, and beside them every test that needs no
# scheduler (no marker slurm or gridengine: tests/conftest.py stops such a test from reaching one),
# whose CPU work fills the outages' waits. Then the trainer's tests on the JAX backend. Then, alone, the secrets scan (marker "last",
# tests/test_fault_secrets.py), which reads everything the run left, and only that: each phase has
# its own base temporary directory under one run directory. Every phase runs; the exit status is
# the first failure's.
run_tmp=$(mktemp -d /tmp/hpc-bridge-tests.XXXXXX)
export HPC_TEST_SCAN_DIRS="$run_tmp"
# JAX compiles each program once for the whole run, not once per process (worker/trainer/backend.py).
export JAX_COMPILATION_CACHE_DIR="$run_tmp/jax-compilation"
status=0
phase() { # phase NAME PYTEST-ARGS...: run pytest; the first failing status is kept (5, no test selected, is none)
  local name=$1 code=0
  shift
  echo "[test] pytest, $name"
  .venv/bin/python -m pytest -q -p no:cacheprovider --basetemp "$run_tmp/$name" "$@" || code=$?
  if [ "$code" -ne 0 ] && [ "$code" -ne 5 ] && [ "$status" -eq 0 ]; then status=$code; fi
}
phase schedulers -n "${HPC_TEST_WORKERS:-4}" --dist loadgroup --no-loadscope-reorder --durations=25 \
    -m "(slurm or gridengine) and not exclusive and not last and not heavy" "$@"
phase heavy -n 2 --dist loadgroup --durations=10 -m "heavy and not exclusive and not last" "$@"
phase outages -n "${HPC_TEST_WORKERS:-4}" --dist loadgroup --no-loadscope-reorder --durations=25 \
    -m "exclusive or not (slurm or gridengine or heavy or last)" "$@"
# The trainer's own tests once more on Keras' JAX backend (JAX's CPU wheels; docs/design-jax.md),
# one module per worker (test_resume's module fixture is its reference run).
KERAS_BACKEND=jax phase jax -n 2 --dist loadfile --durations=10 -m "not slurm and not gridengine and not last" \
    tests/test_trainer.py tests/test_resume.py tests/test_tensorboard_events.py "$@"
phase last -m last "$@"
if [ "$status" -eq 0 ]; then rm -rf "$run_tmp"; else echo "[test] what the tests left: $run_tmp"; fi
exit "$status"
