"""The MoE experts' grouped matmul on Mosaic GPU (Hopper, jax >= 0.11), with
the gate-up fusion and quantized weights (fp8 / int8, MXFP4, NVFP4, int4):
what jax's own `ragged_dot_mgpu` does not take (one bf16 / f16 matrix).

  y = glu(x W_gate^T + b_gate, x W_up^T + b_up)   fused (up given)
  y = x W^T + b                                   one weight

x [R, In] rows sorted by expert (`jax.lax.ragged_dot` semantics, group_sizes
[E]); each weight is the experts' stack in one of three layouts:

  codes  float8_e4m3fn / int8 [E, Out, In] (the checkpoints' [out, in]) with
         block scales [E, ceil(Out / bo), ceil(In / bi)] (`quantized_matmul`'s
         format, float32 / bfloat16): blocks of whole 64 x 64 tiles (bo, bi
         multiples of 64 or the whole dimension: DeepSeek's 128 x 128), or
         one scale per output row over all of In (bo 1: fbgemm / compressed-
         tensors per-channel FP8), or one per tensor;
  packed uint8 [E, Out, In / 2], two 4-bit codes a byte (the even In column
         in the low nibble): "e2m1" FP4 (MXFP4, GPT-OSS's experts as
         published: E8M0 scales uint8 [E, Out, In / 32]; NVFP4, NVIDIA's
         DeepSeek-R1 FP4: float8 scales [E, Out, In / 16] and a second level
         scale2 [E]) or "int4" (two's complement, float32 / bfloat16 scales);
         one scale per output row and group of 16, 32 or a multiple of 64
         values, or per row over all of In;
  plain  bfloat16 / float16 [E, In, Out] (the model's unquantized layout).

Rows are cut into work items of <= 64 rows of one expert (`quantized_grouped_
matmul.work_items`); one program (one warpgroup) per (work item, 64 output
columns) streams In in steps (64 columns; packed: 32 bytes, 64 values), `slots`
in flight: TMA copies of the x tile and of each weight's tile. A quantized
tile is dequantized in registers into a bf16 shared-memory tile that wgmma
reads transposed: one-byte codes times their block's scale; packed nibbles
decoded (FP4: sign, 2-bit exponent, 1-bit mantissa; int4: two's complement)
times their group's scale (E8M0: 2^(s - 127)), the low and high nibbles as
two tiles against x's even and odd columns (the wrapper splits x, so no
nibbles interleave). A step's group scales come by TMA too, from a [E,
In / group, Out] copy XLA makes per call (a group's 64 rows contiguous, as
the load into registers needs: 1/8 of the codes' bytes for MXFP4 written
and read again; storing them so at load would save it). Float32 accumulators,
two when fused (x is read once for both). The epilogue applies per-row
scales and biases, then the GLU ("silu": SwiGLU; "gpt_oss": the clamped
variant with limit and alpha), and stores the tile. An empty item reads no
weights. Other blockings (`unsupported` names them) keep the Pallas
(Triton) kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mosaic_paged_attention import SMEM_BYTES, INTERPRETER, available, plgpu
from pallas_kernels.quantized_grouped_matmul import work_items

TILE = 64  # rows of a work item, output columns and In columns (bytes of codes) of a step
PACKED = ("e2m1", "int4")  # two 4-bit codes a byte, the even In column in the low nibble
PACKED_STEP = 32  # bytes of packed codes a step (64 values: GPT-OSS's 2880 is 45 steps)
CODE_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.int8))
PLAIN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ACTIVATIONS = ("silu", "gpt_oss")


def smem_bytes(num_weights: int, mode: str, slots: int) -> int:
  """x and weight tiles of every slot, the dequantized tiles, the output
  (mode: "plain", "codes" or a packed kind; 4-byte group scales assumed)."""
  nx, t = (2, TILE * PACKED_STEP) if mode in PACKED else (1, TILE * TILE)
  w = (2 if mode == "plain" else 1) * t
  deq = 0 if mode == "plain" else num_weights * nx * 2 * t
  scales = num_weights * slots * 4 * TILE * 4 * (mode in PACKED)  # up to 4 groups a step
  vectors = num_weights * 2 * TILE * 4  # the epilogue's row scales and biases
  return slots * (nx * 2 * t + num_weights * w) + deq + 2 * TILE * TILE + scales + vectors


def unsupported(x_dtype, w_shape, w_dtype, block=None, packed=None) -> str | None:
  """Why the kernel cannot take a weight of this shape / dtype (and, for
  codes, these scale blocks (bo, bi), 0 the whole dimension), else None.
  w_shape: codes [E, Out, In] (packed: [E, Out, In / 2]) or plain [E, In,
  Out]."""
  why = available()
  if why:
    return why
  x_dtype, w_dtype = jnp.dtype(x_dtype), jnp.dtype(w_dtype)
  if x_dtype not in PLAIN_DTYPES:
    return f"x must be bfloat16 or float16 (wgmma inputs), got {x_dtype}"
  if len(w_shape) != 3:
    return f"weights must be an experts' stack [E, ., .], got shape {tuple(w_shape)}"
  if packed not in (None, *PACKED):
    return f"packed must be one of {PACKED}, got {packed!r}"
  if packed and w_dtype != jnp.uint8:
    return f"{packed} codes are uint8 (two per byte), got {w_dtype}"
  if not packed and w_dtype not in CODE_DTYPES and w_dtype != x_dtype:
    return (f"weights must be {x_dtype} (plain) or one-byte codes {[str(d) for d in CODE_DTYPES]}"
            f", got {w_dtype}")
  mode = _mode(w_dtype, packed)
  out, d_in = (w_shape[2], w_shape[1]) if mode == "plain" else (w_shape[1], w_shape[2])
  d_in *= 2 if packed else 1
  step = 2 * PACKED_STEP if packed else TILE
  if out % TILE or d_in % step:
    return f"weights' [Out, In] = [{out}, {d_in}] must be multiples of [{TILE}, {step}]"
  if mode == "plain":
    return None
  if block is None:
    return "quantized codes need their scale block (bo, bi)"
  bo, bi = block[0] or out, block[1] or d_in
  if packed:  # one scale per output row and group of bi values (MXFP4 32, NVFP4 16)
    ok = bo == 1 and (bi >= d_in or bi in (16, 32) or bi % (2 * PACKED_STEP) == 0)
    return None if ok else (f"{packed} codes take scale blocks (1, 16 / 32 / a multiple of "
                            f"{2 * PACKED_STEP} / the whole In), got {(bo, bi)}")
  if not (bo == 1 and bi >= d_in) and (bo % TILE or bi % TILE):
    return (f"scale blocks {bo} x {bi} must be whole {TILE} x {TILE} tiles or one scale per "
            "output row")
  return None


def _glu(g, u, activation, limit, alpha):
  if activation == "silu":
    return g * (1.0 / (1.0 + jnp.exp(-g))) * u
  g, u = jnp.minimum(g, limit), jnp.maximum(jnp.minimum(u, limit), -limit)
  return (u + 1.0) * (g * (1.0 / (1.0 + jnp.exp(-alpha * g))))


def _e2m1(n):
  """FP4 (e2m1) nibbles (int32 0..15, bit 3 the sign) -> their float32 values."""
  e, m = (n >> 1) & 3, (n & 1).astype(jnp.float32)
  mag = jnp.where(e == 0, 0.5 * m, jnp.exp2((e - 1).astype(jnp.float32)) * (1.0 + 0.5 * m))
  return jnp.where((n & 8) != 0, -mag, mag)


def _int4(n):
  """int4 nibbles (int32 0..15, two's complement) -> their float32 values."""
  return (n - jnp.where(n >= 8, 16, 0)).astype(jnp.float32)


def _dequant(mode, w, tile, ts_ref, e, n0, kb, blocks, deq):
  """Weight w's tile of this step (tile [64, step], plain [step, 64]) as
  wgmma right-hand sides, one per x part: plain, the tile itself; codes,
  times its block's scale; packed, the low and high nibbles (even and odd In
  columns) times their group scales (ts_ref: the step's, in shared memory,
  [groups, 64 rows]; none where the row scales wait for the epilogue).
  deq [weights, x parts, 64, step]."""
  if mode == "plain":
    return [tile]
  if mode == "codes":  # per-row scales wait for the epilogue
    s = ts_ref[e, lax.div(n0, jnp.int32(blocks[0])), lax.div(kb, jnp.int32(blocks[1]))]
    deq.at[w, 0][...] = (tile[...].astype(jnp.float32) * s).astype(deq.dtype)
    plgpu.commit_smem()
    return [deq.at[w, 0].T]
  lay = plgpu.Layout.WGMMA_8BIT
  b = plgpu.load(tile, layout=lay).astype(jnp.int32)
  decode = _e2m1 if mode == "e2m1" else _int4
  lo, hi = decode(b & 15), decode(b >> 4)
  groups, _, e8m0 = blocks
  if groups:
    shape = (TILE, PACKED_STEP)
    group = lax.div(plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=lay),
                    jnp.int32(PACKED_STEP // groups))
    scale = None
    for g in range(groups):
      sg = plgpu.load(ts_ref.at[g], layout=lay.reduce(1)).astype(jnp.float32)
      sg = lax.broadcast_in_dim(jnp.exp2(sg - 127.0) if e8m0 else sg, shape, [0])
      scale = sg if scale is None else jnp.where(group == g, sg, scale)
    lo, hi = lo * scale, hi * scale
  deq.at[w, 0][...] = lo.astype(deq.dtype)
  deq.at[w, 1][...] = hi.astype(deq.dtype)
  plgpu.commit_smem()
  return [deq.at[w, 0].T, deq.at[w, 1].T]


def _body(dims, item_ref, *refs):
  """One (work item, 64 output columns): refs = the x parts (whole, or the
  even and odd columns for packed codes), the weights, their tile scales, row scales and
  biases (one of each per weight), the output, then the scratch (x slots,
  weight slots, dequantized tiles, output tile, barriers)."""
  nx, nw, mode, slots, steps, blocks, activation, limit, alpha = dims
  x_refs, refs = refs[:nx], refs[nx:]
  w_refs, ts_refs = refs[:nw], refs[nw:2 * nw]
  col_refs, bias_refs, o_ref = refs[2 * nw:3 * nw], refs[3 * nw:4 * nw], refs[4 * nw]
  x_smem, w_smem, deq_smem, o_smem, vec_smem, bar, vec_bar, *s_smem = refs[4 * nw + 1:]
  i, j = lax.axis_index("items"), lax.axis_index("cols")
  e, rows = item_ref[i, 0], item_ref[i, 1]
  n0 = j * TILE
  hi = jnp.where(rows > 0, jnp.int32(steps), jnp.int32(0))

  kw = PACKED_STEP if mode in PACKED else TILE

  def issue(kb, slot):
    k0 = kb * kw
    for p in range(nx):
      plgpu.copy_gmem_to_smem(x_refs[p].at[pl.ds(i * TILE, TILE), pl.ds(k0, kw)],
                              x_smem.at[p, slot], bar.at[slot])
    for w in range(nw):
      tile = (pl.ds(k0, kw), pl.ds(n0, TILE)) if mode == "plain" else (pl.ds(n0, TILE),
                                                                       pl.ds(k0, kw))
      plgpu.copy_gmem_to_smem(w_refs[w].at[e].at[tile], w_smem.at[w, slot], bar.at[slot])
      if s_smem:  # the step's group scales ([E, groups, Out]: a row of each group)
        groups, per, _ = blocks  # groups a step, steps a group
        first = lax.div(kb * groups, jnp.int32(per))
        plgpu.copy_gmem_to_smem(ts_refs[w].at[e, pl.ds(first, groups), pl.ds(n0, TILE)],
                                s_smem[0].at[w, slot], bar.at[slot])

  for s in range(min(slots, steps)):  # a static step past In would not even trace
    pl.when(s < hi)(lambda s=s: issue(s, s))
  for w in range(nw):  # the epilogue's row scales and biases (s_smem: e2m1's step scales)
    for v, ref in enumerate((col_refs[w], bias_refs[w])):
      plgpu.copy_gmem_to_smem(ref.at[e, pl.ds(n0, TILE)], vec_smem.at[w, v], vec_bar.at[0])

  def step(kb, accs):
    slot = lax.rem(kb, jnp.int32(slots))
    plgpu.barrier_wait(bar.at[slot])
    out = []
    for w in range(nw):
      scales = s_smem[0].at[w, slot] if s_smem else ts_refs[w]
      rhs = _dequant(mode, w, w_smem.at[w, slot], scales, e, n0, kb, blocks, deq_smem)

      def mm(acc_ref, rhs=rhs):
        for p in range(nx):
          plgpu.wgmma(acc_ref, x_smem.at[p, slot], rhs[p])
        return acc_ref[...]
      out.append(accs[w] + pl.run_scoped(mm, plgpu.ACC((TILE, TILE), jnp.float32)))
    pl.when(kb + slots < hi)(lambda: issue(kb + slots, slot))
    return tuple(out)

  zero = plgpu.layout_cast(jnp.zeros((TILE, TILE), jnp.float32), plgpu.Layout.WGMMA)
  accs = lax.fori_loop(jnp.int32(0), hi, step, (zero,) * nw)
  plgpu.barrier_wait(vec_bar.at[0])
  _epilogue(accs, vec_smem, dims, o_smem, o_ref.at[pl.ds(i * TILE, TILE), pl.ds(n0, TILE)])


def _epilogue(accs, vec_smem, dims, o_smem, o_tile):
  """Row scales and biases (vec_smem [weights, 2, 64]: loaded into registers
  from shared memory, which jax 0.11's Mosaic needs), the GLU when fused;
  the tile stored."""
  *_, activation, limit, alpha = dims
  cols = plgpu.Layout.WGMMA.reduce(0)
  ys = []
  for w, acc in enumerate(accs):
    scale = plgpu.load(vec_smem.at[w, 0], layout=cols)
    bias = plgpu.load(vec_smem.at[w, 1], layout=cols)
    ys.append(acc * lax.broadcast_in_dim(scale, (TILE, TILE), [1])
              + lax.broadcast_in_dim(bias, (TILE, TILE), [1]))
  y = _glu(*ys, activation, limit, alpha) if len(ys) == 2 else ys[0]
  o_smem[...] = y.astype(o_smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, o_tile)
  plgpu.wait_smem_to_gmem(0)


def _operands(w, scale, scale2, block, bias, E, out, mode, name):
  """A weight's (tile scales: [E, ., .] f32 blocks, or packed codes' group
  scales [E, In / bi, Out] as stored but transposed; their blocking (codes:
  rows, In steps; packed: groups a step, steps a group, E8M0); row scales
  [E, Out] f32; bias [E, Out] f32)."""
  ones = jnp.ones((E, out), jnp.float32)
  b = jnp.zeros((E, out), jnp.float32) if bias is None else bias.astype(jnp.float32)
  if b.shape != (E, out):
    raise ValueError(f"{name}: bias must be [E, Out] = {(E, out)}, got {b.shape}")
  if mode == "plain":
    return jnp.ones((E, 1, 1), jnp.float32), (out, 1 << 30), ones, b
  d_in = w.shape[2] * (2 if mode in PACKED else 1)
  bo, bi = block[0] or out, block[1] or d_in
  want = (E, -(-out // bo), -(-d_in // bi))
  if scale is None or tuple(scale.shape) != want:
    raise ValueError(f"{name}: scale must be {want} for block {(bo, bi)}, got "
                     f"{None if scale is None else scale.shape}")
  if mode in PACKED:
    return _packed_scales(scale, scale2, bi >= d_in, bi, ones, b, mode, name)
  if bo == 1:  # one scale per output row, over all of In: the epilogue's
    return jnp.ones((E, 1, 1), jnp.float32), (out, 1 << 30), scale[:, :, 0].astype(
        jnp.float32), b
  return scale.astype(jnp.float32), (bo, bi // TILE), ones, b


def _packed_scales(scale, scale2, per_row, bi, ones, b, mode, name):
  """Packed codes' scales: E8M0 bytes (MXFP4), float8 (NVFP4, with its
  per-expert scale2) or float32 / bfloat16; per output row over all of In
  (applied in the epilogue) or per group of bi values (a TMA copy a step
  from the transposed [E, In / bi, Out])."""
  dt = jnp.dtype(scale.dtype)
  allowed = ((jnp.uint8, jnp.float8_e4m3fn) if mode == "e2m1" else (jnp.float32, jnp.bfloat16))
  if dt not in [jnp.dtype(a) for a in allowed]:
    raise ValueError(f"{name}: {mode} codes take scales of {[str(jnp.dtype(a)) for a in allowed]}"
                     f", got {dt}")
  e8m0 = dt == jnp.uint8
  rows = ones if scale2 is None else ones * scale2.astype(jnp.float32).reshape(-1, 1)
  if per_row:
    s = scale[:, :, 0].astype(jnp.float32)
    return jnp.ones((1, 1, 1), jnp.uint8), (0, 1, False), rows * (
        jnp.exp2(s - 127.0) if e8m0 else s), b
  if dt == jnp.bfloat16:  # TMA rows of 4-byte or 1-byte values
    scale = scale.astype(jnp.float32)
  groups, per = max(2 * PACKED_STEP // bi, 1), max(bi // (2 * PACKED_STEP), 1)
  return jnp.swapaxes(scale, 1, 2), (groups, per, e8m0), rows, b


def _mode(w_dtype, packed) -> str:
  if packed is not None:
    return packed
  return "codes" if jnp.dtype(w_dtype) in CODE_DTYPES else "plain"


def _check(xs, ws, group_sizes, block, packed, activation, slots, name):
  """The named errors; -> (mode, E, Out, In)."""
  w = ws[0][0]
  for u, *_ in ws:
    why = unsupported(xs.dtype, u.shape, u.dtype, block, packed)
    if why:
      raise (NotImplementedError if why == available() else ValueError)(f"{name}: {why}")
    if u.shape != w.shape or u.dtype != w.dtype:
      raise ValueError(f"{name}: up {u.shape} {u.dtype} must match w {w.shape} {w.dtype}")
  if activation not in ACTIVATIONS:
    raise ValueError(f"{name}: activation must be one of {ACTIVATIONS}, got {activation!r}")
  if not isinstance(slots, int) or slots < 2:
    raise ValueError(f"{name}: slots must be an int >= 2, got {slots!r}")
  mode, E = _mode(w.dtype, packed), w.shape[0]
  out, d_in = (w.shape[2], w.shape[1]) if mode == "plain" else (w.shape[1], w.shape[2])
  d_in *= 2 if mode in PACKED else 1
  if xs.ndim != 2 or xs.shape[1] != d_in or group_sizes.shape != (E,):
    raise ValueError(f"{name}: xs [R, {d_in}] and group_sizes [{E}] expected, got "
                     f"{xs.shape} and {group_sizes.shape}")
  return mode, E, out, d_in


def mosaic_grouped_matmul(xs, w, group_sizes, *, scale=None, block=None, packed=None,
                          scale2=None, bias=None, up=None, up_scale=None, up_scale2=None,
                          up_bias=None, activation="silu", limit=7.0, alpha=1.702, slots=3,
                          interpret=False):
  """glu(xs W^T + bias, xs U^T + up_bias) with up (the fused gate-up), else
  xs W^T + bias: xs [R, In] sorted by expert (group_sizes [E]) -> [R, Out]
  in xs's dtype, rows past sum(group_sizes) zero. w / up: codes [E, Out, In]
  with scale [E, ceil(Out / bo), ceil(In / bi)] for block (bo, bi) (0: the
  whole dimension; up shares it), packed ("e2m1" / "int4") codes [E, Out,
  In / 2] with per-row group scales (MXFP4: E8M0, block (1, 32); NVFP4: fp8,
  (1, 16), and scale2 [E]), or plain [E, In, Out] (see the module
  docstring); bias [E, Out]. interpret: run on CPU in Mosaic GPU's
  interpret mode."""
  name = "mosaic_grouped_matmul"
  ws = [(w, scale, scale2, bias)] + ([] if up is None else [(up, up_scale, up_scale2, up_bias)])
  mode, E, out, d_in = _check(xs, ws, group_sizes, block, packed, activation, slots, name)
  ops_ = [_operands(u, s, s2, block, b, E, out, mode, name) for u, s, s2, b in ws]
  items, src, pos = work_items(group_sizes, xs.shape[0], TILE)
  x_pad = jnp.concatenate([xs, jnp.zeros((1, d_in), xs.dtype)])[src]
  xparts = (x_pad[:, 0::2], x_pad[:, 1::2]) if mode in PACKED else (x_pad,)
  W, nw, nx = items.shape[0], len(ws), len(xparts)
  kw = PACKED_STEP if mode in PACKED else TILE  # In columns (codes: bytes) a step
  swizzle = lambda cols, dtype: (plgpu.TilingTransform((8, cols)),
                                 plgpu.SwizzleTransform(cols * jnp.dtype(dtype).itemsize))
  w_tile = (kw, TILE) if mode == "plain" else (TILE, kw)
  steps = xparts[0].shape[1] // kw
  groups = ops_[0][1][0] if mode in PACKED else 0
  group_scales = ([plgpu.SMEM((nw, slots, groups, TILE), ops_[0][0].dtype)] if groups else [])
  dims = (nx, nw, mode, slots, steps, ops_[0][1], activation, float(limit), float(alpha))
  kernel = plgpu.kernel(
      lambda *refs: _body(dims, *refs),
      out_type=jax.ShapeDtypeStruct((W * TILE, out), xs.dtype),
      scratch_types=(plgpu.SMEM((nx, slots, TILE, kw), xs.dtype, transforms=swizzle(kw, xs.dtype)),
                     plgpu.SMEM((nw, slots, *w_tile), w.dtype,
                                transforms=swizzle(w_tile[1], w.dtype)),
                     plgpu.SMEM((nw, nx, TILE, kw), xs.dtype, transforms=swizzle(kw, xs.dtype)),
                     plgpu.SMEM((TILE, TILE), xs.dtype),
                     plgpu.SMEM((nw, 2, TILE), jnp.float32),
                     plgpu.Barrier(num_arrivals=nx + nw * (1 + bool(group_scales)),
                                   num_barriers=slots),
                     plgpu.Barrier(num_arrivals=2 * nw, num_barriers=1),
                     *group_scales),
      grid=(W, out // TILE), grid_names=("items", "cols"),
      interpret=INTERPRETER() if interpret else False)
  o = kernel(items, *xparts, *(u[0] for u in ws), *(o[0] for o in ops_),
             *(o[2] for o in ops_), *(o[3] for o in ops_))
  return jnp.concatenate([o, jnp.zeros((1, out), o.dtype)])[pos]
