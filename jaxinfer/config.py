"""`ModelConfig`: one frozen, hashable config type for every architecture.

Architectures differ only through fields (attention kind, router kind, window
pattern, sinks, q/k norm, MTP depth, ...), so model code branches on field
values, never on a model name. The HF `config.json` key mapping behind
`ModelConfig.from_hf` lives in `hf_config.py`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Literal

import jax
import jax.numpy as jnp

from jaxinfer.backend import Backend
from jaxinfer.hf_config import model_config_fields


class Attention(enum.StrEnum):
  """A model's attention kind (`ModelConfig.attention`), asked for what it
  implies, never compared as a name:

    GQA  grouped-query attention: each token caches its num_kv_heads keys and
         values of head_dim (`ModelConfig.cache_entry_shapes`)
    MLA  multi-head latent attention (DeepSeek-V2/V3): each token caches one
         row, its normed latent (kv_lora_rank) and shared rope key
         (qk_rope_head_dim), read as one KV head whose first kv_lora_rank
         columns are the values; attention over a cache runs in the absorbed
         form (queries through W_uk, the result through W_uv), cacheless
         prefill per head expanded from the latent

  A `StrEnum`: made from its name (`ModelConfig(attention="mla")` and
  `from_hf` normalize it), equal to it, hashed and printed as it, so a
  saved config's JSON and jit's static hashing see the name.
  """

  GQA = "gqa"
  MLA = "mla"

  @property
  def latent(self) -> bool:
    """Whether the cache holds MLA's latent rows (one KV head, the values its
    first kv_lora_rank columns, decode in the absorbed form), not per-head
    keys and values."""
    return self is Attention.MLA


# softmax_topk: softmax over all experts, then top-k (Mixtral, Qwen3-MoE).
# topk_softmax: top-k of the logits, softmax over the k (GPT-OSS).
# sigmoid_grouped: sigmoid scores, group-limited top-k chosen with a
#   selection-only bias (DeepSeek-V3 `e_score_correction_bias`).
RouterKind = Literal["softmax_topk", "topk_softmax", "sigmoid_grouped"]
# silu: SwiGLU, silu(gate) * up. clamped_swiglu: GPT-OSS,
#   (clip(up) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit).
Activation = Literal["silu", "clamped_swiglu"]
MoEImpl = Literal["grouped", "dense"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """RoPE frequency scaling, as HF's `rope_scaling` / `rope_parameters`."""

  kind: Literal["linear", "llama3", "yarn"]
  factor: float
  original_max_position_embeddings: int | None = None
  # llama3
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  # yarn
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float | None = None
  mscale_all_dim: float | None = None
  attention_factor: float | None = None
  truncate: bool = True


# Weight groups a quantized checkpoint may hold quantized: "<group>.<leaf>"
# with group attn | mlp (dense MLP) | shared (shared experts) | experts
# (routed) | mtp (the MTP input projection).
QUANT_TARGETS = (
    "attn.wq", "attn.wk", "attn.wv", "attn.wo", "attn.wq_a", "attn.wq_b", "attn.wkv_a",
    "attn.wkv_b", "mlp.w_gate", "mlp.w_up", "mlp.w_down", "shared.w_gate", "shared.w_up",
    "shared.w_down", "experts.w_gate", "experts.w_up", "experts.w_down", "mtp.eh_proj")
QUANT_LAYOUTS = ("deepseek_fp8", "fbgemm_fp8", "modelopt", "compressed_tensors", "mxfp4", "jaxinfer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantConfig:
  """Weight-only quantization of a model's projections (`models.quant`).

  method: fp8 | int8 | int4 | mxfp4 | nvfp4; block: the scale block over a
  weight's [Out, In] (0: the whole dimension); targets: the `QUANT_TARGETS`
  held quantized (embeddings, lm_head, routers and norms never are);
  layout: the checkpoint's tensor naming (`checkpoint.hf_quant`), "jaxinfer"
  for weights quantized on load; kv_cache: "fp8" when the checkpoint
  carries per-layer KV cache scales (GQA `k_scale` / `v_scale`, loaded into
  each attention param dict for the Engine's quantized cache), else None.
  """

  method: str
  block: tuple[int, int] = (0, 0)
  targets: tuple[str, ...] = QUANT_TARGETS
  layout: str = "jaxinfer"
  kv_cache: str | None = None

  def __post_init__(self):
    methods = ("fp8", "int8", "int4", "mxfp4", "nvfp4")
    if self.method not in methods:
      raise ValueError(f"QuantConfig: method must be one of {methods}, got {self.method!r}")
    if len(self.block) != 2 or any(int(b) < 0 for b in self.block):
      raise ValueError(f"QuantConfig: block must be two sizes >= 0 (0: whole dim), got {self.block}")
    bad = sorted(set(self.targets) - set(QUANT_TARGETS))
    if bad:
      raise ValueError(f"QuantConfig: unknown targets {bad}; allowed {QUANT_TARGETS}")
    if self.layout not in QUANT_LAYOUTS:
      raise ValueError(f"QuantConfig: layout must be one of {QUANT_LAYOUTS}, got {self.layout!r}")

  def quantizes(self, target: str) -> bool:
    return target in self.targets


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
  """Qwen3-VL's vision tower (`models.vision`) and its placeholder tokens.

  Patches of temporal_patch x patch x patch pixels, `depth` pre-norm ViT
  blocks with 2D rotary positions, learned position embeddings on a
  sqrt(num_position_embeddings)-square grid resampled to each image, a
  merger of spatial_merge x spatial_merge patches into one LM token of
  out_hidden_size, and one more merger per `deepstack_indexes` block whose
  output is added to the LM's hidden states after layer 0, 1, ...
  """

  depth: int
  hidden_size: int
  intermediate_size: int
  num_heads: int
  out_hidden_size: int
  in_channels: int = 3
  patch_size: int = 16
  temporal_patch_size: int = 2
  spatial_merge_size: int = 2
  num_position_embeddings: int = 2304
  deepstack_indexes: tuple[int, ...] = ()
  rope_theta: float = 10000.0
  image_token_id: int = 151655
  video_token_id: int = 151656
  vision_start_token_id: int = 151652
  vision_end_token_id: int = 151653

  def __post_init__(self):
    for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
                 "patch_size", "temporal_patch_size", "spatial_merge_size"):
      _need(getattr(self, name) > 0, f"vision {name} must be > 0, got {getattr(self, name)}")
    _need(self.hidden_size % (4 * self.num_heads) == 0,
          f"vision head dim ({self.hidden_size} / {self.num_heads}) must be a multiple of 4")
    side = math.isqrt(self.num_position_embeddings)
    _need(side * side == self.num_position_embeddings and side > 0,
          f"vision num_position_embeddings must be a square, got {self.num_position_embeddings}")
    bad = [i for i in self.deepstack_indexes if not 0 <= i < self.depth]
    _need(not bad, f"vision deepstack_indexes {bad} out of range [0, {self.depth})")
    _need(list(self.deepstack_indexes) == sorted(set(self.deepstack_indexes)),
          f"vision deepstack_indexes must increase, got {self.deepstack_indexes}")

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def patch_dim(self) -> int:
    return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Shape and behaviour of a decoder-only transformer.

  Dimension alphabet (docs/style.md): D d_model, F ffn, N q heads, K kv heads,
  H head dim, V vocab, E experts, L layers.
  """

  model_type: str = "llama"  # HF family, used by the checkpoint name maps
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  ffn_dim: int  # dense MLP width (dense layers and dense models)
  norm_eps: float = 1e-6
  tie_embeddings: bool = False
  max_position_embeddings: int = 4096

  # Attention.
  attention: Attention = Attention.GQA  # or its name, "gqa" | "mla"
  qkv_bias: bool = False
  o_bias: bool = False
  qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k, before RoPE
  attention_sinks: bool = False  # GPT-OSS: a learned logit per head
  sliding_window: int = 0  # 0: no sliding window anywhere
  # Per-layer attention kind, HF `layer_types` ("full_attention" /
  # "sliding_attention"); empty: every layer slides iff sliding_window > 0.
  layer_types: tuple[str, ...] = ()

  # Multi-head latent attention (DeepSeek-V2/V3).
  q_lora_rank: int = 0  # 0: q projected directly (V2-Lite)
  kv_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0

  # RoPE.
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rope_interleave: bool = False  # DeepSeek: rotate (2i, 2i+1) pairs
  # Qwen3-VL interleaved MRoPE: frequencies i = 1, 4, 7.. (< 3 * sections[1])
  # rotate by the height position, 2, 5, 8.. (< 3 * sections[2]) by the
  # width, the rest by the temporal one. (): plain RoPE.
  mrope_section: tuple[int, ...] = ()
  # Qwen3-VL's vision tower (None: a text-only model).
  vision: VisionConfig | None = None

  # Mixture of experts; num_experts == 0 means a dense model.
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_ffn_dim: int = 0
  num_shared_experts: int = 0
  router: RouterKind = "softmax_topk"
  norm_topk_prob: bool = True
  router_bias: bool = False  # GPT-OSS: bias on the router projection
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  expert_bias: bool = False  # GPT-OSS: biased expert projections
  dense_layers: tuple[int, ...] = ()  # layers with a dense MLP in a MoE model
  moe_impl: MoEImpl = "grouped"

  activation: Activation = "silu"
  swiglu_limit: float = 7.0
  swiglu_alpha: float = 1.702

  # Multi-token prediction modules (DeepSeek-V3 `num_nextn_predict_layers`).
  num_mtp_layers: int = 0

  # Param/compute dtype name; None: bfloat16 on GPU/TPU, float32 on CPU.
  dtype: str | None = None
  # The kernels (jaxinfer/ops.py) and the device they are built for, static
  # in every jitted step: `Backend(attention="pallas", target="gpu")` compiles
  # the Pallas kernels through Triton, also from a CPU process lowering for
  # compile-only GPUs (`jaxinfer.gpu_compile`); the default picks both from
  # this process's platform.
  backend: Backend = Backend()
  eos_token_ids: tuple[int, ...] = ()
  # Weight-only quantization (None: every weight in `dtype`).
  quant: QuantConfig | None = None

  def __post_init__(self):
    _need(self.attention in tuple(Attention),
          f"attention must be 'gqa' or 'mla', got {self.attention!r}")
    object.__setattr__(self, "attention", Attention(self.attention))
    _validate(self)

  # Derived properties.
  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  @property
  def qk_head_dim(self) -> int:
    if self.attention.latent:
      return self.qk_nope_head_dim + self.qk_rope_head_dim
    return self.head_dim

  @property
  def rope_dim(self) -> int:
    return self.qk_rope_head_dim if self.attention.latent else self.head_dim

  @property
  def attn_v_head_dim(self) -> int:
    return self.v_head_dim if self.attention.latent else self.head_dim

  def cache_entry_shapes(self) -> dict[str, tuple[int, ...]]:
    """Per-token KV cache entry shapes: GQA {k: (K, H), v: (K, H)}; MLA
    {kv: (R + Hr,)} (latent and rope key, `Attention.MLA`)."""
    if self.attention.latent:
      return dict(kv=(self.kv_lora_rank + self.qk_rope_head_dim,))
    return dict(k=(self.num_kv_heads, self.head_dim), v=(self.num_kv_heads, self.head_dim))

  def layer_window(self, i: int) -> int:
    """Sliding window of layer i (0: full attention)."""
    if not self.sliding_window:
      return 0
    if not self.layer_types:
      return self.sliding_window
    return self.sliding_window if self.layer_types[i] == "sliding_attention" else 0

  def window_choices(self) -> tuple[int, ...]:
    """The distinct per-layer windows (static branches for kernels that need one)."""
    return tuple(sorted({self.layer_window(i) for i in range(self.num_layers)}))

  def layer_is_moe(self, i: int) -> bool:
    return self.is_moe and i not in self.dense_layers

  def segments(self) -> tuple[tuple[bool, int, int], ...]:
    """Runs of consecutive layers of one structure: (is_moe, start, count).

    Each segment's params are stacked on a leading layer axis and scanned.
    """
    segs: list[list] = []
    for i in range(self.num_layers):
      moe = self.layer_is_moe(i)
      if segs and segs[-1][0] == moe:
        segs[-1][2] += 1
      else:
        segs.append([moe, i, 1])
    return tuple(tuple(s) for s in segs)

  def softmax_scale(self) -> float:
    """1/sqrt(qk head dim), times DeepSeek's YaRN mscale^2 when it applies."""
    scale = self.qk_head_dim ** -0.5
    rs = self.rope_scaling
    if self.attention.latent and rs is not None and rs.mscale_all_dim:
      m = yarn_get_mscale(rs.factor, rs.mscale_all_dim)
      scale *= m * m
    return scale

  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype) if self.dtype else default_dtype()

  @classmethod
  def from_hf(cls, hf: dict) -> "ModelConfig":
    """Maps an HF `config.json` dict; raises on anything it cannot honour."""
    kw = model_config_fields(hf)
    if "rope_scaling" in kw:
      kw["rope_scaling"] = RopeScaling(**kw["rope_scaling"])
    if "quant" in kw:
      kw["quant"] = QuantConfig(**kw["quant"])
    if "vision" in kw:
      kw["vision"] = VisionConfig(**kw["vision"])
    return cls(**kw)


def default_dtype() -> jnp.dtype:
  """bfloat16 on accelerators; float32 on CPU (XLA:CPU bf16 is ~150x slower)."""
  return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
  if scale <= 1:
    return 1.0
  return 0.1 * mscale * math.log(scale) + 1.0


def _need(ok, msg) -> None:
  if not ok:
    raise ValueError(f"ModelConfig: {msg}")


def _validate(c: ModelConfig) -> None:
  need = _need
  for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads"):
    need(getattr(c, name) > 0, f"{name} must be > 0, got {getattr(c, name)}")
  if not c.attention.latent:
    need(c.head_dim > 0, f"head_dim must be > 0, got {c.head_dim}")
    need(c.num_heads % c.num_kv_heads == 0,
         f"num_heads ({c.num_heads}) must be a multiple of num_kv_heads ({c.num_kv_heads})")
  else:
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
      need(getattr(c, name) > 0, f"MLA needs {name} > 0, got {getattr(c, name)}")
    need(c.q_lora_rank >= 0, f"q_lora_rank must be >= 0, got {c.q_lora_rank}")
    need(not c.qk_norm and not c.attention_sinks and not c.qkv_bias,
         "MLA does not support qk_norm, attention_sinks or qkv_bias")
  need(c.rope_dim % 2 == 0, f"RoPE dim must be even, got {c.rope_dim}")
  if c.mrope_section:
    need(len(c.mrope_section) == 3 and sum(c.mrope_section) == c.rope_dim // 2,
         f"mrope_section must be 3 sizes summing to rope_dim / 2 = {c.rope_dim // 2}, "
         f"got {c.mrope_section}")
  need(c.vision is None or isinstance(c.vision, VisionConfig),
       f"vision must be a VisionConfig or None, got {type(c.vision).__name__}")
  if c.vision is not None:
    need(c.vision.out_hidden_size == c.d_model,
         f"vision out_hidden_size {c.vision.out_hidden_size} != d_model {c.d_model}")
    need(len(c.vision.deepstack_indexes) <= c.num_layers,
         f"{len(c.vision.deepstack_indexes)} DeepStack taps for {c.num_layers} layers")
  need(c.sliding_window >= 0, f"sliding_window must be >= 0, got {c.sliding_window}")
  if c.layer_types:
    need(len(c.layer_types) == c.num_layers,
         f"layer_types has {len(c.layer_types)} entries for {c.num_layers} layers")
    bad = sorted(set(c.layer_types) - {"full_attention", "sliding_attention"})
    need(not bad, f"unsupported layer_types {bad}")
  if c.is_moe:
    _validate_moe(c)
  if not c.is_moe or c.dense_layers:
    need(c.ffn_dim > 0, f"ffn_dim must be > 0 for dense MLP layers, got {c.ffn_dim}")
  need(c.activation in ("silu", "clamped_swiglu"), f"unknown activation {c.activation!r}")
  need(c.quant is None or isinstance(c.quant, QuantConfig),
       f"quant must be a QuantConfig or None, got {type(c.quant).__name__}")
  need(c.num_mtp_layers >= 0, f"num_mtp_layers must be >= 0, got {c.num_mtp_layers}")
  need(isinstance(c.backend, Backend),
       f"backend must be a jaxinfer.Backend, got {type(c.backend).__name__}")
  if c.dtype is not None:
    need(c.dtype in ("float32", "bfloat16", "float16"),
         f"dtype must be float32, bfloat16 or float16, got {c.dtype!r}")
  rs = c.rope_scaling
  if rs is not None:
    need(rs.kind in ("linear", "llama3", "yarn"), f"unsupported rope scaling {rs.kind!r}")
    need(rs.factor > 0, f"rope scaling factor must be > 0, got {rs.factor}")
    if rs.kind == "llama3":
      need(rs.original_max_position_embeddings, "llama3 rope scaling needs original_max_position_embeddings")
      need(rs.high_freq_factor != rs.low_freq_factor, "llama3 rope: high_freq_factor == low_freq_factor")


def _validate_moe(c: ModelConfig) -> None:
  need = _need
  need(0 < c.num_experts_per_tok <= c.num_experts,
       f"num_experts_per_tok must be in [1, {c.num_experts}], got {c.num_experts_per_tok}")
  need(c.moe_ffn_dim > 0, f"moe_ffn_dim must be > 0, got {c.moe_ffn_dim}")
  need(c.router in ("softmax_topk", "topk_softmax", "sigmoid_grouped"),
       f"unknown router {c.router!r}")
  need(c.num_experts % c.n_group == 0,
       f"num_experts ({c.num_experts}) must be divisible by n_group ({c.n_group})")
  need(1 <= c.topk_group <= c.n_group, f"topk_group must be in [1, n_group={c.n_group}]")
  if c.router == "sigmoid_grouped" and c.n_group > 1:
    need(c.num_experts // c.n_group >= 2, "group-limited routing needs >= 2 experts per group")
    need(c.topk_group * (c.num_experts // c.n_group) >= c.num_experts_per_tok,
         "topk_group groups hold fewer experts than num_experts_per_tok")
  need(c.moe_impl in ("grouped", "dense"), f"moe_impl must be 'grouped' or 'dense', got {c.moe_impl!r}")
  # Index num_layers + m is MTP module m's block (HF numbering).
  top = c.num_layers + c.num_mtp_layers
  bad = [i for i in c.dense_layers if not 0 <= i < top]
  need(not bad, f"dense_layers {bad} out of range [0, {top}) (num_layers + num_mtp_layers)")
