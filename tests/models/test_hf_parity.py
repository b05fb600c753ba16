"""load_hf + logits vs HF transformers float32 logits (committed fixtures)."""

import numpy as np
import jax.numpy as jnp
import pytest

from conftest import FIXTURES, HF_FIXTURES
from jaxinfer import checkpoint, models


def rel_err(ours, ref):
  return float(np.max(np.abs(np.asarray(ours) - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("name", HF_FIXTURES)
def test_logits_match_hf(name):
  d = FIXTURES / "hf" / name
  cfg, params = checkpoint.load_hf(str(d), dtype=jnp.float32)
  tokens, ref = np.load(d / "tokens.npy"), np.load(d / "logits.npy")
  assert rel_err(models.logits(cfg, params, tokens), ref) <= 1e-4


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_dense_moe_path_matches_hf_too(name):
  import dataclasses
  d = FIXTURES / "hf" / name
  cfg, params = checkpoint.load_hf(str(d), dtype=jnp.float32)
  cfg = dataclasses.replace(cfg, moe_impl="dense")
  tokens, ref = np.load(d / "tokens.npy"), np.load(d / "logits.npy")
  assert rel_err(models.logits(cfg, params, tokens), ref) <= 1e-4


def test_bf16_load_is_close():
  d = FIXTURES / "hf" / "llama"
  cfg, params = checkpoint.load_hf(str(d), dtype=jnp.bfloat16)
  assert cfg.dtype == "bfloat16"
  assert params["embed"].dtype == jnp.bfloat16
  tokens, ref = np.load(d / "tokens.npy"), np.load(d / "logits.npy")
  out = models.logits(cfg, params, tokens)
  assert out.dtype == jnp.float32
  assert rel_err(out, ref) <= 5e-2
