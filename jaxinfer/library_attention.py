"""Attention from a kernel library, as `Backend.dense_attention` picks it:
`jax.nn.dot_product_attention` ("cudnn": its cuDNN flash kernel; "jax_nn":
its XLA form, which runs anywhere and checks this module's argument
mapping on a CPU) or `tokamax.dot_product_attention` ("tokamax": the first
of its Mosaic GPU, Triton and XLA kernels that takes the case on the
device; its XLA form on a CPU).

  unfit         why the library does not take a case (None: it does)
  dense         causal or unmasked attention over [B, T] rows
  fresh_packed  an Engine step's fresh prompt chunks (token-flattened, each
                from position 0, over its own keys), padded per sequence
                for the library and flattened back

`ops` calls these where the Backend asks and `unfit` finds nothing; our own
kernels run otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer import backend as backend_lib
from pallas_kernels.paged_attention import to_padded

CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 256


def unfit(impl: str, q_shape, v_dim: int, dtype, *, sinks=None, window=0,
          on_gpu: bool = True) -> str | None:
  """Why `impl` ("cudnn" / "jax_nn") cannot run attention of q [..., N, H]
  with values of v_dim, or None. sinks: the model's per-head sink logits
  (no library takes them); window: a traced one (scanned layers of several
  windows) cannot be the library's static window."""
  if sinks is not None:
    return "attention sinks (no library kernel takes them)"
  if not isinstance(window, int):
    return "a traced window (scanned layers of several windows)"
  if impl == "cudnn":
    head = q_shape[-1]
    if not on_gpu:
      return "cuDNN runs on GPUs only"
    if jnp.dtype(dtype).name not in CUDNN_DTYPES:
      return f"cuDNN takes {' / '.join(CUDNN_DTYPES)}, not {jnp.dtype(dtype).name}"
    if head != v_dim or head > CUDNN_MAX_HEAD_DIM or head % 8:
      return (f"cuDNN takes equal q / k and v head dims, multiples of 8 up to "
              f"{CUDNN_MAX_HEAD_DIM} (here {head} and {v_dim})")
  return None


def dense(q, k, v, *, causal: bool, scale: float, impl: str, window: int = 0, q_lens=None,
          kv_lens=None):
  """q [B, T, N, Hk], k [B, S, K, Hk], v [B, S, K, Hv] (N % K == 0) ->
  [B, T, N, Hv] in q's dtype. causal: query t sees keys <= t (T == S);
  window (> 0): and only the last `window` of them (HF's rule: t - j <
  window). q_lens / kv_lens [B]: each row's real queries and keys (None:
  all); rows past them are padding (values unspecified: tokamax's are not
  zero)."""
  local = (window - 1, 0) if window else None  # (left, right) keys, as both libraries take it
  if impl == "tokamax":
    return backend_lib.tokamax().dot_product_attention(
        q, k, v, scale=scale, is_causal=causal, query_seq_lengths=q_lens,
        key_value_seq_lengths=kv_lens, local_window_size=local).astype(q.dtype)
  return jax.nn.dot_product_attention(
      q, k, v, scale=scale, is_causal=causal, query_seq_lengths=q_lens,
      key_value_seq_lengths=kv_lens, local_window_size=local,
      implementation="cudnn" if impl == "cudnn" else "xla").astype(q.dtype)


def fresh_packed(q, k, v, cu_q_lens, max_q: int, *, scale: float, impl: str, window: int = 0):
  """A step of fresh chunks, token-flattened: q [T, N, Hk], k [T, K, Hk],
  v [T, K, Hv] (the step's own keys and values), sequence b's tokens
  cu_q_lens[b]:cu_q_lens[b + 1] at positions 0, 1, ... (at most max_q of
  them) -> [T, N, Hv], padding rows zeros. Each chunk attends causally
  over its own keys, padded to [B, max_q] for the library."""
  q_pad, seq, row, valid = to_padded(q, cu_q_lens, max_q)
  k_pad, v_pad = to_padded(k, cu_q_lens, max_q)[0], to_padded(v, cu_q_lens, max_q)[0]
  lens = (cu_q_lens[1:] - cu_q_lens[:-1]).astype(jnp.int32)
  out = dense(q_pad, k_pad, v_pad, causal=True, scale=scale, impl=impl, window=window,
              q_lens=lens, kv_lens=lens)
  return jnp.where(valid[:, None, None], out[seq, row], 0).astype(q.dtype)

