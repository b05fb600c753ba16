"""The MoE experts' grouped form of the quantized matmul (`jax.lax.ragged_dot`
semantics): rows sorted by expert, each multiplied by its expert's quantized
W_e, dequantized tile by tile as in `quantized_matmul` (same codes, packing
and scale formats; see that module).

Rows are cut into work items of <= block_m rows of one expert; one program per
(work item, block_n output rows) reads its expert's codes tile by tile. An
empty item reads nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.quantized_matmul import (BlockSizes, Tiling, check, pad_operands, scale_cols,
                                             scale_f32, split_x, tile_product,
                                             dequantize_reference, fit)


def _grouped_kernel(*refs, t: Tiling):
  # item_ref [2]                   (expert, rows) of this work item
  # x_ref(s) [bm, Kq_pad]          the item's rows (zero past `rows`); packed: even, odd columns
  # q_ref    [E, N_pad, Kq_pad]    every expert's codes (the item's expert is read)
  # s_ref    [E, Ng, Kg]           stored scales (rows: N_pad for bo = 1, else blocks)
  # s2_ref   [E]                   (scale2 only) per-expert multipliers
  # o_ref    [bm, bn]
  nx = 2 if t.packed else 1
  item_ref, x_refs, q_ref, s_ref = refs[0], refs[1:1 + nx], refs[1 + nx], refs[2 + nx]
  s2_ref, o_ref = (refs[3 + nx], refs[-1]) if t.scale2 else (None, refs[-1])
  e, rows = item_ref[0], item_ref[1]
  j = pl.program_id(1)
  ns = pl.ds(j * t.bn, t.bn)
  srows = ns if t.row_scales else pl.ds(j * t.bn // t.bo, 1)

  def body(kb, acc):
    ks = pl.ds(kb * t.kq, t.kq)
    s = scale_f32(s_ref[e, srows, scale_cols(t, kb)])
    return acc + tile_product(tuple(r[:, ks] for r in x_refs), q_ref[e, ns, ks], s, t)

  # Empty items read nothing (a dynamic trip count; bounds of one integer type for Triton).
  num_kb = jnp.where(rows > 0, jnp.int32(q_ref.shape[2] // t.kq), jnp.int32(0))
  acc = lax.fori_loop(jnp.int32(0), num_kb, body, jnp.zeros(o_ref.shape, jnp.float32))
  if s2_ref is not None:
    acc = acc * s2_ref[pl.ds(e, 1)].astype(jnp.float32)[None, :]
  o_ref[...] = acc.astype(o_ref.dtype)


def work_items(group_sizes, R: int, bm: int):
  """Rows grouped by expert -> work items of <= bm rows of one expert.
  -> (items [W, 2] (expert, rows), src [W * bm] row of xs per padded row
  (R: none), pos [R] padded row of each row of xs)."""
  E = group_sizes.shape[0]
  W = pl.cdiv(R, bm) + E  # each group adds at most one partial tile
  sizes = group_sizes.astype(jnp.int32)
  offsets = jnp.cumsum(sizes) - sizes
  tiles = (sizes + bm - 1) // bm
  first = jnp.cumsum(tiles) - tiles  # first item of each expert
  w = jnp.arange(W, dtype=jnp.int32)
  e = jnp.clip(jnp.searchsorted(first + tiles, w, side="right"), 0, E - 1).astype(jnp.int32)
  local = (w - first[e]) * bm
  rows = jnp.where(w < first[e] + tiles[e], jnp.clip(sizes[e] - local, 0, bm), 0)
  i = jnp.arange(bm, dtype=jnp.int32)
  src = jnp.where(i[None, :] < rows[:, None], offsets[e][:, None] + local[:, None] + i[None, :], R)
  r = jnp.arange(R, dtype=jnp.int32)
  re = jnp.clip(jnp.searchsorted(offsets + sizes, r, side="right"), 0, E - 1)
  rl = r - offsets[re]
  pos = jnp.where(r < jnp.sum(sizes), (first[re] + rl // bm) * bm + rl % bm, W * bm)
  return jnp.stack([e, rows], axis=1), src.reshape(-1), pos


def _check_grouped(xs, codes, scale, group_sizes, block, packed, scale2):
  name = "quantized_grouped_matmul"
  if codes.ndim != 3 or scale.ndim != 3 or group_sizes.shape != (codes.shape[0],):
    raise ValueError(f"{name}: codes [E, N, K], scale [E, ., .], group_sizes [E]; got "
                     f"{codes.shape}, {scale.shape}, {group_sizes.shape}")
  if scale.shape[0] != codes.shape[0]:
    raise ValueError(f"{name}: scale has {scale.shape[0]} experts, codes {codes.shape[0]}")
  if scale2 is not None and jnp.shape(scale2) != (codes.shape[0],):
    raise ValueError(f"{name}: scale2 must be [E] = [{codes.shape[0]}], got {jnp.shape(scale2)}")
  return check(xs, codes[0], scale[0], block, packed, None, name)


def quantized_grouped_matmul(xs, codes, scale, group_sizes, *, block=(0, 0),
                             packed: str | None = None, scale2=None,
                             blocks: BlockSizes = BlockSizes(), interpret: bool = False):
  """xs [R, K] sorted by expert, group_sizes [E] rows per expert; row r of
  expert e gets xs[r] @ W_e^T, W_e [N, K] = codes[e] * scale[e] (* scale2[e])
  over `block` blocks; rows past sum(group_sizes) are 0. -> [R, N] in xs's
  dtype. codes [E, N, K] (packed uint8 [E, N, K / 2]), scale [E, Ng, Kg]."""
  M, K, N, bo, bi = _check_grouped(xs, codes, scale, group_sizes, block, packed, scale2)
  t = fit(blocks, M, N, K, bo, bi, packed, scale2 is not None)
  s2 = None if scale2 is None else jnp.asarray(scale2, jnp.float32)
  return _quantized_grouped_matmul(xs, codes, scale, s2, group_sizes, t=t, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("t", "interpret"))
def _quantized_grouped_matmul(xs, codes, scale, s2, group_sizes, *, t: Tiling, interpret):
  (R, K), (E, N) = xs.shape, codes.shape[:2]
  codes, scale, N_pad, K_pad = pad_operands(codes, scale, t, N, K)
  items, src, pos = work_items(group_sizes, R, t.bm)
  W = items.shape[0]
  x = split_x(jnp.pad(xs, ((0, 1), (0, 0)))[src], t, K_pad)  # zero rows past each item
  full = lambda a: pl.BlockSpec(a.shape, lambda w, j: (0,) * a.ndim)
  in_specs = [pl.BlockSpec((None, 2), lambda w, j: (w, 0))]
  in_specs += [pl.BlockSpec((t.bm, codes.shape[2]), lambda w, j: (w, 0)) for _ in x]
  in_specs += [full(codes), full(scale)]
  args = [items, *x, codes, scale]
  if s2 is not None:
    in_specs.append(full(s2))
    args.append(s2)
  out = pl.pallas_call(
      functools.partial(_grouped_kernel, t=t),
      grid=(W, N_pad // t.bn),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((t.bm, t.bn), lambda w, j: (w, j)),
      out_shape=jax.ShapeDtypeStruct((W * t.bm, N_pad), xs.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
      interpret=interpret,
      name="quantized_grouped_matmul",
  )(*args)
  out = jnp.pad(out, ((0, 1), (0, 0)))  # row W * bm: zeros for rows past the groups
  return out[pos, :N]


def quantized_grouped_matmul_reference(xs, codes, scale, group_sizes, *, block=(0, 0),
                                       packed=None, scale2=None):
  """Dequantize every expert in float32, then `jax.lax.ragged_dot`."""
  _check_grouped(xs, codes, scale, group_sizes, block, packed, scale2)
  w = dequantize_reference(codes, scale, block=block, packed=packed, scale2=scale2)
  y = lax.ragged_dot(xs.astype(jnp.float32), jnp.swapaxes(w, 1, 2), group_sizes.astype(jnp.int32),
                     precision=lax.Precision.HIGHEST)
  return y.astype(xs.dtype)
