"""Paged attention over a KV page pool: decode (Q = 1), multi-query verify
(Q > 1, causal among the Q) and ragged mixed batches, GQA, sliding window,
attention sinks, split-K.

Layout (shared with the engine's page pool and jax's Pallas GPU op):
  q            [B, N, D] or [B, Q, N, D]   (Q newest tokens of each sequence)
  k_pages      [K, P, page_size, D]
  v_pages      [K, P, page_size, Dv]       (None: values = k[..., :Dv], MLA's latent)
  k_scale      None, or a float32 scalar: quantized pages (fp8 e4m3 / int8) read
  v_scale      as pages * scale (`dequantize`): per tile inside the kernel, each
               tile cast to q's dtype and its scale folded into the f32 products
  lengths      [B] int32, KV tokens of each sequence including its Q new ones
  page_indices [B, pages_per_seq] int32    (unused slots may point at any page, e.g. 0)

The core (`ragged_core`) works on a token-flattened batch: sequence b owns the
query rows cu_q_lens[b]:cu_q_lens[b + 1]. Its work items are query blocks: a
sequence with q tokens gets ceil(q / block_q) items, so a decode token costs
one small item and a prefill chunk is tiled, never padded to the longest.
One program per (KV head x row block, item, split), the first axis fastest in
launch order, so an item's row blocks run side by side and share its pages in L2:

  rows      an item's block_q tokens x the G query heads of one KV head,
            tiled into row blocks of at most 64 (tensor-core tiles >= 16);
            a KV head's pages are read once per row block, so once per step
            whenever G x block_q <= 64 (every decode case but MLA without TP).
  pages     the pool stays in HBM: each program gathers only its own pages,
            `pages_per_compute_block` per loop step, through pointer loads
            (Triton pipelines them over `num_stages` buffers).
  head dim  split into power-of-two parts (MLA 576 = 512 + 64, 192 = 128 + 64):
            scores add the parts' dots, nothing is padded.
  split-K   (flash-decoding) a sequence's pages are divided over `num_splits`
            programs; each returns an unnormalised partial (acc, max, sum) that
            the wrapper merges with log-sum-exp weights; sinks join the
            denominator there.

On GPU the kernel lowers through Triton (jax 0.10: `plgpu.CompilerParams`);
it runs on CPU in interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MASK = -0.7 * float(jnp.finfo(jnp.float32).max)
MAX_ROWS = 128  # rows per program for values up to 128 wide ([128, 128] f32 accumulators)
MAX_ROWS_WIDE = 64  # ... and for wider values (MLA's [64, 512] f32 accumulators)


def dequantize(pages, scale, dtype):
  """Quantized KV (fp8 / int8, or any dtype) -> pages * scale in `dtype`,
  the product taken in float32 (the kernel's per-tile read, the references'
  whole-pool one). scale None: a cast."""
  if scale is None:
    return pages.astype(dtype)
  return (pages.astype(jnp.float32) * scale).astype(dtype)


def max_rows(dv: int) -> int:
  """Rows a program tiles: accumulators [rows, Dv] f32 must stay in registers."""
  return MAX_ROWS if dv <= 128 else MAX_ROWS_WIDE


@dataclasses.dataclass(frozen=True)
class PagedBlocks:
  """pages_per_compute_block: pages loaded per loop step (block_k = that x
  page_size); num_splits: programs per sequence over its pages; num_warps /
  num_stages: Triton's launch and software-pipelining depth (GPU only)."""

  pages_per_compute_block: int = 1
  num_splits: int = 1
  num_warps: int = 4
  num_stages: int = 2

  def validate(self):
    for name in ("pages_per_compute_block", "num_splits", "num_warps", "num_stages"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")


def pow2_parts(n: int) -> tuple[tuple[int, int], ...]:
  """(start, size) column parts of a width-n axis, each a power of two,
  largest first: 576 -> ((0, 512), (512, 64))."""
  parts, start = [], 0
  for bit in reversed(range(n.bit_length())):
    if n & (1 << bit):
      parts.append((start, 1 << bit))
      start += 1 << bit
  return tuple(parts)


def gpu_blocks(*, num_seqs: int, num_kv_heads: int, num_q_heads: int, max_q: int,
               pages_per_seq: int, page_size: int, head_dim: int, value_dim: int,
               values_from_keys: bool = False, sms: int = 132,
               quantized_kv: bool = False) -> PagedBlocks:
  """GPU tiling from static shapes.

  - pages_per_compute_block: ~64 keys per loop step.
  - num_warps 8 when the f32 accumulator exceeds [64, 128] (MLA's [64, 512]
    is 128 registers a thread at 256 threads; at 128 threads ptxas spills).
  - num_splits (split-K): enough programs for ~2 per SM when sequences x KV
    heads x row blocks fall short, but never so many that the f32 partials
    (rows x (Dv + 2) x 4 bytes, written and read, per split) exceed 5% of
    the KV bytes the programs read, nor more splits than page blocks.
  - num_stages 1 for quantized (1-byte) pages with MLA-wide values: the
    pipelined fp8 buffers plus the tile cast to bf16 for the dot requested
    241664 bytes of shared memory at 2 stages for DeepSeek-V3's [64, 576]
    tiles (H100: 232448 available); 1 stage fits.
  """
  ppcb = max(1, 64 // page_size)
  _, rows, _ = item_sizes(num_kv_heads, num_q_heads, max_q, num_seqs * max_q, num_seqs,
                          value_dim)
  block_r = min(rows, max_rows(value_dim))
  row_blocks = rows // block_r
  programs = num_seqs * num_kv_heads * row_blocks
  splits = max(1, 2 * sms // programs)
  itemsize = 1 if quantized_kv else 2
  kv_bytes = (pages_per_seq * page_size * (head_dim + (0 if values_from_keys else value_dim))
              * itemsize)
  partial_bytes = rows * (value_dim + 2) * 4 * 2
  splits = min(splits, 8, max(1, int(0.05 * kv_bytes * row_blocks / partial_bytes)),
               pl.cdiv(pages_per_seq, ppcb))
  # 8 warps keep a [64, 512] or [128, 128] f32 accumulator at <= 128 registers a thread.
  wide = value_dim >= 256 or block_r * value_dim > 64 * 128
  return PagedBlocks(pages_per_compute_block=ppcb, num_splits=max(1, splits),
                     num_warps=8 if wide else 4,
                     num_stages=1 if quantized_kv and value_dim >= 256 else 2)


def tile_error(D: int, Dv: int, page_size: int, ppcb: int) -> str | None:
  """Why the compiled (GPU) kernel cannot tile these sizes, or None.
  Triton tiles are powers of two and its dots need every dim >= 16."""
  small = [n for _, n in pow2_parts(D) + pow2_parts(Dv) if n < 16]
  if small:
    return (f"head dims D={D}, Dv={Dv} split into power-of-two parts {pow2_parts(D)}, "
            f"{pow2_parts(Dv)}; parts below 16 cannot be tensor-core tiles")
  if page_size & (page_size - 1) or ppcb & (ppcb - 1):
    return f"page_size ({page_size}) and pages_per_compute_block ({ppcb}) must be powers of two"
  if page_size * ppcb < 16:
    return f"page_size x pages_per_compute_block = {page_size * ppcb} keys per step must be >= 16"
  return None


def _kernel(q_ref, k_ref, v_ref, table_ref, item_ref, glob_ref, *refs, scale, group,
            row_blocks, block_r, pages_per_split, ppcb, k_parts, v_parts, v_from_k, normalize,
            has_sinks, quantized):
  # q_ref     [block_r, D]        rows r: token r // G of the item x query head r % G
  # k_ref     [L, K, P, ps, D]    the whole stacked pool, left in HBM (pointer loads)
  # v_ref     [L, K, P, ps, Dv]   (None when v_from_k: values are k's first Dv columns)
  # table_ref [pages_padded]      the item's sequence's page ids (+ ppcb padding)
  # item_ref  [4] int32           kv_end (keys visible to the item's last token),
  #                               q_pos0 (first token's position), n_tok, unused
  # glob_ref  [2] int32           layer, window (0 = none)
  # kvs_ref   [2] f32             (quantized pages) k_scale, v_scale
  # sink_ref  [block_r] f32       (normalize with sinks) each row's head's sink logit
  # normalize (one split): o_ref [block_r, Dv] in q's dtype, the attention output;
  # else o_ref [block_r, Dv] f32, m_ref / l_ref [block_r] f32: this split's partials
  refs = list(refs)
  kvs_ref = refs.pop(0) if quantized else None
  sink_ref = refs.pop(0) if normalize and has_sinks else None
  o_ref, *ml_refs = refs
  head = pl.program_id(0) // row_blocks
  row0 = (pl.program_id(0) % row_blocks) * block_r
  split = pl.program_id(2)
  layer, window = glob_ref[0], glob_ref[1]
  kv_end, q_pos0, n_tok = item_ref[0], item_ref[1], item_ref[2]
  page_size = k_ref.shape[3]
  block_k = ppcb * page_size
  r = row0 + lax.broadcasted_iota(jnp.int32, (block_r, block_k), 0)
  q_pos = q_pos0 + r // group  # [block_r, block_k]
  row_valid = r < n_tok * group
  dtype = q_ref.dtype
  exact = lax.Precision.HIGHEST if dtype == jnp.float32 else None
  dot = functools.partial(lax.dot_general, preferred_element_type=jnp.float32, precision=exact)
  qs = [q_ref[:, pl.ds(a, n)] for a, n in k_parts]
  # Quantized pages: each tile is cast to q's dtype (exact: e4m3 and int8
  # values are bf16 values) and the scales fold into the f32 products,
  # q.(k s_k) = (q.k) s_k and p.(v s_v) = (p.v) s_v, so no f32 tile is
  # materialised (an f32 [64, 576] MLA tile overflows H100 shared memory).
  k_scale, v_scale = (kvs_ref[0], kvs_ref[1]) if quantized else (1.0, 1.0)
  qk_scale = scale * k_scale

  def load(ref, pages, a, n):  # one tile [block_k, n] in q's dtype
    return ref[layer, head, pages, :, pl.ds(a, n)].reshape(block_k, n).astype(dtype)

  first_page = split * pages_per_split
  end_page = jnp.minimum(first_page + pages_per_split, pl.cdiv(kv_end, page_size))
  # With a window, pages wholly before every row's window are skipped; blocks
  # start at the first page needed (the table carries ppcb pages of padding).
  lo_tok = jnp.where(window > 0, q_pos0 - window + 1, 0)
  start_page = jnp.maximum(first_page, jnp.maximum(lo_tok, 0) // page_size)
  num_blocks = pl.cdiv(jnp.maximum(end_page - start_page, 0), ppcb)
  end_tok = end_page * page_size

  def body(blk, carry):
    accs, m, l = carry
    local = start_page + blk * ppcb
    pages = table_ref[pl.ds(local, ppcb)]  # [ppcb]
    ks = [load(k_ref, pages, a, n) for a, n in k_parts]
    s = sum(dot(q, k, (((1,), (1,)), ((), ()))) for q, k in zip(qs, ks)) * qk_scale
    k_pos = local * page_size + lax.broadcasted_iota(jnp.int32, (block_r, block_k), 1)
    mask = (k_pos < jnp.minimum(kv_end, end_tok)) & (k_pos <= q_pos) & row_valid
    mask &= (window == 0) | (q_pos - k_pos < window)
    s = jnp.where(mask, s, MASK)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    corr = jnp.exp(m - m_new)
    if v_from_k:
      vs = ks[:len(v_parts)]
    else:
      vs = [load(v_ref, pages, a, n) for a, n in v_parts]
    pv = p.astype(dtype)
    accs = tuple(corr[:, None] * acc + dot(pv, v, (((1,), (0,)), ((), ())))
                 for acc, v in zip(accs, vs))
    return accs, m_new, corr * l + p.sum(axis=1)

  if sink_ref is not None:  # the sink: a virtual key with logit `sink` and a zero value
    m0, l0 = sink_ref[...], jnp.ones((block_r,), jnp.float32)
  else:
    m0, l0 = jnp.full((block_r,), MASK, jnp.float32), jnp.zeros((block_r,), jnp.float32)
  init = (tuple(jnp.zeros((block_r, n), jnp.float32) for _, n in v_parts), m0, l0)
  accs, m, l = lax.fori_loop(0, num_blocks, body, init)
  if normalize:  # one split: the output itself (rows that see nothing are 0)
    inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    for (a, n), acc in zip(v_parts, accs):
      o_ref[:, pl.ds(a, n)] = (acc * (inv * v_scale)[:, None]).astype(o_ref.dtype)
    return
  for (a, n), acc in zip(v_parts, accs):
    o_ref[:, pl.ds(a, n)] = acc * v_scale if quantized else acc
  ml_refs[0][...] = m
  ml_refs[1][...] = l


@dataclasses.dataclass(frozen=True)
class Items:
  """The work plan of one call: item w covers tokens [start, start + n_tok) of
  sequence seq (n_tok = 0: an empty item past the last sequence)."""

  seq: jax.Array  # [W]
  start: jax.Array  # [W] first token row in the flattened q
  n_tok: jax.Array  # [W]
  first: jax.Array  # [B] first item of each sequence


def plan_items(cu_q_lens, num_items: int, block_q: int) -> Items:
  """Query-block work items of a ragged batch (static count num_items)."""
  B = cu_q_lens.shape[0] - 1
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  per_seq = (q_lens + block_q - 1) // block_q
  ends = jnp.cumsum(per_seq)
  first = ends - per_seq
  w = jnp.arange(num_items, dtype=jnp.int32)
  seq = jnp.minimum(jnp.searchsorted(ends, w, side="right", method="compare_all"), B - 1).astype(jnp.int32)
  j = w - first[seq]
  start = cu_q_lens[seq] + j * block_q
  n_tok = jnp.where(w < ends[-1], jnp.clip(q_lens[seq] - j * block_q, 0, block_q), 0)
  return Items(seq, start, n_tok.astype(jnp.int32), first.astype(jnp.int32))


def item_sizes(num_kv_heads: int, num_q_heads: int, max_q: int, num_tokens: int,
               num_seqs: int, value_dim: int = 128) -> tuple[int, int, int]:
  """-> (block_q tokens per item, rows per item (all its row blocks), number
  of items W). An item holds as many tokens as one program's rows allow."""
  G = num_q_heads // num_kv_heads
  block_q = min(pl.next_power_of_2(max_q),
                max(1, max_rows(value_dim) // pl.next_power_of_2(G)))
  rows = max(16, pl.next_power_of_2(block_q * G))
  # sum_b ceil(q_b / block_q) <= T / block_q + B, and <= B ceil(max_q / block_q).
  W = min(num_seqs * pl.cdiv(max_q, block_q), num_tokens // block_q + num_seqs)
  return block_q, rows, max(W, 1)


def ragged_core(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *, max_q, scale,
                window=0, sinks=None, dv=None, blocks: PagedBlocks = PagedBlocks(), layer=None,
                k_scale=None, v_scale=None, interpret=False):
  """q [T, N, D] token-flattened (module docstring) -> [T, N, Dv] (rows past
  cu_q_lens[-1] are 0). Shared by paged, MLA and ragged attention; callers
  validate inputs. layer: pools carry a leading layer axis [L, K, P, ps, D] and
  this (possibly traced) layer is read, never sliced out of the stack.
  k_scale / v_scale (scalars, or None): quantized pages, dequantized per tile
  (v_scale None with k_scale: the values' scale is k_scale, MLA's one latent)."""
  if layer is None:
    k_pages = k_pages[None]
    v_pages = None if v_pages is None else v_pages[None]
    layer = 0
  T, N, D = q.shape
  _, K, _, page_size, _ = k_pages.shape
  B = kv_lens.shape[0]
  v_from_k = v_pages is None
  dv = dv if v_from_k else v_pages.shape[-1]
  G = N // K
  k_parts, v_parts = pow2_parts(D), pow2_parts(dv)
  if v_from_k and k_parts[:len(v_parts)] != v_parts:  # value columns first: loads are shared
    k_parts = v_parts + tuple((dv + a, n) for a, n in pow2_parts(D - dv))
  ppcb, splits = blocks.pages_per_compute_block, blocks.num_splits
  pps = page_indices.shape[1]
  pages_per_split = pl.cdiv(pl.cdiv(pps, splits), ppcb) * ppcb
  block_q, rows, W = item_sizes(K, N, max_q, T, B, dv)
  block_r = min(rows, max_rows(dv))
  row_blocks = rows // block_r
  normalize = splits == 1  # one split: the kernel writes the output, no merge

  it = plan_items(cu_q_lens.astype(jnp.int32), W, block_q)
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  kv_lens = kv_lens.astype(jnp.int32)
  q_pos0 = kv_lens[it.seq] - q_lens[it.seq] + (it.start - cu_q_lens[it.seq])
  item_meta = jnp.stack([q_pos0 + it.n_tok, q_pos0, it.n_tok, jnp.zeros_like(q_pos0)], 1)
  pages_padded = pages_per_split * splits + ppcb
  tables = jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, pages_padded - pps)))
  tables = tables[it.seq]  # [W, pages_padded]
  # Item rows: token t of the item x head g of a KV head -> [W, K, rows, D].
  tok = jnp.clip(it.start[:, None] + jnp.arange(block_q)[None], 0, T - 1)  # [W, block_q]
  qi = q[tok].reshape(W, block_q, K, G, D).transpose(0, 2, 1, 3, 4).reshape(W, K, -1, D)
  qi = jnp.pad(qi, ((0, 0), (0, 0), (0, rows - block_q * G), (0, 0)))
  glob = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32)])

  kernel = functools.partial(
      _kernel, scale=scale, group=G, row_blocks=row_blocks, block_r=block_r,
      pages_per_split=pages_per_split, ppcb=ppcb, k_parts=k_parts, v_parts=v_parts,
      v_from_k=v_from_k, normalize=normalize, has_sinks=sinks is not None,
      quantized=k_scale is not None)
  hbm = pl.BlockSpec(memory_space=pl.ANY)
  rb = lambda i: i % row_blocks
  kvh = lambda i: i // row_blocks
  in_specs = [
      pl.BlockSpec((None, None, block_r, D), lambda i, w, s: (w, kvh(i), rb(i), 0)),
      hbm,
      None if v_from_k else hbm,
      pl.BlockSpec((None, pages_padded), lambda i, w, s: (w, 0)),
      pl.BlockSpec((None, 4), lambda i, w, s: (w, 0)),
      pl.BlockSpec((2,), lambda i, w, s: (0,)),
  ]
  args = [qi, k_pages, v_pages, tables, item_meta.astype(jnp.int32), glob]
  if k_scale is not None:
    in_specs.append(pl.BlockSpec((2,), lambda i, w, s: (0,)))
    args.append(jnp.stack([jnp.asarray(k_scale, jnp.float32),
                           jnp.asarray(k_scale if v_scale is None else v_scale, jnp.float32)]))
  if normalize and sinks is not None:  # row r of KV head k: head k G + r % G's sink
    sink_rows = jnp.tile(sinks.astype(jnp.float32).reshape(K, G), (1, pl.cdiv(rows, G)))
    in_specs.append(pl.BlockSpec((None, block_r), lambda i, w, s: (kvh(i), rb(i))))
    args.append(sink_rows[:, :rows])
  o_spec = pl.BlockSpec((None, None, None, block_r, dv), lambda i, w, s: (w, kvh(i), s, rb(i), 0))
  ml_spec = pl.BlockSpec((None, None, None, block_r), lambda i, w, s: (w, kvh(i), s, rb(i)))
  if normalize:
    out_shape = [jax.ShapeDtypeStruct((W, K, 1, rows, dv), q.dtype)]
    out_specs = [o_spec]
  else:
    out_shape = [jax.ShapeDtypeStruct((W, K, splits, rows, dv), jnp.float32),
                 jax.ShapeDtypeStruct((W, K, splits, rows), jnp.float32),
                 jax.ShapeDtypeStruct((W, K, splits, rows), jnp.float32)]
    out_specs = [o_spec, ml_spec, ml_spec]
  if v_from_k:
    in_specs.pop(2)
    args.pop(2)
    kernel = functools.partial(_drop_arg, kernel, 2)
  outs = pl.pallas_call(
      kernel, grid=(K * row_blocks, W, splits), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=interpret, name="paged_attention",
      compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                           num_stages=blocks.num_stages))(*args)
  out = outs[0][:, :, 0] if normalize else merge_splits(*outs, sinks, G)  # [W, K, rows, Dv]
  # Token t of sequence b sits in item first[b] + i // block_q, row (i % block_q) G + g.
  t, seq, valid = token_sequences(cu_q_lens, T)
  i = t - cu_q_lens[seq]
  w = jnp.clip(it.first[seq] + i // block_q, 0, W - 1)
  tok_rows = (i % block_q)[:, None] * G + jnp.arange(G)[None]  # [T, G]
  out = out[w[:, None, None], jnp.arange(K)[None, :, None], tok_rows[:, None, :]]  # [T, K, G, Dv]
  return jnp.where(valid[:, None, None], out.reshape(T, N, dv), 0).astype(q.dtype)


def merge_splits(acc, m, l, sinks, group):
  """Split-K partials [W, K, S, R(, Dv)] -> normalised [W, K, R, Dv]; the
  sinks (one logit per query head, row r -> head r % G) join the denominator."""
  m_all = jnp.max(m, axis=2)  # [W, K, R]
  w = jnp.exp(m - m_all[:, :, None])
  num = jnp.sum(acc * w[..., None], axis=2)
  den = jnp.sum(l * w, axis=2)
  if sinks is not None:
    K, R = m_all.shape[1:]
    sink_rows = jnp.tile(sinks.astype(jnp.float32).reshape(K, group), (1, -(-R // group)))[:, :R]
    den = den + jnp.exp(sink_rows[None] - m_all)
  return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


def _drop_arg(kernel, index, *refs):
  return kernel(*refs[:index], None, *refs[index:])


def token_sequences(cu_q_lens, num_tokens: int):
  """Token-flattened steps: -> (t, seq, valid) [T] int32 / int32 / bool:
  token t belongs to sequence seq[t] (cu_q_lens [B + 1]); tokens past
  cu_q_lens[-1] are padding (not valid, seq clipped to a real one)."""
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  B = cu_q_lens.shape[0] - 1
  seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right", method="compare_all") - 1, 0, B - 1)
  return t, seq, t < cu_q_lens[-1]


def to_padded(q, cu_q_lens, max_q):
  """Token-flattened q [T, ...] -> ([B, max_q, ...], seq [T], row [T], valid [T]):
  token t is row `row[t]` of sequence `seq[t]`; padding tokens are not valid."""
  B = cu_q_lens.shape[0] - 1
  t, seq, valid = token_sequences(cu_q_lens, q.shape[0])
  row = t - cu_q_lens[seq]
  q_pad = jnp.zeros((B, max_q, *q.shape[1:]), q.dtype)
  q_pad = q_pad.at[jnp.where(valid, seq, B), row].set(q, mode="drop")
  return q_pad, seq, jnp.minimum(row, max_q - 1), valid


def validate_paged(q, k_pages, v_pages, lengths, page_indices, *, window, sinks, name,
                   q_lens=None, k_scale=None, v_scale=None):
  """Shape and dtype checks shared by the paged wrappers (ValueError/TypeError).
  Pages in q's dtype need no scales; quantized pages (any other dtype, e.g.
  float8_e4m3fn or int8) need k_scale (and v_scale with v_pages), scalars."""
  def need(ok, msg, exc=ValueError):
    if not ok:
      raise exc(f"{name}: {msg}")

  need(q.ndim == 4, f"q must be [B, Q, N, D] (or [B, N, D]), got shape {q.shape}")
  need(k_pages.ndim == 4, f"k_pages must be [K, P, page_size, D], got shape {k_pages.shape}")
  B, Q, N, D = q.shape
  K = k_pages.shape[0]
  need(N % K == 0, f"query heads ({N}) must be a multiple of KV heads ({K})")
  need(k_pages.shape[-1] == D, f"k_pages head dim {k_pages.shape[-1]} != q head dim {D}")
  if v_pages is not None:
    need(v_pages.ndim == 4 and v_pages.shape[:3] == k_pages.shape[:3],
         f"v_pages must be [K, P, page_size, Dv] matching k_pages {k_pages.shape[:3]}, "
         f"got {v_pages.shape}")
  need(lengths.shape == (B,), f"lengths must be [B={B}], got {lengths.shape}")
  need(page_indices.ndim == 2 and page_indices.shape[0] == B,
       f"page_indices must be [B={B}, pages_per_seq], got {page_indices.shape}")
  need(jnp.issubdtype(lengths.dtype, jnp.integer), f"lengths must be integer, got {lengths.dtype}",
       TypeError)
  need(jnp.issubdtype(page_indices.dtype, jnp.integer),
       f"page_indices must be integer, got {page_indices.dtype}", TypeError)
  need(jnp.issubdtype(q.dtype, jnp.floating), f"q must be floating, got {q.dtype}", TypeError)
  if k_scale is None:
    need(q.dtype == k_pages.dtype, f"q dtype {q.dtype} != k_pages dtype {k_pages.dtype} (pages "
         "in another dtype are quantized: pass k_scale / v_scale)", TypeError)
  for arg, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
    if scale is not None:  # jnp.shape(None) is deprecated (jax 0.12): the message is eager
      need(jnp.shape(scale) == (), f"{arg} must be a scalar, got shape {jnp.shape(scale)}")
  need(v_pages is None or (k_scale is None) == (v_scale is None),
       "pass k_scale and v_scale together (quantized k_pages and v_pages)")
  if v_pages is not None and k_scale is None:
    need(v_pages.dtype == q.dtype, f"q dtype {q.dtype} != v_pages dtype {v_pages.dtype}",
         TypeError)
  need(sinks is None or sinks.shape == (N,), f"sinks must be [N={N}], got "
       f"{None if sinks is None else sinks.shape}")
  if isinstance(window, int):
    need(window >= 0, f"window must be >= 0, got {window}")
  if not isinstance(lengths, jax.core.Tracer):
    need(int(jnp.max(lengths)) <= page_indices.shape[1] * k_pages.shape[2],
         f"a length exceeds pages_per_seq x page_size = {page_indices.shape[1] * k_pages.shape[2]}")
    min_len = Q if q_lens is None else q_lens
    need(bool(jnp.all(lengths >= min_len)),
         "lengths must be >= each sequence's query count (they include the new tokens)")


def check_tiles(D, Dv, page_size, blocks: PagedBlocks, interpret: bool, name: str):
  """Compiled kernels only: a named ValueError for sizes Triton cannot tile."""
  why = None if interpret else tile_error(D, Dv, page_size, blocks.pages_per_compute_block)
  if why:
    raise ValueError(f"{name}: the GPU kernel cannot tile these shapes: {why} "
                     "(jaxinfer.ops falls back to XLA for them)")


def paged_attention(q, k_pages, v_pages, lengths, page_indices, *, sm_scale=None, window=0,
                    sinks=None, pages_per_compute_block=1, num_splits=1, num_warps=4,
                    num_stages=2, k_scale=None, v_scale=None, interpret=False):
  """Paged decode / verify attention (layout in the module docstring).

  q [B, N, D] -> [B, N, Dv]; q [B, Q, N, D] -> [B, Q, N, Dv], the Q queries
  at positions lengths - Q .. lengths - 1, causal among themselves.
  k_scale / v_scale: quantized pages (e.g. fp8 e4m3, int8) read as pages * scale.
  """
  squeeze = q.ndim == 3
  q4 = q[:, None] if squeeze else q
  validate_paged(q4, k_pages, v_pages, lengths, page_indices, window=window, sinks=sinks,
                 name="paged_attention", k_scale=k_scale, v_scale=v_scale)
  blocks = PagedBlocks(pages_per_compute_block, num_splits, num_warps, num_stages)
  blocks.validate()
  B, Q, N, D = q4.shape
  dv = D if v_pages is None else v_pages.shape[-1]
  check_tiles(D, dv, k_pages.shape[2], blocks, interpret, "paged_attention")
  scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
  cu = jnp.arange(B + 1, dtype=jnp.int32) * Q
  out = ragged_core(q4.reshape(B * Q, N, D), k_pages, v_pages, lengths, page_indices, cu,
                    max_q=Q, scale=scale, window=window, sinks=sinks, blocks=blocks,
                    k_scale=k_scale, v_scale=v_scale, interpret=interpret)
  out = out.reshape(B, Q, N, -1)
  return out[:, 0] if squeeze else out


def paged_attention_reference(q, k_pages, v_pages, lengths, page_indices, *, sm_scale=None,
                              window=0, sinks=None, dv=None, q_lens=None, k_scale=None,
                              v_scale=None):
  """Pure jnp, float32: dequantize the whole pool first (scales given),
  gather each sequence's pages, dense masked softmax."""
  k_pages = dequantize(k_pages, k_scale, jnp.float32)
  v_pages = None if v_pages is None else dequantize(v_pages, v_scale, jnp.float32)
  squeeze = q.ndim == 3
  q4 = (q[:, None] if squeeze else q).astype(jnp.float32)
  B, Q, N, D = q4.shape
  K, _, ps, _ = k_pages.shape
  G = N // K
  scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
  k = k_pages[:, page_indices].astype(jnp.float32)  # [K, B, pages, ps, D]
  k = k.reshape(K, B, -1, D).transpose(1, 2, 0, 3)  # [B, S, K, D]
  if v_pages is None:
    v = k[..., :dv]
  else:
    v = v_pages[:, page_indices].astype(jnp.float32).reshape(K, B, -1, v_pages.shape[-1])
    v = v.transpose(1, 2, 0, 3)
  S = k.shape[1]
  q_lens = jnp.full((B,), Q, jnp.int32) if q_lens is None else q_lens
  q_pos = (lengths - q_lens)[:, None] + jnp.arange(Q)[None]  # [B, Q]
  k_pos = jnp.arange(S)
  s = jnp.einsum("bqkgd,bskd->bkgqs", q4.reshape(B, Q, K, G, D), k,
                 precision=lax.Precision.HIGHEST) * scale
  mask = (k_pos[None, None] < lengths[:, None, None]) & (k_pos[None, None] <= q_pos[..., None])
  if window:
    mask &= q_pos[..., None] - k_pos[None, None] < window
  mask &= (jnp.arange(Q)[None] < q_lens[:, None])[..., None]
  s = jnp.where(mask[:, None, None], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  if sinks is not None:
    m = jnp.maximum(m, sinks.astype(jnp.float32).reshape(1, K, G, 1, 1))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.exp(s - m)
  den = jnp.sum(e, axis=-1, keepdims=True)
  if sinks is not None:
    den = den + jnp.exp(sinks.astype(jnp.float32).reshape(1, K, G, 1, 1) - m)
  p = e / jnp.where(den > 0, den, 1.0)
  out = jnp.einsum("bkgqs,bskd->bqkgd", p, v,
                   precision=lax.Precision.HIGHEST).reshape(B, Q, N, v.shape[-1])
  return (out[:, 0] if squeeze else out).astype(q.dtype)
