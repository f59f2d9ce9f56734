#!/bin/bash
# Batch job rendered by hpc-bridge. Directives come from validated settings only and no
# secret is written here (a Rodan job's token lives in the 0600 parameter file its worker reads).
#SBATCH --job-name=rodan-3f2b8c1e-0d4a-4c1b-9a57-6f1f0c3e2d10
#SBATCH --comment=3f2b8c1e-0d4a-4c1b-9a57-6f1f0c3e2d10
#SBATCH --time=0-06:00
#SBATCH --mem=16000M
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=6
#SBATCH --output=/spool/jobs/3f2b/job-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --gres=gpu:1
#SBATCH --account=def-lab
#SBATCH --partition=gpu
#SBATCH --mail-user=lab@example.org
#SBATCH --mail-type=END,FAIL
#SBATCH --nice=10
#SBATCH --constraint=v100
#SBATCH --exclusive

set -euo pipefail
umask 077
export HPC_JOB_SCHEDULER=slurm
export HPC_JOB_TIME_LIMIT_S=21600
export HPC_JOB_WARN_S=300
export HPC_JOB_ID="${SLURM_JOB_ID:-}" HPC_JOB_STARTED="$(date +%s)"
# The time-limit warning (USR1) is ignored until the command has installed its own handler.
trap '' USR1
cd /spool/jobs/3f2b
echo "hpc-bridge job rodan-3f2b8c1e-0d4a-4c1b-9a57-6f1f0c3e2d10: $(date -u +%FT%TZ) on $(hostname) (job ${SLURM_JOB_ID:-?}, restart ${SLURM_RESTART_COUNT:-0})"
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
