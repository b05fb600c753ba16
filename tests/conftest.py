"""Test setup: 8 simulated CPU devices (before jax is imported), float32,
and a persistent XLA compilation cache shared by the xdist workers (many
tests compile the same step programs)."""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "jaxinfer-test-xla-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import pathlib  # noqa: E402

import pytest  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
HF_FIXTURES = ["llama", "llama_sharded", "mixtral", "qwen3_moe", "deepseek_v3",
               "deepseek_v2lite", "gpt_oss"]


@pytest.fixture
def fixtures_dir():
  return FIXTURES
