"""The token exchanges of wide expert parallelism, one rank's view inside
`shard_map` over the expert axes (n ranks, e_local experts each).

Each rank holds t tokens routed to k experts: t * k (token, expert) copies,
of which the valid ones go to the rank holding their expert. Three ways:

  ragged      (GPU) copies sorted by destination, sent with
              `lax.ragged_all_to_all`: exactly the routed rows cross the
              wire (the receive buffer is sized for the worst case, n t k
              rows, but only the received slices are written). The counts
              travel first (an [n] all-gather), so each sender knows where
              its slice lands. Results come back the same way.
  capacity    (CPU: XLA:CPU has no ragged-all-to-all) fixed [n, C, D] send
              buffers with C = ceil(capacity_factor * t k / n) rows per
              destination, in as many rounds as the fullest destination
              needs (every rank loops the same count, `pmax`): dropless,
              and one round when routing is within capacity_factor of even.
              Before, one round sized for the worst case (C = t k) sent n
              times the routed rows.
  replicated  (few tokens) tokens all-gathered, each rank adds its local
              experts' contributions, one `psum` combines.

Dispatch sends the activations in `dispatch_dtype` (None: their own dtype;
"bfloat16", or "float8_e4m3fn" to halve it again); expert outputs return
and combine in the activations' dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxinfer.models.moe_core import grouped_ffn

STRATEGIES = ("auto", "replicated", "all_to_all", "ragged")


def apply_sorted(cfg, p, rows, expert, valid, e_local):
  """Runs rows [R, D] through local expert `expert` [R] (invalid rows -> 0)."""
  key = jnp.where(valid, expert, e_local)  # invalid rows sort last, outside every group
  order = jnp.argsort(key, stable=True)
  sizes = jnp.bincount(key, length=e_local + 1)[:e_local].astype(jnp.int32)
  y = grouped_ffn(cfg, p, rows[order], jnp.minimum(key[order], e_local - 1), sizes)
  return jnp.zeros_like(y).at[order].set(y)


def _copies(x, idx, ok, n, e_local, dispatch_dtype):
  """Per (token, expert) copy: its row (in the dispatch dtype), destination
  rank, local expert and validity; the valid copies per destination [n]."""
  t, k = idx.shape
  flat = idx.reshape(-1)
  copy_ok = ok[jnp.arange(t * k) // k]  # padding rows send nothing
  dest = flat // e_local
  counts = jnp.sum(jax.nn.one_hot(dest, n, dtype=jnp.int32) * copy_ok[:, None], axis=0)
  rows = x[jnp.arange(t * k) // k].astype(dispatch_dtype or x.dtype)
  return rows, dest, flat % e_local, copy_ok, counts


def _combine(y_copies, weights):
  t, k = weights.shape
  return jnp.einsum("TKD,TK->TD", y_copies.reshape(t, k, -1).astype(jnp.float32), weights)


def capacity_all_to_all(cfg, p, x, idx, weights, ok, axes, n, e_local, *,
                        capacity_factor: float = 1.25, dispatch_dtype=None):
  """The capacity exchange (module docstring). -> [t, D] float32."""
  t, k = idx.shape
  rows, dest, local_e, copy_ok, counts = _copies(x, idx, ok, n, e_local, dispatch_dtype)
  onehot = jax.nn.one_hot(dest, n, dtype=jnp.int32) * copy_ok[:, None]
  slot = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)  # position at its dest
  C = max(1, math.ceil(t * k * capacity_factor / n))
  rounds = (jax.lax.pmax(jnp.max(counts), axes) + C - 1) // C
  a2a = lambda a: jax.lax.all_to_all(a, axes, 0, 0, tiled=True)

  def one_round(r, acc):
    s = slot - r * C
    mine = copy_ok & (s >= 0) & (s < C)
    s = jnp.where(mine, s, C)  # out of bounds: dropped by the scatters
    send = jnp.zeros((n, C, rows.shape[-1]), rows.dtype).at[dest, s].set(rows, mode="drop")
    send_e = jnp.zeros((n, C), jnp.int32).at[dest, s].set(local_e, mode="drop")
    send_ok = jnp.zeros((n, C), bool).at[dest, s].set(True, mode="drop")
    recv, recv_e, recv_ok = a2a(send), a2a(send_e), a2a(send_ok)
    y = apply_sorted(cfg, p, recv.reshape(n * C, -1).astype(x.dtype), recv_e.reshape(-1),
                     recv_ok.reshape(-1), e_local)
    back = a2a(y.reshape(n, C, -1).astype(x.dtype))
    return acc + back[dest, jnp.minimum(s, C - 1)] * mine[:, None]

  y_copies = jax.lax.fori_loop(0, rounds, one_round,
                               jnp.zeros((t * k, x.shape[-1]), x.dtype))
  return _combine(y_copies, weights)


def ragged_all_to_all(cfg, p, x, idx, weights, ok, axes, n, e_local, *, dispatch_dtype=None,
                      emulate: bool = False):
  """The ragged exchange (module docstring). emulate: `emulated_ragged_all_to_all`
  instead of the collective (XLA:CPU lacks it; tests check the logic there).
  -> [t, D] float32."""
  t, k = idx.shape
  rows, dest, local_e, copy_ok, counts = _copies(x, idx, ok, n, e_local, dispatch_dtype)
  order = jnp.argsort(jnp.where(copy_ok, dest, n), stable=True)  # by destination, invalid last
  M = jax.lax.all_gather(counts, axes, tiled=False).reshape(n, n)  # M[i, j]: i sends j
  me = jax.lax.axis_index(axes)
  send_off = jnp.cumsum(counts) - counts
  land_off = (jnp.cumsum(M, axis=0) - M)[me]  # where my slice lands on each receiver
  recv_sizes = M[:, me]
  exchange = emulated_ragged_all_to_all if emulate else jax.lax.ragged_all_to_all
  ragged = lambda operand, out, i_off, s, o_off, r: exchange(operand, out, i_off, s, o_off, r,
                                                             axis_name=axes)
  R = n * t * k  # worst case: every rank sends everything here
  recv = ragged(rows[order], jnp.zeros((R, rows.shape[-1]), rows.dtype), send_off, counts,
                land_off, recv_sizes)
  recv_e = ragged(local_e[order], jnp.zeros((R,), jnp.int32), send_off, counts, land_off,
                  recv_sizes)
  valid = jnp.arange(R) < jnp.sum(recv_sizes)
  y = apply_sorted(cfg, p, recv.astype(x.dtype), recv_e, valid, e_local).astype(x.dtype)
  # Back: my received slice from sender i returns to where it left sender i.
  back = ragged(y, jnp.zeros((t * k, y.shape[-1]), x.dtype), jnp.cumsum(recv_sizes) - recv_sizes,
                recv_sizes, (jnp.cumsum(M, axis=1) - M)[:, me], counts)
  y_copies = jnp.zeros_like(back).at[order].set(back) * copy_ok[:, None]
  return _combine(y_copies, weights)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """`lax.ragged_all_to_all`'s result from all-gathers (a reference for
  backends without the collective; it moves every rank's whole operand)."""
  del recv_sizes  # implied by the senders' sizes
  gather = lambda a: jax.lax.all_gather(a, axis_name, tiled=False)
  ops, offs, sizes, lands = (gather(operand), gather(input_offsets), gather(send_sizes),
                             gather(output_offsets))
  me = jax.lax.axis_index(axis_name)
  pos = jnp.arange(output.shape[0])
  for i in range(ops.shape[0]):
    start, size, src = lands[i, me], sizes[i, me], offs[i, me]
    take = (pos >= start) & (pos < start + size)
    rows = ops[i][jnp.clip(src + pos - start, 0, ops.shape[1] - 1)]
    output = jnp.where(take.reshape(-1, *([1] * (output.ndim - 1))), rows, output)
  return output


def replicated(cfg, p, x, idx, weights, ok, axes, n, e_local, *, dispatch_dtype=None):
  """The replicated exchange (module docstring). -> [t, D] in x's dtype."""
  del n
  rank = jax.lax.axis_index(axes)
  gather = lambda a: jax.lax.all_gather(a, axes, tiled=True)
  x_all = gather(x.astype(dispatch_dtype or x.dtype)).astype(x.dtype)  # [n t, D]
  idx_all, w_all, ok_all = gather(idx), gather(weights), gather(ok)
  T, k = idx_all.shape
  flat = idx_all.reshape(-1)
  mine = (flat // e_local == rank) & ok_all[jnp.arange(T * k) // k]
  y = apply_sorted(cfg, p, x_all[jnp.arange(T * k) // k], flat % e_local, mine, e_local)
  part = _combine(y, w_all).astype(x.dtype)  # combined in the activations' dtype
  total = jax.lax.psum(part, axes)
  t = x.shape[0]
  return jax.lax.dynamic_slice_in_dim(total, rank * t, t)
