"""Wide expert parallelism: routed experts split over mesh axes, in `shard_map`.

With n ranks on the expert axes, rank r holds experts [r E/n, (r + 1) E/n)
and 1/n of the tokens. Each rank routes its tokens, exchanges the (token,
expert) copies with the ranks holding their experts, runs its local experts
as one grouped matmul and gets the results back. The exchange is chosen per
call by kernel target and token count (`ep_dispatch`): on a GPU target
`ragged` (`lax.ragged_all_to_all`, exactly the routed rows); on CPU
`replicated` for few tokens, else `all_to_all` with capacity-bounded rounds.
Shared experts run locally on each rank's tokens.

`ExpertParallel` runs it from global arrays (its own `shard_map`);
`InRankExpertParallel` from code already running per rank (the attention
data-parallel speculative step).

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

from jaxinfer.backend import Backend
from jaxinfer.config import ModelConfig
from jaxinfer.models import ep_dispatch, quant
from jaxinfer.models.layers import mlp
from jaxinfer.models.moe_core import ExpertCount, count_kind, expert_counts, physical_ids, route
from jaxinfer.models.quant import QuantizedWeight

# Replicated on every rank: the logical router and the EPLB slot tables.
_REPLICATED = ("router", "router_bias", "score_bias", "eplb_replicas", "eplb_num_replicas")


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
  """Static plan: the mesh, the axes experts are split over, the exchange
  (`ep_dispatch.STRATEGIES`; "auto": ragged on a GPU target, whatever the
  batch, so only routed rows cross the wire; elsewhere replicated up to
  replicated_max_tokens tokens per rank, then capacity all_to_all), its
  capacity factor and dispatch dtype."""

  mesh: Mesh
  axes: tuple[str, ...]
  strategy: str = "auto"
  replicated_max_tokens: int = 16  # auto: tokens per rank at or below this replicate
  capacity_factor: float = 1.25  # all_to_all: rows per destination, over the even share
  dispatch_dtype: str | None = None  # None: the activations' dtype

  def __post_init__(self):
    if self.strategy not in ep_dispatch.STRATEGIES:
      raise ValueError(f"ExpertParallel: strategy must be one of {ep_dispatch.STRATEGIES}, "
                       f"got {self.strategy!r}")
    if not self.capacity_factor > 0:
      raise ValueError(f"ExpertParallel: capacity_factor must be > 0, got {self.capacity_factor}")

  @property
  def size(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.axes)

  def in_rank(self) -> "InRankExpertParallel":
    """The same plan for code already running per rank in `shard_map` over `axes`."""
    return InRankExpertParallel(self)


@dataclasses.dataclass(frozen=True)
class InRankExpertParallel:
  """Expert parallelism from inside a `shard_map` over `plan.axes` (the
  attention data-parallel speculative step runs whole per rank): the layer
  sees this rank's tokens and its slice of the experts, and exchanges with
  the other ranks by collectives over the axes, as `plan` says. Every rank
  must call it with the same token count (the strategy and the collectives
  follow it)."""

  plan: ExpertParallel


def _exchange(ep: ExpertParallel, tokens_per_rank: int, backend: Backend) -> dict:
  """The plan's exchange for this many tokens per rank: strategy and options."""
  strategy = ep.strategy
  if strategy == "auto" and backend.on_gpu():
    strategy = "ragged"
  elif strategy == "auto":
    strategy = "replicated" if tokens_per_rank <= ep.replicated_max_tokens else "all_to_all"
  return dict(strategy=strategy, capacity_factor=ep.capacity_factor,
              dispatch_dtype=ep.dispatch_dtype)


def plan_from_params(params, strategy: str = "auto") -> ExpertParallel | None:
  """The EP plan implied by the routed experts' sharding (None if unsharded)."""
  for seg in params.get("layers", ()):
    w = seg["mlp"].get("w_gate") if "router" in seg["mlp"] else None
    w = w.values if isinstance(w, QuantizedWeight) else w
    sharding = getattr(w, "sharding", None)
    if isinstance(sharding, NamedSharding):
      axis = sharding.spec[1] if len(sharding.spec) > 1 else None
      if axis is None:
        return None
      axes = axis if isinstance(axis, tuple) else (axis,)
      return ExpertParallel(sharding.mesh, axes, strategy)
  return None


def _rank_moe(cfg, experts, router_p, x, ok, *, axes, n, e_local, strategy, count, token0,
              capacity_factor=1.25, dispatch_dtype=None):
  """One rank's routed experts inside `shard_map` over `axes`: x [t, D] its
  tokens (ok [t]: real ones), experts its slots' weights, strategy
  "replicated", "all_to_all" or "ragged" (`ep_dispatch`), token0 the global index of its first token
  (the EPLB replica choice). -> (y [t, D], counts: summed over the ranks, or
  an empty array)."""
  t = x.shape[0]
  experts = quant.held_whole(experts)  # per rank, the local experts are whole
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
  if strategy == "replicated":
    y = ep_dispatch.replicated(cfg, experts, x, idx, weights, ok, axes, n, e_local,
                               dispatch_dtype=dispatch_dtype)
  elif strategy == "ragged":
    y = ep_dispatch.ragged_all_to_all(cfg, experts, x, idx, weights, ok, axes, n, e_local,
                                      dispatch_dtype=dispatch_dtype,
                                      emulate=not cfg.backend.on_gpu())
  else:
    y = ep_dispatch.capacity_all_to_all(cfg, experts, x, idx, weights, ok, axes, n, e_local,
                                        capacity_factor=capacity_factor,
                                        dispatch_dtype=dispatch_dtype)
  return y.astype(x.dtype), counts


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
  exchange = _exchange(ep, per_rank, cfg.backend)

  def per_rank_fn(x_l, ok_l, experts_l, router_p):
    return _rank_moe(cfg, experts_l, router_p, x_l, ok_l, axes=ep.axes, n=n, e_local=E // n,
                     count=count, **exchange,
                     token0=jax.lax.axis_index(ep.axes) * per_rank)

  spec_tokens = P(ep.axes, None)
  spec_experts = jax.tree.map(lambda a: P(ep.axes, *([None] * (a.ndim - 1))), experts)
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
  plan = ep.plan
  exchange = _exchange(plan, B * T, cfg.backend)
  out, counts = _rank_moe(cfg, experts, router, xt, ok, axes=plan.axes, n=plan.size,
                          e_local=p["w_gate"].shape[0], count=count, **exchange,
                          token0=jax.lax.axis_index(plan.axes) * B * T)
  if cfg.num_shared_experts:
    out = out + mlp(cfg, p["shared"], xt)
  return out.reshape(B, T, D), (counts if count else None)
