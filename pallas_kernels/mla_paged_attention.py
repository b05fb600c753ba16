"""DeepSeek MLA decode attention in the absorbed form over the latent page pool.

  q_latent      [B, N, R] or [B, Q, N, R]   q_nope already multiplied by W_uk
  q_rope        [B, N, Hr] or [B, Q, N, Hr]
  latent_pages  [P, page_size, R + Hr]      normed latent c, then the roped shared key
  kv_scale      None, or the float32 scalar of quantized (fp8 / int8) latent pages:
                one scale for the whole row, read as pages * kv_scale
  -> out_latent [B, (Q,) N, R]: softmax(q_lat.c + q_rope.k_rope) @ c; the
     up-projection W_uv stays outside the kernel.

Multi-query attention with one KV head whose keys are the whole page rows and
whose values are their first R columns: the paged core reads each page once
for all N heads.

`prepare` (public: the Mosaic MLA kernels validate through it) checks q_latent,
q_rope and the pages and lays q out as [B, Q, N, R + Hr].
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.paged_attention import (PagedBlocks, check_tiles, paged_attention_reference,
                                            ragged_core, validate_paged)


def prepare(q_latent, q_rope, latent_pages, name):
  """Validate the absorbed queries and latent pages (errors name `name`) ->
  (q [B, Q, N, R + Hr], squeeze: q came without its Q axis, R)."""
  if q_latent.ndim not in (3, 4) or q_rope.ndim != q_latent.ndim:
    raise ValueError(f"{name}: q_latent / q_rope must both be [B, N, R] or [B, Q, N, R], got "
                     f"{q_latent.shape} and {q_rope.shape}")
  if q_latent.shape[:-1] != q_rope.shape[:-1]:
    raise ValueError(f"{name}: q_latent {q_latent.shape} and q_rope {q_rope.shape} disagree")
  if latent_pages.ndim != 3:
    raise ValueError(f"{name}: latent_pages must be [P, page_size, R + Hr], got {latent_pages.shape}")
  R, Hr = q_latent.shape[-1], q_rope.shape[-1]
  if latent_pages.shape[-1] != R + Hr:
    raise ValueError(f"{name}: latent_pages last dim {latent_pages.shape[-1]} != R + Hr = {R + Hr}")
  squeeze = q_latent.ndim == 3
  q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
  return (q[:, None] if squeeze else q), squeeze, R


def mla_paged_attention(q_latent, q_rope, latent_pages, lengths, page_indices, *, sm_scale,
                        pages_per_compute_block=1, num_splits=1, num_warps=4, num_stages=2,
                        kv_scale=None, interpret=False):
  """Absorbed MLA attention over the latent pool (shapes in the module docstring).
  sm_scale is required: MLA scales by 1/sqrt(nope + rope dims) (times YaRN's
  mscale^2), not by the latent width. The R + Hr wide rows are read as
  power-of-two column parts (512 + 64), never padded."""
  q, squeeze, R = prepare(q_latent, q_rope, latent_pages, "mla_paged_attention")
  k_pages = latent_pages[None]
  validate_paged(q, k_pages, None, lengths, page_indices, window=0, sinks=None,
                 name="mla_paged_attention", k_scale=kv_scale)
  blocks = PagedBlocks(pages_per_compute_block, num_splits, num_warps, num_stages)
  blocks.validate()
  B, Q, N, D = q.shape
  check_tiles(D, R, latent_pages.shape[1], blocks, interpret, "mla_paged_attention")
  cu = jnp.arange(B + 1, dtype=jnp.int32) * Q
  out = ragged_core(q.reshape(B * Q, N, D), k_pages, None, lengths, page_indices, cu, max_q=Q,
                    scale=sm_scale, dv=R, blocks=blocks, k_scale=kv_scale, interpret=interpret)
  out = out.reshape(B, Q, N, R)
  return out[:, 0] if squeeze else out


def mla_paged_attention_reference(q_latent, q_rope, latent_pages, lengths, page_indices, *,
                                  sm_scale, kv_scale=None):
  """Pure jnp, float32: `mla_paged_attention`'s semantics through `paged_attention_reference`."""
  q, squeeze, R = prepare(q_latent, q_rope, latent_pages, "mla_paged_attention_reference")
  out = paged_attention_reference(q, latent_pages[None], None, lengths, page_indices,
                                  sm_scale=sm_scale, dv=R, k_scale=kv_scale)
  return out[:, 0] if squeeze else out
