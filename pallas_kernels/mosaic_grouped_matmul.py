"""The MoE experts' grouped matmul on Mosaic GPU (Hopper, jax >= 0.11), with
the gate-up fusion and one-byte quantized weights: what jax's own
`ragged_dot_mgpu` does not take (it multiplies one bf16 / f16 matrix).

  y = glu(x W_gate^T + b_gate, x W_up^T + b_up)   fused (up given)
  y = x W^T + b                                   one weight

x [R, In] rows sorted by expert (`jax.lax.ragged_dot` semantics, group_sizes
[E]); each weight is the experts' stack in one of two layouts:

  codes  float8_e4m3fn / int8 [E, Out, In] (the checkpoints' [out, in]) with
         block scales [E, ceil(Out / bo), ceil(In / bi)] (`quantized_matmul`'s
         format, float32 / bfloat16): blocks of whole 64 x 64 tiles (bo, bi
         multiples of 64 or the whole dimension: DeepSeek's 128 x 128), or
         one scale per output row over all of In (bo 1: fbgemm / compressed-
         tensors per-channel FP8), or one per tensor;
  plain  bfloat16 / float16 [E, In, Out] (the model's unquantized layout).

Rows are cut into work items of <= 64 rows of one expert (`quantized_grouped_
matmul.work_items`); one program (one warpgroup) per (work item, 64 output
columns) streams In in 64-wide steps, `slots` in flight: TMA copies of the
x tile and of each weight's tile, a one-byte tile dequantized into a bf16
shared-memory tile (times its block's scale) that wgmma reads transposed,
float32 accumulators (two when fused: x is read once for both). The epilogue
applies per-row scales and biases, then the GLU ("silu": SwiGLU; "gpt_oss":
the clamped variant with limit and alpha), and stores the tile. An empty
item reads no weights. Packed 4-bit codes (MXFP4, NVFP4, int4) are not
taken (`unsupported` says so): the Pallas (Triton) kernel keeps them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mosaic_paged_attention import SMEM_BYTES, _INTERPRETER, available, plgpu
from pallas_kernels.quantized_grouped_matmul import work_items

TILE = 64  # rows of a work item, output columns and In columns of a step
CODE_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.int8))
PLAIN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ACTIVATIONS = ("silu", "gpt_oss")


def smem_bytes(num_weights: int, coded: bool, slots: int) -> int:
  """x and weight tiles of every slot, the dequantized tiles, the output."""
  t = TILE * TILE
  w = (1 if coded else 2) * t
  return slots * (2 * t + num_weights * w) + num_weights * 2 * t * coded + 2 * t


def unsupported(x_dtype, w_shape, w_dtype, block=None) -> str | None:
  """Why the kernel cannot take a weight of this shape / dtype (and, for
  codes, these scale blocks (bo, bi), 0 the whole dimension), else None.
  w_shape: codes [E, Out, In] or plain [E, In, Out]."""
  why = available()
  if why:
    return why
  x_dtype, w_dtype = jnp.dtype(x_dtype), jnp.dtype(w_dtype)
  if x_dtype not in PLAIN_DTYPES:
    return f"x must be bfloat16 or float16 (wgmma inputs), got {x_dtype}"
  if len(w_shape) != 3:
    return f"weights must be an experts' stack [E, ., .], got shape {tuple(w_shape)}"
  coded = w_dtype in CODE_DTYPES
  if not coded and w_dtype != x_dtype:
    return (f"weights must be {x_dtype} (plain) or one-byte codes {[str(d) for d in CODE_DTYPES]}"
            f", got {w_dtype}")
  out, d_in = (w_shape[1], w_shape[2]) if coded else (w_shape[2], w_shape[1])
  if out % TILE or d_in % TILE:
    return f"weights' [Out, In] = [{out}, {d_in}] must be multiples of {TILE}"
  if coded:
    if block is None:
      return "one-byte codes need their scale block (bo, bi)"
    bo, bi = block[0] or out, block[1] or d_in
    if not (bo == 1 and bi >= d_in) and (bo % TILE or bi % TILE):
      return (f"scale blocks {bo} x {bi} must be whole {TILE} x {TILE} tiles or one scale per "
              "output row")
  return None


def _glu(g, u, activation, limit, alpha):
  if activation == "silu":
    return g * (1.0 / (1.0 + jnp.exp(-g))) * u
  g, u = jnp.minimum(g, limit), jnp.maximum(jnp.minimum(u, limit), -limit)
  return (u + 1.0) * (g * (1.0 / (1.0 + jnp.exp(-alpha * g))))


def _body(dims, x_ref, item_ref, *refs):
  """One (work item, 64 output columns): refs = the weights, their tile
  scales, row scales and biases (one of each per weight), the output, then
  the scratch (x slots, weight slots, dequantized tiles, output tile, bars)."""
  nw, coded, slots, steps, blocks, activation, limit, alpha = dims
  w_refs, ts_refs = refs[:nw], refs[nw:2 * nw]
  col_refs, bias_refs, o_ref = refs[2 * nw:3 * nw], refs[3 * nw:4 * nw], refs[4 * nw]
  x_smem, w_smem, deq_smem, o_smem, bar = refs[4 * nw + 1:]
  i, j = lax.axis_index("items"), lax.axis_index("cols")
  e, rows = item_ref[i, 0], item_ref[i, 1]
  n0 = j * TILE
  hi = jnp.where(rows > 0, jnp.int32(steps), jnp.int32(0))

  def issue(kb, slot):
    k0 = kb * TILE
    plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(i * TILE, TILE), pl.ds(k0, TILE)], x_smem.at[slot],
                            bar.at[slot])
    for w in range(nw):
      tile = (pl.ds(n0, TILE), pl.ds(k0, TILE)) if coded else (pl.ds(k0, TILE), pl.ds(n0, TILE))
      plgpu.copy_gmem_to_smem(w_refs[w].at[e].at[tile], w_smem.at[w, slot], bar.at[slot])

  for s in range(min(slots, steps)):  # a static step past In would not even trace
    pl.when(s < hi)(lambda s=s: issue(s, s))

  def step(kb, accs):
    slot = lax.rem(kb, jnp.int32(slots))
    plgpu.barrier_wait(bar.at[slot])
    out = []
    for w in range(nw):
      if coded:  # the tile's block scale; per-row scales wait for the epilogue
        s = ts_refs[w][e, lax.div(n0, jnp.int32(blocks[0])), lax.div(kb, jnp.int32(blocks[1]))]
        deq_smem.at[w][...] = (w_smem.at[w, slot][...].astype(jnp.float32) * s).astype(
            deq_smem.dtype)
        plgpu.commit_smem()
        rhs = deq_smem.at[w].T
      else:
        rhs = w_smem.at[w, slot]

      def mm(acc_ref, rhs=rhs):
        plgpu.wgmma(acc_ref, x_smem.at[slot], rhs)
        return acc_ref[...]
      out.append(accs[w] + pl.run_scoped(mm, plgpu.ACC((TILE, TILE), jnp.float32)))
    pl.when(kb + slots < hi)(lambda: issue(kb + slots, slot))
    return tuple(out)

  zero = plgpu.layout_cast(jnp.zeros((TILE, TILE), jnp.float32), plgpu.Layout.WGMMA)
  accs = lax.fori_loop(jnp.int32(0), hi, step, (zero,) * nw)
  cols = plgpu.Layout.WGMMA.reduce(0)
  ys = []
  for w in range(nw):
    scale = plgpu.load(col_refs[w].at[e, pl.ds(n0, TILE)], layout=cols)
    bias = plgpu.load(bias_refs[w].at[e, pl.ds(n0, TILE)], layout=cols)
    ys.append(accs[w] * lax.broadcast_in_dim(scale, (TILE, TILE), [1])
              + lax.broadcast_in_dim(bias, (TILE, TILE), [1]))
  y = _glu(*ys, activation, limit, alpha) if nw == 2 else ys[0]
  o_smem[...] = y.astype(o_smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, o_ref.at[pl.ds(i * TILE, TILE), pl.ds(n0, TILE)])
  plgpu.wait_smem_to_gmem(0)


def _operands(w, scale, block, bias, E, out, name):
  """A weight's (tile scales [E, ., .] f32, their block in elements of Out
  and in steps of In, row scales [E, Out] f32, bias [E, Out] f32)."""
  ones = jnp.ones((E, out), jnp.float32)
  b = jnp.zeros((E, out), jnp.float32) if bias is None else bias.astype(jnp.float32)
  if b.shape != (E, out):
    raise ValueError(f"{name}: bias must be [E, Out] = {(E, out)}, got {b.shape}")
  if jnp.dtype(w.dtype) not in CODE_DTYPES:
    return jnp.ones((E, 1, 1), jnp.float32), (out, 1 << 30), ones, b
  d_in = w.shape[2]
  bo, bi = block[0] or out, block[1] or d_in
  want = (E, -(-out // bo), -(-d_in // bi))
  if scale is None or tuple(scale.shape) != want:
    raise ValueError(f"{name}: scale must be {want} for block {(bo, bi)}, got "
                     f"{None if scale is None else scale.shape}")
  if bo == 1:  # one scale per output row, over all of In: the epilogue's
    return jnp.ones((E, 1, 1), jnp.float32), (out, 1 << 30), scale[:, :, 0].astype(
        jnp.float32), b
  return scale.astype(jnp.float32), (bo, bi // TILE), ones, b


def mosaic_grouped_matmul(xs, w, group_sizes, *, scale=None, block=None, bias=None, up=None,
                          up_scale=None, up_bias=None, activation="silu", limit=7.0,
                          alpha=1.702, slots=3, interpret=False):
  """glu(xs W^T + bias, xs U^T + up_bias) with up (the fused gate-up), else
  xs W^T + bias: xs [R, In] sorted by expert (group_sizes [E]) -> [R, Out]
  in xs's dtype, rows past sum(group_sizes) zero. w / up: codes [E, Out, In]
  with scale [E, ceil(Out / bo), ceil(In / bi)] for block (bo, bi) (0: the
  whole dimension; up shares it), or plain [E, In, Out] (see the module
  docstring); bias [E, Out].
  interpret: run on CPU in Mosaic GPU's interpret mode."""
  name = "mosaic_grouped_matmul"
  ws = [(w, scale, bias)] + ([] if up is None else [(up, up_scale, up_bias)])
  coded = jnp.dtype(w.dtype) in CODE_DTYPES
  for u, s, _ in ws:
    why = unsupported(xs.dtype, u.shape, u.dtype, block)
    if why:
      raise (NotImplementedError if why == available() else ValueError)(f"{name}: {why}")
  if up is not None and (up.shape != w.shape or up.dtype != w.dtype):
    raise ValueError(f"{name}: up {up.shape} {up.dtype} must match w {w.shape} {w.dtype}")
  if activation not in ACTIVATIONS:
    raise ValueError(f"{name}: activation must be one of {ACTIVATIONS}, got {activation!r}")
  if not isinstance(slots, int) or slots < 2:
    raise ValueError(f"{name}: slots must be an int >= 2, got {slots!r}")
  E = w.shape[0]
  out, d_in = (w.shape[1], w.shape[2]) if coded else (w.shape[2], w.shape[1])
  if xs.ndim != 2 or xs.shape[1] != d_in or group_sizes.shape != (E,):
    raise ValueError(f"{name}: xs [R, {d_in}] and group_sizes [{E}] expected, got "
                     f"{xs.shape} and {group_sizes.shape}")
  ops_ = [_operands(u, s, block, b, E, out, name) for u, s, b in ws]
  R = xs.shape[0]
  items, src, pos = work_items(group_sizes, R, TILE)
  x_pad = jnp.concatenate([xs, jnp.zeros((1, d_in), xs.dtype)])[src]
  W, nw = items.shape[0], len(ws)
  x_tiles = (plgpu.TilingTransform((8, TILE)), plgpu.SwizzleTransform(128))
  w_tiles = (plgpu.TilingTransform((8, TILE)), plgpu.SwizzleTransform(64 if coded else 128))
  dims = (nw, coded, slots, d_in // TILE, ops_[0][1], activation, float(limit), float(alpha))
  kernel = plgpu.kernel(
      lambda *refs: _body(dims, *refs),
      out_type=jax.ShapeDtypeStruct((W * TILE, out), xs.dtype),
      scratch_types=(plgpu.SMEM((slots, TILE, TILE), xs.dtype, transforms=x_tiles),
                     plgpu.SMEM((nw, slots, TILE, TILE), w.dtype, transforms=w_tiles),
                     plgpu.SMEM((nw, TILE, TILE), xs.dtype, transforms=x_tiles),
                     plgpu.SMEM((TILE, TILE), xs.dtype),
                     plgpu.Barrier(num_arrivals=1 + nw, num_barriers=slots)),
      grid=(W, out // TILE), grid_names=("items", "cols"),
      interpret=_INTERPRETER() if interpret else False)
  o = kernel(x_pad, items, *(u for u, _, _ in ws), *(o[0] for o in ops_),
             *(o[2] for o in ops_), *(o[3] for o in ops_))
  return jnp.concatenate([o, jnp.zeros((1, out), o.dtype)])[pos]
