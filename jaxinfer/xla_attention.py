"""Grouped-query attention in pure JAX (`ops`' XLA path): dense and blocked.

Both take q [B, T, N, Hk], k [B, S, K, Hk], v [B, S, K, Hv], q_positions
[B, T], kv_lengths [B], a window (int or traced scalar, 0: none), sinks [N]
or None and the softmax scale; key j is visible to query t iff
j < kv_lengths[b], j <= q_positions[b, t] and (window == 0 or
q_positions[b, t] - j < window). Softmax runs in float32.

`dense` forms the [B, K, G, T, S] scores (`dense_kmajor` the same from
KV-head-major keys and values). `blocked` walks query blocks and,
inside each, key blocks with an online softmax (Milakov & Gimelshein 2018;
FlashAttention): per row a running max m, sum l and accumulator acc,

  m' = max(m, rowmax(s)),  l' = l e^(m - m') + sum e^(s - m'),
  acc' = acc e^(m - m') + e^(s - m') v,

so no [T, S] tensor exists; key blocks no query of the block can see (after
its last position, or before its window) are skipped by a `cond`. The sink
logit joins the denominator once, at the end. A row with no visible key
(padding) returns zeros in both, as in the flash kernel.

`packed` attends over one flat token axis holding several sequences back
to back (a prompt step whose chunks all start at position 0: each token sees
the keys of its own sequence up to itself), with no page gather and no
per-sequence padding: every query block against its own key block in one
product, then the online softmax over earlier key blocks only where a
sequence started in one.

The paged step's XLA path lives here too (`ops.ragged_paged_attention`'s
"xla" kernel; `ops` is the dispatch): `ragged` takes a step's
`ops.AttentionCall`, `ragged_paged` its pages gathered per sequence,
`packed_step` and `fresh_and_decodes` a step of fresh chunks and decode
tokens, `attention` the padded form (`dense` or `blocked`), `latent_values`
MLA's W_uv.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mosaic_ragged_attention import work_items
from pallas_kernels.paged_attention import dequantize, to_padded

MASKED = -1e30


def _visible(q_positions, kv_lengths, window, kpos):
  """[B, T, S] bool: which keys (at `kpos` [S]) each query sees."""
  qpos = q_positions[:, :, None]
  mask = (kpos[None, None, :] <= qpos) & (kpos[None, None, :] < kv_lengths[:, None, None])
  return mask & ((window == 0) | (qpos - kpos[None, None, :] < window))


def dense(q, k, v, q_positions, kv_lengths, window, sinks, scale):
  B, T, N, _ = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  qg = q.reshape(B, T, K, G, q.shape[-1])
  # Grouped heads attend to their shared KV head without repeating K/V.
  scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32)
  scores = scores * scale
  mask = _visible(q_positions, kv_lengths, jnp.asarray(window, jnp.int32),
                  jnp.arange(S, dtype=jnp.int32))
  # A large finite negative rather than -inf: a fully masked (padding) row
  # stays finite (uniform); it is zeroed at the end.
  scores = jnp.where(mask[:, None, None], scores, MASKED)
  if sinks is None:
    probs = jax.nn.softmax(scores, axis=-1)
  else:
    # Softmax over [scores, sink]; the sink column takes mass but has no value.
    sink = sinks.astype(jnp.float32).reshape(1, K, G, 1, 1)
    m = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
    e = jnp.exp(scores - m)
    probs = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - m))
  out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  out = jnp.where(jnp.any(mask, axis=-1)[:, :, None, None, None], out, 0)
  return out.reshape(B, T, N, v.shape[-1]).astype(q.dtype)


def dense_kmajor(q, k, v, q_positions, kv_lengths, window, sinks, scale):
  """`dense` with keys and values KV-head-major, k [K, B, S, Hk] and
  v [K, B, S, Hv] (as a page gather lays them out, no transpose), each KV
  head's G x T query rows one matrix against its keys; the probabilities
  stay unnormalized through the value product and the [.., Hv] result is
  divided instead (decode attention of bench_dense, 8 sequences x 192 keys,
  on the 2-core EPYC: 0.47 ms a layer against `dense`'s 0.93 over the same
  gathered pages, one run). The scores are laid out keys-major, [K, B, S,
  G x T], so both products read the keys and values in their stored order
  (the gather and attention of 8 sequences x 256 keys: 0.56-0.63 ms a
  layer against 0.63-0.72 with [K, B, G x T, S] scores, four runs)."""
  B, T, N, Hk = q.shape
  K, S, Hv = k.shape[0], k.shape[2], v.shape[-1]
  G = N // K
  R = G * T
  rows = q.reshape(B, T, K, G, Hk).transpose(2, 0, 3, 1, 4).reshape(K, B, R, Hk)
  scores = jnp.einsum("KBSH,KBRH->KBSR", k, rows, preferred_element_type=jnp.float32) * scale
  mask = _visible(q_positions, kv_lengths, jnp.asarray(window, jnp.int32),
                  jnp.arange(S, dtype=jnp.int32))  # [B, T, S]
  rows_mask = jnp.broadcast_to(jnp.swapaxes(mask, 1, 2)[:, :, None, :], (B, S, G, T))
  scores = jnp.where(rows_mask.reshape(B, S, R)[None], scores, MASKED)
  m = jnp.max(scores, axis=2, keepdims=True)  # [K, B, 1, R]
  if sinks is not None:  # the sink column: mass in the denominator, no value
    sink = jnp.repeat(sinks.astype(jnp.float32).reshape(K, 1, 1, G), T, axis=-1)
    m = jnp.maximum(m, sink)
  e = jnp.exp(scores - m)
  total = jnp.sum(e, axis=2)  # [K, B, R]
  if sinks is not None:
    total = total + jnp.exp(sink - m)[:, :, 0]
  out = jnp.einsum("KBSR,KBSH->KBRH", e.astype(v.dtype), v, preferred_element_type=jnp.float32)
  out = (out / total[..., None]).reshape(K, B, G, T, Hv)
  out = jnp.where(jnp.any(mask, axis=-1)[None, :, None, :, None], out, 0)
  return out.transpose(1, 3, 0, 2, 4).reshape(B, T, N, Hv).astype(q.dtype)


def _blocks(x, size, axis=1, mode="constant"):
  """Pad `axis` to a multiple of `size` and move the block index to the front."""
  n = -(-x.shape[axis] // size)
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, n * size - x.shape[axis])
  x = jnp.pad(x, pad, mode=mode)
  x = x.reshape(x.shape[:axis] + (n, size) + x.shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def blocked(q, k, v, q_positions, kv_lengths, window, sinks, scale, *, block_q, block_k):
  B, T, N, _ = q.shape
  K, Hv = k.shape[2], v.shape[-1]
  G = N // K
  window = jnp.asarray(window, jnp.int32)
  # Padded queries repeat the last position (their rows are dropped); padded
  # keys sit at positions >= S >= kv_lengths, so the mask hides them.
  qb = _blocks(q.reshape(B, T, K, G, -1), block_q)  # [nq, B, bq, K, G, Hk]
  pb = _blocks(q_positions, block_q, mode="edge")  # [nq, B, bq]
  kb, vb = _blocks(k, block_k), _blocks(v, block_k)  # [nk, B, bk, K, H]
  kmax = jnp.max(kv_lengths)

  def query_block(_, xs):
    qi, pos = xs
    lo, hi = jnp.min(pos), jnp.max(pos)

    def key_block(carry, ys):
      j0, kj, vj = ys
      seen = (j0 <= hi) & (j0 < kmax) & ((window == 0) | (lo - (j0 + block_k - 1) < window))
      return jax.lax.cond(seen, _online_step, lambda c, *_: c, carry, qi, kj, vj,
                          _visible(pos, kv_lengths, window, j0 + jnp.arange(block_k)),
                          scale), None

    init = (jnp.full((B, K, G, block_q), MASKED, jnp.float32),
            jnp.zeros((B, K, G, block_q), jnp.float32),
            jnp.zeros((B, K, G, block_q, Hv), jnp.float32))
    starts = jnp.arange(kb.shape[0], dtype=jnp.int32) * block_k
    (m, l, acc), _ = jax.lax.scan(key_block, init, (starts, kb, vb))
    if sinks is not None:  # the sink column: mass in the denominator, no value
      sink = sinks.astype(jnp.float32).reshape(1, K, G, 1)
      m_all = jnp.maximum(m, sink)
      l = l * jnp.exp(m - m_all) + jnp.exp(sink - m_all)
      acc = acc * jnp.exp(m - m_all)[..., None]
    return None, acc / jnp.where(l == 0, 1.0, l)[..., None]

  _, out = jax.lax.scan(query_block, None, (qb, pb))  # [nq, B, K, G, bq, Hv]
  out = out.transpose(1, 0, 4, 2, 3, 5).reshape(B, -1, N, Hv)  # [B, nq * bq, N, Hv]
  return out[:, :T].astype(q.dtype)


def _online_step(carry, qi, kj, vj, mask, scale):
  """One key block into the running (max, sum, acc) of a query block.
  qi [B, bq, K, G, Hk], kj [B, bk, K, Hk], vj [B, bk, K, Hv], mask [B, bq, bk]."""
  m, l, acc = carry
  s = jnp.einsum("BTKGH,BSKH->BKGTS", qi, kj, preferred_element_type=jnp.float32) * scale
  mask = mask[:, None, None]
  s = jnp.where(mask, s, MASKED)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)  # masked keys add nothing
  corr = jnp.exp(m - m_new)
  l = l * corr + jnp.sum(p, axis=-1)
  pv = jnp.einsum("BKGTS,BSKH->BKGTH", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
  return m_new, l, acc * corr[..., None] + pv


def packed(q, k, v, seq, positions, window, sinks, scale, *, block, seq_starts):
  """Causal attention within sequences packed on one token axis: q [T, N, Hk],
  k [T, K, Hk], v [T, K, Hv], seq [T] int32 non-decreasing (token t belongs
  to sequence seq[t]; padding past the last sequence), positions [T] int32
  (its position in that sequence, increasing along the axis within a
  sequence), seq_starts [B + 1] int32 (where each sequence starts on the
  axis; the last entry, where padding starts). Key t' is visible to query t
  iff seq[t'] == seq[t], positions[t'] <= positions[t] and (window == 0 or
  positions[t] - positions[t'] < window); padding rows see only the padding
  of their own block (callers discard them).

  Every query block first attends to its own key block, all blocks in one
  batched product (`_diagonal`); only when some block's first sequence
  starts in an earlier block does a loop visit those earlier key blocks
  (`_earlier`, under a `cond`), KV-head-major as `dense_kmajor`. A step of
  block-aligned prompts (the served bench's 128-token prompts) runs no loop.
  -> [T, N, Hv] in q's dtype."""
  T, N, Hk = q.shape
  K, Hv = k.shape[1], v.shape[-1]
  G = N // K
  window = jnp.asarray(window, jnp.int32)
  n = -(-T // block)
  pad = lambda x, fill=0: jnp.pad(x, [(0, n * block - T)] + [(0, 0)] * (x.ndim - 1),
                                  constant_values=fill)
  seq, positions = pad(seq, jnp.max(seq) + 1), pad(positions)
  # KV-head-major blocks: each KV head's G x block query rows one matrix.
  qb = pad(q).reshape(n, block, K, G, Hk).transpose(0, 2, 3, 1, 4).reshape(n, K, G * block, Hk)
  kb = pad(k).reshape(n, block, K, Hk).transpose(0, 2, 1, 3)  # [n, K, block, Hk]
  vb = pad(v).reshape(n, block, K, Hv).transpose(0, 2, 1, 3)
  sb, pb = seq.reshape(n, block), positions.reshape(n, block)

  def visible(qs, qp, ks, kp):  # queries [..., bq], keys [..., bk] -> [..., bq, bk]
    qs, qp, ks, kp = qs[..., :, None], qp[..., :, None], ks[..., None, :], kp[..., None, :]
    return (ks == qs) & (kp <= qp) & ((window == 0) | (qp - kp < window))

  m, l, acc = _diagonal(qb, kb, vb, visible(sb, pb, sb, pb), scale, G)
  # [n]: the block holding each block's first sequence start; a block that
  # starts in the padding (seq >= B) stays in itself (its rows are discarded).
  B = seq_starts.shape[0] - 1
  first = jnp.where(sb[:, 0] < B, seq_starts[jnp.clip(sb[:, 0], 0, B)] // block, n)
  first = jnp.minimum(first, jnp.arange(n))
  m, l, acc = jax.lax.cond(
      jnp.any(first < jnp.arange(n)),
      lambda c: _earlier(c, first, qb, kb, vb, sb, pb, visible, scale, G), lambda c: c,
      (m, l, acc))
  if sinks is not None:
    sink = sinks.astype(jnp.float32).reshape(1, K, G, 1)
    m_all = jnp.maximum(m, sink)
    l = l * jnp.exp(m - m_all) + jnp.exp(sink - m_all)
    acc = acc * jnp.exp(m - m_all)[..., None]
  out = acc / l[..., None]  # every row sees its own key, so l > 0
  out = out.transpose(0, 3, 1, 2, 4).reshape(n * block, N, Hv)
  return out[:T].astype(q.dtype)


def _diagonal(qb, kb, vb, mask, scale, G):
  """Each query block over its own key block, all n blocks in one product:
  qb [n, K, G * bq, Hk], kb [n, K, bk, Hk], vb [n, K, bk, Hv], mask
  [n, bq, bk] -> the softmax state (m, l [n, K, G, bq], acc [.., Hv]).
  The mask enters as an additive bias (0 or MASKED) in the scores' own
  [G * bq, bk] layout, and each row sees its own token, so m is finite and
  e^(MASKED - m) is 0: no select on the scores (bench_dense's 4 x 128-token
  prompts, 8 layers: 46-47 ms against 58-61 with two selects, two runs)."""
  n, K, R, _ = qb.shape
  bias = jnp.where(mask, 0.0, MASKED).astype(jnp.float32)  # [n, bq, bk]
  bias = jnp.broadcast_to(bias[:, None], (n, G) + bias.shape[1:]).reshape(n, 1, R, -1)
  s = jnp.einsum("nKRH,nKSH->nKRS", qb, kb, preferred_element_type=jnp.float32) * scale + bias
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - m)
  acc = jnp.einsum("nKRS,nKSH->nKRH", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
  state = lambda x: x.reshape((n, K, G, R // G) + x.shape[3:])
  return state(m[..., 0]), state(jnp.sum(p, axis=-1)), state(acc)


def _earlier(carry, first, qb, kb, vb, sb, pb, visible, scale, G):
  """Fold the key blocks first[i] .. i - 1 into query block i's softmax
  state (from `_diagonal`): sequences that start in an earlier block."""
  n, K, R, _ = qb.shape

  def query_block(_, xs):
    i, f, qi, qs, qp, state = xs

    def key_block(j, state):
      m, l, acc = state
      s = jnp.einsum("KRH,KSH->KRS", qi, kb[j], preferred_element_type=jnp.float32)
      s = jnp.where(visible(qs, qp, sb[j], pb[j]), s.reshape(K, G, R // G, -1) * scale, MASKED)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      p = jnp.exp(s - m_new[..., None])  # m_new is finite: masked keys give 0
      corr = jnp.exp(m - m_new)
      pv = jnp.einsum("KRS,KSH->KRH", p.reshape(K, R, -1).astype(vb.dtype), vb[j],
                      preferred_element_type=jnp.float32).reshape(acc.shape)
      return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv

    return None, jax.lax.fori_loop(f, i, key_block, state)

  _, state = jax.lax.scan(query_block, None, (jnp.arange(n), first, qb, sb, pb, carry))
  return state


# ---------------------------------------------------------------------------
# The paged step's XLA path (`ops.ragged_paged_attention`'s "xla" kernel).
#
# A step's call (`ops.AttentionCall`: q [T, N, Hk], its `ops.PagedKV` pools
# and metadata, the step's own keys and values) over the page pool: each
# sequence's pages gathered into a contiguous view, its ragged queries in
# rows of whole tokens (`item_size`), then `dense_kmajor` (or `blocked` past a
# block). A step whose sequences are each a fresh chunk or one decode token
# attends the chunks packed over their own keys instead (`packed_step`) and
# the pages for the decode tokens only (`fresh_and_decodes`).

BLOCK_Q, BLOCK_K = 64, 128  # queries and keys a block (`attention`)
# Query and key block of the packed path (`packed`).
PACKED_BLOCK = 128
# How a step's index maps search their (short, sorted) offsets: every probe
# against every offset in one fusion. jnp's default binary search is a while
# loop of log2(offsets) trips, 4 launches each, in every compiled GPU step
# (llama3_8b decode on an H100 at batch 64: 31 of the step's launches).
SEARCH = "compare_all"


def attention(q, k, v, q_positions, kv_lengths, window, sinks, scale):
  """`dense`, or past one block of queries and of keys `blocked` (an online
  softmax: no [T, S] scores, and key blocks past causality or the window
  skipped; bench_dense prefill @512 on a 2-core CPU)."""
  if q.shape[1] > BLOCK_Q and k.shape[1] > BLOCK_K:
    return blocked(q, k, v, q_positions, kv_lengths, window, sinks, scale,
                   block_q=BLOCK_Q, block_k=BLOCK_K)
  return dense(q, k, v, q_positions, kv_lengths, window, sinks, scale)


def token_sequences(cu_q_lens, T: int):
  """[T] int32: the sequence each of a step's tokens belongs to (the last b
  with cu_q_lens[b] <= t; B for the padding past cu_q_lens[-1])."""
  t = jnp.arange(T, dtype=jnp.int32)
  return (jnp.searchsorted(cu_q_lens, t, side="right", method=SEARCH) - 1).astype(jnp.int32)


def packed_step(q, k, v, cu_q_lens, window, sinks, scale):
  """A step of fresh chunks (each starting at position 0) over its own keys
  and values, packed: q [T, N, Hk], k [T, K, Hk], v [T, K, Hv]; token t of
  sequence b sits at position t - cu_q_lens[b]; rows past cu_q_lens[-1] are
  padding and return zeros. -> [T, N, Hv]."""
  T = q.shape[0]
  t = jnp.arange(T, dtype=jnp.int32)
  seq = token_sequences(cu_q_lens, T)
  positions = t - cu_q_lens[seq]
  out = packed(q, k, v, seq, positions, window, sinks, scale,
               block=min(PACKED_BLOCK, T), seq_starts=cu_q_lens)
  return jnp.where((t < cu_q_lens[-1])[:, None, None], out, 0).astype(q.dtype)


def fresh_or_decodes(cu_q_lens, kv_lens):
  """-> (whether every sequence of the step is a fresh chunk, from position
  0, or one decode token: a traced bool; decodes [B] bool: the lone tokens
  past position 0)."""
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  decodes = (q_lens == 1) & (kv_lens > 1)
  return jnp.all((kv_lens == q_lens) | decodes), decodes


def layered(kv):
  """(k_pages, v_pages, layer) of a `ops.PagedKV`, the pools given a layer
  axis where they have none (layer 0)."""
  if kv.layer is not None:
    return kv.k_pages, kv.v_pages, kv.layer
  return kv.k_pages[None], None if kv.v_pages is None else kv.v_pages[None], 0


def fresh_and_decodes(firsts, kv, packed, decodes, *, window, sinks, scale, values=None):
  """A step whose sequences are each a fresh chunk or one decode token
  (`decodes` [B]): the fresh chunks' attention `packed` [T, N, Hv]
  (`packed_step` over the step's own keys), the decode tokens over their
  pages (kv: the `ops.PagedKV`), their queries `firsts` [B, N, Hk] (each
  sequence's first token's), then `values` (MLA's W_uv [N, Hv, R]: the
  latent result's values, `latent_values`), gathered for the decodes only:
  none, at most a quarter of the sequences, or all of them (`lax.switch`)."""
  k_pages, v_pages, layer = layered(kv)
  B, T = kv.page_table.shape[0], packed.shape[0]

  def decode_rows(rows):  # -> [B, N, Hv]: sequence b's decode attention (others: any values)
    order = jnp.argsort(jnp.where(decodes, 0, 1), stable=True)[:rows]  # the decodes first
    out = latent_values(ragged_paged(
        firsts[order], k_pages, v_pages, jnp.where(decodes[order], kv.kv_lens[order], 0),
        kv.page_table[order], jnp.arange(rows + 1, dtype=jnp.int32), 1, window, sinks, scale,
        kv.latent_dim, layer, (None, None)), values)
    return out[jnp.clip(jnp.cumsum(decodes) - 1, 0, rows - 1)]

  sizes = sorted({max(1, B // 4), B})
  n = jnp.sum(decodes)
  dec = jax.lax.switch(jnp.searchsorted(jnp.asarray([0] + sizes), n),
                       [lambda: jnp.zeros(firsts.shape[:2] + packed.shape[-1:], packed.dtype)]
                       + [lambda r=r: decode_rows(r).astype(packed.dtype) for r in sizes])
  seq = token_sequences(kv.cu_q_lens, T)  # B for the padding rows
  b = jnp.clip(seq, 0, B - 1)
  return jnp.where(((seq < B) & decodes[b])[:, None, None], dec[b], packed)


def latent_values(out, w_uv):
  """MLA: the heads' values [..., N, Hv] from the absorbed form's latent
  result [..., N, R] (x W_uv [N, Hv, R], `layouts.AbsorbedMLA`); out
  itself when w_uv is None."""
  if w_uv is None:
    return out
  return jnp.einsum("...NR,NHR->...NH", out, w_uv.astype(out.dtype))


def ragged(call):
  """A step (`ops.AttentionCall`) on the XLA path: GQA fresh chunks packed
  over the step's own keys where every sequence is one or a decode token
  (chosen by value in the step, `fresh_and_decodes`; pools without scales,
  max_q > 1, `call.new_kv` given), else over the pages (`ragged_paged`).
  MLA's fresh chunks in the expanded form are the model's choice
  (`models.attention.mla`). -> [T, N, Hv]."""
  kv = call.kv
  k_pages, v_pages, layer = layered(kv)
  paged = lambda: ragged_paged(call.q, k_pages, v_pages, kv.kv_lens, kv.page_table, kv.cu_q_lens,
                               kv.max_q, call.window, call.sinks, call.scale, kv.latent_dim,
                               layer, (kv.k_scale, kv.v_scale), trim=kv.max_q == 1)
  if v_pages is None or call.new_kv is None or kv.max_q == 1 or kv.k_scale is not None:
    return paged()
  q = call.q
  T = q.shape[0]
  packed = lambda: packed_step(q, *call.new_kv, kv.cu_q_lens, call.window, call.sinks, call.scale)
  fresh, decodes = fresh_or_decodes(kv.cu_q_lens, kv.kv_lens)
  return jax.lax.cond(
      fresh,
      lambda: fresh_and_decodes(q[jnp.clip(kv.cu_q_lens[:-1], 0, T - 1)], kv, packed(), decodes,
                                window=call.window, sinks=call.sinks, scale=call.scale),
      paged)


def item_size(num_tokens: int, num_seqs: int, max_q: int) -> int:
  """Query tokens per row of the XLA path's query layout: max_q (one row per
  sequence, [B, max_q]) where that pads at most 2x over the step's tokens
  (decode steps, batches of prompts), else the largest power of two p <= max_q
  with B * p <= T (at least 1): rows of p tokens of one sequence, so a mixed
  step (a long chunk among decodes) attends about 2T rows, not B * max_q."""
  if num_seqs * max_q <= 2 * num_tokens:
    return max_q
  p = 1
  while 2 * p <= max_q and num_seqs * 2 * p <= num_tokens:
    p *= 2
  return p


def page_rows(pool, layer, table):
  """pool [L, K, P, ps, H], table [R, pages] -> [K, R * pages, ps, H]: the
  pages of `layer`, gathered as whole rows of the pool flattened to
  [L * K * P, ps, H] (bench_dense's decode at batch 8, 12 pages a sequence,
  the gathers and attention of 8 layers: 5.4 ms against 6.2 indexing
  pool[layer, heads, table], one run)."""
  L, K, P = pool.shape[:3]
  rows = (layer * K + jnp.arange(K, dtype=jnp.int32)[:, None]) * P + table.reshape(1, -1)
  return jnp.take(pool.reshape((L * K * P,) + pool.shape[3:]), rows.reshape(-1), axis=0,
                  mode="clip")


def ragged_paged(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q, window,
                      sinks, scale, v_head_dim, layer, kv_scales, per_item=None, trim=False):
  # Reference path: each row's sequence's pages gathered into a contiguous
  # [S] view (KV-head-major), the ragged queries laid out in rows of
  # `per_item` tokens of one sequence (`item_size`; the Mosaic ragged
  # kernel's work items), then the dense kernel (`dense_kmajor`; blocked past
  # a block of queries and of keys).
  B, pages = page_table.shape
  T = q.shape[0]
  K, page_size = k_pages.shape[-4], k_pages.shape[-2]  # [L, K, P, ps, H]
  per_item = per_item or item_size(T, B, max_q)

  def gather(pool, scale, table):  # [L, K, P, ps, H] -> [K, R, pages * ps, H] of `layer`
    g = page_rows(pool, layer, table)  # [K, R * pages, ps, H]
    g = g.reshape(K, table.shape[0], table.shape[1] * page_size, pool.shape[-1])
    return g if scale is None else dequantize(g, scale, q.dtype)

  def attend_pages(qr, table, q_pos, kv_len):
    k = gather(k_pages, kv_scales[0], table)
    v = k[..., :v_head_dim] if v_pages is None else gather(v_pages, kv_scales[1], table)
    if qr.shape[1] > BLOCK_Q and k.shape[2] > BLOCK_K:  # blocked: [R, S, K, H]
      return attention(qr, k.transpose(1, 2, 0, 3), v.transpose(1, 2, 0, 3), q_pos, kv_len,
                            window, sinks, scale)
    return dense_kmajor(qr, k, v, q_pos, kv_len, window, sinks, scale)

  def attend(qr, table, q_pos, kv_len):
    # trim (a decode-only step): its pages come in powers of two; where every
    # row's keys fit in the first three quarters, only those are gathered
    # (the 1.5x page bucket without another program). Prompt programs, whose
    # attention has several branches already, keep one: each branch is more
    # machine code, and serve.py's warm-up then ran out of memory maps
    # (docs/known_issues.md).
    short = 3 * pages // 4
    if not trim or pages < 4 or pages % 4:
      return attend_pages(qr, table, q_pos, kv_len)
    return jax.lax.cond(jnp.max(kv_len) <= short * page_size,
                        lambda: attend_pages(qr, table[:, :short], q_pos, kv_len),
                        lambda: attend_pages(qr, table, q_pos, kv_len))

  if per_item == max_q:  # a row per sequence
    q_pad, seq, row, valid = to_padded(q, cu_q_lens, max_q)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    q_pos = (kv_lens - q_lens)[:, None] + jnp.arange(max_q, dtype=jnp.int32)[None]
    out = attend(q_pad, page_table, q_pos, kv_lens)[seq, row]
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)
  num_items = -(-T // per_item) + B  # >= sum over sequences of ceil(q_len / per_item)
  items, first, item_cu = work_items(cu_q_lens, kv_lens, per_item=per_item,
                                                   num_items=num_items)
  u = jnp.arange(per_item, dtype=jnp.int32)
  q_rows = q[jnp.clip(first[:, None] + u[None], 0, T - 1)]  # [I, per_item, N, H]
  out = attend(q_rows, page_table[items[:, 0]], items[:, 1:2] + u[None], items[:, 2])
  # Back to token order: token t is row (t - start) % per_item of its
  # sequence's item (t - start) // per_item.
  t = jnp.arange(T, dtype=jnp.int32)
  b = jnp.clip(token_sequences(cu_q_lens, T), 0, B - 1)
  offset = t - cu_q_lens[b]
  out = out[jnp.clip(item_cu[b] + offset // per_item, 0, num_items - 1), offset % per_item]
  return jnp.where((t < cu_q_lens[-1])[:, None, None], out, 0).astype(q.dtype)
