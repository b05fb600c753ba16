"""Routing, the grouped expert FFN and expert counting: what the single-device
MoE layer (`moe.py`) and the expert-parallel one (`moe_ep.py`) share.

`route` returns, per token, the chosen experts and their combine weights:
  softmax_topk    p = softmax(logits); top-k of p; renormalise if norm_topk_prob
                  (Mixtral always, Qwen3-MoE by flag)
  topk_softmax    top-k of logits (+ bias); softmax over the k (GPT-OSS)
  sigmoid_grouped s = sigmoid(logits); choose with s + b (b selection-only):
                  keep the topk_group groups with the largest sum of their top-2
                  biased scores, then top-k experts inside them; weights are the
                  unbiased s, renormalised if norm_topk_prob, times
                  routed_scaling_factor (DeepSeek-V3 `noaux_tc`)
Routing runs in float32.

Expert load balancing (`jaxinfer/eplb.py`) may store the experts in physical
slot order (E_phys >= E slots, hot experts replicated) with the tables
`eplb_replicas` [E, R] and `eplb_num_replicas` [E]; `physical_ids` then maps
the router's logical choice to a slot. The router stays logical (E columns);
the expert paths count slots from the weights, `p["w_gate"].shape[0]`.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from jaxinfer import ops
from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import glu, quantized_call
from jaxinfer.models import quant
from jaxinfer.models.quant import dense


def route(cfg: ModelConfig, p, x):
  """x [T, D] -> (expert ids [T, k] int32, weights [T, k] float32)."""
  k = cfg.num_experts_per_tok
  logits = jnp.einsum("TD,DE->TE", x.astype(jnp.float32), p["router"].astype(jnp.float32))
  if cfg.router_bias:
    logits = logits + p["router_bias"].astype(jnp.float32)
  if cfg.router == "topk_softmax":
    top, idx = jax.lax.top_k(logits, k)
    return idx, jax.nn.softmax(top, axis=-1)
  if cfg.router == "softmax_topk":
    weights, idx = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if cfg.norm_topk_prob:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return idx, weights
  # sigmoid_grouped (DeepSeek-V3).
  scores = jax.nn.sigmoid(logits)
  choice = scores + p["score_bias"].astype(jnp.float32)
  if cfg.n_group > 1:
    T, E = choice.shape
    grouped = choice.reshape(T, cfg.n_group, E // cfg.n_group)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, n_group]
    _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
    keep = jnp.zeros((T, cfg.n_group), bool).at[jnp.arange(T)[:, None], top_groups].set(True)
    keep = jnp.repeat(keep, E // cfg.n_group, axis=1)
    choice = jnp.where(keep, choice, -jnp.inf)
  _, idx = jax.lax.top_k(choice, k)
  weights = jnp.take_along_axis(scores, idx, axis=-1)
  if cfg.norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return idx, weights * cfg.routed_scaling_factor


class ExpertCount(enum.StrEnum):
  """What a statistics forward counts per MoE layer (`moe.moe`'s count):
  routed copies of valid tokens per logical expert [E], or per physical slot
  [E + R] of EPLB-placed params."""
  LOGICAL = "logical"
  PHYSICAL = "physical"


def count_kind(count) -> ExpertCount | None:
  """None, or an `ExpertCount` (its value accepted; anything else is an error)."""
  if count is None:
    return None
  try:
    return ExpertCount(count)
  except ValueError:
    raise ValueError(f"count must be None or one of {[c.value for c in ExpertCount]}, "
                     f"got {count!r}") from None


def physical_ids(p, idx, token):
  """Logical expert ids [T, k] -> physical slots (identity without EPLB tables).

  token [T]: global token indices. Token t takes replica t % num_replicas of
  its expert, spreading a hot expert's tokens evenly over its replicas; every
  replica holds the same weights, so the choice never changes the output.
  """
  if "eplb_replicas" not in p:
    return idx
  r = token[:, None] % p["eplb_num_replicas"][idx]
  return p["eplb_replicas"][idx, r]


def _grouped_matmul(cfg: ModelConfig, xs, w, sizes):
  """xs [R, In] sorted by expert times each expert's w [E, In, Out]: the
  quantized grouped kernel for weights marked for it on a GPU backend (tile by
  tile), else `ops.grouped_matmul` (XLA's ragged_dot, or jax's Hopper kernel
  under the Backend's grouped_matmul; a quantized w dequantized whole first)."""
  if quant.kernel_ready(w, grouped=True) and cfg.backend.on_gpu():
    def call(xs, values, scale, scale2, sizes):
      return ops.quantized_grouped_matmul(xs, values, scale, sizes, block=w.block,
                                          packed=quant.PACKING.get(w.method), scale2=scale2,
                                          backend=cfg.backend)
    return quantized_call(w, call, xs, sizes)
  return ops.grouped_matmul(xs, dense(w, xs.dtype), sizes, backend=cfg.backend)


def _mosaic_operands(w, x_dtype):
  """dict(w, scale, scale2, block, packed) of an experts' weight for
  `ops.mosaic_experts`, or None where that kernel cannot take it (a weight
  split over a mesh, blocks or shapes `mosaic_experts_fit` refuses)."""
  if isinstance(w, quant.QuantizedWeight):
    if len(w.lead) != 1 or (w.kernel is not None and w.kernel.mesh is not None):
      return None
    arrays = dict(w=w.values, scale=w.scale, scale2=w.scale2,
                  block=quant.FIXED_BLOCKS.get(w.method, w.block),
                  packed=quant.PACKING.get(w.method))
  else:
    arrays = dict(w=w, scale=None, scale2=None, block=None, packed=None)
  why = ops.mosaic_experts_fit(x_dtype, arrays["w"].shape, arrays["w"].dtype, arrays["block"],
                               arrays["packed"])
  return arrays if why is None else None


def mosaic_experts_take(cfg: ModelConfig, p, x_dtype) -> bool:
  """Whether `grouped_ffn` runs the gate-up on the fused Mosaic kernel: the
  Backend's "fused_experts" trial under grouped_matmul "mosaic", and a gate
  and up the kernel takes."""
  b = cfg.backend
  if "fused_experts" not in b.trials or b.grouped_matmul_kernel() != "mosaic":
    return False
  gate, up = _mosaic_operands(p["w_gate"], x_dtype), _mosaic_operands(p["w_up"], x_dtype)
  same = lambda k: gate[k] == up[k]
  return gate is not None and up is not None and same("block") and same("packed")


def _mosaic_ffn(cfg: ModelConfig, p, xs, expert_ids, sizes):
  """grouped_ffn on the Mosaic expert kernel: gate and up fused with their
  biases and the GLU; the down projection there too where it takes it."""
  gate, up = (_mosaic_operands(p[w], xs.dtype) for w in ("w_gate", "w_up"))
  bias = (lambda name: p[name] if cfg.expert_bias else None)
  act = dict(activation="silu") if cfg.activation == "silu" else dict(
      activation="gpt_oss", limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha)
  h = ops.mosaic_experts(xs, gate.pop("w"), sizes, **gate, bias=bias("b_gate"), up=up["w"],
                         up_scale=up["scale"], up_scale2=up["scale2"], up_bias=bias("b_up"),
                         backend=cfg.backend, **act)
  down = _mosaic_operands(p["w_down"], h.dtype)
  if down is not None:
    return ops.mosaic_experts(h, down.pop("w"), sizes, **down, bias=bias("b_down"),
                              backend=cfg.backend)
  ys = _grouped_matmul(cfg, h, p["w_down"], sizes)
  return ys + p["b_down"][expert_ids] if cfg.expert_bias else ys


def grouped_ffn(cfg: ModelConfig, p, xs, expert_ids, sizes):
  """Expert FFN on rows grouped by expert: xs [R, D] sorted by expert_ids [R],
  sizes [E] rows per expert (rows past sum(sizes) compute to zero)."""
  if mosaic_experts_take(cfg, p, xs.dtype):
    return _mosaic_ffn(cfg, p, xs, expert_ids, sizes)
  gate = _grouped_matmul(cfg, xs, p["w_gate"], sizes)
  up = _grouped_matmul(cfg, xs, p["w_up"], sizes)
  if cfg.expert_bias:
    gate, up = gate + p["b_gate"][expert_ids], up + p["b_up"][expert_ids]
  ys = _grouped_matmul(cfg, glu(cfg, gate, up), p["w_down"], sizes)
  if cfg.expert_bias:
    ys = ys + p["b_down"][expert_ids]
  return ys


def expert_counts(idx, ok, length):
  """Routed copies per expert (or slot): idx [T, k], ok [T] bool -> int32 [length]."""
  return jnp.zeros((length,), jnp.int32).at[idx.reshape(-1)].add(
      jnp.repeat(ok.astype(jnp.int32), idx.shape[1]))
