#!/usr/bin/env bash
# The whole test suite, as CI runs it: set-up, lint, type-check, import contracts (lint-imports, pyproject.toml),
# then pytest against the real RabbitMQ, the real single-node Slurm and Grid Engine clusters and the Rodan stand-in.
# Extra arguments go to pytest. Tests run in HPC_TEST_WORKERS processes (pytest-xdist, default 2):
# most of the suite's time is spent waiting on schedulers (time limits, requeues), not computing.
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
# Two phases: everything that shares the services runs in parallel; the tests that stop a shared
# service (marker "exclusive") run afterwards, alone. Both phases run; the exit status is the worst.
# Each phase has its own base temp directory under one run directory, which the secrets scan
# (tests/test_fault_secrets.py, exclusive) reads: everything the whole suite left, and only that.
run_tmp=$(mktemp -d /tmp/hpc-bridge-tests.XXXXXX)
export HPC_TEST_SCAN_DIRS="$run_tmp"
status=0
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${HPC_TEST_WORKERS:-2}" --durations=20 -m "not exclusive" --dist loadgroup \
    --basetemp "$run_tmp/parallel" "$@" || status=$?
echo "[test] pytest, tests that stop shared services (alone)"
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=10 -m exclusive --basetemp "$run_tmp/exclusive" "$@" || {
    code=$?
    # 5: no test selected (e.g. extra arguments named only other tests) is not a failure.
    [ "$code" -eq 5 ] || status=$code
}
if [ "$status" -eq 0 ]; then rm -rf "$run_tmp"; else echo "[test] what the tests left: $run_tmp"; fi
exit "$status"
