"""HSTU attention over packed jagged sequences (DLRMv3's trunk; Zhai et al. 2024).

Tokens of many users are packed on one axis T (no padding to the longest
user). Shapes use the project alphabet: T packed tokens, N heads, A q/k head
dim, H value head dim. Per head, with s_ij = alpha q_i . k_j + rab(i, j):

  out_i = sum_j mask(i, j) SiLU(s_ij) / n * v_j          (pointwise, no softmax)
  rab(i, j) = pos_bias[clip(p_i - p_j, 0, P - 1)] + time_bias[bucket(t_i - t_j)]
  bucket(dt) = clip(floor(ln(max(|dt|, 1)) / 0.301), 0, len(time_bias) - 1)
  mask(i, j) = seg_i == seg_j and (p_i > p_j or i == j)

seg: the user of each token (padding tokens: any id no real token has, e.g.
-1 - index); p: positions inside the user, clamped at the first candidate for
target-aware masking (candidates see the history and themselves only); t:
timestamps. Visible keys never come after their query (p_i > p_j implies
j < i for the positions the model makes), so the kernel visits, for a block
of queries, only the key blocks from the first token of its first row's user
to the block itself: the work is sum over users of len^2, not T^2.

The kernel: one program per (head, query block), a loop over those key
blocks, the biases gathered from the two small tables in-kernel, float32
accumulation. Nothing is rescaled: SiLU attention has no normaliser.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.flash_attention import BlockSizes  # the same Triton tile rules

_LOG_BUCKET = 0.301
_LANES = 16  # a per-block scalar travels as a [16] row (Triton loads power-of-two tiles)


def _silu(x):
  return x / (1.0 + jnp.exp(-x))


def _bias(pos_bias, time_bias, dp, dt, gather, num_pos, num_time):
  """rab for position differences dp and time differences dt (same shapes); the
  tables' real sizes are num_pos and num_time (the kernel's are padded)."""
  P, Bt = num_pos, num_time
  rel = jnp.clip(dp, 0, P - 1)
  d = jnp.maximum(jnp.abs(dt.astype(jnp.float32)), 1.0)
  tb = jnp.clip(jnp.floor(jnp.log(d) / _LOG_BUCKET), 0, Bt - 1).astype(jnp.int32)
  return gather(pos_bias, rel) + gather(time_bias, tb)


def _hstu_kernel(q_ref, k_ref, v_ref, segq_ref, posq_ref, tsq_ref, segk_ref, posk_ref, tsk_ref,
                 kblo_ref, pos_bias_ref, time_bias_ref, o_ref, *, alpha, inv_n, block_q,
                 block_k, num_pos, num_time):
  # q_ref [block_q, A]; k_ref [T_pad, A]; v_ref [T_pad, H]   (one head)
  # segq/posq/tsq_ref [block_q] int32; segk/posk/tsk_ref [T_pad] int32
  # kblo_ref [16] int32: this block's first key block, repeated
  # pos_bias_ref [P_pad], time_bias_ref [Bt_pad] float32; o_ref [block_q, H]
  i = pl.program_id(1)
  q = q_ref[...]
  exact = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  seg_q, pos_q, ts_q = segq_ref[...], posq_ref[...], tsq_ref[...]
  q_idx = i * block_q + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)

  def gather(ref, idx):
    return ref[idx]  # a gather from the small bias table

  def body(kb, acc):
    ks = pl.ds(kb * block_k, block_k)
    s = lax.dot_general(q, k_ref[ks, :], (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32, precision=exact) * alpha
    seg_k, pos_k = segk_ref[ks], posk_ref[ks]
    dp = pos_q[:, None] - pos_k[None, :]
    bias = _bias(pos_bias_ref, time_bias_ref, dp, ts_q[:, None] - tsk_ref[ks][None, :], gather,
                 num_pos, num_time)
    k_idx = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
    mask = (seg_q[:, None] == seg_k[None, :]) & ((dp > 0) | (q_idx == k_idx))
    a = jnp.where(mask, _silu(s + bias) * inv_n, 0.0)
    v = v_ref[ks, :]
    return acc + lax.dot_general(a.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32, precision=exact)

  kb_lo = jnp.min(kblo_ref[...])
  kb_hi = lax.div((i + 1) * block_q + block_k - 1, block_k)
  acc = lax.fori_loop(kb_lo, kb_hi, body, jnp.zeros(o_ref.shape, jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _check(q, k, v, segment_ids, positions, timestamps, pos_bias, time_bias, alpha, n):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 3:
      raise ValueError(f"{name} must be rank 3 ([T, N, A|H]), got shape "
                       f"{getattr(x, 'shape', None)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
  T, N, A = q.shape
  if k.shape != (T, N, A) or v.shape[:2] != (T, N):
    raise ValueError(f"k must be [T, N, A]={q.shape} and v [T, N, H], got k {k.shape}, v {v.shape}")
  if q.dtype != k.dtype or q.dtype != v.dtype:
    raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  for name, x in (("segment_ids", segment_ids), ("positions", positions),
                  ("timestamps", timestamps)):
    if getattr(x, "shape", None) != (T,):
      raise ValueError(f"{name} must have shape [T]=({T},), got {getattr(x, 'shape', None)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"{name} must be an integer array, got {x.dtype}")
  for name, x in (("pos_bias", pos_bias), ("time_bias", time_bias)):
    if getattr(x, "ndim", None) != 1 or x.shape[0] < 1:
      raise ValueError(f"{name} must be a non-empty rank-1 table, got {getattr(x, 'shape', None)}")
  for name, x in (("alpha", alpha), ("n", n)):
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or x <= 0:
      raise ValueError(f"{name} must be a finite number > 0, got {x!r}")


def hstu_attention(q, k, v, *, segment_ids, positions, timestamps, pos_bias, time_bias, alpha,
                   n, block_q=None, block_k=None, interpret=False):
  """Jagged HSTU attention (module docstring). q/k [T, N, A], v [T, N, H];
  segment_ids / positions / timestamps [T] int; pos_bias [P], time_bias [Bt]
  float -> [T, N, H] in q.dtype. Each user's tokens are one contiguous run of
  equal segment ids, and keys precede or equal their visible queries in token
  order (true of packed users with target-aware positions)."""
  _check(q, k, v, segment_ids, positions, timestamps, pos_bias, time_bias, alpha, n)
  default = BlockSizes()
  blocks = BlockSizes(block_q=default.block_q if block_q is None else block_q,
                      block_k=default.block_k if block_k is None else block_k)
  T = q.shape[0]
  blocks = blocks.fit(T, T)  # shorter blocks for short batches, never below 16
  ints = [jnp.asarray(x, jnp.int32) for x in (segment_ids, positions, timestamps)]
  return _hstu_attention(q, k, v, *ints, pos_bias.astype(jnp.float32),
                         time_bias.astype(jnp.float32), alpha=float(alpha), n=float(n),
                         blocks=blocks, interpret=interpret)


def _first_key_blocks(seg, T_pad, bq, bk):
  """[T_pad // bq, 16]: per query block, the key block of its first row's user's first token."""
  t = jnp.arange(seg.shape[0], dtype=jnp.int32)
  is_start = jnp.concatenate([jnp.ones((1,), bool), seg[1:] != seg[:-1]])
  start = lax.cummax(jnp.where(is_start, t, 0))
  lo = start[::bq] // bk
  return jnp.broadcast_to(lo[:, None], (T_pad // bq, _LANES))


@functools.partial(jax.jit, static_argnames=("alpha", "n", "blocks", "interpret"))
def _hstu_attention(q, k, v, seg, pos, ts, pos_bias, time_bias, *, alpha, n, blocks, interpret):
  T, N, A = q.shape
  H = v.shape[-1]
  bq, bk = blocks.block_q, blocks.block_k
  T_pad = pl.cdiv(T, max(bq, bk)) * max(bq, bk)
  # Triton tiles are powers of two: zero-pad head dims (zero q/k columns leave q.k
  # unchanged; zero v columns are sliced off) and the bias tables (never indexed).
  A_pad = A if interpret else pl.next_power_of_2(A)
  H_pad = H if interpret else pl.next_power_of_2(H)
  pad = lambda x, *w: jnp.pad(x, [(0, p) for p in w]) if any(w) else x
  q, k = pad(q, T_pad - T, 0, A_pad - A), pad(k, T_pad - T, 0, A_pad - A)
  v = pad(v, T_pad - T, 0, H_pad - H)
  # Padding tokens: each its own user, so they see only themselves.
  seg = jnp.concatenate([seg, -1 - jnp.arange(T_pad - T, dtype=jnp.int32)])
  pos, ts = pad(pos, T_pad - T), pad(ts, T_pad - T)
  num_pos, num_time = pos_bias.shape[0], time_bias.shape[0]
  # Padded bias entries are never read: _bias clips the indices to the real sizes.
  pos_bias = pad(pos_bias, pl.next_power_of_2(max(num_pos, 16)) - num_pos)
  time_bias_p = pad(time_bias, pl.next_power_of_2(max(num_time, 16)) - num_time)
  kb_lo = _first_key_blocks(seg, T_pad, bq, bk)
  row = lambda: pl.BlockSpec((bq,), lambda h, i: (i,))
  full = lambda m: pl.BlockSpec((m,), lambda h, i: (0,))
  kernel = functools.partial(_hstu_kernel, alpha=alpha, inv_n=1.0 / n, block_q=bq, block_k=bk,
                             num_pos=num_pos, num_time=num_time)
  out = pl.pallas_call(
      kernel,
      grid=(N, T_pad // bq),
      in_specs=[pl.BlockSpec((bq, None, A_pad), lambda h, i: (i, h, 0)),
                pl.BlockSpec((T_pad, None, A_pad), lambda h, i: (0, h, 0)),
                pl.BlockSpec((T_pad, None, H_pad), lambda h, i: (0, h, 0)),
                row(), row(), row(), full(T_pad), full(T_pad), full(T_pad),
                pl.BlockSpec((None, _LANES), lambda h, i: (i, 0)),
                full(pos_bias.shape[0]), full(time_bias_p.shape[0])],
      out_specs=pl.BlockSpec((bq, None, H_pad), lambda h, i: (i, h, 0)),
      out_shape=jax.ShapeDtypeStruct((T_pad, N, H_pad), q.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="hstu_attention",
  )(q, k, v, seg, pos, ts, seg, pos, ts, kb_lo, pos_bias, time_bias_p)
  return out[:T, :, :H]


def hstu_attention_reference(q, k, v, *, segment_ids, positions, timestamps, pos_bias, time_bias,
                             alpha, n):
  """Dense float32 [T, T] form of `hstu_attention` (same checks, shape, dtype); also
  the XLA path `jaxinfer.ops.hstu_attention` takes off GPU."""
  _check(q, k, v, segment_ids, positions, timestamps, pos_bias, time_bias, alpha, n)
  seg, pos, ts = segment_ids, positions, timestamps
  T = q.shape[0]
  dp = pos[:, None] - pos[None, :]
  bias = _bias(pos_bias.astype(jnp.float32), time_bias.astype(jnp.float32), dp,
               ts[:, None] - ts[None, :], lambda table, idx: table[idx], pos_bias.shape[0],
               time_bias.shape[0])
  mask = (seg[:, None] == seg[None, :]) & ((dp > 0) | jnp.eye(T, dtype=bool))
  s = jnp.einsum("TNA,SNA->NTS", q.astype(jnp.float32), k.astype(jnp.float32),
                 precision=lax.Precision.HIGHEST) * alpha + bias[None]
  a = jnp.where(mask[None], _silu(s) / n, 0.0)
  out = jnp.einsum("NTS,SNH->TNH", a, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
  return out.astype(q.dtype)
