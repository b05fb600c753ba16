"""Weight-only quantized matmul: y = x @ W^T with W [N, K] held as 1-byte
codes (float8_e4m3fn or int8) and float32 scales over (bo, bi) blocks of W,
dequantized one [block_n, block_k] tile at a time in registers. The float W
never exists in memory; each program reads its codes once.

  W[n, k] = q[n, k] * scale[n // bo, k // bi]   (DeepSeek block FP8: 128 x 128;
                                                  per channel: bo = 1, bi = K)

The scale is constant over a tile when block_k divides bi (or bi spans K), so
a tile's product is dot(x_tile, q_tile^T) in float32 times one scale per
output column: the kernel multiplies the [block_m, block_n] partial, not the
weights. The wrapper lays the scales out as s_t [K / block_k, N] (row kb: the
scale of every output row for key tile kb).

One program per (block_m rows of x, block_n rows of W), a loop over K in
block_k steps; float32 accumulation. Shapes: M tokens, K input dim, N output.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

CODE_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.int8))


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
  """Tile sizes, powers of two >= 16 (Triton tiles; the smallest tensor-core
  dot). block_m shrinks to the token count (decode: 16 rows)."""
  block_m: int = 64
  block_n: int = 64
  block_k: int = 128

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      b = getattr(self, name)
      if not isinstance(b, int) or isinstance(b, bool) or b < 16 or b & (b - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {b!r}")

  def fit(self, M: int, bi: int, K: int) -> "BlockSizes":
    """block_m down to the rows; block_k down until it divides the scale block."""
    bk = self.block_k
    while bi < K and bi % bk:
      bk //= 2
    if bk < 16:
      raise ValueError(f"quantized_matmul: scale blocks of {bi} inputs cannot be tiled "
                       "(need a multiple of 16)")
    return BlockSizes(block_m=min(self.block_m, max(16, pl.next_power_of_2(M))),
                      block_n=self.block_n, block_k=bk)


def _check(x, codes, scale, block):
  if x.ndim != 2 or codes.ndim != 2 or scale.ndim != 2:
    raise ValueError(f"quantized_matmul: x [M, K], codes [N, K], scale 2-D; got {x.shape}, "
                     f"{codes.shape}, {scale.shape}")
  (M, K), (N, Kc) = x.shape, codes.shape
  if K != Kc:
    raise ValueError(f"quantized_matmul: x has K={K} inputs, codes {Kc}")
  if codes.dtype not in CODE_DTYPES:
    raise TypeError(f"quantized_matmul: codes must be float8_e4m3fn or int8, got {codes.dtype}")
  bo, bi = block[0] or N, block[1] or K
  want = (-(-N // bo), -(-K // bi))
  if scale.shape != want:
    raise ValueError(f"quantized_matmul: scale must be {list(want)} for blocks {block} of "
                     f"[{N}, {K}], got {list(scale.shape)}")
  return M, K, N, bo, bi


def _kernel(x_ref, q_ref, s_ref, o_ref, *, block_k):
  # x_ref [block_m, K_pad]   activations (the program's rows)
  # q_ref [block_n, K_pad]   codes of the program's output rows
  # s_ref [K_pad / block_k, block_n]  float32 scale per key tile and output row
  # o_ref [block_m, block_n]
  def body(kb, acc):
    ks = pl.ds(kb * block_k, block_k)
    x = x_ref[:, ks]
    q = q_ref[:, ks].astype(x.dtype)  # the tile's dequantization: codes -> compute dtype
    part = lax.dot_general(x, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return acc + part * s_ref[pl.ds(kb, 1), :]

  acc = jnp.zeros(o_ref.shape, jnp.float32)
  acc = lax.fori_loop(0, q_ref.shape[1] // block_k, body, acc)
  o_ref[...] = acc.astype(o_ref.dtype)


def tile_scales(scale, bo: int, bi: int, N_pad: int, K_pad: int, block_k: int):
  """scale [ceil(N/bo), ceil(K/bi)] -> s_t [K_pad / block_k, N_pad]: the scale
  of each (key tile, output row); padded rows and tiles get 0."""
  N, K = scale.shape[0] * bo, scale.shape[1] * bi  # block-padded extents
  rows = jnp.minimum(jnp.arange(N_pad) // bo, scale.shape[0] - 1)
  tiles = jnp.minimum(jnp.arange(K_pad // block_k) * block_k // bi, scale.shape[1] - 1)
  s = scale.astype(jnp.float32)[rows][:, tiles].T  # [tiles, N_pad]
  valid = (jnp.arange(N_pad) < N)[None, :] & (jnp.arange(K_pad // block_k) * block_k < K)[:, None]
  return jnp.where(valid, s, 0.0)


def quantized_matmul(x, codes, scale, *, block=(0, 0), blocks: BlockSizes = BlockSizes(),
                     interpret: bool = False):
  """x [M, K] (bf16 / f32) @ W^T, W [N, K] = codes * scale over `block` =
  (rows, cols) blocks of W (0: the whole dimension) -> [M, N] in x's dtype.
  codes float8_e4m3fn or int8 [N, K]; scale float32 [ceil(N/bo), ceil(K/bi)]."""
  M, K, N, bo, bi = _check(x, codes, scale, block)
  return _quantized_matmul(x, codes, scale, bo=bo, bi=bi, blocks=blocks.fit(M, bi, K),
                           interpret=interpret)


@functools.partial(jax.jit, static_argnames=("bo", "bi", "blocks", "interpret"))
def _quantized_matmul(x, codes, scale, *, bo, bi, blocks, interpret):
  (M, K), N = x.shape, codes.shape[0]
  bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
  M_pad, N_pad, K_pad = (pl.cdiv(M, bm) * bm, pl.cdiv(N, bn) * bn, pl.cdiv(K, bk) * bk)
  x = jnp.pad(x, ((0, M_pad - M), (0, K_pad - K)))
  codes = jnp.pad(codes, ((0, N_pad - N), (0, K_pad - K)))
  s_t = tile_scales(scale, bo, bi, N_pad, K_pad, bk)
  out = pl.pallas_call(
      functools.partial(_kernel, block_k=bk),
      grid=(M_pad // bm, N_pad // bn),
      in_specs=[pl.BlockSpec((bm, K_pad), lambda i, j: (i, 0)),
                pl.BlockSpec((bn, K_pad), lambda i, j: (j, 0)),
                pl.BlockSpec((K_pad // bk, bn), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((M_pad, N_pad), x.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
      interpret=interpret,
      name="quantized_matmul",
  )(x, codes, s_t)
  return out[:M, :N]


def quantized_matmul_reference(x, codes, scale, *, block=(0, 0)):
  """Dequantize W whole in float32, then x @ W^T (float32 math, x's dtype out)."""
  M, K, N, bo, bi = _check(x, codes, scale, block)
  s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), bo, axis=0)[:N], bi, axis=1)[:, :K]
  w = codes.astype(jnp.float32) * s
  y = jnp.dot(x.astype(jnp.float32), w.T, precision=lax.Precision.HIGHEST)
  return y.astype(x.dtype)


# ------------------------------------------------------------ grouped (MoE experts)

def _grouped_kernel(item_ref, x_ref, q_ref, s_ref, o_ref, *, block_k, block_n):
  # item_ref [2]                    (expert, rows) of this work item
  # x_ref    [block_m, K_pad]       the item's rows (zero past `rows`)
  # q_ref    [E, N_pad, K_pad]      every expert's codes (the item's expert is read)
  # s_ref    [E, K_pad / block_k, N_pad]  float32 scale per key tile and output row
  # o_ref    [block_m, block_n]
  e, rows = item_ref[0], item_ref[1]
  ns = pl.ds(pl.program_id(1) * block_n, block_n)

  def body(kb, acc):
    ks = pl.ds(kb * block_k, block_k)
    x = x_ref[:, ks]
    q = q_ref[e, ns, ks].astype(x.dtype)
    part = lax.dot_general(x, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return acc + part * s_ref[e, pl.ds(kb, 1), ns]

  # Empty items read nothing (a dynamic trip count; bounds of one integer type for Triton).
  num_kb = jnp.where(rows > 0, jnp.int32(q_ref.shape[2] // block_k), jnp.int32(0))
  acc = lax.fori_loop(jnp.int32(0), num_kb, body, jnp.zeros(o_ref.shape, jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _work_items(group_sizes, R: int, bm: int):
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


def quantized_grouped_matmul(xs, codes, scale, group_sizes, *, block=(0, 0),
                             blocks: BlockSizes = BlockSizes(), interpret: bool = False):
  """The MoE experts' grouped form (`jax.lax.ragged_dot` semantics): xs [R, K]
  sorted by expert, group_sizes [E] rows per expert; row r of expert e gets
  xs[r] @ W_e^T, W_e [N, K] = codes[e] * scale[e] over `block` blocks; rows
  past sum(group_sizes) are 0. -> [R, N] in xs's dtype. Each work item (<=
  block_m rows of one expert) reads its expert's codes tile by tile."""
  if codes.ndim != 3 or scale.ndim != 3 or group_sizes.shape != (codes.shape[0],):
    raise ValueError(f"quantized_grouped_matmul: codes [E, N, K], scale [E, ., .], group_sizes "
                     f"[E]; got {codes.shape}, {scale.shape}, {group_sizes.shape}")
  M, K, N, bo, bi = _check(xs, codes[0], scale[0], block)
  return _quantized_grouped_matmul(xs, codes, scale, group_sizes, bo=bo, bi=bi,
                                   blocks=blocks.fit(M, bi, K), interpret=interpret)


@functools.partial(jax.jit, static_argnames=("bo", "bi", "blocks", "interpret"))
def _quantized_grouped_matmul(xs, codes, scale, group_sizes, *, bo, bi, blocks, interpret):
  (R, K), (E, N, _) = xs.shape, codes.shape
  bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
  N_pad, K_pad = pl.cdiv(N, bn) * bn, pl.cdiv(K, bk) * bk
  items, src, pos = _work_items(group_sizes, R, bm)
  W = items.shape[0]
  x = jnp.pad(xs, ((0, 1), (0, K_pad - K)))[src]  # [W * bm, K_pad], zero rows past each item
  codes = jnp.pad(codes, ((0, 0), (0, N_pad - N), (0, K_pad - K)))
  s_t = jax.vmap(lambda s: tile_scales(s, bo, bi, N_pad, K_pad, bk))(scale)
  out = pl.pallas_call(
      functools.partial(_grouped_kernel, block_k=bk, block_n=bn),
      grid=(W, N_pad // bn),
      in_specs=[pl.BlockSpec((None, 2), lambda w, j: (w, 0)),
                pl.BlockSpec((bm, K_pad), lambda w, j: (w, 0)),
                pl.BlockSpec((E, N_pad, K_pad), lambda w, j: (0, 0, 0)),
                pl.BlockSpec((E, K_pad // bk, N_pad), lambda w, j: (0, 0, 0))],
      out_specs=pl.BlockSpec((bm, bn), lambda w, j: (w, j)),
      out_shape=jax.ShapeDtypeStruct((W * bm, N_pad), xs.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
      interpret=interpret,
      name="quantized_grouped_matmul",
  )(items, x, codes, s_t)
  out = jnp.pad(out, ((0, 1), (0, 0)))  # row W * bm: zeros for rows past the groups
  return out[pos, :N]


def quantized_grouped_matmul_reference(xs, codes, scale, group_sizes, *, block=(0, 0)):
  """Dequantize every expert in float32, then `jax.lax.ragged_dot`."""
  E, N, K = codes.shape
  bo, bi = block[0] or N, block[1] or K
  s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), bo, axis=1)[:, :N], bi, axis=2)[:, :, :K]
  w = jnp.swapaxes(codes.astype(jnp.float32) * s, 1, 2)  # [E, K, N]
  y = lax.ragged_dot(xs.astype(jnp.float32), w, group_sizes.astype(jnp.int32),
                     precision=lax.Precision.HIGHEST)
  return y.astype(xs.dtype)
