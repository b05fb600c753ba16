"""MoE prefill on CPU: the routed experts of one `bench_moe` layer over a
prefill's tokens, in the variants XLA:CPU could run them, each checked
against the dense reference and timed in one run.

Variants (all exact up to float32 summation order):
  split C=<n>       the Engine's CPU path (`moe.experts_split`): token
                    copies sorted by expert (one argsort), one loop over
                    every chosen expert's chunks of C rows, the weights
                    picked by `lax.switch`, gate and up fused in one dot per
                    chunk; C from the expected rows per expert (default)
                    or forced
  split (again)     the default compiled twice: the noise floor
  split unfused     the same with gate and up as two dots per chunk
  looped C=<n>      the path until round 30 (`experts_looped`): a loop
                    per expert over its chunks
  capacity <n>      looped, each expert's first n rows as one static block
                    outside the loop (a capacity bucket), the loop only past it
  native            the C++ CPU kernel (`moe.experts_native`), where it builds
  grouped           the stacked layout's `lax.ragged_dot` (`moe_core.grouped_ffn`)
  dense             every expert on every token (E/k times the FLOPs): the reference

Routing (`moe_core.route`) runs once outside the timed programs; each
variant gets the same expert ids and weights.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import models, presets
from jaxinfer.models import moe, moe_core, transformer
from jaxinfer.models.layers import glu
from jaxinfer.models.layouts import DenseExperts, WeightForm
import native_kernels as cpu_kernels


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _GateUp:
  """An expert's gate and up weights held apart: `x @ _GateUp` runs two dots."""
  gate: jax.Array
  up: jax.Array

  def __rmatmul__(self, x):
    return jnp.concatenate([x @ self.gate, x @ self.up], axis=-1)


def experts_looped(cfg, p, x, idx, weights, chunk: int | None = None, capacity: int = 0):
  """The Engine's split-expert path until round 30: the same sorted
  copies, but a loop of its own per expert (64 x 7 loops of code in a
  bench_moe step). chunk (static) overrides C; capacity > 0 runs each
  expert's first `capacity` rows as one block outside the loop (a static
  capacity bucket: no loop trip for an expert that fits, padding rows for
  one with fewer), the loop only past it."""
  T, k = idx.shape
  D = x.shape[1]
  E = len(p.w_down)  # physical slots
  C = chunk or moe.split_chunk(T, k, E)
  order, sizes = moe.sorted_copies(idx, E)  # copy c belongs to token c // k
  starts = jnp.cumsum(sizes) - sizes
  pad = max(C, capacity)
  xs = jnp.concatenate([x[order // k], jnp.zeros((pad, D), x.dtype)])  # [T k + pad, D]
  ys = jnp.zeros((T * k + pad, p.w_down[0].shape[-1]), x.dtype)

  def block(e, first, n, ys):  # rows first .. first + n of expert e (static n)
    start = starts[e] + first
    xe = jax.lax.dynamic_slice_in_dim(xs, start, n)  # [n, D]
    gate, up = jnp.split(xe @ p.w_gate_up[e], 2, axis=-1)
    if cfg.expert_bias:
      gate, up = gate + p["b_gate"][e], up + p["b_up"][e]
    ye = glu(cfg, gate, up) @ p.w_down[e]
    if cfg.expert_bias:
      ye = ye + p["b_down"][e]
    mine = (first + jnp.arange(n) < sizes[e])[:, None]  # the tail belongs to later experts
    return jax.lax.dynamic_update_slice_in_dim(
        ys, jnp.where(mine, ye, jax.lax.dynamic_slice_in_dim(ys, start, n)), start, 0)

  for e in range(E):
    if capacity:
      ys = block(e, 0, capacity, ys)
    rest = jnp.maximum(sizes[e] - capacity, 0)
    ys = jax.lax.fori_loop(0, (rest + C - 1) // C,
                           lambda i, ys, e=e: block(e, capacity + i * C, C, ys), ys)
  return moe.combine_copies(ys, order, weights)




def layer(cfg, seed: int = 0):
  """-> (stacked params of the first MoE layer, its `SplitExperts` layout as
  the Engine builds it (`transformer.step_layout`), the same with gate and
  up apart)."""
  params = models.init_params(cfg, jax.random.key(seed))
  moe_seg = next(i for i, (is_moe, _, _) in enumerate(cfg.segments()) if is_moe)
  p = jax.tree.map(lambda w: w[0], params["layers"][moe_seg]["mlp"])
  split = transformer.step_layout(cfg, params, WeightForm(split_experts=True))["layers"][moe_seg][0]["mlp"]
  unfused = dataclasses.replace(split, w_gate_up=tuple(
      _GateUp(g, u) for g, u in zip(p["w_gate"], p["w_up"])))
  return p, split, unfused


def variants(cfg, p, split, unfused, tokens: int) -> dict:
  """name -> (jitted fn(params, x, idx, weights), its params). "(again)" is
  the default compiled a second time: the spread between the two is the
  run's noise floor."""
  k, E = cfg.num_experts_per_tok, cfg.num_experts
  C = moe.split_chunk(tokens, k, E)  # the Engine's chunk at this many tokens
  fn = lambda impl, **kw: jax.jit(lambda q, x, i, w: impl(cfg, q, x, i, w, **kw))
  out = {f"split C={C} (default)": (fn(moe.experts_split), split),
         f"split C={C} (again)": (fn(moe.experts_split), split)}
  smaller = sorted({max(1, C // 4), max(1, C // 2)} - {C})
  for c in smaller + [2 * C]:
    out[f"split C={c}"] = (fn(moe.experts_split, chunk=c), split)
  out[f"split unfused C={C}"] = (fn(moe.experts_split), unfused)
  out[f"looped C={C}"] = (fn(experts_looped), split)
  half = max(1, C // 2)
  for cap, c in ((C, C), (2 * C, C), (C, half)):
    out[f"capacity {cap}, then C={c}"] = (fn(experts_looped, chunk=c, capacity=cap), split)
  if cpu_kernels.available():  # the Engine's path where the C++ kernel builds
    out["native (C++ kernel)"] = (fn(moe.experts_native), split)
  out["grouped (ragged_dot)"] = (fn(moe.experts_grouped), p)
  out["dense (reference)"] = (fn(moe.experts_dense), DenseExperts(p))
  return out


def run(model: str = "bench_moe", tokens: int = 512, repeats: int = 5, seed: int = 0) -> list[dict]:
  """Each variant at `tokens` prefill tokens -> rows {variant, ms (median),
  min_ms, max_ms, vs_default (default ms / this), max_abs_err (vs dense)}.
  Variants interleave in each repeat, in a new random order each time (in
  a fixed order the variant after the dense reference's heavy call ran up
  to 1.4x slower), after one untimed call each."""
  cfg = presets.get(model)
  p, split, unfused = layer(cfg, seed)
  x = jax.random.normal(jax.random.key(seed + 1), (tokens, cfg.d_model), jnp.float32)
  idx, weights = jax.jit(lambda x: moe_core.route(cfg, p, x))(x)
  fns = variants(cfg, p, split, unfused, tokens)
  outs = {name: np.asarray(f(q, x, idx, weights)) for name, (f, q) in fns.items()}
  ref = outs["dense (reference)"]
  times = {name: [] for name in fns}
  rng = np.random.default_rng(seed)
  for _ in range(repeats):
    for name in rng.permutation(list(fns)):
      f, q = fns[name]
      t0 = time.perf_counter()
      jax.block_until_ready(f(q, x, idx, weights))
      times[name].append(time.perf_counter() - t0)
  default = statistics.median(next(v for n, v in times.items() if n.endswith("(default)")))
  return [dict(variant=name, ms=1e3 * statistics.median(t), min_ms=1e3 * min(t),
               max_ms=1e3 * max(t), vs_default=default / statistics.median(t),
               max_abs_err=float(np.max(np.abs(outs[name] - ref))),
               ref_max_abs=float(np.max(np.abs(ref))))
          for name, t in times.items()]
