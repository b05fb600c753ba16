"""Attention-data-parallel ranks as a dimension of every step.

A step's per-request inputs carry a leading rank axis [n, ...]: n = 1 on one
device and under the tensor-parallel layouts, n = the mesh's batch-axis size
under dp_attn_ep, where each rank owns whole requests, its own slice of the
page pool's pages and its own rows of the draft state. `per_rank` runs a
step's one-rank program on each rank: called directly for n = 1, in one
`shard_map` over the rank axes otherwise, where the weights stay as they are
placed (each rank sees its shards) and the routed experts stay expert-parallel
inside it (`moe_ep.InRankExpertParallel`: the ranks exchange tokens by
collectives, and their routing counts are summed over the ranks).

So the plain and the speculative steps are written once, for one rank; there
is no second, ranked form of either.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Ranks:
  """The attention-DP ranks of a step (jit-static: hashable).

  mesh, axes: the mesh and its batch axes the ranks run over.
  param_specs: (treedef, PartitionSpec per leaf) of the step's params as
  placed (`of`), the shard_map specs of the weights.
  """

  mesh: Mesh
  axes: tuple[str, ...]
  param_specs: tuple

  @classmethod
  def of(cls, params, mesh: Mesh, axes: tuple[str, ...]) -> "Ranks":
    """The ranks of `axes` for params placed on mesh."""
    leaves, treedef = jax.tree.flatten(params)
    specs = []
    for a in leaves:
      sh = getattr(a, "sharding", None)
      if not isinstance(sh, NamedSharding) or sh.mesh != mesh:
        raise ValueError(f"a step under attention DP: a parameter of shape {a.shape} is not "
                         f"placed on the engine's mesh ({sh})")
      specs.append(sh.spec)
    return cls(mesh, tuple(axes), (treedef, tuple(specs)))


def expert_parallel(ep, ranks: Ranks | None):
  """The experts' plan inside a step's one-rank program: ep as it is for one
  rank, its in-rank form (`ExpertParallel.in_rank`) under attention DP."""
  return ep if ranks is None or ep is None else ep.in_rank()


def per_rank(body, ranks: Ranks | None, params, pool, ranked, rows=None, load=None):
  """body(params, pool, ranked_one, rows, load) -> (out, pool, rows, load),
  one rank's program, run on every rank.

  ranked: a pytree of arrays with a leading rank axis [n, ...] (a step's
  batch, previous samples, targets...); body gets rank r's [...] and returns
  out, which comes back stacked [n, ...]. rows: arrays whose first axis is
  split into the ranks' contiguous blocks (the draft state [n * slots, ...]),
  passed to body as its block; None: none. load: the EPLB routing counts,
  the same on every rank (replicated; the in-rank experts sum them), or None.
  pool: the page pool, its pages split over the ranks.
  -> (out [n, ...], pool, rows, load)."""

  def one(params, pool, ranked, rows, load):
    out, pool, rows, load = body(params, pool, jax.tree.map(lambda a: a[0], ranked), rows, load)
    return jax.tree.map(lambda a: a[None], out), pool, rows, load

  if ranks is None:
    return one(params, pool, ranked, rows, load)
  treedef, leaves = ranks.param_specs
  rank = P(ranks.axes)
  pool_specs = pool.spec(pages=ranks.axes)
  return jax.shard_map(
      one, mesh=ranks.mesh,
      in_specs=(jax.tree.unflatten(treedef, leaves), pool_specs, rank, rank, P()),
      out_specs=(rank, pool_specs, rank, P()), check_vma=False,
  )(params, pool, ranked, rows, load)
