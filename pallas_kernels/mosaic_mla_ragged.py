"""DeepSeek MLA's mixed steps on Mosaic GPU (Hopper, jax >= 0.11): prefill
chunks and decode tokens in the absorbed form over the latent pool, on
`mosaic_mla_attention`'s kernel.

Same layout and meaning as `ragged_paged_attention` with MLA's one latent
pool (q [T, N, R + Hr] token-flattened as q_latent [T, N, R] and q_rope
[T, N, Hr], sequence b owning tokens cu_q_lens[b]:cu_q_lens[b + 1], the last
at position kv_lens[b] - 1; latent_pages [P, page_size, R + Hr], the values
its first R columns) -> [T, N, R].

Work items: each sequence's tokens are cut into items of `tokens_per_item`
whole tokens whose rows (token x N heads) fill one 64-row block (N <= 64:
64 // N tokens; more heads: one token in ceil(N / 64) blocks), as
`mosaic_ragged_attention` cuts GQA steps; each item streams the latent up
to its last token (causal within the chunk), so no sequence is padded to
the longest.

cluster=True: a sequence longer than one such item runs on items of
MAX_CLUSTER (8) row blocks (512 // N tokens), each item's blocks one
cluster of programs that share every latent read by TMA multicast; the
other sequences keep their short items (a token's several blocks one
cluster where N > 64, as `mosaic_mla_attention`'s cluster). The step is
then two launches, each token's output taken from its sequence's (one
where max_q fits a short item).

Interpreted (CPU), the clustered launches run eagerly but stall inside a
jitted program on jax 0.12's Mosaic GPU interpreter (all 16 warpgroup
threads of a cluster waiting on barriers; not found in the kernel, whose
cluster protocol is `mosaic_mla_attention`'s); the Engine therefore runs
the unclustered items when it interprets (`jaxinfer.ops`).

Each latent read then serves at most 8 x 64 rows: the accumulators of 8
programs (64 rows x 512 float32 value columns over two warpgroups) are
their register files. A long chunk is compute-bound in this form (2 x
(576 + 512) flops a row and key, about 1000 flops a latent byte read),
so its re-reads cost L2 and HBM bandwidth that the tensor cores leave idle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import mosaic_mla_attention as mma
from pallas_kernels import mosaic_ragged_attention as mra
from pallas_kernels.mla_paged_attention import prepare
from pallas_kernels.mosaic_paged_attention import ROWS
from pallas_kernels.paged_attention import token_sequences, validate_paged
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference


def tokens_per_item(N: int, cluster: bool = False) -> int:
  """Query tokens of one work item: as many as fill its 64-row block (with
  cluster, its MAX_CLUSTER blocks), at least one."""
  return max(1, (mma.MAX_CLUSTER if cluster else 1) * ROWS // N)


def row_blocks(N: int, cluster: bool = False) -> int:
  """64-row blocks of one work item (`tokens_per_item` tokens x N heads)."""
  return -(-tokens_per_item(N, cluster) * N // ROWS)


def mosaic_mla_ragged_attention(q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens,
                                *, max_q, sm_scale, num_splits=1, slots=2, cluster=False,
                                block_keys=mma.KEYS, split_scores=False, interpret=False):
  """See the module docstring. max_q (static) >= every sequence's query
  count (checked like `ragged_paged_attention`). block_keys, split_scores:
  as `mosaic_mla_attention`'s."""
  name = "mosaic_mla_ragged_attention"
  if q_latent.ndim != 3:
    raise ValueError(f"{name}: q_latent must be [T, N, R], got {q_latent.shape}")
  q, _, R = prepare(q_latent, q_rope, latent_pages, name)
  q = q[:, 0]
  T, N, D = q.shape
  B = kv_lens.shape[0]
  if cu_q_lens.shape != (B + 1,):
    raise ValueError(f"{name}: cu_q_lens must be [B + 1 = {B + 1}], got {cu_q_lens.shape}")
  if not isinstance(max_q, int) or max_q < 1:
    raise ValueError(f"{name}: max_q must be a static int >= 1, got {max_q!r}")
  cu = cu_q_lens.astype(jnp.int32)
  validate_paged(jax.ShapeDtypeStruct((B, max_q, N, D), q.dtype), latent_pages[None], None,
                 kv_lens, page_indices, window=0, sinks=None, name=name, q_lens=cu[1:] - cu[:-1])
  mma.check_call(D, R, latent_pages.shape[1], q.dtype, slots, num_splits, cluster, name,
                 block_keys, split_scores)
  kv_lens = kv_lens.astype(jnp.int32)
  kw = dict(N=N, R=R, scale=sm_scale, num_splits=num_splits, slots=slots, cluster=cluster,
            block_keys=block_keys, split_scores=split_scores, interpret=interpret)
  _, seq, valid = token_sequences(cu, T)
  launch = lambda q, wide, keep=None, num=None: _items(q, latent_pages, kv_lens, page_indices,
                                                       cu, seq, wide, kw, keep, num)
  per = tokens_per_item(N)
  if not cluster or max_q <= per:
    out = launch(q, False)
  else:
    long = (cu[1:] - cu[:-1]) > per  # [B]: sequences on the clustered items
    # The others hold at most one short item each: that launch is B items.
    out = jnp.where(long[seq][:, None, None], launch(q, True, long),
                    launch(q, False, ~long, B))
  return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)


def _items(q, latent_pages, kv_lens, page_indices, cu, seq, wide, kw, keep=None, num=None):
  """One launch over the step's items of `tokens_per_item(N, wide)` tokens
  (keep [B]: the sequences it runs, which alone get items; num: a bound on
  their items, else the step's) -> [T, N, R] float32 in token order (the
  tokens of the sequences it runs)."""
  T, N, D = q.shape
  B = kv_lens.shape[0]
  per, blocks = tokens_per_item(N, wide), row_blocks(N, wide)
  # At most one partial item a sequence, at least one token an item.
  items, first, item_cu = mra.work_items(cu, kv_lens, per_item=per,
                                         num_items=num or min(T // per + B, T), keep=keep)
  rows = mra.item_rows(q, first, items, group=N, per_item=per, rows=blocks * ROWS)
  o, lse = mma.launch(rows.reshape(-1, blocks, ROWS, D), latent_pages, items, page_indices, **kw)
  I = items.shape[0]
  return mra.to_tokens(o.astype(jnp.float32).reshape(-1, I, 1, blocks * ROWS, kw["R"]),
                        lse.reshape(-1, I, 1, blocks * ROWS), None, N, per, item_cu, cu, seq)


def mosaic_mla_ragged_attention_reference(q_latent, q_rope, latent_pages, kv_lens, page_indices,
                                          cu_q_lens, *, max_q, sm_scale):
  """Pure jnp, float32: the same semantics (`ragged_paged_attention_reference`
  over the latent pool, values its first R columns)."""
  q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
  return ragged_paged_attention_reference(
      q.astype(jnp.float32), latent_pages[None].astype(jnp.float32), None, kv_lens,
      page_indices, cu_q_lens, max_q=max_q, sm_scale=sm_scale, v_head_dim=q_latent.shape[-1])
