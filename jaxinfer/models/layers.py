"""Small shared pieces: RMSNorm, RoPE frequencies and rotation, the gated
MLP, and `linear` (a projection from a plain or a packed weight)."""

from __future__ import annotations

import math

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import ops
from jaxinfer.backend import Backend
from jaxinfer.config import ModelConfig, RopeScaling, yarn_get_mscale
from jaxinfer.models import quant, quant_cpu
from jaxinfer.models.layouts import FusedMLP
from jaxinfer.models.quant import QuantizedWeight, matmul_weight


def rms_norm(x, weight, eps):
  """HF RMSNorm: normalise in float32, cast back, then scale."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return weight * xf.astype(x.dtype)


@struct.dataclass
class RmsScaled:
  """An RMSNorm's output held apart for the one matmul that reads it
  (`rms_scaled`): the rows times the norm's weight, and each row's 1 / rms,
  which `linear` applies to the product instead of the input (a row scale
  commutes with the matmul). In the compiled H100 decode step XLA then
  fuses the weight into the matmul's operand and the row scale into the
  product's consumer: one launch a norm fewer than `rms_norm`'s reduce and
  apply (`benchlib.hlo_report`). Same values up to rounding: the row scale
  is applied in float32 to the float32 product."""
  scaled: jax.Array  # x * weight [..., D], x's dtype
  inv_rms: jax.Array  # [..., 1] float32

  def scale(self, y):
    """A product y [..., *Out] of `scaled` times its rows' 1 / rms."""
    return y * self.inv_rms.reshape(self.inv_rms.shape + (1,) * (y.ndim - self.inv_rms.ndim))


def rms_scaled(x, weight, eps) -> RmsScaled:
  """`rms_norm(x, weight, eps)` as an `RmsScaled`, for a `linear` to read.

  A lone row sums its squares in 128-wide chunks, then adds the chunk sums
  one by one: XLA fuses the chunks' row reduction with the residual add that
  makes x, and the additions, elementwise, into the product's consumer
  (compiled for an H100, jax 0.12.1: the residual add, norm and next matmul
  in 3 launches, 4 with one reduction over the whole row, which XLA keeps
  apart from the add). With more rows one reduction fuses so already (and
  the chunks would cost a launch)."""
  xf = x.astype(jnp.float32)
  D = x.shape[-1]
  if math.prod(x.shape[:-1]) == 1 and D % 128 == 0 and D > 128:
    part = jnp.sum(jnp.square(xf.reshape(*x.shape[:-1], D // 128, 128)), axis=-1)
    total = part[..., :1]
    for i in range(1, D // 128):
      total = total + part[..., i:i + 1]
    inv = jax.lax.rsqrt(total / D + eps)
  else:
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return RmsScaled(scaled=(x * weight).astype(x.dtype), inv_rms=inv)


# ---------------------------------------------------------------- linear

@struct.dataclass
class PackedLinear:
  """One projection weight [*In, *Out] as the engine's CPU step reads it
  (`pack_linear`): stored transposed, wt [Out, In] with Out flattened.
  Which way round XLA:CPU multiplies faster depends on the CPU
  (`engine.weight_layout`, which the Engine asks): on a 2-core Intel Xeon
  (float32, `bench_dense`'s projections, interleaved runs) this one, 1.1x
  at 1 row, 1.45x at 8, 1.4x at 32, as fast at 512; on a 2-core AMD EPYC
  [In, Out]. (Cutting it into 2 column blocks, independent matmuls, was
  0.85x at 1 row, 1.08x at 32 and equal at 8 and 512 on the Xeon, so it is
  one block.)

  out_major: multiply as wt [Out, In] x rows^T into [Out, rows], then
  transpose that (small) product (`out_major_dot`), instead of rows x wt^T
  (up to OUT_MAJOR_MAX_ROWS rows).
  On the 2-core AMD EPYC, bench_dense's Engine decode step took 29.4 ms
  against [In, Out]'s 45.6 at batch 8, 17.2 against 21.7 at 1 and 81.5
  against 95.5 at 32 (one run each, same process settings).

  panels: wt holds [In, Out] as 32-column panels [ceil(Out / 32), In, 32]
  (`ops.pack_panels`), multiplied by the C++ CPU kernel at any row count
  (`ops.panel_linear`; float32 only). On the same EPYC, projections of
  bench_dense's shapes, against out_major: 1.2-1.5x at 8 rows (weights
  streamed at 41-43 GB/s against 28-32), 0.86-1.3x at 32 rows (the
  2816-deep down projection the slower), 1.0-1.08x at 512 (docs/kernels.md
  has the table)."""
  wt: jax.Array  # [Out, In], or panels [P, In, 32] with panels
  out_shape: tuple = struct.field(pytree_node=False)  # Out, the weight's trailing dims
  in_shape: tuple = struct.field(pytree_node=False, default=())  # In, its leading dims
  out_major: bool = struct.field(pytree_node=False, default=False)
  panels: bool = struct.field(pytree_node=False, default=False)


def pack_linear(w, in_dims: int = 1, out_major: bool = False,
                panels: bool = False) -> PackedLinear:
  """[*In, *Out] (In the first in_dims dims) -> `PackedLinear` (multiplied
  out-major with out_major; a float32 one in panels with panels, other
  dtypes [Out, In]); a `QuantizedWeight` is already [Out, In]: its codes
  are unpacked for the CPU step (`quant_cpu.unpacked_codes`: same
  numbers)."""
  if isinstance(w, QuantizedWeight):
    return quant_cpu.unpacked_codes(w)
  if not 1 <= in_dims < w.ndim:
    raise ValueError(f"pack_linear: in_dims must be in [1, {w.ndim - 1}], got {in_dims}")
  w2 = w.reshape(math.prod(w.shape[:in_dims]), -1)
  out_shape, in_shape = tuple(w.shape[in_dims:]), tuple(w.shape[:in_dims])
  if panels and w.dtype == jnp.float32:
    return PackedLinear(ops.pack_panels(w2), out_shape, in_shape, panels=True)
  return PackedLinear(jnp.transpose(w2), out_shape, in_shape, out_major)


def unpack_linear(w):
  """The inverse of `pack_linear`: a `PackedLinear` -> [*In, *Out]; any
  other weight as it is (a `QuantizedWeight` with its codes packed back)."""
  if isinstance(w, QuantizedWeight):
    return quant_cpu.packed_codes(w)
  if not isinstance(w, PackedLinear):
    return w
  if w.panels:
    return ops.unpack_panels(w.wt, math.prod(w.out_shape)).reshape(*w.in_shape, *w.out_shape)
  return jnp.transpose(w.wt).reshape(*w.in_shape, *w.out_shape)


def linear(x, w, in_dims: int = 1, preferred_element_type=None, backend: Backend = Backend()):
  """x [..., *In] times w [*In, *Out] (or its `PackedLinear`) -> [..., *Out],
  contracting the last in_dims dims of x. A `QuantizedWeight` is
  dequantized inside the step: per tile by the Pallas kernel when the
  backend builds for GPUs and the weight is marked for it
  (`quant.kernel_ready`), else whole (one layer's matrix) to x's dtype. On
  a CPU target, a packed or
  quantized weight meets a few rows (`ROW_REDUCE_ROWS`) as one
  multiply-reduce instead (`row_reduce_matmul`). x may be an `RmsScaled`
  (in_dims 1): its row scale multiplies the float32 product."""
  if isinstance(x, RmsScaled):
    if in_dims != 1:
      raise ValueError(f"linear: an RmsScaled input contracts its last dim only, got "
                       f"in_dims={in_dims}")
    y = linear(x.scaled, w, 1, jnp.float32, backend)
    return x.scale(y).astype(preferred_element_type or x.scaled.dtype)
  if isinstance(w, QuantizedWeight) and quant.kernel_ready(w) and backend.on_gpu():
    y = _kernel_linear(x.reshape(-1, w.dims[1]), w, backend)
    y = y.reshape(*x.shape[:x.ndim - in_dims], *w.out_shape)
    return y if preferred_element_type is None else y.astype(preferred_element_type)
  if _pad_lone_row(x, w, in_dims, backend):
    lead, tail = x.shape[:x.ndim - in_dims], x.shape[x.ndim - in_dims:]
    x2 = jnp.pad(x.reshape(1, *tail), ((0, 1),) + ((0, 0),) * len(tail))
    y = linear(x2, w, in_dims, preferred_element_type, backend)
    return y[:1].reshape(*lead, *y.shape[1:])
  if isinstance(w, (PackedLinear, QuantizedWeight)):
    xi = x.reshape(*x.shape[:x.ndim - in_dims], -1)
    rows = math.prod(xi.shape[:-1])
    if isinstance(w, PackedLinear) and w.panels:
      y = ops.panel_linear(xi.reshape(rows, -1), w.wt, math.prod(w.out_shape))
      y = y.astype(preferred_element_type or x.dtype).reshape(*xi.shape[:-1], -1)
    elif isinstance(w, PackedLinear) and w.out_major and rows <= OUT_MAJOR_MAX_ROWS:
      x2 = xi.reshape(rows, -1)
      y = _dot(lambda pet: out_major_dot(x2, w.wt, pet), x2, w.wt, preferred_element_type,
               backend).reshape(*xi.shape[:-1], -1)
    elif _row_reduce(w, rows, backend):
      y = row_reduce_matmul(xi.reshape(rows, -1), w).astype(preferred_element_type or x.dtype)
      y = y.reshape(*xi.shape[:-1], -1)
    else:
      wt = matmul_weight(w, x.dtype) if isinstance(w, QuantizedWeight) else w.wt
      y = _dot(lambda pet: jnp.einsum("...I,OI->...O", xi, wt, preferred_element_type=pet),
               xi, wt, preferred_element_type, backend)
    return y.reshape(*y.shape[:-1], *w.out_shape)
  return _dot(lambda pet: jnp.tensordot(x, w, axes=in_dims, preferred_element_type=pet),
              x, w, preferred_element_type, backend)


# Above this many rows an out_major `PackedLinear` multiplies as rows x wt^T:
# transposing a large product costs more than the layout saves (EPYC,
# GFLOP/s out_major against rows x wt^T: gate-up 1024x5632 0.90x at 128 and
# 256 rows, 0.75x at 1024; down 2816x1024 1.17x, 1.06x, 0.99x).
OUT_MAJOR_MAX_ROWS = 256


def out_major_dot(x2, wt, preferred_element_type=None):
  """x2 [rows, In] times wt [Out, In] -> [rows, Out], computed as wt x x2^T
  ([Out, rows], the weight the dot's left side) and transposed. The
  optimization barrier keeps the product [Out, rows] in memory: without it
  XLA:CPU's layout assignment folds the transpose into the dot, which then
  multiplies rows x wt^T again (measured on the EPYC at 8 rows, weights
  [Out, In] of 5632x1024 / 1024x2816 / 1536x1024, one run: 13.6 / 6.9 / 12.3 GB/s
  without the barrier, 22.6 / 26.1 / 17.8 with it)."""
  yt = jax.lax.dot_general(wt, x2, (((1,), (1,)), ((), ())),
                           preferred_element_type=preferred_element_type)
  return jax.lax.optimization_barrier(yt).T


def _pad_lone_row(x, w, in_dims: int, backend: Backend) -> bool:
  """Whether a 16-bit float row meets float weights on a CPU target, alone:
  XLA:CPU multiplies one bf16 row about 10x slower than two (6 copies of
  [1, 1024] x [1024, 5632]: 52.5 ms, 5.0 with the row padded to two), so
  `linear` pads it to two rows and keeps the first."""
  return (x.dtype in (jnp.bfloat16, jnp.float16) and not isinstance(w, QuantizedWeight)
          and not backend.on_gpu() and math.prod(x.shape[:x.ndim - in_dims]) == 1)


def _dot(dot, x, w, preferred_element_type, backend: Backend):
  """dot(preferred_element_type). XLA:CPU multiplies bfloat16 x bfloat16
  into float32 natively (YNNPACK), but for a bfloat16 result it converts
  both operands to float32 first, every weight every step (bench_dense, 8
  prompts' prefill and 3 decode steps: 1.6 s against 0.8 s with float32
  results): on a CPU target 16-bit operands multiply into float32, then
  round to x's dtype."""
  low = (jnp.bfloat16, jnp.float16)
  if (preferred_element_type is None and x.dtype in low and w.dtype in low
      and not backend.on_gpu()):
    return dot(jnp.float32).astype(x.dtype)
  return dot(preferred_element_type)


# Rows for which a CPU step multiplies as one multiply-reduce fusion, not a
# dot. Measured on `bench_dense`'s decode step, the Engine with each setting
# in its own process (`experiments/linear_forms.py --engine_batches`):
# float weights at 8 rows 25.1 ms against the dot's 27.3, at 32 rows
# reduce-to-64 286 ms against 51 (XLA then writes out x broadcast against
# some weights, [Out, rows, In], instead of fusing it), at 1 row 13.5
# against 8.1 (results/xla_cpu_flags.json, idle machine); int8 at 1 row 25.5
# ms against dequantize-then-dot's 164, at 8-32 rows 6-20x slower than it
# (results/linear_forms.json, a loaded machine).
ROW_REDUCE_ROWS = {"float": (2, 8), "quantized": (1, 1)}


def _row_reduce(w, rows: int, backend: Backend) -> bool:
  if backend.on_gpu():
    return False
  lo, hi = ROW_REDUCE_ROWS["quantized" if isinstance(w, QuantizedWeight) else "float"]
  return lo <= rows <= hi and (not isinstance(w, QuantizedWeight) or quant_cpu.reducible(w))


def row_reduce_matmul(x2, w):
  """x2 [M, In] times a `PackedLinear` or a `quant_cpu.reducible`
  `QuantizedWeight` [Out, In] -> float32 [M, Out], as y[o, m] = sum_i
  W[o, i] x[m, i]: one reduce fusion that reads W once (a quantized one
  decoded on the fly, `quant_cpu`), row o held in cache while it meets every
  row of x."""
  if isinstance(w, QuantizedWeight):
    return quant_cpu.reduce_matmul(x2, w)
  x2, wt = x2.astype(jnp.float32), w.wt.astype(jnp.float32)
  if x2.shape[0] == 1:  # [Out, 1, In] would reduce over a broadcast XLA:CPU runs slowly
    return jnp.sum(wt * x2, axis=-1)[None]
  return jnp.sum(wt[:, None, :] * x2[None], axis=-1).T


def _kernel_linear(x2, w: QuantizedWeight, backend: Backend):
  """x2 [M, In] @ w [Out, In] on the quantized kernel."""
  def call(x2, values, scale, scale2):
    return ops.quantized_matmul(x2, values, scale, block=w.block, packed=quant.PACKING.get(w.method),
                                scale2=scale2, backend=backend)
  return quantized_call(w, call, x2)


def quantized_call(w: QuantizedWeight, fn, x, *replicated):
  """fn(x, values, scale, scale2, *replicated) -> y [..., Out], a kernel call
  on x [..., In] and the weight w [*lead, Out, In]: once for a weight held
  whole, else per device in shard_map over w's split (`quant.KernelPlan`),
  x split like w's In, and the partial products of a split In summed."""
  plan = w.kernel
  if plan.mesh is None:
    return fn(x, w.values, w.scale, w.scale2, *replicated)
  P = jax.sharding.PartitionSpec
  lead = (None,) * len(w.lead)
  matrix = (plan.out_axis, plan.in_axis)
  scale = (*lead, *(a if n > 1 else None for a, n in zip(matrix, w.scale.shape[-2:])))
  args = [x, w.values, w.scale, *replicated]
  specs = [P(*(None,) * (x.ndim - 1), plan.in_axis), P(*lead, *matrix), P(*scale),
           *(P() for _ in replicated)]
  if w.scale2 is not None:
    args.append(w.scale2)
    specs.append(P())

  def per_device(x, values, scale, *rest):
    scale2 = rest[-1] if w.scale2 is not None else None
    y = fn(x, values, scale, scale2, *rest[:len(replicated)])
    return y if plan.in_axis is None else jax.lax.psum(y, plan.in_axis)

  return jax.shard_map(per_device, mesh=plan.mesh, in_specs=tuple(specs),
                       out_specs=P(*(None,) * (x.ndim - 1), plan.out_axis), check_vma=False)(*args)


# ---------------------------------------------------------------- RoPE

def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
  """Inverse frequencies [rope_dim / 2] and the cos/sin scale (YaRN's
  attention factor; 1 otherwise), as transformers' rope init functions."""
  dim = cfg.rope_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
  rs = cfg.rope_scaling
  if rs is None:
    return inv_freq.astype(np.float32), 1.0
  if rs.kind == "linear":
    return (inv_freq / rs.factor).astype(np.float32), 1.0
  if rs.kind == "llama3":
    return _llama3(inv_freq, rs).astype(np.float32), 1.0
  return _yarn(cfg, rs, dim)


def _llama3(inv_freq, rs: RopeScaling):
  old_len = rs.original_max_position_embeddings
  low_wavelen = old_len / rs.low_freq_factor
  high_wavelen = old_len / rs.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
  smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
  smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled)


def _yarn(cfg: ModelConfig, rs: RopeScaling, dim: int):
  base, factor = cfg.rope_theta, rs.factor
  orig = rs.original_max_position_embeddings or cfg.max_position_embeddings
  attn_factor = rs.attention_factor
  if attn_factor is None:
    if rs.mscale and rs.mscale_all_dim:
      attn_factor = yarn_get_mscale(factor, rs.mscale) / yarn_get_mscale(factor, rs.mscale_all_dim)
    else:
      attn_factor = yarn_get_mscale(factor)

  def correction_dim(rotations):
    return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
  if rs.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate
  pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
  inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
  return inv_freq.astype(np.float32), float(attn_factor)


def rope_cos_sin(cfg: ModelConfig, positions):
  """positions [B, T] -> cos, sin [B, T, rope_dim / 2] in float32."""
  inv_freq, attn_factor = rope_frequencies(cfg)
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  return jnp.cos(angles) * attn_factor, jnp.sin(angles) * attn_factor


def mrope_cos_sin(cfg: ModelConfig, positions):
  """Qwen3-VL interleaved MRoPE: positions [3, B, T] (temporal, height,
  width) -> cos, sin [B, T, rope_dim / 2]. Frequency i takes the height
  position when i % 3 == 1 and i < 3 * sections[1], the width one when
  i % 3 == 2 and i < 3 * sections[2], else the temporal one. Text tokens
  have all three equal, which is plain RoPE."""
  inv_freq, attn_factor = rope_frequencies(cfg)
  axis = np.zeros(len(inv_freq), np.int32)
  for a in (1, 2):
    axis[a:3 * cfg.mrope_section[a]:3] = a
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [3, B, T, R/2]
  angles = jnp.where(axis == 0, angles[0], jnp.where(axis == 1, angles[1], angles[2]))
  return jnp.cos(angles) * attn_factor, jnp.sin(angles) * attn_factor


def apply_rope(x, cos, sin, interleave: bool = False):
  """x [B, T, N, R] rotated by position. Pairs (i, i + R/2) as HF's
  rotate_half; with `interleave`, pairs (2i, 2i + 1) (DeepSeek's layout),
  emitted de-interleaved as HF does (q and k alike, so q.k is unchanged)."""
  if interleave:
    x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
  # As x * [c, c] + rotate_half(x) * [s, s], with rotate_half = [-x2, x1]:
  # the halves swapped by a reverse over a [2, R/2] view and the sign put on
  # sin, one elementwise fusion over x (the concatenates of the two
  # products were passes of their own, 11.5-13.4 ms of bench_dense's
  # profiled 544-token prompt steps on the 2-core EPYC).
  # x1 * c + x2 * (-s) == x1 * c - x2 * s exactly.
  xf = x.astype(jnp.float32)
  swapped = jnp.flip(xf.reshape(*x.shape[:-1], 2, -1), axis=-2).reshape(x.shape)
  c = jnp.concatenate([cos, cos], axis=-1)[:, :, None, :]
  s = jnp.concatenate([-sin, sin], axis=-1)[:, :, None, :]
  return (xf * c + swapped * s).astype(x.dtype)


# ---------------------------------------------------------------- MLP

def glu(cfg: ModelConfig, gate, up):
  """The gated activation: SwiGLU, or GPT-OSS's clamped variant."""
  if cfg.activation == "silu":
    return jax.nn.silu(gate) * up
  limit, alpha = cfg.swiglu_limit, cfg.swiglu_alpha
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def fuse_gate_up(w_gate, w_up):
  """[D, F] twice -> [D, 2F]: one matmul reads both (`layouts.FusedMLP`)."""
  return jnp.concatenate([w_gate, w_up], axis=-1)


def mlp(cfg: ModelConfig, p, x):
  """Dense gated MLP. x [..., D]; p: {w_gate, w_up [D, F], w_down [F, D]},
  or a `layouts.FusedMLP` (weights plain or packed)."""
  if isinstance(p, FusedMLP) and isinstance(x, RmsScaled):
    # The row scale after the split: XLA then applies it in the activation's
    # fusion, not in the matmul's epilogue, which jax 0.10.2's XLA could not
    # give the chunk sums of `rms_scaled` (a launch more a layer for H100).
    gu = linear(x.scaled, p.w_gate_up, preferred_element_type=jnp.float32, backend=cfg.backend)
    gate, up = (x.scale(h).astype(x.scaled.dtype) for h in jnp.split(gu, 2, axis=-1))
  elif isinstance(p, FusedMLP):
    gate, up = jnp.split(linear(x, p.w_gate_up, backend=cfg.backend), 2, axis=-1)
  else:
    b = cfg.backend
    gate, up = linear(x, p["w_gate"], backend=b), linear(x, p["w_up"], backend=b)
  return linear(glu(cfg, gate, up), p["w_down"], backend=cfg.backend)
