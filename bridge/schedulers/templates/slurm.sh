#!/bin/bash
# Batch job rendered by hpc-bridge for one Rodan training request.
# Directives come from validated settings only; no secret is written here
# (the Rodan token lives in the 0600 parameter file the worker reads and deletes).
$directives

set -euo pipefail
umask 077
cd $workdir
echo "hpc-bridge job $job_name: $$(date -u +%FT%TZ) on $$(hostname) (job $${SLURM_JOB_ID:-?}, restart $${SLURM_RESTART_COUNT:-0})"
exec $command
