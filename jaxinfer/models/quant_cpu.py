"""A quantized projection on XLA:CPU for a few rows: one multiply-reduce
fusion that reads the codes once, decodes them in registers and never writes
a dequantized matrix.

Dequantize-then-dot (`quant.matmul_weight` feeding a dot) writes each
layer's float32 matrix and reads it back; XLA:CPU also schedules every
layer's dequantization ahead of the first matmul (they depend on the weights
alone), so a step held the whole model in float32 at once. Measured on
`bench_dense`'s MLPs (`experiments/linear_forms.py`): that form ran at
0.12-0.4x the float32 dot, the reduce here at 0.8-1.7x for int8.

XLA:CPU decodes an int8 or bfloat16 code with one convert, but float8 and
packed 4-bit codes with many integer ops (~1 ns a weight, slower than
reading float32). So the CPU step layout holds them unpacked
(`unpacked_codes`, from `layers.pack_linear`): fp8 values as bfloat16 and
4-bit codes as int8 (E2M1 values doubled, so integers), each exact, at 2
bytes (fp8) or 1 byte (4-bit) a weight; `packed_codes` is the inverse.

y[m, o] = sum_i code[o, i] * s[o, i // bi] * x[m, i]: one reduce over In,
the block scale looked up per weight. Packed codes that reach it (outside
the step layout) are read as their low and high nibbles against x's even
and odd columns, so no interleaved copy is formed; the decoders
`fp8_e4m3_to_f32`, `int4_to_f32` and `e2m1_to_f32` are exact for every code
(a test checks all of them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models.quant import (PACKED, QuantizedWeight, block_scales, block_sizes,
                                   float_codes)


def fp8_e4m3_to_f32(codes):
  """float8_e4m3fn (or its uint8 bits) -> float32, exactly (NaN kept):
  |v| = (m + 8 [e > 0]) * 2^(max(e, 1) - 10), the power of two built as
  float32 exponent bits."""
  b = jax.lax.bitcast_convert_type(codes, jnp.uint8).astype(jnp.int32)
  e, m = (b >> 3) & 0xF, b & 7
  mag = (m + jnp.where(e > 0, 8, 0)).astype(jnp.float32)
  v = mag * jax.lax.bitcast_convert_type((jnp.maximum(e, 1) + 117) << 23, jnp.float32)
  v = jnp.where((b & 0x7F) == 0x7F, jnp.nan, v)
  return jnp.where(b >= 128, -v, v)


def int4_to_f32(nibbles):
  """Two's-complement 4-bit codes (int32 in [0, 16)) -> float32."""
  return ((nibbles ^ 8) - 8).astype(jnp.float32)


def e2m1_to_f32(nibbles):
  """FP4 E2M1 codes (int32 in [0, 16)) -> float32:
  |v| = (m + 2 [e > 0]) * 2^(max(e, 1) - 2)."""
  e, m = (nibbles >> 1) & 3, nibbles & 1
  mag = (m + jnp.where(e > 0, 2, 0)).astype(jnp.float32)
  v = mag * jnp.where(e == 3, 2.0, jnp.where(e == 2, 1.0, 0.5)).astype(jnp.float32)
  return jnp.where(nibbles >= 8, -v, v)


_NIBBLE = {"int4": int4_to_f32, "mxfp4": e2m1_to_f32, "nvfp4": e2m1_to_f32}


_E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12], np.int8)  # 2 * |e2m1| per magnitude code


def unpacked_codes(w):
  """A `QuantizedWeight` matrix (no lead dims) with its values as XLA:CPU
  decodes them fast, the same numbers: float8 -> bfloat16, packed 4-bit ->
  int8 [Out, In] (int4 codes; E2M1 values x 2). Anything else as it is."""
  if not isinstance(w, QuantizedWeight) or w.lead:
    return w
  v = w.values
  if w.method == "fp8" and v.dtype == jnp.float8_e4m3fn:
    return w.replace(values=v.astype(jnp.bfloat16))
  if w.method in PACKED and v.dtype == jnp.uint8:
    nib = jnp.stack([v & 0xF, v >> 4], axis=-1).reshape(*v.shape[:-1], -1).astype(jnp.int32)
    codes = int4_to_f32(nib) if w.method == "int4" else 2 * e2m1_to_f32(nib)
    return w.replace(values=codes.astype(jnp.int8))
  return w


def packed_codes(w):
  """The inverse of `unpacked_codes` (an E2M1 -0 code comes back as +0, the
  same number)."""
  if not isinstance(w, QuantizedWeight) or w.lead:
    return w
  v = w.values
  if w.method == "fp8" and v.dtype == jnp.bfloat16:
    return w.replace(values=v.astype(jnp.float8_e4m3fn))
  if w.method in PACKED and v.dtype == jnp.int8:
    n = v.astype(jnp.int32)
    if w.method != "int4":  # |2 e2m1| -> magnitude code, sign bit 3
      mag = jnp.argmax(jnp.abs(n)[..., None] == jnp.asarray(_E2M1_DOUBLED, jnp.int32), axis=-1)
      n = mag + jnp.where(n < 0, 8, 0)
    n = (n & 0xF).reshape(*v.shape[:-1], -1, 2)
    return w.replace(values=(n[..., 0] | (n[..., 1] << 4)).astype(jnp.uint8))
  return w


MIN_IN_BLOCK = 128  # smaller In blocks: the scale lookup per weight costs more than the reduce saves


def reducible(w: QuantizedWeight) -> bool:
  """Whether `reduce_matmul` takes w: one matrix (no stacked lead dims) whose
  In blocks tile In exactly, of at least `MIN_IN_BLOCK` inputs (measured:
  fp8 in 128-blocks 1.4x and 1.6x faster than dequantize-then-dot at 1 and 8
  rows, int4 in groups of 32 0.72x at 1 row: results/linear_forms_blocks.json,
  bench_dense's MLPs, idle machine)."""
  if w.lead:
    return False
  out, d_in = w.dims
  bi = block_sizes(w.block, out, d_in)[1]
  return d_in % bi == 0 and bi >= min(MIN_IN_BLOCK, d_in)


def _row_scales(w: QuantizedWeight):
  """float32 [Out, In blocks]: each row's scale per In block
  (`quant.block_scales` with the rows of a block repeated; small, built
  outside the reduce)."""
  s = block_scales(w)
  out, d_in = w.dims
  bo = block_sizes(w.block, out, d_in)[0]
  return jnp.repeat(s, bo, axis=0)[:out] if bo > 1 else s


def _expand(s, k: int):
  """[O, nb] block scales -> [O, nb * k], each repeated over its block's k
  columns by broadcast and reshape (fused into the reduce as index math)."""
  out, nb = s.shape
  return s if nb == 1 else jnp.broadcast_to(s[:, :, None], (out, nb, k)).reshape(out, nb * k)


def _sum(*terms):
  """sum_t codes_t [O, K] * x_t [M, K] over K -> [O, M], one reduce over
  the minor dim (M == 1 as a plain row reduction: XLA:CPU runs the broadcast
  form slowly at one row, and a reduce over two dims slowly at any)."""
  if terms[0][1].shape[0] == 1:
    return sum(c * x for c, x in terms).sum(axis=-1)[:, None]
  return sum(c[:, None] * x[None] for c, x in terms).sum(axis=-1)


def reduce_matmul(x2, w: QuantizedWeight):
  """x2 [M, In] @ W^T -> float32 [M, Out] for w one matrix [Out, In] whose
  In blocks tile In (`reducible` also asks for blocks that make it pay)."""
  out, d_in = w.dims
  bi = block_sizes(w.block, out, d_in)[1]
  if w.lead or d_in % bi:
    raise ValueError(f"reduce_matmul: needs one matrix with In blocks tiling In, got lead dims "
                     f"{w.lead} and blocks of {bi} over {d_in} inputs")
  x = x2.astype(jnp.float32)
  s = _row_scales(w)  # [O, nb]
  if w.method in PACKED and w.values.dtype == jnp.uint8:
    v = w.values.astype(jnp.int32)  # [O, In / 2]
    decode, s = _NIBBLE[w.method], _expand(s, bi // 2)
    xp = x.reshape(x.shape[0], d_in // 2, 2)
    y = _sum((decode(v & 0xF) * s, xp[..., 0]), (decode(v >> 4) * s, xp[..., 1]))
  else:
    codes = (fp8_e4m3_to_f32(w.values) if w.values.dtype == jnp.float8_e4m3fn
             else float_codes(w))  # XLA:CPU's own fp8 convert is slower
    y = _sum((codes * _expand(s, bi), x))
  return y.T
