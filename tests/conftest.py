"""Test setup: 8 simulated CPU devices (before jax is imported), float32.

No persistent XLA compilation cache: reading executables back from it
segfaulted XLA:CPU inside `compilation_cache.get_executable_and_time`
(sharded engine programs, xdist workers sharing the cache)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
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
