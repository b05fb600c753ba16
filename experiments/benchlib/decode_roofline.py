"""The memory roofline of a decode step (`benchlib.decode`'s): this
machine's streaming read bandwidth now (`measure_bandwidth`) and the bytes
one step must read at least (`decode_bytes_per_step`: weights, the routed
experts a batch touches, `expected_experts`, and the KV cache). tokens/s <=
batch * bandwidth / bytes per step.
"""

from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import models
from jaxinfer.config import ModelConfig
from jaxinfer.models.specs import is_spec


def _median_rate(fn, nbytes: float, repeats: int) -> float:
  fn()  # compile / first touch
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return nbytes / statistics.median(times) / 1e9


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 9) -> dict:
  """Streaming read bandwidth of this machine now -> {gbps, numpy_copy_gbps,
  nbytes, repeats}. `gbps` (the roofline's) is a jitted `jnp.sum` over a
  float32 array of nbytes: one read of every byte, the access pattern of a
  decode step's weights. The numpy copy (read + write bytes counted) is for
  reference. (numpy's `sum` is not: its pairwise float32 summation is
  compute bound here, well under the read bandwidth.)"""
  n = nbytes // 4
  x = jnp.ones((n,), jnp.float32)
  total = jax.jit(jnp.sum)
  gbps = _median_rate(lambda: total(x).block_until_ready(), 4 * n, repeats)
  del x
  a = np.ones(n, np.float32)
  b = np.empty_like(a)
  copy = _median_rate(lambda: np.copyto(b, a), 8 * n, repeats)
  return dict(gbps=gbps, numpy_copy_gbps=copy, nbytes=4 * n, repeats=repeats)


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
  """Distinct experts `tokens` tokens route to on average, each picking top_k
  of E uniformly: E * (1 - (1 - k/E)^tokens)."""
  return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def decode_bytes_per_step(cfg: ModelConfig, batch: int, context_len: int,
                          weight_dtype_bytes: int = 4, kv_dtype_bytes: int | None = None) -> dict:
  """Bytes one decode step of `batch` sequences, each attending to
  `context_len` cached tokens, must read -> {embed, weights, experts, kv, total}.

  From `models.param_specs` shapes: every weight is read once per step except
  the embedding table (batch rows gathered; the whole table once more if tied,
  as the output head) and the routed experts (a leaf with an `expert` axis
  counts E(1 - (1 - k/E)^batch) of its E slices). MTP modules are left out:
  plain decoding does not run them. KV: `cfg.cache_entry_shapes()` per token and
  layer (MLA: the latent + rope key), over min(context, window) tokens."""
  wb = weight_dtype_bytes
  kvb = wb if kv_dtype_bytes is None else kv_dtype_bytes
  specs = models.param_specs(cfg)
  touched = (expected_experts(cfg.num_experts, cfg.num_experts_per_tok, batch)
             if cfg.is_moe else 0.0)
  V, D = specs["embed"].shape
  out = dict(embed=float(batch * D * wb), weights=float(V * D * wb if cfg.tie_embeddings else 0),
             experts=0.0, kv=0.0)
  for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
    top = path[0].key
    if top in ("embed", "mtp"):
      continue
    # A quantized weight's values and scales are read at their storage size.
    quantized = any(isinstance(k, jax.tree_util.GetAttrKey) for k in path)
    n = math.prod(spec.shape) * (jnp.dtype(spec.dtype).itemsize if quantized else wb)
    if "expert" in spec.logical_axes:
      out["experts"] += n / spec.shape[spec.logical_axes.index("expert")] * touched
    else:
      out["weights"] += n
  per_token_layer = sum(math.prod(e) for e in cfg.cache_entry_shapes().values()) * kvb
  tokens = sum(min(context_len, cfg.layer_window(i) or context_len)
               for i in range(cfg.num_layers))
  out["kv"] = float(batch * tokens * per_token_layer)
  out["total"] = out["embed"] + out["weights"] + out["experts"] + out["kv"]
  return out
