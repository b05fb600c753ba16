"""FLOPs and HBM bytes of one attention kernel call, from shapes, following
the kernels' real tiling (`pallas_kernels.paged_attention.ragged_core` and
`pallas_kernels.flash_attention`), next to the minimum any kernel needs.

Sequences are (q, kv) pairs: q query tokens, the last of which sees kv keys
(kv includes the q new tokens); token t of the q sits at position kv - q + t.
`e` is the element size of q, K/V and the output (2 for bf16); partials are f32.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pallas_kernels import mosaic_mla_attention as mma
from pallas_kernels import mosaic_mla_ragged as mmr
from pallas_kernels import mosaic_paged_attention as mpa
from pallas_kernels import mosaic_ragged_attention as mra
from pallas_kernels import mosaic_wide_attention as mwa
from pallas_kernels.flash_attention import BlockSizes
from pallas_kernels.paged_attention import item_sizes, max_rows


@dataclasses.dataclass(frozen=True)
class Traffic:
  """flops: useful (visible query x key pairs); tiled_flops: what the tiles
  multiply (padded rows, whole key blocks). planned / minimum: component ->
  bytes (planned: loads and stores the kernel and its wrapper issue, before
  any cache; minimum: every KV byte once per KV head, q and out once)."""

  flops: float
  tiled_flops: float
  planned: dict
  minimum: dict
  tiling: dict  # block sizes and counts the figures follow

  @property
  def planned_bytes(self) -> float:
    return float(sum(self.planned.values()))

  @property
  def minimum_bytes(self) -> float:
    return float(sum(self.minimum.values()))

  @property
  def ratio(self) -> float:
    return self.planned_bytes / self.minimum_bytes


def visible_keys(pos: int, kv: int, window: int = 0) -> int:
  """Keys a query at position pos sees: min(pos + 1, kv), and at most
  `window` of them when window > 0."""
  n = min(pos + 1, kv)
  return min(n, window) if window else n


def attention_flops(seqs: Sequence[tuple[int, int]], *, N: int, D: int, Dv: int,
                    window: int = 0) -> float:
  """sum over sequences and query tokens of visible keys x N x 2 (D + Dv):
  q.k over D and p.v over Dv, 2 FLOPs per multiply-add."""
  pairs = sum(visible_keys(kv - q + t, kv, window) for q, kv in seqs for t in range(q))
  return float(pairs * N * 2 * (D + Dv))


def min_kv_tokens(q: int, kv: int, window: int = 0) -> int:
  """KV tokens some query of a sequence sees: kv, or q + window - 1 under a window."""
  return min(kv, q + window - 1) if window else kv


def _items(seqs, W: int, block_q: int) -> list[tuple[int, int, int]]:
  """(kv_end, q_pos0, n_tok) per work item, as `plan_items` builds them: the
  W - (real items) padding items belong to the last sequence, past its tokens."""
  out = []
  for b, (q, kv) in enumerate(seqs):
    for j in range(-(-q // block_q)):
      n = min(block_q, q - j * block_q)
      out.append((kv - q + j * block_q + n, kv - q + j * block_q, n))
  q, kv = seqs[-1]
  j = -(-q // block_q)
  while len(out) < W:  # n_tok = 0, but the loop still runs to kv_end = q_pos0
    out.append((kv - q + j * block_q, kv - q + j * block_q, 0))
    j += 1
  return out


def split_pages(kv_end: int, q_pos0: int, split: int, *, ps: int, pages_per_split: int,
                ppcb: int, window: int = 0) -> int:
  """Pages one paged program loads: its split's pages from the window's first
  page to ceil(kv_end / ps), in whole blocks of ppcb pages starting at that
  first page (the last block's masked pages are still loaded)."""
  first = split * pages_per_split
  end = min(first + pages_per_split, -(-kv_end // ps))
  lo_tok = q_pos0 - window + 1 if window else 0
  start = max(first, max(lo_tok, 0) // ps)
  return -(-max(end - start, 0) // ppcb) * ppcb


def paged_traffic(seqs: Sequence[tuple[int, int]], *, N: int, K: int, D: int, Dv: int,
                  ps: int, pages_per_seq: int, ppcb: int = 1, splits: int = 1, window: int = 0,
                  v_from_k: bool = False, e: int = 2) -> Traffic:
  """The paged core's traffic. One program per (item, KV head x row block,
  split); each loads `split_pages` pages of ps x (D + Dv) (MLA, v_from_k:
  ps x D, values are the keys' first Dv columns) elements, so

    kv       = sum over programs of pages x ps x (D + Dv | D) x e
             = K x row_blocks x sum over items and splits of pages ...
    q        the wrapper's gather (W x block_q x N x D read, W x K x rows x D
             written) + each program's [block_r, D] tile (once per split)
    partials split-K only: f32 acc [rows, Dv] + m, l [rows] per (item, KV
             head, split), written by the kernel and read by the merge
    out      one split: the kernel writes [W, K, rows, Dv] x e, gathered to
             T x N x Dv x e; split-K: the merge writes T x N x Dv x e
    tables   page ids (int32) gathered and read.
  minimum: sum_b min_kv_tokens x K x (D + Dv | D) x e + q + out, T = sum q."""
  if N % K:
    raise ValueError(f"N={N} must be a multiple of K={K}")
  if not seqs or any(q < 1 or kv < q for q, kv in seqs):
    raise ValueError(f"seqs must be non-empty (q, kv) pairs with 1 <= q <= kv, got {seqs}")
  T, B, G = sum(q for q, _ in seqs), len(seqs), N // K
  block_q, rows, W = item_sizes(K, N, max(q for q, _ in seqs), T, B, Dv)
  block_r = min(rows, max_rows(Dv))
  row_blocks = rows // block_r
  pages_per_split = -(-(-(-pages_per_seq // splits)) // ppcb) * ppcb
  items = _items(seqs, W, block_q)
  pages = [split_pages(end, pos0, s, ps=ps, pages_per_split=pages_per_split, ppcb=ppcb,
                       window=window) for end, pos0, _ in items for s in range(splits)]
  tok_bytes = (D if v_from_k else D + Dv) * e
  programs = W * K * row_blocks * splits
  planned = dict(
      kv=K * row_blocks * sum(pages) * ps * tok_bytes,
      q=W * block_q * N * D * e + W * K * rows * D * e + programs * block_r * D * e,
      partials=2 * W * K * splits * rows * (Dv + 2) * 4 * (splits > 1),
      out=T * N * Dv * e + 2 * W * K * rows * Dv * e * (splits == 1),
      tables=programs * (pages_per_split + 4) * 4 + W * pages_per_split * splits * 4
      + B * pages_per_seq * 4)
  minimum = dict(kv=K * sum(min_kv_tokens(q, kv, window) for q, kv in seqs) * tok_bytes,
                 q=T * N * D * e, out=T * N * Dv * e)
  tiled = K * row_blocks * sum(pages) * ps * block_r * 2 * (D + Dv)
  tiling = dict(block_q=block_q, rows=rows, row_blocks=row_blocks, items=W,
                real_items=sum(-(-q // block_q) for q, _ in seqs), splits=splits,
                pages_per_split=pages_per_split, ppcb=ppcb, programs=programs, G=G)
  return Traffic(attention_flops(seqs, N=N, D=D, Dv=Dv, window=window), float(tiled),
                 planned, minimum, tiling)


def mosaic_traffic(seqs: Sequence[tuple[int, int]], *, N: int, K: int, D: int, Dv: int,
                   ps: int, window: int = 0, latent: bool = False, cluster: bool = False,
                   wide: bool = False, items: bool = False, e: int = 2) -> Traffic:
  """The Mosaic GPU kernels' KV traffic, one split (`pallas_kernels.
  mosaic_paged_attention` / `mosaic_ragged_attention`; latent: MLA's
  `mosaic_mla_attention` over one latent pool of D columns, values its
  first Dv). GQA: a sequence's q tokens are items of 64 // G tokens (one
  item for a decode step's Q x G <= 64 rows), each loading its keys from
  the window's first block to its last query in blocks of `keys` (whole
  pages, >= 64 keys); MLA: each sequence's Q x N query rows are row blocks
  of 64, each loading every key block, or with cluster a cluster of them
  (`mosaic_mla_attention.cluster_blocks`) loading each key block once;
  GQA with wide: items of 128 // G tokens (`mosaic_ragged_attention`'s
  wide), and with cluster too a sequence longer than one item of
  `mosaic_wide_attention.CLUSTER_TILES` tiles on such items, in clusters
  of `mosaic_ragged_attention.CLUSTER` loading the union of their blocks
  once; MLA with items (`mosaic_mla_ragged`, clustered): a sequence's q
  tokens in items of `tokens_per_item(N)` tokens, or of
  `tokens_per_item(N, True)` where q is more than one such item, each item
  (its row blocks one cluster) loading the keys up to its last token once.
  kv counts those loads; q and out the tiles once. minimum as `paged_traffic`'s."""
  G, rows = N // K, mpa.ROWS
  if latent:
    K, keys = 1, mma.KEYS
  else:
    keys = ps * mpa.pages_per_block(ps)
  blocks = lambda lo, hi: max(-(-hi // keys) - lo // keys, 0) * keys
  kv_tokens, count = 0, 0
  for q, kv in seqs:
    if latent and items:
      wide = q > mmr.tokens_per_item(N)
      per = mmr.tokens_per_item(N, wide)
      for j in range(-(-q // per)):
        kv_tokens += blocks(0, kv - q + min(q, (j + 1) * per))
        count += mmr.row_blocks(N, wide)
      continue
    if latent:
      row_blocks = -(-q * N // rows)
      kv_tokens += row_blocks // mma.cluster_blocks(q * N, cluster) * blocks(0, kv)
      count += row_blocks
      continue
    per = mra.tokens_per_item(G, wide)  # a decode / verify step's Q x G <= 64 rows: one item
    together = 1  # items sharing each read
    if cluster and wide and q > mra.tokens_per_item(G, tiles=mwa.CLUSTER_TILES):
      per, together = mra.tokens_per_item(G, tiles=mwa.CLUSTER_TILES), mra.CLUSTER
    n = -(-q // per)
    for j in range(0, n, together):
      pos0, end = kv - q + j * per, kv - q + min(q, (j + together) * per)
      kv_tokens += blocks(max(pos0 - window + 1, 0) if window else 0, end)
      count += min(together, n - j)
  tok_bytes = (D if latent else D + Dv) * e
  T = sum(q for q, _ in seqs)
  planned = dict(kv=K * kv_tokens * tok_bytes, q=T * N * D * e, out=T * N * Dv * e)
  minimum = dict(kv=K * sum(min_kv_tokens(q, kv, window) for q, kv in seqs) * tok_bytes,
                 q=T * N * D * e, out=T * N * Dv * e)
  return Traffic(attention_flops(seqs, N=N, D=D, Dv=Dv, window=window),
                 float(K * kv_tokens * rows * 2 * (D + Dv)), planned, minimum,
                 dict(keys_per_block=keys, items=count, G=G))


def _pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def flash_traffic(*, B: int, T: int, S: int, N: int, K: int, D: int, Dv: int, window: int = 0,
                  sinks: bool = False, e: int = 2) -> Traffic:
  """flash_attention's traffic (causal). Grid (B, N, T_pad / bq): each query
  head's program loads the key blocks kb in [kb_lo, kb_hi) its rows can see,
  bk x (H + Hv) padded to powers of two, so K/V are re-read per query head
  and query block (FlashAttention-2 tiling; L2 absorbs much of it):

    kv  = B x N x sum_i blocks_i x bk x (Hp + Hvp) x e
    q   B x T_pad x N x Hp x e (+ the wrapper's zero-pad copies of q, k, v
        when Hp != D, Hvp != Dv or T, S are not block multiples)
    out B x T_pad x N x Hvp x e (+ a slice copy when padded); sinks f32 rows.
  minimum: q + the K/V some query sees (once per KV head) + out."""
  if N % K or T > S:
    raise ValueError(f"need N % K == 0 and T <= S, got N={N}, K={K}, T={T}, S={S}")
  blocks = BlockSizes().fit(T, S)
  bq, bk = blocks.block_q, blocks.block_k
  nq, num_kb = -(-T // bq), -(-S // bk)
  Hp, Hvp = _pow2(D), _pow2(Dv)
  per_block = []
  for i in range(nq):
    q_start = S - T + i * bq
    hi = min(num_kb, (q_start + bq + bk - 1) // bk)
    lo = max(q_start - window + 1, 0) // bk if window else 0
    per_block.append(max(hi - lo, 0))
  kb_total = sum(per_block)
  T_pad, S_pad = nq * bq, num_kb * bk
  pad_q = T_pad != T or Hp != D
  pad_kv = S_pad != S or Hp != D or Hvp != Dv
  planned = dict(
      kv=B * N * kb_total * bk * (Hp + Hvp) * e,
      q=B * T_pad * N * Hp * e + (B * T * N * D * e + B * T_pad * N * Hp * e) * pad_q,
      kv_pad=(B * S * K * (D + Dv) * e + B * S_pad * K * (Hp + Hvp) * e) * pad_kv,
      out=B * T_pad * N * Hvp * e + 2 * B * T * N * Dv * e * (T_pad != T or Hvp != Dv),
      sinks=B * N * nq * bq * 4 * sinks)
  first_seen = max(S - T - window + 1, 0) if window else 0
  minimum = dict(kv=B * (S - first_seen) * K * (D + Dv) * e, q=B * T * N * D * e,
                 out=B * T * N * Dv * e)
  flops = B * attention_flops([(T, S)], N=N, D=D, Dv=Dv, window=window)
  tiled = B * N * kb_total * bq * bk * 2 * (Hp + Hvp)
  tiling = dict(block_q=bq, block_k=bk, head_dims=(Hp, Hvp), programs=B * N * nq,
                key_blocks_per_head=kb_total)
  return Traffic(flops, float(tiled), planned, minimum, tiling)


def roofline_s(flops: float, nbytes: float, *, peak_flops: float, bandwidth: float) -> float:
  """max(flops / peak, bytes / bandwidth): the time neither unit can beat."""
  return max(flops / peak_flops, nbytes / bandwidth)
