"""ops dispatch: models and the engine through the Pallas kernels (interpret
mode on CPU) equal the XLA path."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES, HF_FIXTURES
from jaxinfer import (Backend, Engine, EngineConfig, ModelConfig, SamplingParams, checkpoint,
                      models, presets)


@pytest.mark.parametrize("name", [n for n in HF_FIXTURES if n != "llama_sharded"])
def test_pallas_prefill_matches_hf(name):
  d = FIXTURES / "hf" / name
  cfg, params = checkpoint.load_hf(str(d), dtype=jnp.float32)
  cfg = dataclasses.replace(cfg, backend=Backend(attention="pallas"))
  tokens, ref = np.load(d / "tokens.npy"), np.load(d / "logits.npy")
  out = np.asarray(models.logits(cfg, params, tokens))
  assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) <= 1e-4


def _gpt_oss():
  cfg = ModelConfig.from_hf(json.loads((FIXTURES / "hf" / "gpt_oss" / "config.json").read_text()))
  return dataclasses.replace(cfg, max_position_embeddings=256)


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe", "gpt_oss"])
def test_engine_greedy_identical_pallas_vs_xla(name):
  cfg = _gpt_oss() if name == "gpt_oss" else presets.get(name)
  params = models.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (1, 13, 30)]
  outs = {}
  for impl in ("xla", "pallas"):
    eng = Engine(dataclasses.replace(cfg, backend=Backend(attention=impl)), params,
                 EngineConfig(page_size=8, num_pages=40, max_num_batched_tokens=16))
    outs[impl] = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=6))]
  assert outs["pallas"] == outs["xla"]


def test_resolve_and_bad_implementation():
  assert Backend().attention_kernel() == ("xla", True)  # CPU
  assert Backend(attention="pallas").attention_kernel() == ("pallas", True)
  with pytest.raises(ValueError, match="attention"):
    Backend(attention="cuda")
  with pytest.raises(ValueError, match="backend"):
    presets.get("tiny_dense", backend="triton")
