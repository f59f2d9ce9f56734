#!/bin/bash
# Batch job rendered by hpc-bridge. Directives come from validated settings only and no
# secret is written here (a Rodan job's token lives in the 0600 parameter file its worker reads).
# Grid Engine starts this with `-S /bin/bash` as a login shell, so /etc/profile resets PATH: the
# command always begins with an absolute interpreter path (the caller guarantees it). The
# environment is exported below rather than with `qsub -v`, which splits values on commas.
$directives

set -euo pipefail
umask 077
$environment
export HPC_JOB_ID="$${JOB_ID:-}" HPC_JOB_STARTED="$$(date +%s)"
# Grid Engine gives root's jobs no TMPDIR, only TMP (its per-job directory).
export TMPDIR="$${TMPDIR:-$${TMP:-/tmp}}"
# The warnings of -notify (USR1 before a suspend, USR2 before the kill at h_rt or after qdel) are
# ignored until the command has installed its own handler.
trap '' USR1 USR2
cd $workdir
echo "hpc-bridge job $job_name: $$(date -u +%FT%TZ) on $$(hostname) (job $${JOB_ID:-?}, restart $${RESTARTED:-0})"
${prologue}exec $command
