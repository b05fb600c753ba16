"""The one kernel dispatch. Model code calls these; it never branches on backend.

Only the pure-XLA implementations exist so far; the Pallas kernels plug in here
(selected per call with `implementation=`) when they land.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_IMPLEMENTATIONS = ("xla",)
_MASKED = -1e30


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
  # A large finite negative rather than -inf: a fully masked (padding) row
  # yields a harmless uniform row instead of NaN.
  scores = jnp.where(mask[:, None, None], scores, _MASKED)
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


def ragged_paged_attention(q, k_pages, v_pages, *, kv_lens, page_table, cu_q_lens, max_q,
                           window=0, sinks=None, scale, v_head_dim=None, layer=None,
                           implementation: str | None = None):
  """Attention for a token-flattened mixed batch over a paged KV cache.

  q [T, N, Hk]: the step's tokens, sequence b owning rows
  cu_q_lens[b]:cu_q_lens[b + 1] (its newest tokens, the last at position
  kv_lens[b] - 1). k_pages [K, P, page_size, Hk], v_pages [K, P, page_size, Hv];
  page_table [B, pages_per_seq]; max_q (static) >= every sequence's query count.
  v_pages None: the values are the first v_head_dim columns of the keys (MLA's
  latent, one pool for both). layer: pools carry a leading layer axis
  ([L, K, P, page_size, H]) and this layer's pages are read (gathered
  directly, never slicing the layer's whole pool). Rows past cu_q_lens[-1] are padding and return
  zeros. -> [T, N, Hv].
  """
  implementation = implementation or "xla"
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(f"ragged_paged_attention: implementation must be one of "
                     f"{_IMPLEMENTATIONS}, got {implementation!r}")
  if layer is None:
    k_pages = k_pages[None]
    v_pages = None if v_pages is None else v_pages[None]
    layer = 0
  return _ragged_paged_xla(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q,
                           window, sinks, scale, v_head_dim, layer)


def _ragged_paged_xla(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q, window,
                      sinks, scale, v_head_dim, layer):
  # Reference path: gather each sequence's pages into a contiguous [B, S]
  # view and lay the ragged queries out as [B, max_q]; then the dense kernel.
  T = q.shape[0]
  B, pages = page_table.shape
  _, K, _, page_size, _ = k_pages.shape

  def gather(pool):  # [L, K, P, ps, H] -> [B, pages * ps, K, H] of `layer`
    g = pool[layer, :, page_table]  # [B, pages, K, ps, H] (one gather)
    return g.transpose(0, 1, 3, 2, 4).reshape(B, pages * page_size, K, pool.shape[-1])

  t = jnp.arange(T, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, B - 1)
  row = t - cu_q_lens[seq]
  valid = t < cu_q_lens[-1]
  seq_w = jnp.where(valid, seq, B)  # out of bounds: dropped by the scatter
  q_pad = jnp.zeros((B, max_q, *q.shape[1:]), q.dtype).at[seq_w, row].set(q, mode="drop")
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  q_pos = (kv_lens - q_lens)[:, None] + jnp.arange(max_q, dtype=jnp.int32)[None]
  k = gather(k_pages)
  v = k[..., :v_head_dim] if v_pages is None else gather(v_pages)
  out = _attention_xla(q_pad, k, v, q_pos, kv_lens, window, sinks, scale)
  out = out[seq, jnp.minimum(row, max_q - 1)]
  return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)
