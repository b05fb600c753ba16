#!/usr/bin/env bash
# The day a GPU is there: the kernel tests compiled on it, then kernel_bench.
#   bash experiments/gpu_day.sh            (from the repository root, on a CUDA 12 machine)
# Installs the CUDA extra into .venv-gpu, runs the kernel test classes' GPU
# subclasses (interpret-mode and compiled runs side by side) and the engine's
# Pallas-vs-XLA greedy tests on the GPU, then times every kernel against its
# peers (experiments/results/kernel_bench_<device>_<date>.json).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-gpu
. .venv-gpu/bin/activate
pip install -q --upgrade pip
pip install -q -e ".[dev,cuda12]"
python -c "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 'no GPU visible to jax')"
JAX_PLATFORMS=cuda python -m pytest -q tests/test_kernels_flash.py tests/test_kernels_paged.py \
  tests/test_kernels_dispatch.py
JAX_PLATFORMS=cuda python experiments/kernel_bench.py
