"""Tiny random HF checkpoints for parity checks against transformers.

  model = save_tiny("deepseek_v3", out_dir, seed=0)   # config.json + model.safetensors

`BASE_CONFIGS` names one tiny config per architecture (vocab 128-256, hidden
64, 2-4 layers). `build_model` builds it with random weights, nothing
downloaded, and `reinit_weights` redraws every saved tensor with non-trivial
values (norms 1 + 0.1 N(0, 1), biases, DeepSeek `e_score_correction_bias`,
GPT-OSS `sinks`), so a loader that silently drops a tensor fails. Used by the
test fixtures (tests/fixtures/make_hf_fixtures.py) and experiments/check_hf.py.
torch and transformers are imported when called (pip install -e '.[hf]').
"""

from __future__ import annotations

import copy
import math
from typing import Any

# name -> (transformers config class name, its kwargs).
BASE_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
  # Llama 3 style: GQA (4 q heads / 2 kv heads, head_dim 16), llama3 rope scaling with a
  # small original context (16) so that every frequency is affected for positions < 12.
  "llama": (
    "LlamaConfig",
    dict(
      vocab_size=256,
      hidden_size=64,
      intermediate_size=128,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=16,
      max_position_embeddings=64,
      rms_norm_eps=1e-5,
      tie_word_embeddings=False,
      rope_parameters=dict(
        rope_type="llama3",
        rope_theta=10000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
      ),
    ),
  ),
  # Mixtral: 4 experts, top-2, GQA, default rope.
  "mixtral": (
    "MixtralConfig",
    dict(
      vocab_size=128,
      hidden_size=64,
      intermediate_size=32,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=16,
      max_position_embeddings=64,
      rms_norm_eps=1e-5,
      num_local_experts=4,
      num_experts_per_tok=2,
      tie_word_embeddings=False,
      rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
  ),
  # Qwen3-MoE: explicit head_dim (32 != hidden/heads = 16), q/k RMSNorm, 8 experts top-2 with
  # renormalised top-k, layer 1 is a dense MLP (mlp_only_layers=[1]).
  "qwen3_moe": (
    "Qwen3MoeConfig",
    dict(
      vocab_size=128,
      hidden_size=64,
      intermediate_size=64,
      moe_intermediate_size=16,
      num_hidden_layers=3,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=32,
      max_position_embeddings=64,
      rms_norm_eps=1e-6,
      num_experts=8,
      num_experts_per_tok=2,
      norm_topk_prob=True,
      decoder_sparse_step=1,
      mlp_only_layers=[1],
      tie_word_embeddings=False,
      rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
  ),
  # DeepSeek-V3: MLA with q LoRA, sigmoid group-limited routing with correction bias,
  # 1 shared expert, first layer dense, YaRN with mscale (DeepSeek-V3 values).
  "deepseek_v3": (
    "DeepseekV3Config",
    dict(
      vocab_size=128,
      hidden_size=64,
      intermediate_size=64,
      moe_intermediate_size=16,
      num_hidden_layers=3,
      num_attention_heads=4,
      num_key_value_heads=4,
      q_lora_rank=48,
      kv_lora_rank=32,
      qk_nope_head_dim=16,
      qk_rope_head_dim=8,
      v_head_dim=12,
      n_routed_experts=8,
      n_group=4,
      topk_group=2,
      num_experts_per_tok=3,
      n_shared_experts=1,
      routed_scaling_factor=2.5,
      norm_topk_prob=True,
      first_k_dense_replace=1,
      max_position_embeddings=32,
      rms_norm_eps=1e-6,
      rope_interleave=True,
      tie_word_embeddings=False,
      rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=8,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
      ),
    ),
  ),
  # DeepSeek-V2-Lite style on the DeepSeek-V3 architecture: no q LoRA (plain q_proj),
  # 2 heads, no expert groups (n_group=1), 2 shared experts, no top-k renormalisation,
  # routed_scaling_factor 1, YaRN factor 2 with mscale != mscale_all_dim so that both the
  # cos/sin attention_factor and the softmax-scale mscale are != 1.
  "deepseek_v2lite": (
    "DeepseekV3Config",
    dict(
      vocab_size=128,
      hidden_size=64,
      intermediate_size=64,
      moe_intermediate_size=12,
      num_hidden_layers=2,
      num_attention_heads=2,
      num_key_value_heads=2,
      q_lora_rank=None,
      kv_lora_rank=24,
      qk_nope_head_dim=12,
      qk_rope_head_dim=16,
      v_head_dim=8,
      n_routed_experts=8,
      n_group=1,
      topk_group=1,
      num_experts_per_tok=2,
      n_shared_experts=2,
      routed_scaling_factor=1.0,
      norm_topk_prob=False,
      first_k_dense_replace=1,
      max_position_embeddings=32,
      rms_norm_eps=1e-6,
      rope_interleave=True,
      tie_word_embeddings=False,
      rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=2.0,
        original_max_position_embeddings=16,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=0.8,
      ),
    ),
  ),
  # GPT-OSS: 4 experts top-2 (softmax over the top-k logits), attention sinks, biases on
  # q/k/v/o and on experts, sliding window 4 on even layers, YaRN (truncate=False as in the
  # released config; theta 500, original context 96 and beta_fast 4 put the correction range
  # at [1.72, 3.51], so truncating it to [1, 4] would change the logits).
  # swiglu_limit is lowered from 7.0 to 1.0 so the clamp is exercised.
  "gpt_oss": (
    "GptOssConfig",
    dict(
      vocab_size=128,
      hidden_size=64,
      intermediate_size=16,
      num_hidden_layers=4,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=16,
      max_position_embeddings=64,
      rms_norm_eps=1e-5,
      num_local_experts=4,
      num_experts_per_tok=2,
      sliding_window=4,
      layer_types=["sliding_attention", "full_attention"] * 2,
      attention_bias=True,
      swiglu_limit=1.0,
      tie_word_embeddings=False,
      rope_parameters=dict(
        rope_type="yarn",
        rope_theta=500.0,
        factor=4.0,
        original_max_position_embeddings=96,
        beta_fast=4.0,
        beta_slow=1.0,
        truncate=False,
      ),
    ),
  ),
}


def import_torch_transformers():
  """(torch, transformers), or an ImportError that says how to install them."""
  try:
    import torch
    import transformers
  except ImportError as e:
    raise ImportError(f"jaxinfer.checkpoint.hf_build needs torch and transformers ({e}): "
                      "pip install -e '.[hf]'") from e
  return torch, transformers


def build_config(name: str, overrides: dict | None = None):
  """The HF config of base config `name`, `overrides` a shallow update of its kwargs.

  Passing `rope_parameters`, say, replaces the whole rope dict.
  """
  if name not in BASE_CONFIGS:
    raise KeyError(f"unknown base config {name!r}; choose from {sorted(BASE_CONFIGS)}")
  _, transformers = import_torch_transformers()
  config_cls, kwargs = BASE_CONFIGS[name]
  kwargs = copy.deepcopy(kwargs)
  kwargs.update(copy.deepcopy(overrides or {}))
  return getattr(transformers, config_cls)(**kwargs)


def _fan_in(model, name: str, tensor) -> int:
  """Input dimension of a weight matrix (2-D nn.Linear weight or 3-D fused expert tensor)."""
  if tensor.ndim == 2:
    return tensor.shape[1]  # nn.Linear: [out, in]
  owner = model.get_submodule(name.rsplit(".", 1)[0])
  # Fused expert tensors are [E, out, in], except GPT-OSS ("is_transposed") which is [E, in, out].
  return tensor.shape[1] if getattr(owner, "is_transposed", False) else tensor.shape[2]


def reinit_weights(model, generator, bias_std: float = 0.1) -> None:
  """Redraws every tensor that `save_pretrained` will write, from `generator`.

  * norm weights:                 1 + 0.1 * N(0, 1)
  * embeddings:                   N(0, 1)
  * weight matrices / experts:    N(0, 1 / fan_in)   (keeps activations and logits O(1))
  * biases (incl. router biases): N(0, bias_std^2)
  * DeepSeek e_score_correction_bias: N(0, bias_std^2)  (~ the spread of sigmoid scores)
  * GPT-OSS sinks:                N(0, 1)
  """
  torch, _ = import_torch_transformers()
  with torch.no_grad():
    for name in model.state_dict().keys():
      try:
        tensor = model.get_parameter(name)
      except AttributeError:
        tensor = model.get_buffer(name)

      def normal(std: float, mean: float = 0.0):
        return mean + std * torch.randn(tensor.shape, generator=generator, dtype=torch.float32)

      leaf = name.rsplit(".", 1)[-1]
      if name.endswith("norm.weight"):  # input/post_attention/final norm, q/k norm, q_a/kv_a norm
        value = normal(0.1, mean=1.0)
      elif "embed_tokens" in name:
        value = normal(1.0)
      elif leaf == "sinks":
        value = normal(1.0)
      elif leaf in ("bias", "e_score_correction_bias") or leaf.endswith("_bias"):
        value = normal(bias_std)
      elif tensor.ndim in (2, 3):
        value = normal(1.0 / math.sqrt(_fan_in(model, name, tensor)))
      else:
        raise ValueError(f"don't know how to initialise {name} with shape {tuple(tensor.shape)}")
      tensor.copy_(value.to(tensor.dtype))


def build_model(name: str, *, seed: int = 0, overrides: dict | None = None,
                bias_std: float = 0.1):
  """A float32 HF model of base config `name` (eager attention and experts, eval mode)
  with `reinit_weights` drawn from `seed`."""
  torch, transformers = import_torch_transformers()
  config = build_config(name, overrides)
  torch.manual_seed(seed)  # from_config's own init, overwritten below
  model = transformers.AutoModelForCausalLM.from_config(
      config, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
  model.eval()
  reinit_weights(model, torch.Generator().manual_seed(seed), bias_std)
  return model


def save_tiny(name: str, out_dir: str, *, seed: int = 0, overrides: dict | None = None,
              bias_std: float = 0.1):
  """`build_model(name, ...)` saved as safetensors (+ config.json) in `out_dir` -> the model."""
  model = build_model(name, seed=seed, overrides=overrides, bias_std=bias_std)
  model.save_pretrained(out_dir, safe_serialization=True)
  return model
