#!/bin/bash
# Batch job rendered by hpc-bridge. Directives come from validated settings only and no
# secret is written here (a Rodan job's token lives in the 0600 parameter file its worker reads).
# Grid Engine starts this with `-S /bin/bash` as a login shell, so /etc/profile resets PATH: the
# command always begins with an absolute interpreter path (the caller guarantees it). The
# environment is exported below rather than with `qsub -v`, which splits values on commas.
#$ -N rodan-3f2b8c1e-0d4a-4c1b-9a57-6f1f0c3e2d10
#$ -S /bin/bash
#$ -o /spool/jobs/3f2b/job-$JOB_ID.out
#$ -j y
#$ -wd /spool/jobs/3f2b
#$ -l h_rt=6:00:00
#$ -l mem_free=2667M
#$ -r n
#$ -w e
#$ -pe smp 6
#$ -l gpu=1
#$ -P def-lab
#$ -q gpu
#$ -M lab@example.org
#$ -m ea
#$ -notify
#$ -l h_vmem=4G
#$ -A lab-ocr
#$ -R y

set -euo pipefail
umask 077
export HPC_JOB_SCHEDULER=gridengine
export HPC_JOB_TIME_LIMIT_S=21600
export HPC_JOB_WARN_S=300
export HPC_JOB_ID="${JOB_ID:-}" HPC_JOB_STARTED="$(date +%s)"
# Grid Engine gives root's jobs no TMPDIR, only TMP (its per-job directory).
export TMPDIR="${TMPDIR:-${TMP:-/tmp}}"
# The warnings of -notify (USR1 before a suspend, USR2 before the kill at h_rt or after qdel) are
# ignored until the command has installed its own handler.
trap '' USR1 USR2
cd /spool/jobs/3f2b
echo "hpc-bridge job rodan-3f2b8c1e-0d4a-4c1b-9a57-6f1f0c3e2d10: $(date -u +%FT%TZ) on $(hostname) (job ${JOB_ID:-?}, restart ${RESTARTED:-0})"
# The site's set-up (HPC_JOB_PROLOGUE): a failing line ends the job here.
set +u
trap 'echo "hpc-bridge: HPC_JOB_PROLOGUE failed (exit $?, line $LINENO of this script)" >&2' ERR
module load cuda/12.2 cudnn
source /opt/site/tensorflow-env.sh
export HTTPS_PROXY=http://proxy.example.org:3128
trap - ERR
set -u
cd /spool/jobs/3f2b
exec /opt/venv/bin/python -m worker run /spool/params/3f2b.json
