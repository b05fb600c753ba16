"""Mixture-of-experts layer: routing (`moe_core.route`) and three
interchangeable single-device expert paths; with an expert-parallel plan the
layer runs `moe_ep.moe_ep` instead (same outputs).

Expert paths, chosen by the type of the layer's params (`layouts`), same
outputs:
  grouped  (the stacked dict of `specs`) token copies sorted by expert, one
           grouped matmul per projection (`jax.lax.ragged_dot`,
           `moe_core.grouped_ffn`), unsorted and combined
  dense    (`DenseExperts`) every expert on every token, masked by the
           combine weights (a reference: E/k times the FLOPs)
  split    (`SplitExperts`: one array per expert, the Engine's CPU layout)
           sorted copies through the C++ CPU kernel where `ops.cpu_experts`
           allows (`experts_native`), else one loop over the chosen
           experts' row chunks (`experts_split`)

`cfg.moe_impl` stays a config field (users and tests pick the reference
path through the config, as they pick the attention kernels in `cfg.backend`); `with_impl` turns
it into the params' type once, where a block is entered, so the layer
itself never reads it.

With EPLB-placed params (`moe_core.physical_ids`) the paths count physical
slots from the weights, `p["w_gate"].shape[0]`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxinfer import ops
from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import glu, mlp
from jaxinfer.models.layouts import DenseExperts, SplitExperts
from jaxinfer.models.moe_core import (ExpertCount, count_kind, expert_counts, grouped_ffn,
                                      physical_ids, route)
from jaxinfer.models.moe_ep import ExpertParallel, InRankExpertParallel, moe_ep
from jaxinfer.models.quant import dense


def with_impl(cfg: ModelConfig, p):
  """A MoE layer's params in the type that runs `cfg.moe_impl`: the stacked
  dict marked `DenseExperts` for "dense"; any other layout as it is."""
  if cfg.moe_impl == "dense" and isinstance(p, dict):
    return DenseExperts(p)
  return p


def experts_dense(cfg: ModelConfig, p, x, idx, weights):
  """The reference: every token through every expert (stacked dict params),
  weighted by its routing weights (0 for experts it did not choose)."""
  T, E = x.shape[0], p["w_gate"].shape[0]  # physical slots (== cfg.num_experts without EPLB)
  combine = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], idx].add(weights)
  gate = jnp.einsum("TD,EDF->TEF", x, dense(p["w_gate"], x.dtype))
  up = jnp.einsum("TD,EDF->TEF", x, dense(p["w_up"], x.dtype))
  if cfg.expert_bias:
    gate, up = gate + p["b_gate"], up + p["b_up"]
  y = jnp.einsum("TEF,EFD->TED", glu(cfg, gate, up), dense(p["w_down"], x.dtype))
  if cfg.expert_bias:
    y = y + p["b_down"]
  return jnp.einsum("TED,TE->TD", y.astype(jnp.float32), combine)


def sorted_copies(idx, E: int):
  """idx [T, k] -> (order [T k]: the token copies sorted by expert, copy c
  belonging to token c // k; sizes [E]: each expert's copies). Copies to
  slot E and above (`moe`'s padding) sort last and are not counted."""
  order = jnp.argsort(idx.reshape(-1), stable=True)
  return order, jnp.bincount(idx.reshape(-1), length=E).astype(jnp.int32)


def combine_copies(ys, order, weights):
  """ys [>= T k, D]: the sorted copies' outputs -> [T, D] float32, each
  token's k outputs weighted by weights [T, k]."""
  T, k = weights.shape
  # each copy's row in ys by a gather (the inverse permutation scattered as
  # ints): scattering the rows into zeros wrote and copied [T k, D] floats
  # more (bench_moe's 8 x 128 prefill, profiled: the scatters, the zeros and
  # their copies ~23 ms; the gathers after ~7-14 ms)
  where = jnp.zeros((T * k,), jnp.int32).at[order].set(jnp.arange(T * k, dtype=jnp.int32))
  y = ys[where].reshape(T, k, -1)
  return jnp.einsum("TKD,TK->TD", y.astype(jnp.float32), weights)


def experts_grouped(cfg: ModelConfig, p, x, idx, weights):
  """Token copies sorted by expert through one grouped matmul
  (`moe_core.grouped_ffn`) over the stacked experts."""
  k = idx.shape[1]
  order, sizes = sorted_copies(idx, p["w_gate"].shape[0])  # physical slots
  ys = grouped_ffn(cfg, p, x[order // k], idx.reshape(-1)[order], sizes)
  return combine_copies(ys, order, weights)


def split_chunk(T: int, k: int, E: int) -> int:
  """`experts_split`'s default C for T tokens routed to k of E experts: 1
  while the expected rows per chosen expert are under 2.5 (a one-row product
  is XLA:CPU's matrix-vector kernel, and an expert's second row finds its
  weights in cache), else those rows rounded up to a power of two.

  Measured in benchmark round 31 on `bench_moe`'s experts (2-core CPU, random
  routing, one layer, ms): C = 1 / 2 / 4 at 4 tokens 5.9 / 7.6 / 8.1, at 8
  tokens 10.1 / 11.9 / 12.3, at 16 tokens 18.2 / 20.7 / 21.1, at 32 tokens
  28.8 / 28.9 / 25.6. A one-row product runs XLA:CPU's matrix-vector kernel
  (~25 GB/s of weights here, ~16 for two to eight rows), and an expert's
  chunks are consecutive. In the Engine, bench_moe's decode step at 8 rows
  took 92-94 ms at C = 1 against 106-124 ms at C = 2 (one process each,
  alternating). An earlier round had measured C = 2 faster at 4-16
  tokens, with a loop per expert."""
  rows = T * k / (E * (1 - (1 - k / E) ** T))
  return 1 if rows < 2.5 else 1 << math.ceil(math.log2(rows))


def experts_split(cfg: ModelConfig, p, x, idx, weights, chunk: int | None = None):
  """Routed experts held as one array per expert (`SplitExperts`): token
  copies sorted by expert, then one loop over every chosen expert's row
  chunks of C. Chunk i belongs to expert e (a search of the chunk counts'
  prefix sums), and its two products pick e's weights with `lax.switch`
  (each branch one dot over its own expert's array, read in place), so an
  expert no token chose costs nothing and the loop's code exists once a
  layer. C (static, `chunk` overrides it): `split_chunk`. This is the CPU
  path where the C++ kernel is not (`experts_native`): XLA:CPU's grouped
  matmul touches every expert, and slicing a stacked expert copies it.
  Copies routed to slot E (`moe` sends a step's padding tokens there) are
  never computed: their rows of the result are zeros.

  Until round 30 each expert had a loop of its own (`experiments/benchlib/
  moe_prefill.experts_looped`): as fast (bench_moe in the Engine, 5-7
  alternating runs: decode at batch 1 29.8 vs 30.0 ms, batch 8 127 vs 135
  ms, 8 x 128 prefill 2.17 vs 2.09 s), but 64 x 7 loops of code made each
  step program ~1.2x the memory maps and ~2x the compile time of serve.py's
  warm-up (docs/known_issues.md).
  """
  T, k = idx.shape
  D = x.shape[1]
  E = len(p.w_down)  # physical slots
  C = chunk or split_chunk(T, k, E)
  order, sizes = sorted_copies(idx, E)  # slot E: never run (`moe`'s padding)
  starts = jnp.cumsum(sizes) - sizes
  chunks = (sizes + C - 1) // C
  ends = jnp.cumsum(chunks)  # expert e's chunks: ends[e] - chunks[e] .. ends[e]
  xs = jnp.concatenate([x[order // k], jnp.zeros((C, D), x.dtype)])  # [T k + C, D]
  ys = jnp.zeros((T * k + C, p.w_down[0].shape[-1]), x.dtype)
  gate_up = [lambda a, w=w: a @ w for w in p.w_gate_up]
  down = [lambda a, w=w: a @ w for w in p.w_down]

  def body(i, ys):
    e = jnp.minimum(jnp.searchsorted(ends, i, side="right"), E - 1).astype(jnp.int32)
    first = (i - (ends[e] - chunks[e])) * C
    start = starts[e] + first
    gate, up = jnp.split(jax.lax.switch(e, gate_up, jax.lax.dynamic_slice_in_dim(xs, start, C)),
                         2, axis=-1)
    if cfg.expert_bias:
      gate, up = gate + p["b_gate"][e], up + p["b_up"][e]
    ye = jax.lax.switch(e, down, glu(cfg, gate, up))
    if cfg.expert_bias:
      ye = ye + p["b_down"][e]
    mine = (first + jnp.arange(C) < sizes[e])[:, None]  # the tail belongs to later experts
    return jax.lax.dynamic_update_slice_in_dim(
        ys, jnp.where(mine, ye, jax.lax.dynamic_slice_in_dim(ys, start, C)), start, 0)

  return combine_copies(jax.lax.fori_loop(0, ends[-1], body, ys), order, weights)


def experts_native(cfg: ModelConfig, p, x, idx, weights):
  """`experts_split`'s outputs from the C++ CPU kernel
  (`ops.routed_experts_cpu`): token copies sorted by expert, each chosen
  expert's weights read once for all its copies, the cores on different
  experts. Copies routed to slot E (padding) sort last, past every count,
  and come back zero."""
  order, sizes = sorted_copies(idx, len(p.w_down))
  ys = ops.routed_experts_cpu(x[order // idx.shape[1]], sizes, p.w_gate_up, p.w_down,
                              activation=cfg.activation, limit=cfg.swiglu_limit,
                              alpha=cfg.swiglu_alpha)
  return combine_copies(ys, order, weights)


def moe(cfg: ModelConfig, p, x, ep: ExpertParallel | InRankExpertParallel | None = None, valid=None, count=None):
  """x [B, T, D] -> ([B, T, D], counts): routed experts plus shared experts.

  ep: an `moe_ep.ExpertParallel` plan when the experts are split over mesh
  axes (or an `moe_ep.InRankExpertParallel` inside a per-rank shard_map); valid [B, T] or None: padding rows (False) are never dispatched to
  experts (expert-parallel) and contribute nothing. count (a
  `moe_core.ExpertCount`): counts [E] (LOGICAL) or [E + R] slots of
  EPLB-placed params (PHYSICAL) of the routed copies of valid tokens, taken
  from this layer's own routing; None: counts is None.
  """
  count = count_kind(count)
  if ep is not None:
    return moe_ep(cfg, p, x, ep, valid, count)
  B, T, D = x.shape
  xt = x.reshape(B * T, D)
  ok = jnp.ones((B * T,), bool) if valid is None else valid.reshape(B * T)
  idx, weights = route(cfg, p, xt)
  weights = jnp.where(ok[:, None], weights, 0.0)
  counts = expert_counts(idx, ok, cfg.num_experts) if count == ExpertCount.LOGICAL else None
  idx = physical_ids(p, idx, jnp.arange(B * T))
  if count == ExpertCount.PHYSICAL:
    counts = expert_counts(idx, ok, len(p["w_down"]))
  if isinstance(p, SplitExperts):
    experts = experts_split
    if p.native and ops.cpu_experts(B * T * cfg.num_experts_per_tok, len(p.w_down), xt.dtype,
                                    p.w_gate_up, p.w_down, cfg.expert_bias, cfg.backend):
      experts = experts_native
    if valid is not None:  # padding copies to slot E: past every expert's rows, never run
      idx = jnp.where(ok[:, None], idx, len(p.w_down))
  elif isinstance(p, DenseExperts):
    experts = experts_dense
  else:
    experts = experts_grouped
  out = experts(cfg, p, xt, idx, weights).astype(x.dtype)
  if cfg.num_shared_experts:
    out = out + mlp(cfg, p["shared"], xt)
  return out.reshape(B, T, D), counts
