"""Weight-only quantized matmul: y = x @ W^T with W [N, K] held as codes plus
block scales, dequantized one [block_n, block_k] tile at a time inside the
kernel. The float W never exists in memory; each program reads its codes once.

  codes  float8_e4m3fn / int8 [N, K]       one code per byte
         uint8 [N, K / 2], packed=         two codes per byte, the even element
           "int4" (two's complement)       in the low nibble (MXFP4, NVFP4 and
           "e2m1" (FP4: 0, .5, 1, ... 6)   int4 checkpoints alike)
  scale  [ceil(N / bo), ceil(K / bi)]      float32 / float8_e4m3fn multipliers,
                                           or uint8 E8M0 (2^(s - 127), MXFP4)
  scale2 optional float32 scalar           NVFP4's per-tensor second level

  W[n, k] = code[n, k] * scale[n // bo, k // bi] * scale2

A key tile inside one scale block (block_k divides bi, or bi spans K) is a
float32 dot of the codes times one scale per output row: the [block_m,
block_n] partial is scaled, not the weights. Scale blocks smaller than a key
tile (MXFP4's 32 inputs, NVFP4's 16) are broadcast over their blocks and
multiply the decoded tile before the dot. For packed codes the wrapper splits
x into its even and odd columns, so a byte tile is two dots, x_even @ low^T +
x_odd @ high^T, and no nibbles are interleaved in the kernel.

Scales are read as stored, converted to float32 in the kernel (no per-call
relayout). Tiles are chosen to divide N and K, so real model dims are read in
place; only dims that are not multiples of 16 (tiny test shapes) are padded
per call. One program per (block_m rows of x, block_n rows of W), a loop over
K in block_k steps, float32 accumulation. Shapes: M tokens, K input dim, N
output dim.

Public helpers (`quantized_grouped_matmul` builds on them): `check` (the
operands' validation, naming the argument), `scale_f32` (a scale tile as
float32, E8M0 decoded), `scale_cols` (a scale tile's columns for one key
tile), `tile_product` (one tile's dequantized dot), `split_x` (x padded to
K_pad, split into even / odd columns for packed codes), `pad_operands`
(codes and scales padded to the tiling).
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
PACKED = ("int4", "e2m1")
SCALE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn),
                jnp.dtype(jnp.uint8))


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
  """Tile sizes, powers of two >= 16 (Triton tiles; the smallest tensor-core
  dot). block_m shrinks to the token count (decode: 16 rows); block_n and
  block_k shrink until they tile N, K and the scale blocks."""
  block_m: int = 64
  block_n: int = 64
  block_k: int = 128

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      b = getattr(self, name)
      if not isinstance(b, int) or isinstance(b, bool) or b < 16 or b & (b - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {b!r}")


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Everything static about one call (jit-static, hashable)."""
  bm: int
  bn: int
  bk: int  # key tile in elements (packed: bk / 2 bytes)
  bo: int  # scale block rows, resolved (N: whole)
  bi: int  # scale block inputs, resolved (K: whole)
  packed: str | None
  groups: int  # scale blocks per key tile (0: the tile lies inside one)
  scale2: bool

  @property
  def kq(self) -> int:
    """A key tile's width in the codes' last dim."""
    return self.bk // 2 if self.packed else self.bk

  @property
  def row_scales(self) -> bool:
    """One scale row per output row (bo = 1) rather than one per program."""
    return self.bo == 1


def fit(blocks: BlockSizes, M: int, N: int, K: int, bo: int, bi: int, packed, scale2: bool) -> Tiling:
  """The tiling for [M, K] x [N, K]^T with (bo, bi) scale blocks."""
  bm = min(blocks.block_m, max(16, pl.next_power_of_2(M)))
  bn = blocks.block_n
  while bn > 16 and (N % bn or (1 < bo < N and bo % bn)):
    bn //= 2
  if 1 < bo < N and bo % bn:
    raise ValueError(f"quantized_matmul: scale blocks of {bo} rows cannot be tiled "
                     "(need a multiple of 16)")
  inside = lambda b: bi >= K or bi % b == 0  # the tile lies in one scale block
  ok = lambda b: inside(b) or (b % bi == 0 and (not packed or bi % 2 == 0))
  sizes = [b for b in (blocks.block_k >> i for i in range(8)) if b >= (32 if packed else 16)]
  sizes = [b for b in sizes if ok(b)]
  if not sizes:
    raise ValueError(f"quantized_matmul: scale blocks of {bi} inputs cannot be tiled "
                     "(need a multiple or divisor of a 16..128 key tile)")
  # Tiles that divide K first; 1-byte codes prefer tiles inside one scale block
  # (a scaled partial), packed codes the widest tile (the decode dominates).
  bk = min(sizes, key=lambda b: (K % b != 0, not packed and not inside(b), -b))
  return Tiling(bm=bm, bn=bn, bk=bk, bo=bo, bi=bi, packed=packed,
                groups=0 if inside(bk) else bk // bi, scale2=scale2)


# ------------------------------------------------------------ tile math (in the kernel)

def _decode(nib, packed: str):
  """4-bit codes (int32 in [0, 15]) -> float32 values."""
  if packed == "int4":
    return ((nib ^ 8) - 8).astype(jnp.float32)
  # e2m1: sign, 2 exponent bits, 1 mantissa bit: 0, .5 | 1, 1.5 | 2, 3 | 4, 6.
  e, m = nib & 6, (nib & 1).astype(jnp.float32)
  v = jnp.where(e == 0, 0.5 * m, jnp.where(e == 2, 1.0 + 0.5 * m,
                                           jnp.where(e == 4, 2.0 + m, 4.0 + 2.0 * m)))
  return jnp.where((nib & 8) != 0, -v, v)


def scale_f32(s):
  """Stored scales -> float32 multipliers (uint8: E8M0 exponents)."""
  if s.dtype == jnp.uint8:
    return jnp.exp2(s.astype(jnp.float32) - 127.0)
  return s.astype(jnp.float32)


def scale_cols(t: Tiling, kb):
  """The scale columns key tile kb reads."""
  if t.groups:
    return pl.ds(kb * t.groups, t.groups)
  return pl.ds(kb * t.bk // t.bi, 1)


def tile_product(xs, codes, s, t: Tiling):
  """xs: (x,) or (x_even, x_odd) tiles [bm, kq]; codes [bn, kq]; s float32
  [R, groups or 1], the tile's scales for its R (bn or 1) scale rows ->
  float32 [bm, bn]."""
  if t.packed:
    b = codes.astype(jnp.int32)
    ws = (_decode(b & 15, t.packed), _decode((b >> 4) & 15, t.packed))
  else:
    ws = (codes,)
  if t.groups:  # scales vary inside the tile: scale the decoded weights
    R, G = s.shape
    width = t.kq // G
    s = jnp.broadcast_to(s[:, :, None], (R, G, width)).reshape(R, G * width)
    ws = tuple(w.astype(jnp.float32) * s for w in ws)
  dn = (((1,), (1,)), ((), ()))
  part = None
  # float32 activations get float32 dots (Triton's default for them is TF32).
  exact = lax.Precision.HIGHEST if xs[0].dtype == jnp.float32 else None
  for x, w in zip(xs, ws):
    p = lax.dot_general(x, w.astype(x.dtype), dn, preferred_element_type=jnp.float32,
                        precision=exact)
    part = p if part is None else part + p
  return part if t.groups else part * s.reshape(1, -1)


def _kernel(*refs, t: Tiling):
  # x_ref(s) [bm, Kq_pad]   activations (packed: even and odd columns)
  # q_ref    [bn, Kq_pad]   codes of the program's output rows
  # s_ref    [R, Kg]        stored scales of those rows (R = bn, or 1 for bo > 1)
  # s2_ref   [1]            (scale2 only) the per-tensor multiplier
  # o_ref    [bm, bn]
  nx = 2 if t.packed else 1
  x_refs, q_ref, s_ref = refs[:nx], refs[nx], refs[nx + 1]
  s2_ref, o_ref = (refs[nx + 2], refs[-1]) if t.scale2 else (None, refs[-1])

  def body(kb, acc):
    ks = pl.ds(kb * t.kq, t.kq)
    s = scale_f32(s_ref[:, scale_cols(t, kb)])
    return acc + tile_product(tuple(r[:, ks] for r in x_refs), q_ref[:, ks], s, t)

  acc = lax.fori_loop(0, q_ref.shape[1] // t.kq, body, jnp.zeros(o_ref.shape, jnp.float32))
  if s2_ref is not None:
    acc = acc * s2_ref[...].astype(jnp.float32)
  o_ref[...] = acc.astype(o_ref.dtype)


# ------------------------------------------------------------ wrappers

def check(x, codes, scale, block, packed, scale2, name="quantized_matmul"):
  """Validate the operands (a ValueError naming the argument and `name`)."""
  if x.ndim != 2 or codes.ndim != 2 or scale.ndim != 2:
    raise ValueError(f"{name}: x [M, K], codes [N, K] (packed [N, K / 2]), scale 2-D; got "
                     f"{x.shape}, {codes.shape}, {scale.shape}")
  (M, K), (N, Kc) = x.shape, codes.shape
  if packed is not None:
    if packed not in PACKED:
      raise ValueError(f"{name}: packed must be one of {PACKED} or None, got {packed!r}")
    if codes.dtype != jnp.uint8:
      raise TypeError(f"{name}: packed codes must be uint8, got {codes.dtype}")
    Kc *= 2
  elif codes.dtype not in CODE_DTYPES:
    raise TypeError(f"{name}: codes must be float8_e4m3fn or int8 (or packed uint8 with "
                    f"packed=), got {codes.dtype}")
  if K != Kc:
    raise ValueError(f"{name}: x has K={K} inputs, codes {Kc}")
  if scale.dtype not in SCALE_DTYPES:
    raise TypeError(f"{name}: scale dtype must be one of {[str(d) for d in SCALE_DTYPES]}, "
                    f"got {scale.dtype}")
  bo, bi = min(block[0] or N, N), min(block[1] or K, K)
  want = (-(-N // bo), -(-K // bi))
  if scale.shape != want:
    raise ValueError(f"{name}: scale must be {list(want)} for blocks {block} of [{N}, {K}], "
                     f"got {list(scale.shape)}")
  if scale2 is not None and jnp.shape(scale2) != ():
    raise ValueError(f"{name}: scale2 must be a scalar, got shape {jnp.shape(scale2)}")
  return M, K, N, bo, bi


def split_x(x, t: Tiling, K_pad: int):
  """x [M', K] -> the kernel's activation operands, K padded to K_pad."""
  x = jnp.pad(x, ((0, 0), (0, K_pad - x.shape[1])))
  return (x[:, 0::2], x[:, 1::2]) if t.packed else (x,)


def pad_operands(codes, scale, t: Tiling, N: int, K: int):
  """Codes and scales padded to whole tiles: a no-op when the tiles divide N
  and K (model dims); codes pad with 0, so padded weights are 0."""
  N_pad, K_pad = pl.cdiv(N, t.bn) * t.bn, pl.cdiv(K, t.bk) * t.bk
  kq_pad = K_pad // 2 if t.packed else K_pad
  codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 2) + [(0, N_pad - codes.shape[-2]),
                                                          (0, kq_pad - codes.shape[-1])])
  rows = N_pad if t.row_scales else scale.shape[-2]
  cols = max(scale.shape[-1], K_pad // t.bi) if t.groups else scale.shape[-1]
  scale = jnp.pad(scale, [(0, 0)] * (scale.ndim - 2) + [(0, rows - scale.shape[-2]),
                                                          (0, cols - scale.shape[-1])])
  return codes, scale, N_pad, K_pad


def quantized_matmul(x, codes, scale, *, block=(0, 0), packed: str | None = None, scale2=None,
                     blocks: BlockSizes = BlockSizes(), interpret: bool = False):
  """x [M, K] (bf16 / f32) @ W^T, W [N, K] = codes * scale (* scale2) over
  `block` = (rows, cols) blocks of W (0: the whole dimension) -> [M, N] in
  x's dtype. See the module docstring for codes, packed and scale formats."""
  M, K, N, bo, bi = check(x, codes, scale, block, packed, scale2)
  t = fit(blocks, M, N, K, bo, bi, packed, scale2 is not None)
  s2 = None if scale2 is None else jnp.asarray(scale2, jnp.float32).reshape(1)
  return _quantized_matmul(x, codes, scale, s2, t=t, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("t", "interpret"))
def _quantized_matmul(x, codes, scale, s2, *, t: Tiling, interpret):
  M, N, K = x.shape[0], codes.shape[0], x.shape[1]
  M_pad = pl.cdiv(M, t.bm) * t.bm
  codes, scale, N_pad, K_pad = pad_operands(codes, scale, t, N, K)
  xs = split_x(jnp.pad(x, ((0, M_pad - M), (0, 0))), t, K_pad)
  kq_pad = codes.shape[1]
  rows = ((t.bn, scale.shape[1]), lambda i, j: (j, 0)) if t.row_scales else (
      (1, scale.shape[1]), lambda i, j: (j * t.bn // t.bo, 0))
  in_specs = [pl.BlockSpec((t.bm, kq_pad), lambda i, j: (i, 0)) for _ in xs]
  in_specs += [pl.BlockSpec((t.bn, kq_pad), lambda i, j: (j, 0)), pl.BlockSpec(*rows)]
  args = [*xs, codes, scale]
  if s2 is not None:
    in_specs.append(pl.BlockSpec((1,), lambda i, j: (0,)))
    args.append(s2)
  out = pl.pallas_call(
      functools.partial(_kernel, t=t),
      grid=(M_pad // t.bm, N_pad // t.bn),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((t.bm, t.bn), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((M_pad, N_pad), x.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
      interpret=interpret,
      name="quantized_matmul",
  )(*args)
  return out[:M, :N]


# ------------------------------------------------------------ references

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_INT4 = tuple(range(8)) + tuple(range(-8, 0))


def dequantize_reference(codes, scale, *, block=(0, 0), packed=None, scale2=None):
  """codes, scale (one matrix, or a stack [E, ...]) -> float32 W [..., N, K],
  by table lookup and explicit block expansion."""
  if packed is not None:
    table = jnp.asarray(_E2M1 if packed == "e2m1" else _INT4, jnp.float32)
    c = codes.astype(jnp.int32)
    w = jnp.stack([table[c & 15], table[c >> 4]], axis=-1).reshape(*codes.shape[:-1], -1)
  else:
    w = codes.astype(jnp.float32)
  N, K = w.shape[-2:]
  bo, bi = min(block[0] or N, N), min(block[1] or K, K)
  s = jnp.exp2(scale.astype(jnp.float32) - 127.0) if scale.dtype == jnp.uint8 else scale.astype(
      jnp.float32)
  s = jnp.repeat(jnp.repeat(s, bo, axis=-2)[..., :N, :], bi, axis=-1)[..., :K]
  w = w * s
  if scale2 is not None:
    w = w * jnp.asarray(scale2, jnp.float32)[..., None, None]
  return w


def quantized_matmul_reference(x, codes, scale, *, block=(0, 0), packed=None, scale2=None):
  """Dequantize W whole in float32, then x @ W^T (float32 math, x's dtype out)."""
  check(x, codes, scale, block, packed, scale2)
  w = dequantize_reference(codes, scale, block=block, packed=packed, scale2=scale2)
  y = jnp.dot(x.astype(jnp.float32), w.T, precision=lax.Precision.HIGHEST)
  return y.astype(x.dtype)
