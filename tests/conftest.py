"""Test setup: 8 simulated CPU devices (before jax is imported), float32.

No persistent XLA compilation cache: reading executables back from it
segfaulted XLA:CPU inside `compilation_cache.get_executable_and_time`
(sharded engine programs, xdist workers sharing the cache)."""

import os

# One LLVM module per compile on XLA:CPU (no parallel codegen threads): every
# crash seen in full runs (issue 23) was a segfault inside backend_compile on
# the 2-core machine, in unrelated programs; a race in the parallel codegen
# split is the suspect. Compile time is unchanged here (1.9 vs 2.1 s, tiny_moe).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                      "--xla_cpu_parallel_codegen_split_count=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# Kernel test classes run in interpret mode everywhere; their GPU subclasses
# (compiled kernels) are defined only where this process has a GPU, e.g.
# `JAX_PLATFORMS=cuda python -m pytest tests/test_kernels_*.py` (experiments/gpu_day.sh).
ON_GPU = jax.default_backend() == "gpu"

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
HF_FIXTURES = ["llama", "llama_sharded", "mixtral", "qwen3_moe", "deepseek_v3",
               "deepseek_v2lite", "gpt_oss"]


@pytest.fixture
def fixtures_dir():
  return FIXTURES
