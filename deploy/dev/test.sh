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
# The pytest phases, one after another, two of them with a second pytest beside them:
#   1. schedulers: every test that uses a scheduler, in parallel (HPC_TEST_WORKERS processes,
#      default 4: on 2 cores four overlap the tests' waits on schedulers while the trainings keep the
#      CPUs busy; longest first, the waits in turn with the tests that compute: tests/conftest.py).
#   2. heavy, and beside it nothing-but-CPU: the long scenarios (marker "heavy": the real Rodan end
#      to end, the Paco benchmark), two at a time, whose waits on Rodan left the cores idle half
#      the time when they ran alone; beside them every test that needs no scheduler (no marker slurm
#      or gridengine: tests/conftest.py stops such a test from reaching one) and the tests that stop
#      Grid Engine (marker "exclusive", one at a time): the heavy tests use Slurm only.
#   3. slurm-outages, and beside it jax, then first-epoch: the tests that stop Slurm's controller or
#      accounting, one at a time, while nothing else uses Slurm, mostly waits; beside them the
#      trainer's tests once more on Keras' JAX backend (one module per worker: test_resume's module
#      fixture is its reference run), then the first-epoch guard's trainings on real pages
#      (tests/test_fresh_start.py, taken out of phase 2, whose CPUs were busy to the end).
#   4. last, alone: the secrets scan (marker "last", tests/test_fault_secrets.py), which reads
#      everything the run left, and only that: each phase has its own base temporary directory under
#      one run directory.
# Every phase runs; the exit status is the first failure's. A phase beside another writes its output
# to a file, shown once both have ended.
# Compiled modules are kept (Python's default; some machines' environments switch it off with
# PYTHONDONTWRITEBYTECODE): without them every pytest process rewrites the assertions of all ~100
# test modules again while collecting (about 9 s of CPU, for each of the run's 13 pytest processes),
# and every job and pass compiles what it imports again. They go to __pycache__ beside the sources
# (ignored by git; whatever copies a package out of the tree already leaves __pycache__ behind).
unset PYTHONDONTWRITEBYTECODE
run_tmp=$(mktemp -d /tmp/hpc-bridge-tests.XXXXXX)
beside_log=$(mktemp /tmp/hpc-bridge-tests-beside.XXXXXX)  # outside run_tmp: the secrets scan reads that
trap 'rm -f "$beside_log"' EXIT
export HPC_TEST_SCAN_DIRS="$run_tmp"
# JAX compiles each program once for the whole run, not once per process (worker/trainer/backend.py).
export JAX_COMPILATION_CACHE_DIR="$run_tmp/jax-compilation"
status=0
keep() { # keep CODE: the first failing status is kept (5, no test selected, is none)
  if [ "$1" -ne 0 ] && [ "$1" -ne 5 ] && [ "$status" -eq 0 ]; then status=$1; fi
}
run_phase() { # run_phase NAME PYTEST-ARGS...: pytest with the phase's own base temporary directory
  local name=$1
  shift
  echo "[test] pytest, $name ($(date -u +%H:%M:%S))"
  .venv/bin/python -m pytest -q -p no:cacheprovider --basetemp "$run_tmp/$name" "$@"
}
phase() { # phase NAME PYTEST-ARGS...
  local code=0
  run_phase "$@" || code=$?
  keep "$code"
}
beside() { # beside NAME PYTEST-ARGS...: starts the phase in the background, its output to beside_log
  run_phase "$@" > "$beside_log" 2>&1 &
  beside_pid=$!
}
joined() { # joined: waits for the phase started by beside, shows its output, keeps its status
  local code=0
  wait "$beside_pid" || code=$?
  cat "$beside_log"
  keep "$code"
}
phase schedulers -n "${HPC_TEST_WORKERS:-4}" --dist loadgroup --no-loadscope-reorder --durations=25 \
    -m "(slurm or gridengine) and not exclusive and not last and not heavy" "$@"
beside heavy -n 2 --dist loadgroup --durations=10 -m "heavy and not exclusive and not last" "$@"
phase outages -n 3 --dist loadgroup --no-loadscope-reorder --durations=25 --ignore=tests/test_fresh_start.py \
    -m "(exclusive and not slurm) or not (slurm or gridengine or heavy or last)" "$@"
joined
beside slurm-outages --durations=10 -m "exclusive and slurm and not last" "$@"
KERAS_BACKEND=jax phase jax -n 2 --dist loadfile --durations=10 -m "not slurm and not gridengine and not last" \
    tests/test_trainer.py tests/test_resume.py tests/test_tensorboard_events.py "$@"
phase first-epoch -n 2 --durations=10 -m "not slurm and not gridengine and not last" tests/test_fresh_start.py "$@"
joined
phase last -m last "$@"
if [ "$status" -eq 0 ]; then rm -rf "$run_tmp"; else echo "[test] what the tests left: $run_tmp"; fi
exit "$status"
