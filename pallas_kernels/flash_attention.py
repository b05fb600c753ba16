"""Flash attention for prefill: causal / sliding-window / sinks / packed segments, GQA.

Shapes use the project alphabet: B batch, T query tokens, S key tokens, N query
heads, K kv heads (G = N // K query heads share one), H head dim (Hqk for q/k,
Hv for v). Queries are aligned to the END of the keys: query t sits at key
position p = S - T + t (the prefill-with-cache convention). Key j is visible to
the query at p iff j < S, (not causal or j <= p), (window == 0 or p - j < window)
and, with segment ids, q_seg[t] == kv_seg[j]. Sinks (GPT-OSS) are one learned
logit per head that joins the softmax denominator but carries no value:

  out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink - m)).

The kernel runs the online softmax of FlashAttention-2 (arXiv:2307.08691, alg. 1)
in float32 with one program per (batch, query head, query block) and a loop over
key blocks; the sink is folded in as the initial state (m = sink, l = 1, acc = 0),
i.e. a virtual key with logit `sink` and a zero value.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Finite stand-in for -inf: exp(_MASKED - m) underflows to 0 for any real logit m,
# and unlike -inf it never produces (-inf) - (-inf) = NaN in the rescaling.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
  """Tile sizes: block_q query rows per program, block_k keys per loop step.

  Powers of two >= 16 (Triton tiles must be powers of two; 16 is the smallest
  tensor-core dot). 64/64 keeps a [64, 192] q tile plus k/v tiles well inside
  shared memory for every head dim used here (64, 72->128, 128, 192->256).
  """
  block_q: int = 64
  block_k: int = 64

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      b = getattr(self, name)
      if not isinstance(b, int) or isinstance(b, bool) or b < 16 or b & (b - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {b!r}")

  def fit(self, T: int, S: int) -> "BlockSizes":
    """Shrinks blocks for short sequences (never below 16) to avoid padding waste."""
    return BlockSizes(block_q=min(self.block_q, max(16, pl.next_power_of_2(T))),
                      block_k=min(self.block_k, max(16, pl.next_power_of_2(S))))


def _flash_kernel(*refs, sm_scale, causal, window, T, S, block_q, block_k, has_sinks,
                  has_segments):
  # q_ref     [block_q, Hqk]   this program's query rows of one head
  # k_ref     [S_pad, Hqk]     all keys of the head's KV head (sliced per loop step)
  # v_ref     [S_pad, Hv]
  # sinks_ref [block_q]        the head's sink logit broadcast over rows (if has_sinks)
  # qseg_ref  [block_q]        int32 query segment ids (if has_segments)
  # kvseg_ref [S_pad]          int32 key segment ids (if has_segments)
  # o_ref     [block_q, Hv]
  q_ref, k_ref, v_ref, *rest = refs
  sinks_ref = rest.pop(0) if has_sinks else None
  qseg_ref, kvseg_ref = (rest.pop(0), rest.pop(0)) if has_segments else (None, None)
  (o_ref,) = rest

  i = pl.program_id(2)
  q = q_ref[...]
  hv = o_ref.shape[-1]
  num_kb = k_ref.shape[0] // block_k
  q_start = (S - T) + i * block_q  # key position of this block's first query row
  q_pos = q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
  q_seg = qseg_ref[...] if has_segments else None
  # A mask is needed only where some (row, key) pair can be invisible.
  needs_mask = causal or window > 0 or has_segments or S % block_k != 0

  # float32 inputs get float32 dots (Triton's default for them is TF32); bf16 stays bf16.
  exact = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

  def body(kb, carry):
    acc, m_prev, l_prev = carry
    k_slice = pl.ds(kb * block_k, block_k)
    k = k_ref[k_slice, :]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                        precision=exact) * sm_scale  # [block_q, block_k]
    if needs_mask:
      k_pos = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
      mask = k_pos < S
      if causal:
        mask &= k_pos <= q_pos
      if window > 0:
        mask &= q_pos - k_pos < window
      if has_segments:
        mask &= q_seg[:, None] == kvseg_ref[k_slice][None, :]
      s = jnp.where(mask, s, _MASKED)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    p = jnp.exp(s - m_next[:, None])
    if needs_mask:
      # While every key so far is masked m_next == _MASKED and exp(0) == 1: zero it.
      p = jnp.where(mask, p, 0.0)
    alpha = jnp.exp(m_prev - m_next)
    l_next = alpha * l_prev + jnp.sum(p, axis=1)
    v = v_ref[k_slice, :]
    acc = alpha[:, None] * acc + lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
        precision=exact)
    return acc, m_next, l_next

  # Key blocks that no row of this query block can see are never visited: under
  # causal the last visible key is the last row's position, under a window the
  # first visible key is (first row's position - window + 1).
  kb_lo, kb_hi = 0, num_kb
  if causal:
    kb_hi = jnp.minimum(num_kb, lax.div(q_start + block_q + block_k - 1, block_k))
  if window > 0:
    kb_lo = lax.div(jnp.maximum(q_start - window + 1, 0), block_k)

  if has_sinks:
    m0 = sinks_ref[...].astype(jnp.float32)
    l0 = jnp.ones((block_q,), jnp.float32)
  else:
    m0 = jnp.full((block_q,), _MASKED, jnp.float32)
    l0 = jnp.zeros((block_q,), jnp.float32)
  acc0 = jnp.zeros((block_q, hv), jnp.float32)
  acc, _, l = lax.fori_loop(kb_lo, kb_hi, body, (acc0, m0, l0))
  # l == 0 only for a row with no visible key (and no sink); acc is 0 there too.
  l = jnp.where(l > 0.0, l, 1.0)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def _check_inputs(q, k, v, causal, sm_scale, window, sinks, segment_ids):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"{name} must be rank 4 ([B, T|S, N|K, H]), got shape "
                       f"{getattr(x, 'shape', None)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
  if q.dtype != k.dtype:
    raise TypeError(f"q and k must share a dtype, got q {q.dtype} and k {k.dtype}")
  B, T, N, H = q.shape
  _, S, K, _ = k.shape
  if min(B, T, N, H) < 1 or min(S, K) < 1 or v.shape[-1] < 1:
    raise ValueError(f"q, k, v dimensions must be >= 1, got q {q.shape}, k {k.shape}, "
                     f"v {v.shape}")
  if k.shape[0] != B or v.shape[0] != B:
    raise ValueError(f"batch B must agree: q {q.shape}, k {k.shape}, v {v.shape}")
  if k.shape[3] != H:
    raise ValueError(f"k head dim must equal q head dim {H}, got k {k.shape}")
  if v.shape[1:3] != (S, K):
    raise ValueError(f"v must be [B, S={S}, K={K}, Hv], got {v.shape}")
  if N % K:
    raise ValueError(f"q heads N={N} must be a multiple of kv heads K={K} (k/v dim 2)")
  if causal and T > S:
    raise ValueError(f"causal needs q length T <= k length S, got T={T}, S={S}")
  if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 0:
    raise ValueError(f"window must be an int >= 0 (0 = no window), got {window!r}")
  if sm_scale is not None and not (isinstance(sm_scale, numbers.Real)
                                   and not isinstance(sm_scale, bool)
                                   and math.isfinite(sm_scale) and sm_scale > 0):
    raise ValueError(f"sm_scale must be a finite float > 0 or None, got {sm_scale!r}")
  if sinks is not None:
    if getattr(sinks, "shape", None) != (N,):
      raise ValueError(f"sinks must have shape [N]=({N},), got {getattr(sinks, 'shape', None)}")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
      raise TypeError(f"sinks must have a floating dtype, got {sinks.dtype}")
  if segment_ids is not None:
    if not isinstance(segment_ids, (tuple, list)) or len(segment_ids) != 2:
      raise ValueError("segment_ids must be a pair (q_segment_ids [B, T], "
                       "kv_segment_ids [B, S])")
    for name, ids, want in (("q_segment_ids", segment_ids[0], (B, T)),
                            ("kv_segment_ids", segment_ids[1], (B, S))):
      if getattr(ids, "shape", None) != want:
        raise ValueError(f"segment_ids: {name} must have shape {want}, got "
                         f"{getattr(ids, 'shape', None)}")
      if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"segment_ids: {name} must be an integer dtype, got {ids.dtype}")


def flash_attention(q, k, v, *, causal=True, sm_scale=None, window=0, sinks=None,
                    segment_ids=None, block_q=None, block_k=None, interpret=False):
  """Prefill attention. q [B, T, N, Hqk]; k [B, S, K, Hqk]; v [B, S, K, Hv] -> [B, T, N, Hv].

  N % K == 0 (GQA: query head n reads KV head n // (N // K); K/V are never
  repeated). causal needs T <= S; queries sit at key positions S - T + t.
  window > 0: key j visible to position p iff p - j < window (and j <= p when
  causal). sinks [N]: per-head logit in the softmax denominator only.
  segment_ids: (q_segment_ids [B, T], kv_segment_ids [B, S]) integer; attend
  only within equal ids. sm_scale defaults to 1/sqrt(Hqk). block_q/block_k:
  powers of two >= 16 (default 64, shrunk for short sequences). Rows with no
  visible key return 0. Output dtype is q.dtype.
  """
  _check_inputs(q, k, v, causal, sm_scale, window, sinks, segment_ids)
  default = BlockSizes()
  blocks = BlockSizes(block_q=default.block_q if block_q is None else block_q,
                      block_k=default.block_k if block_k is None else block_k)
  B, T, N, H = q.shape
  sm_scale = 1.0 / math.sqrt(H) if sm_scale is None else float(sm_scale)
  if segment_ids is not None:
    segment_ids = tuple(jnp.asarray(s, jnp.int32) for s in segment_ids)
  return _flash_attention(q, k, v, sinks, segment_ids, causal=causal,
                          sm_scale=sm_scale, window=int(window), blocks=blocks.fit(T, k.shape[1]),
                          interpret=interpret)


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "window", "blocks",
                                             "interpret"))
def _flash_attention(q, k, v, sinks, segment_ids, *, causal, sm_scale, window,
                     blocks, interpret):
  B, T, N, H = q.shape
  _, S, K, Hv = v.shape
  G = N // K
  bq, bk = blocks.block_q, blocks.block_k
  T_pad, S_pad = pl.cdiv(T, bq) * bq, pl.cdiv(S, bk) * bk
  # Triton tiles must have power-of-two sizes: on GPU, zero-pad the head dims
  # (zero q/k columns leave q.k unchanged; zero v columns are sliced off).
  # Interpret mode takes any head dim, so it runs the unpadded shapes.
  H_pad = H if interpret else pl.next_power_of_2(H)
  Hv_pad = Hv if interpret else pl.next_power_of_2(Hv)

  def pad(x, *widths):
    widths = [(0, w) for w in widths]
    return jnp.pad(x, widths) if any(w for _, w in widths) else x

  q = pad(q, 0, T_pad - T, 0, H_pad - H)
  k = pad(k, 0, S_pad - S, 0, H_pad - H)
  v = pad(v, 0, S_pad - S, 0, Hv_pad - Hv)

  # Grid (B, N, T_pad // bq); the KV head of query head n is n // G.
  inputs = [q, k, v]
  in_specs = [
      pl.BlockSpec((None, bq, None, H_pad), lambda b, n, i: (b, i, n, 0)),
      pl.BlockSpec((None, S_pad, None, H_pad), lambda b, n, i: (b, 0, n // G, 0)),
      pl.BlockSpec((None, S_pad, None, Hv_pad), lambda b, n, i: (b, 0, n // G, 0)),
  ]
  if sinks is not None:
    # Broadcast to a [N, bq] row so the kernel loads a power-of-two tile, not a scalar.
    inputs.append(jnp.broadcast_to(sinks.astype(jnp.float32)[:, None], (N, bq)))
    in_specs.append(pl.BlockSpec((None, bq), lambda b, n, i: (n, 0)))
  if segment_ids is not None:
    inputs += [pad(segment_ids[0], 0, T_pad - T), pad(segment_ids[1], 0, S_pad - S)]
    in_specs += [pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
                 pl.BlockSpec((None, S_pad), lambda b, n, i: (b, 0))]
  out_spec = pl.BlockSpec((None, bq, None, Hv_pad), lambda b, n, i: (b, i, n, 0))

  kernel = functools.partial(
      _flash_kernel, sm_scale=sm_scale, causal=causal, window=window, T=T, S=S,
      block_q=bq, block_k=bk, has_sinks=sinks is not None,
      has_segments=segment_ids is not None)
  out = pl.pallas_call(
      kernel,
      grid=(B, N, T_pad // bq),
      in_specs=in_specs,
      out_specs=out_spec,
      out_shape=jax.ShapeDtypeStruct((B, T_pad, N, Hv_pad), q.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4 if H_pad <= 64 else 8, num_stages=2),
      interpret=interpret,
      name="flash_attention",
  )(*inputs)
  return out[:, :T, :, :Hv]


def flash_attention_reference(q, k, v, *, causal=True, sm_scale=None, window=0, sinks=None,
                              segment_ids=None):
  """Dense float32 attention with `flash_attention`'s semantics (same checks, shape, dtype)."""
  _check_inputs(q, k, v, causal, sm_scale, window, sinks, segment_ids)
  B, T, N, H = q.shape
  _, S, K, Hv = v.shape
  G = N // K
  sm_scale = 1.0 / math.sqrt(H) if sm_scale is None else float(sm_scale)
  qg = q.astype(jnp.float32).reshape(B, T, K, G, H)
  s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k.astype(jnp.float32),
                 precision=lax.Precision.HIGHEST) * sm_scale
  q_pos = (S - T + jnp.arange(T))[:, None]  # [T, 1]
  k_pos = jnp.arange(S)[None, :]  # [1, S]
  mask = jnp.ones((B, T, S), bool)
  if causal:
    mask &= k_pos <= q_pos
  if window > 0:
    mask &= q_pos - k_pos < window
  if segment_ids is not None:
    mask &= segment_ids[0][:, :, None] == segment_ids[1][:, None, :]
  mask = mask[:, None, None]  # [B, 1, 1, T, S]
  m = jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True)
  if sinks is not None:
    sink = sinks.astype(jnp.float32).reshape(1, K, G, 1, 1)
    m = jnp.maximum(m, sink)
  m = jnp.where(jnp.isfinite(m), m, 0.0)  # rows with nothing visible and no sink
  e = jnp.where(mask, jnp.exp(s - m), 0.0)
  denom = jnp.sum(e, axis=-1, keepdims=True)
  if sinks is not None:
    denom = denom + jnp.exp(sink - m)
  probs = e / jnp.where(denom > 0, denom, 1.0)
  out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)
  return out.reshape(B, T, N, Hv).astype(q.dtype)
