"""Wide expert parallelism: routed experts split over mesh axes, in `shard_map`.

With n ranks on the expert axes, rank r holds experts [r E/n, (r + 1) E/n)
and 1/n of the tokens. Two strategies, chosen per call by token count:

  all_to_all  (prefill, large batches) each rank routes its tokens, packs
              every (token, expert) copy into a per-destination send buffer
              sized for the worst case (all t*k copies to one rank: dropless),
              exchanges with `all_to_all`, runs its local experts as one
              grouped matmul (`ragged_dot`; buffer padding falls outside every
              group and computes to zero), and sends the results back.
  replicated  (small decode batches) tokens are all-gathered, each rank adds
              the contributions of its local experts, and a `psum` combines.

`jax.lax.ragged_all_to_all` would send only the filled part of each buffer;
XLA:CPU does not implement it, so the fixed-size form is used everywhere.
Shared experts run locally on each rank's tokens.

With an EPLB placement (`jaxinfer/eplb.py`) E counts physical slots (read from
`w_gate`), the rank holds slots [r E/n, (r + 1) E/n), and each rank maps its
routed logical ids to slots (`moe_core.physical_ids`, tables replicated) before
dispatch.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import mlp
from jaxinfer.models.moe_core import (ExpertCount, count_kind, expert_counts, grouped_ffn,
                                      physical_ids, route)

# Replicated on every rank: the logical router and the EPLB slot tables.
_REPLICATED = ("router", "router_bias", "score_bias", "eplb_replicas", "eplb_num_replicas")


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
  """Static plan: the mesh, the axes experts are split over, the strategy."""

  mesh: Mesh
  axes: tuple[str, ...]
  strategy: str = "auto"  # "auto" | "all_to_all" | "replicated"
  replicated_max_tokens: int = 16  # auto: tokens per rank at or below this replicate

  @property
  def size(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.axes)

  def in_rank(self) -> "InRankExpertParallel":
    """The same plan for code already running per rank in `shard_map` over `axes`."""
    return InRankExpertParallel(self.axes, self.size, self.strategy, self.replicated_max_tokens)


@dataclasses.dataclass(frozen=True)
class InRankExpertParallel:
  """Expert parallelism from inside a `shard_map` over `axes` (the attention
  data-parallel speculative step runs whole per rank): the layer sees this
  rank's tokens and its slice of the experts, and exchanges with the other
  ranks by collectives over `axes`. Every rank must call it with the same
  token count (the strategy and the collectives follow it)."""

  axes: tuple[str, ...]
  size: int
  strategy: str = "auto"
  replicated_max_tokens: int = 16


def plan_from_params(params, strategy: str = "auto") -> ExpertParallel | None:
  """The EP plan implied by the routed experts' sharding (None if unsharded)."""
  for seg in params.get("layers", ()):
    w = seg["mlp"].get("w_gate") if "router" in seg["mlp"] else None
    sharding = getattr(w, "sharding", None)
    if isinstance(sharding, NamedSharding):
      axis = sharding.spec[1] if len(sharding.spec) > 1 else None
      if axis is None:
        return None
      axes = axis if isinstance(axis, tuple) else (axis,)
      return ExpertParallel(sharding.mesh, axes, strategy)
  return None


def _apply_sorted(cfg, p, rows, expert, valid, e_local):
  """Runs rows [R, D] through local expert `expert` [R] (invalid rows -> 0)."""
  key = jnp.where(valid, expert, e_local)  # invalid rows sort last, outside every group
  order = jnp.argsort(key, stable=True)
  sizes = jnp.bincount(key, length=e_local + 1)[:e_local].astype(jnp.int32)
  y = grouped_ffn(cfg, p, rows[order], jnp.minimum(key[order], e_local - 1), sizes)
  return jnp.zeros_like(y).at[order].set(y)


def _all_to_all(cfg, p, x, idx, weights, ok, axes, n, e_local):
  t, k = idx.shape
  cap = t * k  # worst case: every copy goes to one rank
  flat = idx.reshape(-1)
  dest = flat // e_local
  copy_ok = ok[jnp.arange(cap) // k]  # padding rows send nothing
  onehot = jax.nn.one_hot(dest, n, dtype=jnp.int32) * copy_ok[:, None]  # [t*k, n]
  slot = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)  # position at its dest
  slot = jnp.where(copy_ok, slot, cap)  # out of bounds: dropped by the scatters
  send = jnp.zeros((n, cap, x.shape[-1]), x.dtype).at[dest, slot].set(
      x[jnp.arange(cap) // k], mode="drop")
  send_e = jnp.zeros((n, cap), jnp.int32).at[dest, slot].set(flat % e_local, mode="drop")
  send_ok = jnp.zeros((n, cap), bool).at[dest, slot].set(True, mode="drop")
  a2a = lambda a: jax.lax.all_to_all(a, axes, 0, 0, tiled=True)
  recv, recv_e, recv_ok = a2a(send), a2a(send_e), a2a(send_ok)
  y = _apply_sorted(cfg, p, recv.reshape(n * cap, -1), recv_e.reshape(-1),
                    recv_ok.reshape(-1), e_local)
  back = a2a(y.reshape(n, cap, -1))
  y_copies = back[dest, jnp.minimum(slot, cap - 1)] * copy_ok[:, None]
  y_copies = y_copies.reshape(t, k, -1)
  return jnp.einsum("TKD,TK->TD", y_copies.astype(jnp.float32), weights)


def _replicated(cfg, p, x, idx, weights, ok, axes, n, e_local):
  rank = jax.lax.axis_index(axes)
  x_all = jax.lax.all_gather(x, axes, tiled=True)  # [n t, D]
  idx_all = jax.lax.all_gather(idx, axes, tiled=True)
  w_all = jax.lax.all_gather(weights, axes, tiled=True)
  ok_all = jax.lax.all_gather(ok, axes, tiled=True)
  T, k = idx_all.shape
  flat = idx_all.reshape(-1)
  mine = (flat // e_local == rank) & ok_all[jnp.arange(T * k) // k]
  y = _apply_sorted(cfg, p, x_all[jnp.arange(T * k) // k], flat % e_local, mine, e_local)
  part = jnp.einsum("TKD,TK->TD", y.reshape(T, k, -1).astype(jnp.float32), w_all)
  total = jax.lax.psum(part, axes)
  t = x.shape[0]
  return jax.lax.dynamic_slice_in_dim(total, rank * t, t)


def _rank_moe(cfg, experts, router_p, x, ok, *, axes, n, e_local, strategy, count, token0):
  """One rank's routed experts inside `shard_map` over `axes`: x [t, D] its
  tokens (ok [t]: real ones), experts its slots' weights, strategy
  "replicated" or "all_to_all", token0 the global index of its first token
  (the EPLB replica choice). -> (y [t, D], counts: summed over the ranks, or
  an empty array)."""
  t = x.shape[0]
  idx, weights = route(cfg, router_p, x)
  counts = jnp.zeros((0,), jnp.int32)
  if count == ExpertCount.LOGICAL:
    counts = jax.lax.psum(expert_counts(idx, ok, cfg.num_experts), axes)
  if "eplb_replicas" in router_p:
    # Global token index, so the replica choice matches the unsharded path.
    idx = physical_ids(router_p, idx, token0 + jnp.arange(t))
  if count == ExpertCount.PHYSICAL:
    counts = jax.lax.psum(expert_counts(idx, ok, n * e_local), axes)
  weights = weights * ok[:, None]
  body = _replicated if strategy == "replicated" else _all_to_all
  return body(cfg, experts, x, idx, weights, ok, axes, n, e_local).astype(x.dtype), counts


def _split_params(p):
  """-> (routed expert weights, the replicated router and EPLB tables)."""
  experts = {k: p[k] for k in p if k not in (*_REPLICATED, "shared")}
  return experts, {k: p[k] for k in _REPLICATED if k in p}


def moe_ep(cfg: ModelConfig, p, x, ep, valid=None, count=None):
  """x [B, T, D] -> ([B, T, D], counts or None) with experts split over
  ep.axes; count as in `moe.moe` (summed over the ranks' tokens). ep: an
  `ExpertParallel` (called on global arrays: tokens split over the ranks
  here) or an `InRankExpertParallel` (called inside a `shard_map` over its
  axes: x is this rank's tokens, p its experts)."""
  count = count_kind(count)
  if isinstance(ep, InRankExpertParallel):
    return _moe_in_rank(cfg, p, x, ep, valid, count)
  B, T, D = x.shape
  E = p["w_gate"].shape[0]  # physical slots (= num_experts without EPLB)
  n = ep.size
  if E % n:
    raise ValueError(f"num_experts ({E}) is not divisible by the expert-parallel "
                     f"axes {ep.axes} (size {n})")
  xt = x.reshape(B * T, D)
  pad = -(B * T) % n
  xt = jnp.pad(xt, ((0, pad), (0, 0)))
  ok = jnp.ones((B * T,), bool) if valid is None else valid.reshape(B * T)
  ok = jnp.pad(ok, (0, pad))  # the alignment padding is not real tokens either
  per_rank = xt.shape[0] // n
  experts, router = _split_params(p)
  strategy = ep.strategy
  if strategy == "auto":
    strategy = "replicated" if per_rank <= ep.replicated_max_tokens else "all_to_all"

  def per_rank_fn(x_l, ok_l, experts_l, router_p):
    return _rank_moe(cfg, experts_l, router_p, x_l, ok_l, axes=ep.axes, n=n, e_local=E // n,
                     strategy=strategy, count=count,
                     token0=jax.lax.axis_index(ep.axes) * per_rank)

  spec_tokens = P(ep.axes, None)
  spec_experts = {k: P(ep.axes, *([None] * (w.ndim - 1))) for k, w in experts.items()}
  out, counts = jax.shard_map(per_rank_fn, mesh=ep.mesh,
                      in_specs=(spec_tokens, P(ep.axes), spec_experts,
                                jax.tree.map(lambda _: P(), router)),
                      out_specs=(spec_tokens, P()), check_vma=False)(xt, ok, experts, router)
  out = out[:B * T]
  if cfg.num_shared_experts:
    out = out + mlp(cfg, p["shared"], x.reshape(B * T, D))
  return out.reshape(B, T, D), (counts if count else None)


def _moe_in_rank(cfg, p, x, ep: "InRankExpertParallel", valid, count):
  B, T, D = x.shape
  xt = x.reshape(B * T, D)
  ok = jnp.ones((B * T,), bool) if valid is None else valid.reshape(B * T)
  experts, router = _split_params(p)
  strategy = ep.strategy
  if strategy == "auto":
    strategy = "replicated" if B * T <= ep.replicated_max_tokens else "all_to_all"
  out, counts = _rank_moe(cfg, experts, router, xt, ok, axes=ep.axes, n=ep.size,
                          e_local=p["w_gate"].shape[0], strategy=strategy, count=count,
                          token0=jax.lax.axis_index(ep.axes) * B * T)
  if cfg.num_shared_experts:
    out = out + mlp(cfg, p["shared"], xt)
  return out.reshape(B, T, D), (counts if count else None)
