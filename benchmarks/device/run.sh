#!/usr/bin/env bash
# The GPU measurement of issue 21, as one prepared run for a lent GPU machine (the `device` tool):
# bench_gpu_path.py on Keras' JAX backend, the real train_page path against the bare Keras step.
# The machine has JAX but no TensorFlow, no network and no ../shared: what the trainer needs beyond
# the machine's own packages comes in benchmarks/device/wheels, the Einsiedeln page in
# benchmarks/device/data (both ignored by git, carried by the call; benchmarks/README.md, "The real
# training path on a GPU"). Tables go to $OUT (the device tool brings them back).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv | tee "$out/device.txt"
# --no-deps: the machine's own numpy, h5py, ml-dtypes, rich and absl-py stay; only what it lacks is added.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/device/wheels/*.whl
export PYTHONPATH=/tmp/site KERAS_BACKEND=jax JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache PYTHONUNBUFFERED=1
export HPC_EINSIEDELN_DIR="$PWD/benchmarks/device/data"
python3 -c 'import jax, keras, numpy; print("jax", jax.__version__, jax.devices(), "keras", keras.__version__, "numpy", numpy.__version__)' | tee -a "$out/device.txt"
python3 benchmarks/bench_gpu_path.py 2>&1 | tee "$out/gpu_path_256.txt"                       # the target
python3 benchmarks/bench_gpu_path.py --patch 64 --batch 64 2>&1 | tee "$out/gpu_path_64.txt"  # if minutes remain
