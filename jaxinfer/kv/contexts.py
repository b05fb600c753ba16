"""KV contexts: where a forward's keys and values live.

Attention blocks compute q and the new K/V entries, then hand them to a
context, which writes them into its cache slice and attends. The block code is
the same for every cache; the context type (not a mode string) decides:

  FullContext        no cache: tokens [B, T] attend causally among themselves
  ContiguousContext  per-sequence cache slices [B, S, ...]; tokens append at
                     `starts` (the cached length of each sequence)
  PagedContext       the engine's page pool; a token-flattened mixed batch of
                     prefill chunks and decode tokens with per-sequence
                     metadata (the layout of vLLM v1 / ragged paged attention)

`attend` takes the config's kernel choices (`backend`: ModelConfig.backend,
a `jaxinfer.Backend`) and hands them to every `jaxinfer.ops` kernel call
unchanged, so the kernels a jitted step builds follow the config, never the
backend of the process tracing it.

New entries are a dict matching the cache: GQA {k [B, T, K, H], v}; MLA
{kv [B, T, R + Hr]} (normed latent + roped shared key). For MLA the context
reads k = the whole entry (one KV head) and v = its first `latent_dim` columns
and returns the heads' values (latent result x `values`, W_uv, a tensor the
model passes).
`fresh_prompts` says whether a step may attend its fresh prompts apart
(the paged XLA path; None elsewhere): MLA's model then takes them in the
expanded form, over the pages `write` returns (`ops.PagedKV`).

The cache a context receives is (stacked segment cache [L, ...], layer index):
it reads and writes at [layer] without slicing the layer out, so XLA updates
the cache in place instead of copying it every step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer import ops
from jaxinfer.backend import Backend
from jaxinfer.kv.pool import PoolLayout


def _layout(latent: bool, stack: dict) -> PoolLayout:
  return PoolLayout.of(latent, stack)


def _split(cache: dict, latent_dim: int | None, head_axis: int):
  if latent_dim is None:
    return cache["k"], cache["v"]
  kv = jnp.expand_dims(cache["kv"], head_axis)
  return kv, kv[..., :latent_dim]


@dataclasses.dataclass(frozen=True)
class FullContext:
  """Cacheless causal forward over tokens [B, T]."""

  positions: jax.Array  # [B, T]: arange(T) in every row
  window_choices: tuple[int, ...] = (0,)  # the model's distinct layer windows
  caches_latent = False  # MLA runs in the expanded form

  def token_positions(self, T: int):
    return self.positions

  def token_valid(self):
    return None

  def fresh_prompts(self, q, cache, **kw):
    return None

  def attend(self, q, new, cache, *, latent_dim=None, window=0, sinks=None, scale,
             values=None, backend: Backend = Backend()):
    k, v = _split(new, latent_dim, head_axis=2)
    out = ops.causal_attention(q, k, v, window=window, window_choices=self.window_choices,
                               sinks=sinks, scale=scale, backend=backend)
    return ops.latent_values(out, values), cache


@dataclasses.dataclass(frozen=True)
class ContiguousContext:
  """Tokens [B, T] appended at starts[b] of per-sequence caches [B, S, ...]."""

  starts: jax.Array  # [B] int32
  caches_latent = True

  def token_positions(self, T: int):
    return self.starts[:, None] + jnp.arange(T, dtype=jnp.int32)[None]

  def token_valid(self):
    return None

  def fresh_prompts(self, q, cache, **kw):
    return None  # the absorbed form throughout (a reference path)

  def attend(self, q, new, cache, *, latent_dim=None, window=0, sinks=None, scale,
             values=None, backend: Backend = Backend()):
    # Per-sequence offsets into a contiguous cache: the XLA path on every
    # backend (a reference; the engine's paged path is the one with kernels).
    stack, layer = cache  # {name: [L, B, S, ...]}
    B, T = q.shape[:2]
    rows = jnp.arange(B)[:, None]
    pos = self.token_positions(T)
    stack = {n: stack[n].at[layer, rows, pos].set(new[n].astype(stack[n].dtype)) for n in stack}
    k, v = _split({n: stack[n][layer] for n in stack}, latent_dim, head_axis=2)
    out = ops.attention(q, k, v, q_positions=pos, kv_lengths=self.starts + T,
                        window=window, sinks=sinks, scale=scale)
    return ops.latent_values(out, values), (stack, layer)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedContext:
  """A token-flattened step over the page pool (tokens as a [1, T] batch).

  The cache is a segment's stacked pool entry (`kv.pool.PoolLayout`).
  Token t belongs to sequence token_seq[t] at position positions[t]; its K/V
  go to page page_table[seq, pos // page_size], slot pos % page_size (padding
  tokens, valid[t] False, write into the reserved null page 0).

  mesh / head_axis (static): when the engine's layout splits attention heads
  over `head_axis` (tp, tp_attn_ep), attention runs per device of that axis
  in `shard_map` (the kernel is a custom call GSPMD cannot split; outside
  shard_map XLA gathers the whole pool around it). None: one program.
  fresh (static): every sequence of the step is a fresh chunk, from
  position 0 (the host knows; `ops.PagedKV.fresh`).
  """

  positions: jax.Array  # [T] int32
  token_seq: jax.Array  # [T] int32
  valid: jax.Array  # [T] bool
  cu_q_lens: jax.Array  # [B + 1] int32: query start offsets
  kv_lens: jax.Array  # [B] int32: KV length after this step
  page_table: jax.Array  # [B, pages_per_seq] int32
  max_q: int = dataclasses.field(metadata=dict(static=True), default=1)
  mesh: object = dataclasses.field(metadata=dict(static=True), default=None)
  head_axis: object = dataclasses.field(metadata=dict(static=True), default=None)
  fresh: bool = dataclasses.field(metadata=dict(static=True), default=False)
  rope_positions: jax.Array | None = None  # [T] int32 rotary positions; None: positions
  caches_latent = True

  def token_positions(self, T: int):
    return (self.positions if self.rope_positions is None else self.rope_positions)[None]

  def token_valid(self):
    return self.valid[None]

  def attend(self, q, new, cache, *, latent_dim=None, window=0, sinks=None, scale,
             values=None, backend: Backend = Backend()):
    kw = dict(latent_dim=latent_dim, scale=scale, backend=backend)
    if self.mesh is None or self.head_axis is None:
      return self._attend_local(q, new, cache, window=window, sinks=sinks, values=values, **kw)
    # Per head shard: the absorbed form, W_uv after the shard_map (GSPMD splits it).
    out, cache = self._attend_per_head_shard(q, new, cache, window, sinks, kw)
    return ops.latent_values(out, values), cache

  def fresh_prompts(self, q, cache, *, latent_dim=None, window=0, scale,
                    backend: Backend = Backend()):
    """`ops.fresh_prompts` for this step over `cache` (q [1, T, N, H], or
    its ShapeDtypeStruct): None (static) where the step cannot attend its
    fresh prompts apart (per head shard, or not the XLA path), else (every
    sequence a fresh chunk or one decode token, decodes [B])."""
    if self.mesh is not None and self.head_axis is not None:
      return None
    q0 = jax.ShapeDtypeStruct(q.shape[1:], q.dtype)
    return ops.fresh_prompts(ops.AttentionCall(q=q0, kv=self._kv(cache, latent_dim), window=window,
                                               scale=scale), backend)

  def _kv(self, cache, latent_dim) -> ops.PagedKV:
    """The step's `ops.PagedKV` over the pools of `cache`."""
    stack, layer = cache
    layout = _layout(latent_dim is not None, stack)
    k_pages, v_pages = layout.kernel_pools(stack)
    k_scale, v_scale = (layout.layer_scales(stack, layer) + (None,))[:2]  # MLA: k_scale only
    return ops.PagedKV(k_pages=k_pages, v_pages=v_pages, kv_lens=self.kv_lens,
                       page_table=self.page_table, cu_q_lens=self.cu_q_lens, layer=layer,
                       k_scale=k_scale, v_scale=v_scale, max_q=self.max_q, latent_dim=latent_dim,
                       fresh=self.fresh)

  def write(self, new, cache, *, latent_dim=None):
    """The step's new entries written into its pages -> (`ops.PagedKV` over
    the written pools, the new cache)."""
    stack, layer = cache
    layout = _layout(latent_dim is not None, stack)
    page_size = layout.page_size(stack)
    page = self.page_table[self.token_seq, self.positions // page_size]
    page = jnp.where(self.valid, page, 0)
    slot = jnp.where(self.valid, self.positions % page_size, 0)
    stack = layout.write(stack, layer, page, slot, {n: new[n][0] for n in layout.names})
    return self._kv((stack, layer), latent_dim), (stack, layer)

  def _attend_per_head_shard(self, q, new, cache, window, sinks, kw):
    """`_attend_local` on each device of `head_axis`: its q heads [1, T, N/n, H]
    and its pool slice. GQA pools [L, K, P, ps, H] are split over KV heads like
    wk/wv (`sharding.kv_pool_spec`); q head i reads KV head i // (N/K), so
    contiguous splits of N and K keep every q head's KV head on its device.
    MLA's pool [L, P, ps, C] (one latent head) is replicated: each device
    writes the same entries into its copy and attends its q heads over all of it."""
    stack, layer = cache
    heads = P(None, None, self.head_axis)  # q [1, T, N, H], out [1, T, N, Hv], GQA k/v [1, T, K, H]
    latent = kw["latent_dim"] is not None
    pool = _layout(latent, stack).specs(heads=self.head_axis)
    has_sinks = sinks is not None
    local_ctx = dataclasses.replace(self, mesh=None, head_axis=None)

    def local(ctx, q, new, stack, layer, window, sinks):
      out, (stack, _) = ctx._attend_local(q, new, (stack, layer), window=window,
                                          sinks=sinks if has_sinks else None, **kw)
      return out, stack

    out, stack = jax.shard_map(
        local, mesh=self.mesh,
        in_specs=(P(), heads, {n: P() if latent else heads for n in new}, pool, P(), P(),
                  P(self.head_axis) if has_sinks else P()),
        out_specs=(heads, pool), check_vma=False,
    )(local_ctx, q, new, stack, jnp.asarray(layer), jnp.asarray(window, jnp.int32),
      sinks if has_sinks else jnp.zeros((), jnp.float32))
    return out, (stack, layer)

  def _attend_local(self, q, new, cache, *, latent_dim, window, sinks, scale, backend,
                    values=None):
    kv, cache = self.write(new, cache, latent_dim=latent_dim)
    new_kv = (new["k"][0], new["v"][0]) if set(new) == {"k", "v"} else None
    call = ops.AttentionCall(q=q[0], kv=kv, new_kv=new_kv, window=window, sinks=sinks,
                             scale=scale, values=values)
    out = ops.ragged_paged_attention(call, backend)
    return out[None], cache
