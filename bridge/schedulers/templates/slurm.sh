#!/bin/bash
# Batch job rendered by hpc-bridge. Directives come from validated settings only and no
# secret is written here (a Rodan job's token lives in the 0600 parameter file its worker reads).
$directives

set -euo pipefail
umask 077
$environment
export HPC_JOB_ID="$${SLURM_JOB_ID:-}" HPC_JOB_STARTED="$$(date +%s)"
# The time-limit warning (USR1) is ignored until the command has installed its own handler.
trap '' USR1
cd $workdir
echo "hpc-bridge job $job_name: $$(date -u +%FT%TZ) on $$(hostname) (job $${SLURM_JOB_ID:-?}, restart $${SLURM_RESTART_COUNT:-0})"
${prologue}exec $command
