"""Expert-parallel load balancing (EPLB, after DeepSeek's `eplb`).

With contiguous expert parallelism rank r holds experts [r E/n, (r + 1) E/n);
a skewed router makes the rank holding the hot experts the step's straggler.
EPLB measures each MoE layer's routing load, gives the hottest experts extra
copies (redundant slots), and packs the E + R physical slots onto ranks so the
per-rank load evens out. Every copy holds the same weights and a token picks
one of its expert's copies, so the model's outputs do not change.

  expert_load          tokens routed to each expert per MoE layer [Lm, E]
  plan_placement       load -> Placement (replicate the hottest, then pack)
  imbalance            (max - mean) / mean per-rank load, default or placed
  apply_placement      params -> params with experts in physical slot order
  remove_placement     placed params -> logical params
  shard_placed_params  those params split over expert mesh axes

Placed params are runtime params, not a checkpoint format: each MoE block's
expert weights become [L, E + R, ...] and the block gains `eplb_replicas`
[L, E, max_r] and `eplb_num_replicas` [L, E] (int32), which `models.moe`
reads; `models.param_specs` does not describe them; `sharding.shard_params` (and so
`Engine(mesh=...)`) splits their slot dim like the logical expert dim, and
`shard_placed_params` splits it over chosen mesh axes. `Engine` records the
routing load while serving and `Engine.rebalance` applies a placement. The config is unchanged:
the model reads the slot count from the weights. The MTP modules' MoE block is
placed with the trunk when the load has its rows (an engine that speculates).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.models import mtp as mtp_lib, transformer
from jaxinfer.models.moe_core import ExpertCount
from jaxinfer.models.moe_ep import plan_from_params

EXPERT_KEYS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")  # [L, E, ...]
TABLE_KEYS = ("eplb_replicas", "eplb_num_replicas")


# ---------------------------------------------------------------- statistics

@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _logits_and_load(cfg, params, tokens, ep, physical):
  """The model's full forward, counting routed copies per MoE layer."""
  return transformer.logits_and_counts(cfg, params, tokens, ep,
                                       ExpertCount.PHYSICAL if physical else ExpertCount.LOGICAL)


def expert_load(cfg: ModelConfig, params, tokens, *, physical: bool = False) -> np.ndarray:
  """Routed (token, expert) copies per expert in each MoE layer: int [Lm, E].

  tokens [B, T] run through the full causal forward (sharded params run
  expert-parallel). physical=True counts per physical slot [Lm, E + R] of
  placed params, with the replica choice the model makes: the load each rank
  actually gets (`imbalance(load, num_ranks=n)` with no placement).
  """
  if not cfg.is_moe:
    raise ValueError(f"expert_load: cfg has no MoE layers (num_experts={cfg.num_experts})")
  transformer.check_tokens(cfg, tokens)
  if physical and not _is_placed(params):
    raise ValueError("expert_load: physical=True needs params from apply_placement")
  _, load = _logits_and_load(cfg, params, jnp.asarray(tokens, jnp.int32),
                             plan_from_params(params), physical)
  return np.asarray(load)


# ---------------------------------------------------------------- planning

@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
  """One MoE layer's slots. Slot s lives on rank s // slots_per_rank."""

  phys_to_logical: np.ndarray  # [S] int32: the logical expert in each slot
  replicas: np.ndarray  # [E, max_r] int32: slots of each expert, padded with its first slot
  num_replicas: np.ndarray  # [E] int32, >= 1
  num_ranks: int

  @property
  def num_slots(self) -> int:
    return len(self.phys_to_logical)

  @property
  def slots_per_rank(self) -> int:
    return self.num_slots // self.num_ranks


def _check_load(load, name="load") -> np.ndarray:
  load = np.asarray(load)
  if load.ndim not in (1, 2) or load.shape[-1] == 0 or load.size == 0:
    raise ValueError(f"{name} must be [E] or [num_moe_layers, E] with E >= 1, got shape "
                     f"{load.shape}")
  if not np.issubdtype(load.dtype, np.number) or np.issubdtype(load.dtype, np.complexfloating):
    raise ValueError(f"{name} must be real numbers, got dtype {load.dtype}")
  load = load.astype(np.float64)
  if not np.all(np.isfinite(load)) or np.any(load < 0):
    raise ValueError(f"{name} must be finite and >= 0")
  return load


def _check_int(value, name, lo) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
    raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
  return int(value)


def _plan_one(load: np.ndarray, n: int, redundant: int) -> Placement:
  E = len(load)
  count = np.ones(E, np.int64)
  # Replicate: each extra slot goes to the expert with the highest load per
  # copy (ties: fewest copies, then lowest id, so zero load spreads evenly).
  for _ in range(redundant):
    per_copy = load / count
    best = np.flatnonzero(per_copy == per_copy.max())
    count[best[np.argmin(count[best])]] += 1
  logical = np.repeat(np.arange(E), count)  # [S] one entry per copy
  weight = load[logical] / count[logical]  # a copy serves 1/count of the expert's tokens
  # Pack: longest processing time first, each copy onto the least-loaded rank
  # that still has a free slot (ties: lowest rank). S = n * per_rank exactly.
  per_rank = len(logical) // n
  rank_load, fill = np.zeros(n), np.zeros(n, np.int64)
  phys = np.empty(len(logical), np.int64)
  for i in np.argsort(-weight, kind="stable"):
    free = np.flatnonzero(fill < per_rank)
    r = free[np.argmin(rank_load[free])]
    phys[r * per_rank + fill[r]] = logical[i]
    fill[r] += 1
    rank_load[r] += weight[i]
  replicas = np.empty((E, count.max()), np.int64)
  for e in range(E):
    slots = np.flatnonzero(phys == e)
    replicas[e] = np.pad(slots, (0, replicas.shape[1] - len(slots)), constant_values=slots[0])
  return Placement(phys.astype(np.int32), replicas.astype(np.int32), count.astype(np.int32), n)


def plan_placement(load, num_ranks: int, num_redundant: int = 0):
  """load [E] -> Placement; load [Lm, E] -> tuple of Lm Placements.

  The E + num_redundant slots split evenly over num_ranks ranks.
  """
  load = _check_load(load)
  n = _check_int(num_ranks, "num_ranks", 1)
  redundant = _check_int(num_redundant, "num_redundant", 0)
  S = load.shape[-1] + redundant
  if S % n:
    raise ValueError(f"num_ranks ({n}) must divide num_experts + num_redundant "
                     f"({load.shape[-1]} + {redundant} = {S})")
  if load.ndim == 1:
    return _plan_one(load, n, redundant)
  return tuple(_plan_one(row, n, redundant) for row in load)


def _as_list(placement, layers: int, name: str) -> list[Placement]:
  if isinstance(placement, Placement):
    return [placement] * layers
  placement = list(placement)
  if len(placement) != layers or not all(isinstance(p, Placement) for p in placement):
    raise ValueError(f"{name} must be a Placement or {layers} Placements (one per MoE layer), "
                     f"got {len(placement)} items")
  return placement


def imbalance(load, placement: Placement | Sequence[Placement] | None = None,
              num_ranks: int | None = None) -> float:
  """Per-rank load imbalance (max - mean) / mean: 0 is perfect balance.

  A logical expert's load splits evenly over its replicas. Without a placement
  rank r holds experts [r E/n, (r + 1) E/n) (this also reads a physical slot
  load from `expert_load(..., physical=True)`). For [Lm, E] the layers run one
  after another, so it is (sum of per-layer max - sum of means) / sum of means.
  """
  load = _check_load(load)
  rows = load if load.ndim == 2 else load[None]
  E = rows.shape[1]
  if placement is None:
    n = _check_int(num_ranks, "num_ranks", 1)
    if E % n:
      raise ValueError(f"num_ranks ({n}) must divide the number of experts ({E})")
    ranks = rows.reshape(len(rows), n, E // n).sum(-1)
  else:
    placements = _as_list(placement, len(rows), "placement")
    for pl in placements:
      if len(pl.num_replicas) != E:
        raise ValueError(f"placement is for {len(pl.num_replicas)} experts, load has {E}")
      if num_ranks is not None and num_ranks != pl.num_ranks:
        raise ValueError(f"num_ranks ({num_ranks}) differs from the placement's ({pl.num_ranks})")
    ranks = [(row[pl.phys_to_logical] / pl.num_replicas[pl.phys_to_logical])
             .reshape(pl.num_ranks, -1).sum(-1) for row, pl in zip(rows, placements)]
  total_mean = sum(float(np.mean(r)) for r in ranks)
  if total_mean == 0:
    return 0.0
  return (sum(float(np.max(r)) for r in ranks) - total_mean) / total_mean


# ---------------------------------------------------------------- applying

def _blocks(params) -> list:
  """(key, stacked mlp params) of every block group: each trunk segment
  ("layers", i), then the MTP modules' block ("mtp",) when present."""
  out = [(("layers", i), seg["mlp"]) for i, seg in enumerate(params["layers"])]
  if "mtp" in params:
    out.append((("mtp",), params["mtp"]["block"]["mlp"]))
  return out


def _with_mlp(params, key, mlp_p):
  """params with the block group `key`'s mlp replaced."""
  if key[0] == "mtp":
    block = dict(params["mtp"]["block"], mlp=mlp_p)
    return dict(params, mtp=dict(params["mtp"], block=block))
  layers = list(params["layers"])
  layers[key[1]] = dict(layers[key[1]], mlp=mlp_p)
  return dict(params, layers=tuple(layers))


def _moe_blocks(cfg: ModelConfig, params, with_mtp: bool) -> list:
  """(key, mlp, layers) of the MoE block groups, in EPLB row order: the
  trunk's MoE segments, then (with_mtp) the MTP modules' MoE block."""
  groups = {key: mlp_p for key, mlp_p in _blocks(params)}
  out = [(("layers", i), groups[("layers", i)], n)
         for i, (is_moe, _, n) in enumerate(cfg.segments()) if is_moe]
  if with_mtp and ("mtp",) in groups and mtp_lib.is_moe(cfg):
    out.append((("mtp",), groups[("mtp",)], cfg.num_mtp_layers))
  return out


def _is_placed(params) -> bool:
  return any("eplb_replicas" in mlp_p for _, mlp_p in _blocks(params))


def apply_placement(cfg: ModelConfig, params, placements):
  """Params -> params with each MoE layer's experts in its placement's slot
  order (w[phys_to_logical], E -> E + R) plus the slot tables.

  placements: one Placement for every MoE layer, or one per MoE layer in
  order (`plan_placement` of an [Lm, E] load), optionally followed by one
  per MTP module (an engine's load with speculation is [Lm + M, E]): the
  MTP modules' MoE block is placed too; without them it stays logical.
  cfg is unchanged.
  """
  if not cfg.is_moe:
    raise ValueError(f"apply_placement: cfg has no MoE layers (num_experts={cfg.num_experts})")
  if _is_placed(params):
    raise ValueError("apply_placement: params already carry a placement; apply to logical params")
  trunk = sum(n for _, _, n in _moe_blocks(cfg, params, with_mtp=False))
  everything = sum(n for _, _, n in _moe_blocks(cfg, params, with_mtp=True))
  if isinstance(placements, Placement):
    placements = [placements] * trunk
  placements = list(placements)
  with_mtp = len(placements) == everything > trunk
  placements = _as_list(placements, everything if with_mtp else trunk, "placements")
  for pl in placements:
    if len(pl.num_replicas) != cfg.num_experts:
      raise ValueError(f"placements: a placement is for {len(pl.num_replicas)} experts, "
                       f"cfg has {cfg.num_experts}")
    if pl.num_slots != placements[0].num_slots:
      raise ValueError("placements: every MoE layer needs the same slot count, got "
                       f"{sorted({p.num_slots for p in placements})}")
  max_r = max(pl.replicas.shape[1] for pl in placements)
  done = 0
  for key, mlp_p, count in _moe_blocks(cfg, params, with_mtp):
    params = _with_mlp(params, key, _place(mlp_p, placements[done:done + count], max_r))
    done += count
  return params


def _place(mlp_p, mine: list, max_r: int) -> dict:
  """One stacked block group's experts [L, E, ...] -> slots [L, S, ...] + tables."""
  count = len(mine)
  p2l = jnp.asarray(np.stack([pl.phys_to_logical for pl in mine]))  # [L, S]
  # Pad each layer's table to the max_r of all layers with its first replica.
  reps = np.stack([np.concatenate([pl.replicas, np.repeat(pl.replicas[:, :1],
                                   max_r - pl.replicas.shape[1], 1)], 1) for pl in mine])
  mlp_p = dict(mlp_p)
  for k in EXPERT_KEYS:
    if k in mlp_p:
      mlp_p[k] = mlp_p[k][jnp.arange(count)[:, None], p2l]  # [L, E, ...] -> [L, S, ...]
  mlp_p["eplb_replicas"] = jnp.asarray(reps, jnp.int32)
  mlp_p["eplb_num_replicas"] = jnp.asarray(np.stack([pl.num_replicas for pl in mine]), jnp.int32)
  return mlp_p


def placements_of(params, num_ranks: int) -> tuple[Placement, ...] | None:
  """The per-MoE-layer Placements stored in placed params (None if logical):
  the trunk's, then the MTP modules' when placed."""
  if not _is_placed(params):
    return None
  out = []
  for _, mlp_p in _blocks(params):
    if "eplb_replicas" not in mlp_p:
      continue
    reps = np.asarray(mlp_p["eplb_replicas"])
    nums = np.asarray(mlp_p["eplb_num_replicas"])
    slots = mlp_p["w_gate"].shape[1]
    for rep, num in zip(reps, nums):
      p2l = np.zeros(slots, np.int32)
      for e, (r, k) in enumerate(zip(rep, num)):
        p2l[r[:k]] = e
      out.append(Placement(p2l, rep.astype(np.int32), num.astype(np.int32), num_ranks))
  return tuple(out)


def remove_placement(params):
  """Placed params -> logical params (each expert from its first slot, the
  slot tables dropped); logical params are returned unchanged."""
  for key, mlp_p in _blocks(params):
    if "eplb_replicas" not in mlp_p:
      continue
    first = mlp_p["eplb_replicas"][:, :, 0]  # [L, E]
    L = first.shape[0]
    params = _with_mlp(params, key, {
        k: (v[jnp.arange(L)[:, None], first] if k in EXPERT_KEYS else v)
        for k, v in mlp_p.items() if k not in TABLE_KEYS})
  return params


def rebalance(cfg: ModelConfig, params, load, placements, *, num_ranks: int,
              num_redundant: int = 0, reshard=None):
  """A serving engine's EPLB step over the load it recorded (int [Lm, E]):
  plans a placement over num_ranks expert-parallel ranks, applies it to the
  params (placed or logical; outputs unchanged) and, when given, places them
  with reshard(params). placements: the params' current ones (None: the
  default contiguous split). -> (new params, new placements, report with the
  per-rank imbalance of the load before and after)."""
  if not np.asarray(load).any():
    raise ValueError("rebalance: no routed tokens recorded yet; serve some requests first")
  new = plan_placement(load, num_ranks, num_redundant)
  before = imbalance(load, placements, num_ranks=num_ranks)
  after = imbalance(load, new)
  params = apply_placement(cfg, remove_placement(params), new)
  if reshard is not None:
    params = reshard(params)
  return params, new, dict(imbalance_before=before, imbalance_after=after, num_ranks=num_ranks,
                           num_redundant=num_redundant)


def shard_placed_params(params, mesh: Mesh, axes):
  """Places placed params on `mesh`: routed expert weights [L, S, ...] split
  over `axes` on the slot dim (so rank r holds slots [r S/n, (r + 1) S/n),
  the placement's ranks when n equals its num_ranks); everything else,
  the slot tables included, replicated (the `dp_attn_ep` layout when axes
  are all of the mesh's). Models then run expert-parallel over `axes`."""
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  bad = [a for a in axes if a not in mesh.axis_names]
  if not axes or bad:
    raise ValueError(f"axes: {list(axes)} must be non-empty names of mesh axes {mesh.axis_names}")
  n = math.prod(mesh.shape[a] for a in axes)
  axis = axes[0] if len(axes) == 1 else axes
  replicated = NamedSharding(mesh, P())
  shardings = jax.tree.map(lambda _: replicated, params)
  for key, mlp_p in _blocks(params):
    if "router" not in mlp_p:
      continue
    mlp_s = dict(jax.tree.map(lambda _: replicated, mlp_p))
    for k in EXPERT_KEYS:
      if k in mlp_p:
        w = mlp_p[k]
        if w.shape[1] % n:
          raise ValueError(f"{k}: {w.shape[1]} slots are not divisible by axes {axes} "
                           f"(size {n})")
        mlp_s[k] = NamedSharding(mesh, P(None, axis, *([None] * (w.ndim - 2))))
    shardings = _with_mlp(shardings, key, mlp_s)
  return jax.device_put(params, shardings)
