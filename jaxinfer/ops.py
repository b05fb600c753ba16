"""The one kernel dispatch. Model code calls these; it never branches on backend.

Only the pure-XLA implementations exist so far; the Pallas kernels plug in here
(selected per call with `implementation=`) when they land.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_IMPLEMENTATIONS = ("xla",)


def attention(q, k, v, *, q_positions, kv_lengths, window=0, sinks=None, scale,
              implementation: str | None = None):
  """Causal grouped-query attention over a (possibly padded) key range.

  q [B, T, N, Hk]; k [B, S, K, Hk]; v [B, S, K, Hv]; N % K == 0.
  q_positions [B, T] int32: absolute position of each query; key j sits at
  position j. Key j is visible to query t iff j < kv_lengths[b],
  j <= q_positions[b, t] and (window == 0 or q_positions - j < window)
  (HF's sliding-window rule). `window` may be a traced scalar (scanned layers).
  sinks [N] or None: a learned logit per head in the softmax denominator
  (GPT-OSS). Returns [B, T, N, Hv] in q's dtype; softmax runs in float32.
  """
  implementation = implementation or "xla"
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(f"attention: implementation must be one of {_IMPLEMENTATIONS}, got {implementation!r}")
  return _attention_xla(q, k, v, q_positions, kv_lengths, window, sinks, scale)


def _attention_xla(q, k, v, q_positions, kv_lengths, window, sinks, scale):
  B, T, N, _ = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  qg = q.reshape(B, T, K, G, q.shape[-1])
  # Grouped heads attend to their shared KV head without repeating K/V.
  scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32)
  scores = scores * scale
  kpos = jnp.arange(S, dtype=jnp.int32)
  qpos = q_positions[:, :, None]  # [B, T, 1]
  mask = (kpos[None, None, :] <= qpos) & (kpos[None, None, :] < kv_lengths[:, None, None])
  window = jnp.asarray(window, jnp.int32)
  mask &= (window == 0) | (qpos - kpos[None, None, :] < window)
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  if sinks is None:
    probs = jax.nn.softmax(scores, axis=-1)
  else:
    # Softmax over [scores, sink]; the sink column takes mass but has no value.
    sink = sinks.astype(jnp.float32).reshape(1, K, G, 1, 1)
    m = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
    e = jnp.exp(scores - m)
    probs = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - m))
  out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.reshape(B, T, N, v.shape[-1]).astype(q.dtype)
