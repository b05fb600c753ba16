"""Paged decode attention on Mosaic GPU (Hopper, jax >= 0.11): TMA page loads
and wgmma, for GQA decode and multi-query verify.

Same layout and meaning as `paged_attention` (q [B, N, D] or [B, Q, N, D],
pages [K, P, page_size, D], lengths, page_indices; window, sinks), written
with `plgpu.kernel` instead of Pallas Triton (deprecated in jax 0.11).

One program per (KV head, work item, split), one warpgroup; here a work
item is a sequence (`mosaic_ragged_attention` cuts a mixed step's tokens
into items of whole tokens, `launch` runs either):

  rows    the Q queries x G query heads of the KV head (row = q * G + g),
          padded to the 64 rows of a wgmma tile (Q * G <= 64); each KV page
          is read once per KV head per step.
  pages   a block of `pages_per_block` pages (64+ keys) per loop step: the
          page table drives one TMA copy per page from the HBM pool into a
          swizzled shared-memory tile, `slots` blocks in flight (the copy
          of block i + slots is issued when block i is done).
  math    S = Q K^T and O += P V with wgmma (bf16 / f16 in, f32 out); P goes
          to wgmma from registers and P V accumulates onto O in place (as
          jax's `attention_mgpu`; interpreted, P goes through shared memory
          and the product is added: the interpreter takes no register
          operand); online softmax in base 2 with a finite mask value, so blocks a
          window hides entirely leave no NaN.
  split-K a sequence's blocks are divided over `num_splits` programs; each
          returns its normalised output and log-sum-exp, merged here with
          the sinks (one logit per query head) in the denominator.

On CPU the kernel runs in Mosaic GPU's interpret mode
(`plgpu.InterpretGPUParams`: simulated shared memory, barriers, TMA), which
jax has from 0.11; jax 0.10 gets a named error. Not yet: quantized pages,
MLA (latent pages), Q * G > 64, head dims other than multiples of 64.

Public helpers the other Mosaic kernels share: `INTERPRETER` (Mosaic GPU's
interpret-mode params class, None on a jax without it), `LOG2E` (the base-2
softmax's log2(e)), with `ROWS`, `SMEM_BYTES`, `available`, `finish`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.paged_attention import validate_paged

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
  INTERPRETER = getattr(plgpu, "InterpretGPUParams", None)
except ImportError:  # a jax without Mosaic GPU
  plgpu, INTERPRETER = None, None

ROWS = 64  # one wgmma tile of rows: the Q x G queries of a KV head, padded
MIN_KEYS = 64  # keys per loop step: P's [64, keys] tile is one 128-byte swizzle wide
SMEM_BYTES = 227 * 1024  # Hopper's shared memory per block
MASK = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2E = math.log2(math.e)


def available() -> str | None:
  """None when this jax can run the kernel, else why not."""
  if plgpu is None or INTERPRETER is None or not hasattr(plgpu, "kernel"):
    return (f"jax {jax.__version__} has no Mosaic GPU kernels with an interpreter "
            "(plgpu.kernel, plgpu.InterpretGPUParams): jax >= 0.11 needed")
  return None


def pages_per_block(page_size: int, block_keys: int = MIN_KEYS) -> int:
  """Pages per loop step: enough for `block_keys` keys."""
  return max(1, -(-block_keys // page_size))


def smem_bytes(D: int, page_size: int, slots: int, itemsize: int = 2,
               block_keys: int = MIN_KEYS) -> int:
  """Shared memory of one program: q, `slots` K and V blocks, the f32
  output tile and the log-sum-exp row. (Interpreted, P's tile adds ROWS x
  keys; the interpreter has no shared-memory limit.)"""
  keys = page_size * pages_per_block(page_size, block_keys)
  return itemsize * (ROWS * D + 2 * slots * keys * D) + 4 * (ROWS * D + ROWS)


def unsupported(q_shape, dtype, pages_shape, *, values_dim=None, quantized=False,
                slots: int = 2, block_keys: int = MIN_KEYS) -> tuple[type, str] | None:
  """(exception type, why) when the kernel cannot take these inputs, else
  None. q_shape [B, Q, N, D]; pages_shape [..., K, P, page_size, D]."""
  why = available()
  if why:
    return NotImplementedError, why
  _, Q, N, D = q_shape
  K, _, ps, _ = pages_shape[-4:]
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return TypeError, f"q must be bfloat16 or float16 (wgmma inputs), got {jnp.dtype(dtype)}"
  if quantized:
    return ValueError, "quantized pages are not supported yet"
  if values_dim is None:
    return ValueError, "v_pages is required (latent / MLA pages are not supported yet)"
  if values_dim != D:
    return ValueError, f"values head dim {values_dim} != {D}"
  if D % 64:
    return ValueError, f"head dim must be a multiple of 64 (a 128-byte swizzle row), got {D}"
  if Q * (N // K) > ROWS:
    return ValueError, f"Q x query heads per KV head = {Q * (N // K)} > {ROWS} rows"
  if block_keys % MIN_KEYS:
    return ValueError, f"block_keys must be a multiple of {MIN_KEYS}, got {block_keys}"
  if ps % 8 or (ps * pages_per_block(ps, block_keys)) % MIN_KEYS:
    return ValueError, f"page_size must be a multiple of 8 that tiles {MIN_KEYS} keys, got {ps}"
  used = smem_bytes(D, ps, slots, jnp.dtype(dtype).itemsize, block_keys)
  if used > SMEM_BYTES:
    return ValueError, f"{used} bytes of shared memory > {SMEM_BYTES} (fewer slots)"
  return None


def check_call(q4, k_pages, v_pages, slots, num_splits, block_keys,
               name="mosaic_paged_attention"):
  """The kernel's own limits, as named ValueErrors / TypeErrors."""
  for ok, what, got in ((isinstance(slots, int) and slots >= 2, "slots", slots),
                        (isinstance(num_splits, int) and num_splits >= 1, "num_splits",
                         num_splits)):
    if not ok:
      raise ValueError(f"{name}: {what} must be an int >= "
                       f"{2 if what == 'slots' else 1}, got {got!r}")
  bad = unsupported(q4.shape, q4.dtype, k_pages.shape, slots=slots, block_keys=block_keys,
                    values_dim=None if v_pages is None else v_pages.shape[-1])
  if bad:
    raise bad[0](f"{name}: {bad[1]}")


def item_span(item_ref, glob_ref, i, split, keys, num_splits):
  """Work item i's sequence, row 0's query position, key end, window and the
  key blocks [lo, hi) of its split (blocks wholly before every row's window
  skipped). item_ref [I, 3] int32: sequence, position, end (0: empty item);
  glob_ref [2] int32: the pools' layer and the window (0: none)."""
  window = glob_ref[1]
  b, pos0, end = item_ref[i, 0], item_ref[i, 1], item_ref[i, 2]
  first_blk = jnp.where(window > 0,
                        lax.div(jnp.maximum(pos0 - window + 1, 0), jnp.int32(keys)), 0)
  last_blk = lax.div(end + keys - 1, jnp.int32(keys))
  per = lax.div(jnp.maximum(last_blk - first_blk, 0) + num_splits - 1, jnp.int32(num_splits))
  lo = first_blk + split * per
  return b, pos0, end, window, lo, jnp.minimum(lo + per, last_blk)


def kv_issuer(k_ref, v_ref, tab_ref, layer, kh, b, bufs, ps, ppb, collective_axes=None):
  """issue(blk, slot): TMA copies of key block blk's pages of sequence b (KV
  head kh, pool layer `layer`) into slot `slot` of bufs = (k_smem, v_smem,
  k_bar, v_bar), one copy per page and pool; with collective_axes (a
  cluster's), multicast into every member's slot, each member issuing its
  share."""
  k_smem, v_smem, k_bar, v_bar = bufs

  def issue(blk, slot):
    for j in range(ppb):
      page = tab_ref[b, blk * ppb + j]
      plgpu.copy_gmem_to_smem(k_ref.at[layer, kh, page], k_smem.at[slot, pl.ds(j * ps, ps)],
                              k_bar.at[slot], collective_axes=collective_axes)
      plgpu.copy_gmem_to_smem(v_ref.at[layer, kh, page], v_smem.at[slot, pl.ds(j * ps, ps)],
                              v_bar.at[slot], collective_axes=collective_axes)
  return issue


def wait_last_releases(used_bar, lo, hi, slots):
  """Wait on the release barrier of the last `slots` blocks of [lo, hi),
  which no refill waited for: every phase is then observed before the
  barrier is freed, and no cluster peer still arrives on it after exit."""
  for s in range(slots):
    blk = hi - slots + s
    pl.when(blk >= lo)(lambda blk=blk: plgpu.barrier_wait(
        used_bar.at[lax.rem(blk - lo, jnp.int32(slots))]))


def _body(dims, q_ref, k_ref, v_ref, item_ref, tab_ref, glob_ref, o_ref, lse_ref, q_smem, k_smem,
          v_smem, o_smem, lse_smem, q_bar, k_bar, v_bar, *p_smem):
  """One (KV head, work item, split): stream the split's blocks of pages.
  item_ref [I, 3] int32: the item's sequence, the position of its row 0's
  query and the end of its keys (0: an empty item); glob_ref [2] int32:
  the pools' layer and the window (0: none), either traced. p_smem: [P's
  tile] where interpreted (Mosaic GPU's interpreter takes neither a
  register operand nor a stateful wgmma), else []."""
  G, D, ps, ppb, slots, num_splits, scale = dims
  kh, i, split = lax.axis_index("heads"), lax.axis_index("items"), lax.axis_index("splits")
  b, pos0, end, window, lo, hi = item_span(item_ref, glob_ref, i, split, ps * ppb, num_splits)
  keys = ps * ppb
  plgpu.copy_gmem_to_smem(q_ref.at[i, kh], q_smem, q_bar.at[0])
  issue = kv_issuer(k_ref, v_ref, tab_ref, glob_ref[0], kh, b, (k_smem, v_smem, k_bar, v_bar),
                    ps, ppb)

  for s in range(slots):
    pl.when(lo + s < hi)(lambda s=s: issue(lo + s, s))
  plgpu.barrier_wait(q_bar.at[0])
  wg = plgpu.Layout.WGMMA
  row = plgpu.broadcasted_iota(jnp.int32, (ROWS, keys), 0, layout=wg)
  col = plgpu.broadcasted_iota(jnp.int32, (ROWS, keys), 1, layout=wg)
  q_pos = pos0 + lax.div(row, jnp.int32(G))

  def step(blk, carry):
    acc, m_i, l_i = carry
    slot = lax.rem(blk - lo, jnp.int32(slots))
    plgpu.barrier_wait(k_bar.at[slot])

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
      return acc_ref[...]
    s = pl.run_scoped(qk, plgpu.ACC((ROWS, keys), jnp.float32)) * (scale * LOG2E)
    k_pos = blk * keys + col
    # Causal: keys < end too for every row that is a query (padding rows are dropped).
    visible = (k_pos <= q_pos) & (k_pos < end) & ((window == 0) | (q_pos - k_pos < window))
    p, alpha, m_new, l_i = softmax_step(s, visible, m_i, l_i)
    p16 = p.astype(v_smem.dtype)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    if p_smem:  # interpreted: P through shared memory, the product added (same sum)
      p_smem[0][...] = p16
      plgpu.commit_smem()
    plgpu.barrier_wait(v_bar.at[slot])

    def pv(acc_ref):
      plgpu.wgmma(acc_ref, p_smem[0] if p_smem else p16, v_smem.at[slot])
    if p_smem:
      acc = acc + pl.run_scoped(lambda r: pv(r) or r[...], plgpu.ACC((ROWS, D), jnp.float32))
    else:  # P from registers, accumulated onto acc in place: one [64, D] accumulator
      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
    pl.when(blk + slots < hi)(lambda: issue(blk + slots, slot))
    return acc, m_new, l_i

  o_smem[...], lse_smem[...] = finish(*lax.fori_loop(lo, hi, step, softmax_init(D)))
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, o_ref.at[split, i, kh])
  plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, i, kh])
  plgpu.wait_smem_to_gmem(0)


def softmax_init(width: int):
  """(acc [ROWS, width], running max, running sum) of an online softmax, in
  the wgmma accumulator's register layout."""
  wg = plgpu.Layout.WGMMA
  return (plgpu.layout_cast(jnp.zeros((ROWS, width), jnp.float32), wg),
          plgpu.layout_cast(jnp.full((ROWS,), MASK, jnp.float32), wg.reduce(1)),
          plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), wg.reduce(1)))


def softmax_step(s, visible, m_i, l_i):
  """One block of the online softmax in base 2 (s [ROWS, keys] already
  scaled by log2 e): -> (p, alpha, new max, new sum). Hidden keys get the
  finite MASK, so a block that hides a row entirely leaves no NaN."""
  s = jnp.where(visible, s, MASK)
  m_new = jnp.maximum(m_i, s.max(axis=1))
  alpha = jnp.exp2(m_i - m_new)
  p = jnp.where(visible, jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
  return p, alpha, m_new, l_i * alpha + p.sum(axis=1)


def finish(acc, m_i, l_i):
  """-> (acc / sum, natural log-sum-exp); a row that saw no key: 0, -inf."""
  filled = l_i > 0
  safe_l = jnp.where(filled, l_i, 1.0)
  lse = jnp.where(filled, m_i / LOG2E + jnp.log(safe_l), -jnp.inf)
  return acc / lax.broadcast_in_dim(safe_l, acc.shape, [0]), lse


def merge_lse(o, lse, sinks=None, group=1):
  """Split partials o [W, B, K, R, D] (each normalised), lse [W, B, K, R]
  -> [B, K, R, D] in float32; row r of KV head k is query head k * group +
  r % group, whose sink (if any) joins the row's denominator.

  Written split by split (W is static and small), every step elementwise
  over [B, K, R(, D)]: XLA fuses the whole merge into one loop at batch 1
  where reductions over the split axis took two launches (compiled for an
  H100, jax 0.12.1: 1 against 2 at batch 1, 2 against 3 at 64)."""
  W = lse.shape[0]
  top = lse[0]
  for s in range(1, W):
    top = jnp.maximum(top, lse[s])
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  den, num = 0.0, 0.0
  for s in range(W):
    w = jnp.exp(lse[s] - top)  # [B, K, R]
    den, num = den + w, num + o[s] * w[..., None]
  if sinks is not None:
    K, R = lse.shape[2:]
    sink_rows = jnp.tile(sinks.astype(jnp.float32).reshape(K, group), (1, -(-R // group)))[:, :R]
    den = den + jnp.exp(sink_rows[None] - top)
  return num / jnp.where(den > 0, den, 1.0)[..., None]


def launch(rows, k_pages, v_pages, items, page_indices, layer, window, *, G, scale,
           num_splits, slots, block_keys, interpret):
  """The kernel over work items: rows [I, K, ROWS, D] (item i's query rows
  of each KV head, row = token * G + query head in the group), pools [L, K,
  P, ps, D], items [I, 3] int32 (sequence, position of row 0's query, end
  of its keys), page_indices [B, pages] -> (normalised outputs [W, I, K,
  ROWS, D], log-sum-exps [W, I, K, ROWS]) of the W = num_splits splits,
  float32 (`merge_lse` joins them)."""
  I, K, _, D = rows.shape
  ps = k_pages.shape[-2]
  ppb = pages_per_block(ps, block_keys)
  table = page_indices.astype(jnp.int32)
  table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % ppb)))  # whole blocks; padding masked
  keys = ps * ppb
  tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  dims = (G, D, ps, ppb, slots, num_splits, float(scale))
  kernel = plgpu.kernel(
      lambda *refs: _body(dims, *refs),
      out_type=(jax.ShapeDtypeStruct((num_splits, I, K, ROWS, D), jnp.float32),
                jax.ShapeDtypeStruct((num_splits, I, K, ROWS), jnp.float32)),
      scratch_types=(plgpu.SMEM((ROWS, D), rows.dtype, transforms=tiles),
                     plgpu.SMEM((slots, keys, D), rows.dtype, transforms=tiles),
                     plgpu.SMEM((slots, keys, D), rows.dtype, transforms=tiles),
                     plgpu.SMEM((ROWS, D), jnp.float32),
                     plgpu.SMEM((ROWS,), jnp.float32),
                     plgpu.Barrier(num_barriers=1),
                     plgpu.Barrier(num_arrivals=ppb, num_barriers=slots),
                     plgpu.Barrier(num_arrivals=ppb, num_barriers=slots),
                     *([plgpu.SMEM((ROWS, keys), rows.dtype, transforms=tiles)]
                       if interpret else [])),
      grid=(K, I, num_splits), grid_names=("heads", "items", "splits"),
      interpret=INTERPRETER() if interpret else False)
  glob = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32)])
  return kernel(rows, k_pages, v_pages, items.astype(jnp.int32), table, glob)


def stacked_pools(k_pages, v_pages, layer, name):
  """Pools with a layer axis ([L, K, P, ps, D]) and the layer to read:
  unstacked pools get one (layer 0)."""
  if layer is None:
    k_pages, v_pages, layer = k_pages[None], None if v_pages is None else v_pages[None], 0
  if k_pages.ndim != 5:
    raise ValueError(f"{name}: with layer, pools must be [L, K, P, page_size, D]"
                     f", got {k_pages.shape}")
  return k_pages, v_pages, layer


def mosaic_paged_attention(q, k_pages, v_pages, lengths, page_indices, *, sm_scale=None,
                           window=0, sinks=None, num_splits=1, slots=2, block_keys=MIN_KEYS,
                           layer=None, interpret=False):
  """Paged decode / verify attention on Mosaic GPU (see the module docstring).

  q [B, N, D] -> [B, N, D]; q [B, Q, N, D] -> [B, Q, N, D], the Q queries at
  positions lengths - Q .. lengths - 1, causal among themselves. layer: the
  pools carry a leading layer axis ([L, K, P, page_size, D]) and this layer's
  pages are read (an int or a traced scalar). block_keys: keys a loop step
  loads (a multiple of 64; whole pages). interpret: run on CPU in Mosaic
  GPU's interpret mode.
  """
  squeeze = q.ndim == 3
  q4 = q[:, None] if squeeze else q
  k_pages, v_pages, layer = stacked_pools(k_pages, v_pages, layer, "mosaic_paged_attention")
  view = lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
  validate_paged(q4, view(k_pages), view(v_pages), lengths, page_indices, window=window,
                 sinks=sinks, name="mosaic_paged_attention")
  check_call(q4, k_pages, v_pages, slots, num_splits, block_keys)
  B, Q, N, D = q4.shape
  K = k_pages.shape[1]
  G = N // K
  scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
  rows = q4.reshape(B, Q, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K, Q * G, D)
  rows = jnp.pad(rows, ((0, 0), (0, 0), (0, ROWS - Q * G), (0, 0)))
  lengths = lengths.astype(jnp.int32)
  items = jnp.stack([jnp.arange(B, dtype=jnp.int32), lengths - Q, lengths], axis=1)
  o, lse = launch(rows, k_pages, v_pages, items, page_indices, layer, window, G=G, scale=scale,
                  num_splits=num_splits, slots=slots, block_keys=block_keys, interpret=interpret)
  out = merge_lse(o, lse, sinks, G)[:, :, :Q * G]
  out = out.reshape(B, K, Q, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Q, N, D).astype(q.dtype)
  return out[:, 0] if squeeze else out
