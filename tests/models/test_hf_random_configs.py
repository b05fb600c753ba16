"""HF parity on tiny random configs other than the committed fixtures.

Builds each model with transformers + torch on the fly (other head counts,
group settings, rope scalings, windows, tied embeddings, old-style
`rope_scaling`), so the loader must read every field from config.json rather
than assume the fixtures' values. The dev extra installs torch and transformers.
"""

import sys

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES

VARIANTS = {
    "llama_tied_mqa_linear": ("llama", dict(
        num_attention_heads=8, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True,
        attention_bias=True, num_hidden_layers=3,
        rope_parameters=dict(rope_type="linear", rope_theta=500000.0, factor=3.0))),
    "llama_default_rope": ("llama", dict(
        hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=3,
        head_dim=12, rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "mixtral_top3": ("mixtral", dict(
        num_local_experts=8, num_experts_per_tok=3, num_key_value_heads=4, num_hidden_layers=3,
        intermediate_size=24)),
    "qwen3_sparse_step": ("qwen3_moe", dict(
        num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False,
        head_dim=8, num_experts=6, num_experts_per_tok=3)),
    "deepseek_groups": ("deepseek_v3", dict(
        n_routed_experts=16, n_group=4, topk_group=1, num_experts_per_tok=4,
        first_k_dense_replace=2, num_hidden_layers=4, kv_lora_rank=20, q_lora_rank=40,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=16, num_attention_heads=3,
        num_key_value_heads=3, rope_interleave=False, routed_scaling_factor=1.7,
        rope_parameters=dict(rope_type="yarn", rope_theta=5000.0, factor=8.0,
                             original_max_position_embeddings=4, beta_fast=16.0,
                             beta_slow=2.0, mscale=0.9, mscale_all_dim=0.707))),
    "gpt_oss_variant": ("gpt_oss", dict(
        sliding_window=3, num_hidden_layers=3,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        num_local_experts=8, num_experts_per_tok=3, num_key_value_heads=1, swiglu_limit=0.5,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
}


@pytest.fixture(scope="module")
def make_model():
  sys.path.insert(0, str(FIXTURES))
  import make_hf_fixtures
  return make_hf_fixtures.make_model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_random_config_parity(variant, make_model, tmp_path):
  from jaxinfer import checkpoint, models
  base, overrides = VARIANTS[variant]
  # Large router biases make some of DeepSeek's biased scores negative; with
  # top-k = the kept group's size, masked groups must be excluded (-inf), not
  # merely zeroed, or a zeroed expert outranks a kept one.
  make_model(base, str(tmp_path), seed=7, overrides=overrides, seq_len=10,
             bias_std=3.0 if base == "deepseek_v3" else 1.0)
  cfg, params = checkpoint.load_hf(str(tmp_path), dtype=jnp.float32)
  tokens, ref = np.load(tmp_path / "tokens.npy"), np.load(tmp_path / "logits.npy")
  out = np.asarray(models.logits(cfg, params, tokens))
  assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) <= 1e-4
