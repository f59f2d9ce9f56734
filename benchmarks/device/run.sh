#!/usr/bin/env bash
# The GPU measurement of issue 21, as one prepared run for a lent GPU machine (the `device` tool):
# bench_gpu_path.py on Keras' JAX backend, the real train_page path against the bare Keras step.
# The machine has JAX but no TensorFlow and no network: what the trainer needs beyond JAX comes in
# benchmarks/device/wheels, fetched beforehand on a machine with network (benchmarks/README.md,
# "The real training path on a GPU"). Tables go to $OUT (the device tool brings them back).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv | tee "$out/device.txt"
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' | tee -a "$out/device.txt"
python3 -m pip install --quiet --no-index --find-links benchmarks/device/wheels \
    keras h5py structlog nvidia-ml-py pillow matplotlib python-dotenv
export KERAS_BACKEND=jax JAX_COMPILATION_CACHE_DIR="$out/jax-cache"
python3 benchmarks/bench_gpu_path.py | tee "$out/gpu_path_256.txt"                       # the target
python3 benchmarks/bench_gpu_path.py --patch 64 --batch 64 | tee "$out/gpu_path_64.txt"  # if minutes remain
