"""MoE prefill on CPU: the routed experts of one `bench_moe` layer over a
prefill's tokens, in the variants XLA:CPU could run them, each checked
against the dense reference and timed in one run.

Variants (all exact up to float32 summation order):
  split C=<n>       the Engine's CPU path (`moe._experts_split`): token
                    copies sorted by expert (one argsort), each expert a
                    loop over chunks of C rows, gate and up fused in one dot
                    per chunk; C from the expected rows per expert (default)
                    or forced
  split (again)     the default compiled twice: the noise floor
  split unfused     the same with gate and up as two dots per chunk
  capacity <n>      each expert's first n rows as one static block outside
                    the loop (a capacity bucket), the loop only past it
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
from jaxinfer.models.layouts import DenseExperts, WeightForm


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _GateUp:
  """An expert's gate and up weights held apart: `x @ _GateUp` runs two dots."""
  gate: jax.Array
  up: jax.Array

  def __rmatmul__(self, x):
    return jnp.concatenate([x @ self.gate, x @ self.up], axis=-1)


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
  out = {f"split C={C} (default)": (fn(moe._experts_split), split),
         f"split C={C} (again)": (fn(moe._experts_split), split)}
  smaller = sorted({max(1, C // 4), max(1, C // 2)} - {C})
  for c in smaller + [2 * C]:
    out[f"split C={c}"] = (fn(moe._experts_split, chunk=c), split)
  out[f"split unfused C={C}"] = (fn(moe._experts_split), unfused)
  half = max(1, C // 2)
  for cap, c in ((C, C), (2 * C, C), (C, half)):
    out[f"capacity {cap}, then C={c}"] = (fn(moe._experts_split, chunk=c, capacity=cap), split)
  out["grouped (ragged_dot)"] = (fn(moe._experts_grouped), p)
  out["dense (reference)"] = (fn(moe._experts_dense), DenseExperts(p))
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
