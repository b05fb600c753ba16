"""The page pool type (`jaxinfer.kv.pool`): layout, sharding and accessors
agree with each other and with the engine's own use of the pool."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer import presets, sharding
from jaxinfer.kv import cache as kv_cache
from jaxinfer.kv.pool import PagePool, PoolLayout
from jaxinfer.ops import kernel_dims

GQA = presets.get("tiny_dense")
MLA = presets.get("tiny_moe")


def _filled(cfg, num_pages=6, page_size=4, mtp=False):
  pool = kv_cache.init_pool(cfg, num_pages, page_size, jnp.float32, mtp=mtp)
  key = jax.random.key(0)
  return jax.tree.map(lambda a: jax.random.normal(jax.random.fold_in(key, a.size), a.shape), pool)


@pytest.mark.parametrize("cfg", [GQA, MLA], ids=["gqa", "mla"])
def test_init_pool_follows_the_layout(cfg):
  pool = kv_cache.init_pool(cfg, 6, 4, jnp.float32, mtp=bool(cfg.num_mtp_layers))
  layout = pool.layout
  assert layout == kv_cache.pool_layout(cfg) and layout.latent == cfg.attention.latent
  assert len(pool) == len(cfg.segments()) + bool(cfg.num_mtp_layers)
  for seg, entry in zip(pool, [n for _, _, n in cfg.segments()]):
    assert set(seg) == set(layout.names)
    for a in seg.values():
      assert a.shape[layout.axis("layer")] == entry
      assert a.shape[layout.axis("page")] == 6 and a.shape[layout.axis("slot")] == 4
  assert pool.page_size == 4 and pool.num_pages == 6
  if not layout.latent:
    assert kernel_dims(pool[0]["k"]) == dict(kv_head=cfg.num_kv_heads, page=6, slot=4,
                                             dim=cfg.head_dim)


def test_take_put_round_trip_touches_only_those_pages():
  src, dst = _filled(MLA, mtp=True), kv_cache.init_pool(MLA, 6, 4, jnp.float32, mtp=True)
  pages = jnp.asarray([4, 1], jnp.int32)
  blob = kv_cache.gather_pages(src, pages)
  assert isinstance(blob, PagePool) and blob.num_pages == 2 and blob.mtp
  out = kv_cache.scatter_pages(dst, pages, blob)
  for s, o in zip(src.segments, out.segments):
    ax = src.layout.axis("page")
    np.testing.assert_array_equal(jnp.take(o["kv"], pages, axis=ax), jnp.take(s["kv"], pages, axis=ax))
    rest = jnp.asarray([0, 2, 3, 5])
    assert not jnp.any(jnp.take(o["kv"], rest, axis=ax))


@pytest.mark.parametrize("cfg", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize("page,slot", [([2, 2, 3], [0, 3, 1]), ([3], [2])], ids=["scatter", "one"])
def test_write_puts_tokens_at_page_and_slot(cfg, page, slot):
  """Several tokens (a scatter) or one (a dynamic-update-slice) land at
  their (page, slot) of the layer given, and nowhere else."""
  layout = kv_cache.pool_layout(cfg)
  stack = kv_cache.init_pool(cfg, 5, 4, jnp.float32)[0]
  T = len(page)
  shapes = {"kv": (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)} if layout.latent else {
      n: (cfg.num_kv_heads, cfg.head_dim) for n in layout.names}
  new = {n: jnp.arange(T * int(np.prod(shapes[n])), dtype=jnp.float32).reshape(T, *shapes[n]) + 1 + i
         for i, n in enumerate(layout.names)}
  page, slot = jnp.asarray(page, jnp.int32), jnp.asarray(slot, jnp.int32)
  layer = stack[layout.names[0]].shape[0] - 1
  out = jax.jit(layout.write)(stack, layer, page, slot, new)
  for n in layout.names:
    for t in range(T):
      at = (layer, page[t], slot[t]) if layout.latent else (layer, slice(None), page[t], slot[t])
      got = out[n][at]
      np.testing.assert_array_equal(got, new[n][t])
    assert float(jnp.abs(out[n]).sum()) == float(jnp.abs(new[n]).sum())  # nothing else written


@pytest.mark.parametrize("layout_name", ["tp", "dp_attn_ep"])
@pytest.mark.parametrize("cfg", [GQA, MLA], ids=["gqa", "mla"])
def test_pool_spec_places_pages_and_heads(cfg, layout_name):
  mesh = sharding.make_mesh({"data": 2, "tensor": 2, "expert": 2})
  spec = sharding.kv_pool_spec(cfg, mesh, layout_name)
  layout = kv_cache.pool_layout(cfg)
  pool = kv_cache.init_pool(cfg, 8, 4, jnp.float32, sharding=NamedSharding(mesh, spec))
  a = pool[0][layout.names[0]]
  shard = a.sharding.shard_shape(a.shape)
  dp = sharding.dp_axes(mesh, layout_name)
  if dp:  # pages split over the attention-DP ranks
    ranks = int(np.prod([mesh.shape[x] for x in dp]))
    assert shard[layout.axis("page")] == 8 // ranks
  else:
    assert shard[layout.axis("page")] == 8
    if not layout.latent:  # GQA KV heads split like wk/wv; MLA's latent replicated
      assert shard[layout.axis("kv_head")] < a.shape[layout.axis("kv_head")]
    else:
      assert shard == a.shape


def test_named_errors():
  with pytest.raises(ValueError, match="unknown attention kind 'mha'"):
    PoolLayout.for_attention("mha")
  plain = kv_cache.init_pool(GQA, 4, 4, jnp.float32)
  with pytest.raises(ValueError, match="holds no MTP entry"):
    plain.mtp_entry
  spec_pool = kv_cache.init_pool(MLA, 4, 4, jnp.float32, mtp=True)
  with pytest.raises(ValueError, match="needs its MTP entry"):
    spec_pool.with_segments(spec_pool.model)
  with pytest.raises(ValueError, match="blob has 1 segments"):
    spec_pool.put(jnp.asarray([1]), plain.take(jnp.asarray([1])))
  assert PoolLayout(latent=False).spec(heads="tensor") == P(None, "tensor")
  assert PoolLayout(latent=True).spec(heads="tensor", pages=None) == P()
