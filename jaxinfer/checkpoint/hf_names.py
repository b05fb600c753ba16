"""Per-architecture maps from HF tensor names to jaxinfer param leaves.

`block_sources(cfg, prefix, is_moe, has)` gives, for every leaf of one block
(keyed by its path in the block spec tree), a `Source`: the HF tensors it is
built from, their expected shapes, and the conversion. HF linear weights are
[out, in]; ours are [in, out] with heads split out (`[D, N, H]`, `[N, H, D]`).

Expert weights: every layout transformers 5 itself reads.
  per expert  `experts.{e}.gate_proj/up_proj/down_proj.weight` (Mixtral: w1/w3/w2,
              under `block_sparse_moe` or `mlp`, its router `gate` likewise):
              published Qwen3-MoE, Mixtral and DeepSeek checkpoints, and what
              save_pretrained writes for them
  fused       `experts.gate_up_proj` [E, 2F, D] (gate rows first) and
              `experts.down_proj` [E, D, F]: transformers 5's in-memory layout,
              written by save_pretrained(save_original_format=False), and by
              plain save_pretrained for Qwen3-VL-MoE
  Qwen3-VL-MoE as published: `gate_up_proj` [E, D, 2F] (gate columns first),
              `down_proj` [E, F, D]; chosen by shape, and where a shape fits
              both (D == 2F, D == F) the in-memory layout, as transformers does
  GPT-OSS     `experts.gate_up_proj` [E, D, 2F] with gate/up interleaved on the
              last axis, `down_proj` [E, F, D], plus their `_bias` tensors (the
              one layout, saved and published)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from einops import rearrange
import numpy as np

from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class WeightRef:
  """Where a projection leaf lives as an [out, in] matrix, for checkpoints
  that store it quantized (`hf_quant`): the HF weight tensors (one per expert
  when `stacked`), each [*lead, out, in]; `rows` of out the leaf takes (a
  fused gate/up)."""
  names: tuple[str, ...]
  out: int  # rows of each tensor
  d_in: int
  lead: tuple[int, ...] = ()  # dims inside each tensor before [out, in]
  rows: slice | None = None
  stacked: bool = False


@dataclasses.dataclass(frozen=True)
class Source:
  names: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  convert: Callable[..., np.ndarray]  # HF arrays (in `names` order) -> our leaf
  ref: WeightRef | None = None  # projections: the matrix a quantized checkpoint holds


def _one(name, shape, fn=lambda w: w, ref=None):
  return Source((name,), (tuple(shape),), fn, ref)


def _linear(name, d_in, out_shape):
  """HF linear [prod(out_shape), d_in] -> ours [d_in, *out_shape]."""
  n_out = int(np.prod(out_shape))
  return _one(name, (n_out, d_in), lambda w: w.T.reshape(d_in, *out_shape),
              WeightRef((name,), n_out, d_in))


def _linear_out(name, in_shape, d_out):
  """HF linear [d_out, prod(in_shape)] -> ours [*in_shape, d_out]."""
  n_in = int(np.prod(in_shape))
  return _one(name, (d_out, n_in), lambda w: w.T.reshape(*in_shape, d_out),
              WeightRef((name,), d_out, n_in))


def _mla_kv_scale(cfg: ModelConfig, a: str, has: Callable[[str], bool]) -> Source:
  """MLA's one latent-cache scale. ModelOpt exports put k_scale (and v_scale)
  on kv_a_proj_with_mqa, compressed-tensors on the attention module; the
  cached latent row is read as both K and V, so it takes the larger."""
  base = f"{a}.kv_a_proj_with_mqa" if cfg.quant.layout == "modelopt" else a
  shape = () if cfg.quant.layout == "modelopt" else (1,)
  names = tuple(f"{base}.{kv}_scale" for kv in ("k", "v") if kv == "k" or has(f"{base}.{kv}_scale"))
  return Source(names, (shape,) * len(names), lambda *s: np.max([np.reshape(x, ()) for x in s]))


def _attn_sources(cfg: ModelConfig, a: str, has: Callable[[str], bool]) -> dict:
  D, N, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads
  if cfg.attention == "mla":
    R, Hr, Hn, Hv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    s = {}
    if cfg.q_lora_rank:
      Rq = cfg.q_lora_rank
      s[("wq_a",)] = _linear(f"{a}.q_a_proj.weight", D, (Rq,))
      s[("q_norm",)] = _one(f"{a}.q_a_layernorm.weight", (Rq,))
      s[("wq_b",)] = _linear(f"{a}.q_b_proj.weight", Rq, (N, Hn + Hr))
    else:
      s[("wq",)] = _linear(f"{a}.q_proj.weight", D, (N, Hn + Hr))
    s[("wkv_a",)] = _linear(f"{a}.kv_a_proj_with_mqa.weight", D, (R + Hr,))
    s[("kv_norm",)] = _one(f"{a}.kv_a_layernorm.weight", (R,))
    s[("wkv_b",)] = _linear(f"{a}.kv_b_proj.weight", R, (N, Hn + Hv))
    s[("wo",)] = _linear_out(f"{a}.o_proj.weight", (N, Hv), D)
    if cfg.quant is not None and cfg.quant.kv_cache:
      s[("kv_scale",)] = _mla_kv_scale(cfg, a, has)
    return s
  H = cfg.head_dim
  s = {("wq",): _linear(f"{a}.q_proj.weight", D, (N, H)),
       ("wk",): _linear(f"{a}.k_proj.weight", D, (K, H)),
       ("wv",): _linear(f"{a}.v_proj.weight", D, (K, H)),
       ("wo",): _linear_out(f"{a}.o_proj.weight", (N, H), D)}
  if cfg.qkv_bias:
    for ours, hf, heads in (("bq", "q_proj", N), ("bk", "k_proj", K), ("bv", "v_proj", K)):
      s[(ours,)] = _one(f"{a}.{hf}.bias", (heads * H,), lambda b, heads=heads: b.reshape(heads, H))
  if cfg.o_bias:
    s[("bo",)] = _one(f"{a}.o_proj.bias", (D,))
  if cfg.qk_norm:
    s[("q_norm",)] = _one(f"{a}.q_norm.weight", (H,))
    s[("k_norm",)] = _one(f"{a}.k_norm.weight", (H,))
  if cfg.attention_sinks:
    s[("sinks",)] = _one(f"{a}.sinks", (N,))
  if cfg.quant is not None and cfg.quant.kv_cache:  # per-layer KV cache scales
    if cfg.quant.layout == "modelopt":  # scalars on the k / v projections
      s[("k_scale",)] = _one(f"{a}.k_proj.k_scale", ())
      s[("v_scale",)] = _one(f"{a}.v_proj.v_scale", ())
    else:  # compressed-tensors: [1] on the attention module
      s[("k_scale",)] = _one(f"{a}.k_scale", (1,), lambda x: x.reshape(()))
      s[("v_scale",)] = _one(f"{a}.v_scale", (1,), lambda x: x.reshape(()))
  return s


def _dense_sources(m: str, D: int, F: int, names=("gate_proj", "up_proj", "down_proj"), key=()):
  g, u, d = names
  return {(*key, "w_gate"): _linear(f"{m}.{g}.weight", D, (F,)),
          (*key, "w_up"): _linear(f"{m}.{u}.weight", D, (F,)),
          (*key, "w_down"): _linear(f"{m}.{d}.weight", F, (D,))}


def _stack_experts(name_fmt: str, E: int, shape, fn) -> Source:
  names = tuple(name_fmt.format(e=e) for e in range(E))
  return Source(names, (tuple(shape),) * E, lambda *ws: np.stack([fn(w) for w in ws]),
                WeightRef(names, shape[0], shape[1], stacked=True))


def _published_vl_layout(cfg: ModelConfig, x: str, shape: Callable | None) -> bool:
  """Qwen3-VL-MoE's fused experts: True for the published [E, D, 2F] /
  [E, F, D], False for transformers' in-memory [E, 2F, D] / [E, D, F]
  (preferred where a shape fits both, as transformers reads it)."""
  D, E, F = cfg.d_model, cfg.num_experts, cfg.moe_ffn_dim
  layouts = {"gate_up_proj": ((E, 2 * F, D), (E, D, 2 * F)), "down_proj": ((E, D, F), (E, F, D))}
  published = []
  for leaf, (memory, pub) in layouts.items():
    got = shape(f"{x}.{leaf}") if shape is not None else pub
    if got is None:
      raise CheckpointError(f"missing tensor {x}.{leaf!r}")
    if tuple(got) not in (memory, pub):
      raise CheckpointError(
          f"tensor {x}.{leaf!r} has shape {list(got)}; expected {list(pub)} (as published) or "
          f"{list(memory)} (as transformers 5's save_pretrained writes it)")
    published.append(tuple(got) != memory)
  if published[0] != published[1]:
    raise CheckpointError(f"{x}: gate_up_proj and down_proj are in different layouts "
                          "(one published, one as transformers holds it in memory)")
  return published[0]


def _fused_experts(cfg: ModelConfig, x: str, shape: Callable | None) -> dict:
  """Fused `gate_up_proj` / `down_proj`: transformers 5's in-memory layout,
  or (Qwen3-VL-MoE only) the published one."""
  D, E, F = cfg.d_model, cfg.num_experts, cfg.moe_ffn_dim
  s = {}
  if cfg.model_type == "qwen3_vl_moe" and _published_vl_layout(cfg, x, shape):
    s[("w_gate",)] = _one(f"{x}.gate_up_proj", (E, D, 2 * F), lambda w: w[..., :F])
    s[("w_up",)] = _one(f"{x}.gate_up_proj", (E, D, 2 * F), lambda w: w[..., F:])
    s[("w_down",)] = _one(f"{x}.down_proj", (E, F, D))
    return s
  gu = lambda rows: WeightRef((f"{x}.gate_up_proj",), 2 * F, D, (E,), rows)
  s[("w_gate",)] = _one(f"{x}.gate_up_proj", (E, 2 * F, D),
                        lambda w: rearrange(w[:, :F], "E F D -> E D F"), gu(slice(0, F)))
  s[("w_up",)] = _one(f"{x}.gate_up_proj", (E, 2 * F, D),
                      lambda w: rearrange(w[:, F:], "E F D -> E D F"), gu(slice(F, 2 * F)))
  s[("w_down",)] = _one(f"{x}.down_proj", (E, D, F), lambda w: rearrange(w, "E D F -> E F D"),
                        WeightRef((f"{x}.down_proj",), D, F, (E,)))
  return s


def _moe_sources(cfg: ModelConfig, prefix: str, has: Callable[[str], bool],
                 shape: Callable | None = None) -> dict:
  D, E, F = cfg.d_model, cfg.num_experts, cfg.moe_ffn_dim
  if cfg.model_type == "mixtral" and has(f"{prefix}.block_sparse_moe.gate.weight"):
    m, expert_names = f"{prefix}.block_sparse_moe", ("w1", "w3", "w2")
  elif cfg.model_type == "mixtral":  # transformers 5 renames block_sparse_moe to mlp on load
    m, expert_names = f"{prefix}.mlp", ("w1", "w3", "w2")
  else:
    m, expert_names = f"{prefix}.mlp", ("gate_proj", "up_proj", "down_proj")
  router = f"{m}.router" if cfg.model_type == "gpt_oss" else f"{m}.gate"
  s = {("router",): _linear(f"{router}.weight", D, (E,))}
  if cfg.router_bias:
    s[("router_bias",)] = _one(f"{router}.bias", (E,))
  if cfg.router == "sigmoid_grouped":
    s[("score_bias",)] = _one(f"{router}.e_score_correction_bias", (E,))
  x = f"{m}.experts"
  if cfg.model_type == "gpt_oss":
    # Quantized (MXFP4) the same tensors are [E, out, in]: gate/up interleave rows.
    gu = lambda rows: WeightRef((f"{x}.gate_up_proj",), 2 * F, D, (E,), rows)
    s[("w_gate",)] = _one(f"{x}.gate_up_proj", (E, D, 2 * F), lambda w: w[..., 0::2],
                          gu(slice(0, None, 2)))
    s[("w_up",)] = _one(f"{x}.gate_up_proj", (E, D, 2 * F), lambda w: w[..., 1::2],
                        gu(slice(1, None, 2)))
    s[("w_down",)] = _one(f"{x}.down_proj", (E, F, D), ref=WeightRef((f"{x}.down_proj",), D, F, (E,)))
    s[("b_gate",)] = _one(f"{x}.gate_up_proj_bias", (E, 2 * F), lambda b: b[..., 0::2])
    s[("b_up",)] = _one(f"{x}.gate_up_proj_bias", (E, 2 * F), lambda b: b[..., 1::2])
    s[("b_down",)] = _one(f"{x}.down_proj_bias", (E, D))
  elif has(f"{x}.gate_up_proj"):
    s.update(_fused_experts(cfg, x, shape))
  else:
    g, u, d = expert_names
    s[("w_gate",)] = _stack_experts(x + ".{e}." + g + ".weight", E, (F, D), lambda w: w.T)
    s[("w_up",)] = _stack_experts(x + ".{e}." + u + ".weight", E, (F, D), lambda w: w.T)
    s[("w_down",)] = _stack_experts(x + ".{e}." + d + ".weight", E, (D, F), lambda w: w.T)
  if cfg.num_shared_experts:
    s.update(_dense_sources(f"{m}.shared_experts", D, F * cfg.num_shared_experts, key=("shared",)))
  return s


def block_sources(cfg: ModelConfig, prefix: str, is_moe: bool, has: Callable[[str], bool],
                  shape: Callable[[str], tuple | None] | None = None) -> dict:
  """Sources of every leaf of the block at `prefix` (e.g. 'model.layers.3').
  `has(name)`: the checkpoint holds the tensor; `shape(name)`: its shape (or
  None), which picks between fused-expert layouts (None: the published one)."""
  D = cfg.d_model
  s = {("attn_norm",): _one(f"{prefix}.input_layernorm.weight", (D,)),
       ("mlp_norm",): _one(f"{prefix}.post_attention_layernorm.weight", (D,))}
  s.update({("attn", *k): v for k, v in _attn_sources(cfg, f"{prefix}.self_attn", has).items()})
  mlp = (_moe_sources(cfg, prefix, has, shape) if is_moe
         else _dense_sources(f"{prefix}.mlp", D, cfg.ffn_dim))
  s.update({("mlp", *k): v for k, v in mlp.items()})
  return s


def lm_prefix(cfg: ModelConfig) -> str:
  """Where the language model's tensors live ('model', or Qwen3-VL's 'model.language_model')."""
  return "model.language_model" if cfg.vision is not None else "model"


def top_sources(cfg: ModelConfig) -> dict:
  D, V, p = cfg.d_model, cfg.vocab_size, lm_prefix(cfg)
  s = {("embed",): _one(f"{p}.embed_tokens.weight", (V, D)),
       ("final_norm",): _one(f"{p}.norm.weight", (D,))}
  if not cfg.tie_embeddings:
    s[("lm_head",)] = _one("lm_head.weight", (V, D), lambda w: w.T)
  return s


def mtp_sources(cfg: ModelConfig, depth: int, has: Callable[[str], bool]) -> tuple[dict, tuple[str, ...]]:
  """DeepSeek MTP module `depth` lives at model.layers.{num_layers + depth}.

  Returns its sources and the names it holds that duplicate shared weights
  (embed_tokens, shared_head.head): consumed, not loaded.
  """
  D = cfg.d_model
  p = f"model.layers.{cfg.num_layers + depth}"
  is_moe = cfg.is_moe and cfg.num_layers not in cfg.dense_layers
  s = {("enorm",): _one(f"{p}.enorm.weight", (D,)),
       ("hnorm",): _one(f"{p}.hnorm.weight", (D,)),
       ("eh_proj",): _linear(f"{p}.eh_proj.weight", 2 * D, (D,)),
       ("norm",): _one(f"{p}.shared_head.norm.weight", (D,))}
  s.update({("block", *k): v for k, v in block_sources(cfg, p, is_moe, has).items()})
  return s, (f"{p}.embed_tokens.weight", f"{p}.shared_head.head.weight")
