"""Model presets: `jaxinfer.presets.get(name)` -> `ModelConfig`.

Plain functions built with `dataclasses.replace`. Full-size presets are shapes
only (use `models.abstract_params` / `models.count_params`; nothing allocates).
The `bench_*` presets equal the HF configs in `tests/fixtures/bench_configs/`,
the models the peer figures in `perf_facts.md` were measured on.

These live in the library (not in `configs/`, which holds experiment configs)
so that an installed jaxinfer can reach them without importing upward.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from jaxinfer.config import ModelConfig, QuantConfig, RopeScaling

_PRESETS: dict[str, Callable[[], ModelConfig]] = {}


def _preset(fn):
  _PRESETS[fn.__name__] = fn
  return fn


def names() -> tuple[str, ...]:
  return tuple(sorted(_PRESETS))


def get(name: str, **overrides) -> ModelConfig:
  """The preset `name`, with optional field overrides."""
  if name not in _PRESETS:
    raise ValueError(f"unknown preset {name!r}; available: {', '.join(names())}")
  cfg = _PRESETS[name]()
  return dataclasses.replace(cfg, **overrides) if overrides else cfg


# The published checkpoints' weight formats, for sizing a preset as shipped
# (`quant(...)`): DeepSeek-V3/R1 block FP8, NVIDIA's NVFP4 exports, GPT-OSS's
# MXFP4 experts; int8 / int4 as quantized on load.
_EXPERTS = ("experts.w_gate", "experts.w_up", "experts.w_down")
QUANT = {"fp8": QuantConfig(method="fp8", block=(128, 128)),
         "nvfp4": QuantConfig(method="nvfp4", block=(1, 16)),
         "mxfp4": QuantConfig(method="mxfp4", block=(1, 32), targets=_EXPERTS),
         "int8": QuantConfig(method="int8", block=(1, 0)),
         "int4": QuantConfig(method="int4", block=(1, 32))}


def quant(name: str | None) -> QuantConfig | None:
  """A weight format by name (`QUANT`), or None for unquantized weights."""
  if name is None or name == "none":
    return None
  if name not in QUANT:
    raise ValueError(f"unknown weight format {name!r}; available: none, {', '.join(QUANT)}")
  return QUANT[name]


# ----------------------------------------------------------------- Llama 3

_LLAMA31_ROPE = RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0,
                            high_freq_factor=4.0, original_max_position_embeddings=8192)


@_preset
def llama3_8b() -> ModelConfig:
  """Llama-3.1-8B."""
  return ModelConfig(model_type="llama", vocab_size=128256, d_model=4096, num_layers=32,
                     num_heads=32, num_kv_heads=8, head_dim=128, ffn_dim=14336,
                     norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE,
                     max_position_embeddings=131072, eos_token_ids=(128001, 128008, 128009))


@_preset
def llama3_1_405b() -> ModelConfig:
  return dataclasses.replace(llama3_8b(), d_model=16384, num_layers=126, num_heads=128,
                             ffn_dim=53248)


@_preset
def bench_dense() -> ModelConfig:
  """`bench_configs/bench_dense.json`: Llama-3 style, 155.7M params."""
  return ModelConfig(model_type="llama", vocab_size=32000, d_model=1024, num_layers=8,
                     num_heads=16, num_kv_heads=4, head_dim=64, ffn_dim=2816, norm_eps=1e-6,
                     rope_theta=10000.0, max_position_embeddings=4096, eos_token_ids=(2,))


@_preset
def tiny_dense() -> ModelConfig:
  """A byte-level Llama for tests and examples."""
  return ModelConfig(model_type="llama", vocab_size=256, d_model=128, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=32, ffn_dim=384,
                     rope_theta=10000.0, max_position_embeddings=2048)


# ----------------------------------------------------------------- MoE

@_preset
def mixtral_8x7b() -> ModelConfig:
  return ModelConfig(model_type="mixtral", vocab_size=32000, d_model=4096, num_layers=32,
                     num_heads=32, num_kv_heads=8, head_dim=128, ffn_dim=14336, norm_eps=1e-5,
                     rope_theta=1e6, max_position_embeddings=32768, num_experts=8,
                     num_experts_per_tok=2, moe_ffn_dim=14336, router="softmax_topk",
                     norm_topk_prob=True, eos_token_ids=(2,))


@_preset
def qwen3_moe_235b_a22b() -> ModelConfig:
  return ModelConfig(model_type="qwen3_moe", vocab_size=151936, d_model=4096, num_layers=94,
                     num_heads=64, num_kv_heads=4, head_dim=128, ffn_dim=12288, norm_eps=1e-6,
                     rope_theta=1e6, max_position_embeddings=40960, qk_norm=True,
                     num_experts=128, num_experts_per_tok=8, moe_ffn_dim=1536,
                     router="softmax_topk", norm_topk_prob=True, eos_token_ids=(151645,))


@_preset
def deepseek_v3() -> ModelConfig:
  """DeepSeek-V3 / R1 (same architecture): MLA, 256 experts, 1 MTP module."""
  return ModelConfig(
      model_type="deepseek_v3", vocab_size=129280, d_model=7168, num_layers=61, num_heads=128,
      num_kv_heads=128, head_dim=0, ffn_dim=18432, norm_eps=1e-6, max_position_embeddings=163840,
      attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
      qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0, rope_interleave=True,
      rope_scaling=RopeScaling(kind="yarn", factor=40.0, original_max_position_embeddings=4096,
                               beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
      num_experts=256, num_experts_per_tok=8, moe_ffn_dim=2048, num_shared_experts=1,
      router="sigmoid_grouped", norm_topk_prob=True, n_group=8, topk_group=4,
      routed_scaling_factor=2.5, dense_layers=(0, 1, 2), num_mtp_layers=1, eos_token_ids=(1,))


@_preset
def bench_moe() -> ModelConfig:
  """`bench_configs/bench_moe.json`: DeepSeek-V3 style, 813.1M params."""
  return dataclasses.replace(
      deepseek_v3(), vocab_size=32000, d_model=1024, num_layers=8, num_heads=16,
      num_kv_heads=16, ffn_dim=2816, max_position_embeddings=4096, q_lora_rank=384,
      kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
      rope_scaling=None, num_experts=64, num_experts_per_tok=6, moe_ffn_dim=512,
      dense_layers=(0,), eos_token_ids=(1,))


@_preset
def tiny_moe() -> ModelConfig:
  """A byte-level DeepSeek-style model: MLA + MoE (grouped sigmoid routing) + 1 MTP module."""
  return dataclasses.replace(
      deepseek_v3(), vocab_size=256, d_model=128, num_layers=4, num_heads=4, num_kv_heads=4,
      ffn_dim=384, max_position_embeddings=2048, q_lora_rank=96, kv_lora_rank=64,
      qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rope_scaling=None,
      num_experts=8, num_experts_per_tok=2, moe_ffn_dim=128, n_group=2, topk_group=1,
      routed_scaling_factor=1.0, dense_layers=(0,), eos_token_ids=())


@_preset
def gpt_oss_120b() -> ModelConfig:
  return ModelConfig(
      model_type="gpt_oss", vocab_size=201088, d_model=2880, num_layers=36, num_heads=64,
      num_kv_heads=8, head_dim=64, ffn_dim=2880, norm_eps=1e-5, max_position_embeddings=131072,
      qkv_bias=True, o_bias=True, attention_sinks=True, sliding_window=128,
      layer_types=("sliding_attention", "full_attention") * 18, rope_theta=150000.0,
      rope_scaling=RopeScaling(kind="yarn", factor=32.0, original_max_position_embeddings=4096,
                               beta_fast=32.0, beta_slow=1.0, truncate=False),
      num_experts=128, num_experts_per_tok=4, moe_ffn_dim=2880, router="topk_softmax",
      router_bias=True, expert_bias=True, activation="clamped_swiglu", swiglu_limit=7.0,
      eos_token_ids=(200002,))
