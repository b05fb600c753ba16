"""The one kernel dispatch. Model code calls these; it never branches on backend.

Each op takes `implementation`: "xla" (pure JAX, every backend), "pallas"
(`pallas_kernels`; compiled on GPU, interpret mode elsewhere), or None: Pallas
on GPU, XLA otherwise. Models pass `ModelConfig.attention_impl`.

  causal_attention        full causal self-attention (prefill without a cache)
  attention               queries at arbitrary positions over a padded KV range (XLA)
  ragged_paged_attention  an engine step's mixed batch over the page pool
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels.ragged_paged_attention import to_padded

_IMPLEMENTATIONS = ("xla", "pallas")
_MASKED = -1e30


def resolve(implementation: str | None) -> tuple[str, bool]:
  """-> (implementation, interpret): Pallas kernels are interpreted off GPU."""
  on_gpu = jax.default_backend() == "gpu"
  impl = implementation or ("pallas" if on_gpu else "xla")
  if impl not in _IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {_IMPLEMENTATIONS} or None, got {impl!r}")
  return impl, not on_gpu


def causal_attention(q, k, v, *, window=0, window_choices=(0,), sinks=None, scale,
                     implementation: str | None = None):
  """Causal self-attention: q [B, T, N, Hk], k [B, T, K, Hk], v [B, T, K, Hv].

  window may be traced (a scanned layer's); the Pallas kernel needs it static,
  so it then switches over `window_choices` (the model's distinct windows).
  """
  impl, interpret = resolve(implementation)
  if impl == "xla":
    B, T = q.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return _attention_xla(q, k, v, pos, jnp.full((B,), T, jnp.int32), window, sinks, scale)
  flash = lambda w: functools.partial(pallas_kernels.flash_attention, causal=True, sm_scale=scale,
                                      window=w, interpret=interpret)
  if isinstance(window, int):
    return flash(window)(q, k, v, sinks=sinks)
  if len(window_choices) == 1:
    return flash(window_choices[0])(q, k, v, sinks=sinks)
  index = jnp.argmax(jnp.asarray(window_choices, jnp.int32) == window)
  return jax.lax.switch(index, [lambda q, k, v, s, w=w: flash(w)(q, k, v, sinks=s)
                                for w in window_choices], q, k, v, sinks)


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
  if implementation not in (None, "xla"):
    raise ValueError(f"attention: only the 'xla' implementation exists, got {implementation!r}")
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
  impl, interpret = resolve(implementation)
  if impl == "pallas":
    return pallas_kernels.ragged_paged_attention(
        q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q=max_q, sm_scale=scale,
        window=window, sinks=sinks, v_head_dim=v_head_dim, layer=layer, interpret=interpret)
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
  B, pages = page_table.shape
  _, K, _, page_size, _ = k_pages.shape

  def gather(pool):  # [L, K, P, ps, H] -> [B, pages * ps, K, H] of `layer`
    g = pool[layer, :, page_table]  # [B, pages, K, ps, H] (one gather)
    return g.transpose(0, 1, 3, 2, 4).reshape(B, pages * page_size, K, pool.shape[-1])

  q_pad, seq, row, valid = to_padded(q, cu_q_lens, max_q)
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  q_pos = (kv_lens - q_lens)[:, None] + jnp.arange(max_q, dtype=jnp.int32)[None]
  k = gather(k_pages)
  v = k[..., :v_head_dim] if v_pages is None else gather(v_pages)
  out = _attention_xla(q_pad, k, v, q_pos, kv_lens, window, sinks, scale)
  out = out[seq, row]
  return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)
