"""Quantized weights: `QuantizedWeight`, kept in its storage dtype on device
and dequantized inside the jitted step where a matmul reads it.

A projection our float tree holds as [*lead, *In, *Out] (lead: the stacked
`layers` and `expert` axes) is held quantized in the checkpoints' own
orientation, values [*lead, Out, In] with In and Out flattened, plus scales
over blocks of (rows, cols) = `block` of that [Out, In] matrix (0: the whole
dimension, so (0, 0) is per tensor and (1, 0) per output channel). The last
block of a dimension may be partial (DeepSeek's 576-row kv_a_proj, 128-blocks).

  method  values                                scale                          W[o, i]
  fp8     float8_e4m3fn [*, O, I]               float32 [*, O/bo, I/bi]        q * s
  int8    int8 [*, O, I]                        float32 [*, O/bo, I/bi]        q * s
  int4    uint8 [*, O, I/2], two's-complement   float32 [*, O/bo, I/bi]        q * s
  mxfp4   uint8 [*, O, I/2], e2m1 codes         uint8 E8M0 [*, O, I/32]        e2m1(q) * 2^(s - 127)
  nvfp4   uint8 [*, O, I/2], e2m1 codes         float8_e4m3fn [*, O, I/16],    e2m1(q) * s * s2
                                                scale2 float32 [*]
Packed 4-bit values hold two codes per byte, the even element in the low
nibble (MXFP4, NVFP4 and our int4 alike). `quant_formats.md` (shared
reference) cites each format's source.

`linear` and the expert paths call `matmul_weight` / `dense`: XLA fuses the
scale multiply into the operand read on GPU (the H100 compile gate checks
the programs), and XLA:CPU materialises one layer's dequantized weight per
use, except a projection at one row, which `quant_cpu` multiplies from the
codes (`bench_decode --quant` reports what each costs).
"""

from __future__ import annotations

import dataclasses
import math

from flax import struct
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

METHODS = ("fp8", "int8", "int4", "mxfp4", "nvfp4")
PACKED = ("int4", "mxfp4", "nvfp4")  # two 4-bit codes per uint8
VALUE_DTYPES = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8, "int4": jnp.uint8,
                "mxfp4": jnp.uint8, "nvfp4": jnp.uint8}
SCALE_DTYPES = {"fp8": jnp.float32, "int8": jnp.float32, "int4": jnp.float32,
                "mxfp4": jnp.uint8, "nvfp4": jnp.float8_e4m3fn}
FIXED_BLOCKS = {"mxfp4": (1, 32), "nvfp4": (1, 16)}  # the formats fix their blocks
_QMAX = {"fp8": 448.0, "int8": 127.0, "int4": 7.0}
E2M1_MAX, E4M3_MAX = 6.0, 448.0


@dataclasses.dataclass(frozen=True)
class KernelPlan:
  """How a step holds a weight it multiplies with the quantized kernels:
  whole (mesh None: one device, or per rank inside a shard_map), or split
  over `mesh` with its [Out, In] matrix's dims over `out_axis` / `in_axis`
  (values and scales alike): `layers.linear` then runs the kernel per device
  in shard_map (GSPMD cannot split the kernel's custom call; it would gather
  the weight around it) and sums the partial products of an `in_axis` split."""
  mesh: jax.sharding.Mesh | None = None
  out_axis: str | tuple[str, ...] | None = None
  in_axis: str | tuple[str, ...] | None = None


@struct.dataclass
class QuantizedWeight:
  """One quantized projection (see the module docstring for the layouts)."""
  values: jax.Array  # [*lead, Out, In] or packed [*lead, Out, In / 2]
  scale: jax.Array  # [*lead, ceil(Out / bo), ceil(In / bi)]
  scale2: jax.Array | None = None  # [*lead]: NVFP4's per-tensor second level
  method: str = struct.field(pytree_node=False, default="fp8")
  block: tuple[int, int] = struct.field(pytree_node=False, default=(0, 0))
  in_shape: tuple[int, ...] = struct.field(pytree_node=False, default=())
  out_shape: tuple[int, ...] = struct.field(pytree_node=False, default=())
  # Marked for the Pallas kernels on a GPU target (`with_kernel`): how the
  # program holds the weight, so the call runs where the shards are.
  kernel: "KernelPlan | None" = struct.field(pytree_node=False, default=None)

  @property
  def lead(self) -> tuple[int, ...]:
    return tuple(self.values.shape[:-2])

  @property
  def shape(self) -> tuple[int, ...]:
    """The float weight's shape in our orientation, [*lead, *In, *Out]."""
    return (*self.lead, *self.in_shape, *self.out_shape)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def dims(self) -> tuple[int, int]:
    """(Out, In) of the flattened matrix."""
    return math.prod(self.out_shape), math.prod(self.in_shape)


def block_sizes(block: tuple[int, int], out: int, d_in: int) -> tuple[int, int]:
  """A block with 0 (whole dimension) resolved against [out, d_in]."""
  return block[0] or out, block[1] or d_in


def scale_shape(block, out: int, d_in: int) -> tuple[int, int]:
  bo, bi = block_sizes(block, out, d_in)
  return -(-out // bo), -(-d_in // bi)


def bytes_per_weight(method: str, block=(0, 0)) -> float:
  """Bytes one weight takes, its share of the block scales included (a whole-
  dimension block counts as free: one scale per row or tensor)."""
  block = FIXED_BLOCKS.get(method, block)
  per_block = block[0] * block[1]
  scale = np.dtype(SCALE_DTYPES[method]).itemsize / per_block if per_block else 0.0
  return (0.5 if method in PACKED else 1.0) + scale


def stored_in(method: str, d_in: int) -> int:
  """The values' last dim: packed formats hold two codes per byte."""
  return d_in // 2 if method in PACKED else d_in


# ------------------------------------------------------------ dequantization

def float_codes(w: QuantizedWeight):
  """values -> float32 codes [*lead, Out, In] (before the scales)."""
  v = w.values
  if w.method in PACKED and v.dtype == jnp.int8:  # held unpacked (`quant_cpu.unpacked_codes`)
    return v.astype(jnp.float32) * (1.0 if w.method == "int4" else 0.5)
  if w.method in ("mxfp4", "nvfp4"):
    pairs = jax.lax.bitcast_convert_type(v, jnp.float4_e2m1fn)  # [..., I/2, 2], low nibble first
    return pairs.reshape(*v.shape[:-1], -1).astype(jnp.float32)
  if w.method == "int4":
    nib = jnp.stack([v & 0xF, v >> 4], axis=-1).astype(jnp.int32)
    return ((nib ^ 8) - 8).reshape(*v.shape[:-1], -1).astype(jnp.float32)
  return v.astype(jnp.float32)


def block_scales(w: QuantizedWeight):
  """Scales as float32 multipliers, one per block: [*lead, ceil(Out / bo),
  ceil(In / bi)] (E8M0 decoded, NVFP4's second level applied)."""
  s = w.scale
  s = jnp.exp2(s.astype(jnp.float32) - 127.0) if w.method == "mxfp4" else s.astype(jnp.float32)
  if w.scale2 is not None:
    s = s * w.scale2.astype(jnp.float32)[..., None, None]
  return s


def _scales(w: QuantizedWeight):
  """Scales as float32 multipliers, [*lead, Out, In] after block expansion."""
  s = block_scales(w)
  out, d_in = w.dims
  bo, bi = block_sizes(w.block, out, d_in)
  # Block expansion by broadcast and reshape (a gather would not split like the weight).
  *lead, no, ni = s.shape
  s = jnp.broadcast_to(s[..., :, None, :, None], (*lead, no, bo, ni, bi))
  return s.reshape(*lead, no * bo, ni * bi)[..., :out, :d_in]


def matmul_weight(w: QuantizedWeight, dtype) -> jax.Array:
  """The dequantized [*lead, Out, In] matrix in dtype (inside a jitted step)."""
  return (float_codes(w) * _scales(w)).astype(dtype)


def dense(w, dtype=None) -> jax.Array:
  """A weight as its float array in our orientation [*lead, *In, *Out]; plain
  arrays pass through (cast to dtype when given)."""
  if not isinstance(w, QuantizedWeight):
    return w if dtype is None else w.astype(dtype)
  m = matmul_weight(w, dtype or jnp.float32)
  lead = w.lead
  m = jnp.swapaxes(m, -1, -2)  # [*lead, In, Out]
  return m.reshape(*lead, *w.in_shape, *w.out_shape)


PACKING = {"int4": "int4", "mxfp4": "e2m1", "nvfp4": "e2m1"}  # the kernels' `packed=`


def _tileable(w: QuantizedWeight) -> bool:
  """Whether the kernels can tile w's scale blocks (`pallas_kernels.quantized_matmul.fit`)."""
  out, d_in = w.dims
  bo, bi = block_sizes(w.block, out, d_in)
  rows = bo in (1, out) or bo % 16 == 0
  cols = bi >= d_in or bi % 16 == 0 or (128 % bi == 0 and (w.method not in PACKED or bi % 2 == 0))
  return rows and cols


def kernel_ready(w, grouped: bool = False) -> bool:
  """Whether w goes to the quantized matmul kernels (`linear`: one matrix;
  grouped: the experts' stack [E, Out, In]), whole or split per its
  `KernelPlan`."""
  if not isinstance(w, QuantizedWeight) or w.kernel is None:
    return False
  return len(w.lead) == int(grouped) and _tileable(w)


def _plan(w: QuantizedWeight, mesh) -> KernelPlan | None:
  """w's plan from its arrays' shardings (NamedSharding over mesh), or None
  when its scales do not split with its values' blocks."""
  if mesh is None:
    return KernelPlan()
  spec = lambda a: tuple(getattr(getattr(a, "sharding", None), "spec", ())) + (None,) * a.ndim
  vs, ss = spec(w.values)[len(w.lead):len(w.lead) + 2], spec(w.scale)[len(w.lead):len(w.lead) + 2]
  if any(a is not None for a in spec(w.values)[:len(w.lead)]):
    return None  # split stacks (experts over ranks) run per rank in their own shard_map
  out, d_in = w.dims
  for axis, s_axis, n, b, s_n in zip(vs, ss, (out, d_in), block_sizes(w.block, out, d_in),
                                     w.scale.shape[-2:]):
    if axis is None:
      if s_axis is not None:
        return None
      continue
    size = math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))
    whole = b >= n  # one scale over the dim: replicated, it applies to every shard
    if not (whole and s_n == 1 and s_axis is None) and (s_axis != axis or (n // size) % b):
      return None
  return KernelPlan(mesh=mesh, out_axis=vs[0], in_axis=vs[1])


def with_kernel(tree, mesh=None):
  """Every `QuantizedWeight` in tree marked for the kernels: held whole
  (mesh None), or split as its arrays' shardings over mesh say."""
  return jax.tree.map(lambda w: w.replace(kernel=_plan(w, mesh)) if isinstance(w, QuantizedWeight)
                      else w, tree, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def without_kernel(tree):
  """The inverse of `with_kernel`: every `QuantizedWeight` unmarked."""
  return jax.tree.map(lambda w: w.replace(kernel=None) if isinstance(w, QuantizedWeight) else w,
                      tree, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def held_whole(tree):
  """The weights in tree that are marked for the kernels, marked as held
  whole: for code that runs per rank inside a shard_map over their splits."""
  return jax.tree.map(lambda w: w.replace(kernel=KernelPlan())
                      if isinstance(w, QuantizedWeight) and w.kernel is not None else w,
                      tree, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def dense_tree(tree, dtype):
  """Every `QuantizedWeight` in tree dequantized (`dense`)."""
  return jax.tree.map(lambda w: dense(w, dtype) if isinstance(w, QuantizedWeight) else w,
                      tree, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def take(w, idx, axis: int):
  """jnp.take on a plain or quantized weight along a lead axis (experts)."""
  if isinstance(w, QuantizedWeight):
    if axis >= len(w.lead):
      raise ValueError(f"take: axis {axis} is not a lead axis of a quantized weight {w.shape}")
    return jax.tree.map(lambda a: jnp.take(a, idx, axis=axis), w)
  return jnp.take(w, idx, axis=axis)


def nbytes(tree) -> int:
  """Bytes of every array leaf (quantized values and scales at their storage size)."""
  return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# ------------------------------------------------------------ quantization (host, numpy)

def _expand(s: np.ndarray, bo: int, bi: int, out: int, d_in: int) -> np.ndarray:
  return np.repeat(np.repeat(s, bo, axis=-2)[..., :out, :], bi, axis=-1)[..., :d_in]


def _block_amax(w: np.ndarray, bo: int, bi: int) -> np.ndarray:
  """max |w| over each (bo, bi) block of [*lead, Out, In], edge blocks partial."""
  *lead, out, d_in = w.shape
  no, ni = -(-out // bo), -(-d_in // bi)
  pad = np.zeros((*lead, no * bo, ni * bi), np.float32)
  pad[..., :out, :d_in] = np.abs(w)
  return pad.reshape(*lead, no, bo, ni, bi).max(axis=(-3, -1))


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
  """uint8 codes [..., I] (low 4 bits) -> [..., I / 2], the even element low."""
  c = codes.astype(np.uint8) & 0xF
  return c[..., 0::2] | (c[..., 1::2] << 4)


def quantize_matrix(w: np.ndarray, method: str, block=(0, 0)):
  """Float [*lead, Out, In] -> (values, scale, scale2 or None) as numpy arrays
  in the storage dtypes, by absmax scaling per block (round to nearest)."""
  if method not in METHODS:
    raise ValueError(f"quantize: method must be one of {METHODS}, got {method!r}")
  w = np.asarray(w, np.float32)
  *lead, out, d_in = w.shape
  if method in PACKED and d_in % 2:
    raise ValueError(f"quantize: {method} packs two values per byte; the input dim {d_in} is odd")
  block = FIXED_BLOCKS.get(method, block)
  bo, bi = block_sizes(block, out, d_in)
  amax = _block_amax(w, bo, bi)
  if method == "mxfp4":
    # E8M0 power of two with the block max inside e2m1's range (max 6 = 1.5 * 2^2).
    e = np.clip(np.floor(np.log2(np.maximum(amax, 2.0 ** -126))) - 2, -127, 127)
    codes = np.clip(w / _expand(2.0 ** e, bo, bi, out, d_in), -E2M1_MAX, E2M1_MAX)
    codes = codes.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    return pack_nibbles(codes), (e + 127).astype(np.uint8), None
  if method == "nvfp4":
    s2 = np.maximum(np.abs(w).reshape(*lead, -1).max(axis=-1), 1e-12) / (E2M1_MAX * E4M3_MAX)
    s = (amax / E2M1_MAX / s2[..., None, None]).astype(ml_dtypes.float8_e4m3fn)
    full = _expand(s.astype(np.float32) * s2[..., None, None], bo, bi, out, d_in)
    codes = np.clip(w / np.where(full == 0, 1.0, full), -E2M1_MAX, E2M1_MAX)
    codes = codes.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    return pack_nibbles(codes), s, s2.astype(np.float32)
  qmax = _QMAX[method]
  s = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
  q = np.clip(w / _expand(s, bo, bi, out, d_in), -qmax, qmax)
  if method == "fp8":
    return q.astype(ml_dtypes.float8_e4m3fn), s, None
  q = np.round(q).astype(np.int8)
  if method == "int8":
    return q, s, None
  return pack_nibbles(q.view(np.uint8)), s, None


def quantize(w_ours, method: str, block=(0, 0), in_dims: int = 1, lead: int = 0) -> QuantizedWeight:
  """A float weight in our orientation [*lead, *In, *Out] (the first `lead`
  dims stacked, the next `in_dims` contracted) -> `QuantizedWeight` (numpy
  leaves; `jax.device_put` places them)."""
  w = np.asarray(w_ours, np.float32)
  lead_shape = w.shape[:lead]
  in_shape, out_shape = w.shape[lead:lead + in_dims], w.shape[lead + in_dims:]
  if not in_shape or not out_shape:
    raise ValueError(f"quantize: a weight of shape {w.shape} with lead={lead}, in_dims={in_dims} "
                     "has no input or output dims")
  m = w.reshape(*lead_shape, math.prod(in_shape), math.prod(out_shape))
  values, scale, scale2 = quantize_matrix(np.swapaxes(m, -1, -2), method, block)
  return QuantizedWeight(values=values, scale=scale, scale2=scale2, method=method,
                         block=tuple(FIXED_BLOCKS.get(method, block)),
                         in_shape=tuple(in_shape), out_shape=tuple(out_shape))
