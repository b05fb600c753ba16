"""Sequence-parallel (Ulysses), tensor-parallel and CFG-parallel DiT passes and
sampling on 8 CPU devices equal the single-device ones."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.diffusion import unipc, wan_dit, wan_parallel, wan_pipeline, wan_weights
from jaxinfer.diffusion.wan_config import WanConfig

CFG = WanConfig(num_heads=8, head_dim=12, text_dim=32, ffn_dim=32, num_layers=2)


def _params(seed):
  """Random params with every bias / norm weight perturbed (init makes them 0 / 1)."""
  p = wan_weights.init_params(CFG, jax.random.key(seed))
  leaves, tree = jax.tree.flatten(p)
  keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape)
                                   for x, k in zip(leaves, keys)])


def _inputs(batch):
  k = jax.random.split(jax.random.key(9), 2)
  latents = jax.random.normal(k[0], (batch, 16, 2, 8, 8))  # 2 x 4 x 4 = 32 tokens
  return latents, jax.random.normal(k[1], (batch, 5, 32))


@pytest.mark.parametrize("seq,cfg,tensor,ring", [(8, 1, 1, 1), (2, 2, 2, 1), (2, 1, 1, 4),
                                                (1, 1, 1, 8)])
def test_sharded_forward_equals_single_device(seq, cfg, tensor, ring):
  params = _params(0)
  latents, text = _inputs(2)
  t = jnp.array([900.0, 300.0])
  ref = wan_dit.forward(CFG, params, latents, t, text)
  mesh = wan_parallel.make_mesh(seq=seq, cfg=cfg, tensor=tensor, ring=ring)
  placed = jax.device_put(params, wan_parallel.param_shardings(CFG, mesh))
  if tensor > 1:  # each device holds a slice of the block weights
    wq = placed["blocks"]["self"]["wq"]
    assert wq.addressable_shards[0].data.shape[2] == CFG.num_heads // tensor
  ours = jax.jit(wan_parallel.forward, static_argnums=(0, 5))(CFG, placed, latents, t, text, mesh)
  err = float(jnp.max(jnp.abs(ours - ref)) / jnp.max(jnp.abs(ref)))
  print(f"seq={seq} cfg={cfg} tensor={tensor} ring={ring}: "
        f"max|sharded - single| / max|single| = {err:.2e}")
  assert err < 1e-5


def test_sharded_sampling_equals_single_device():
  high, low = _params(0), _params(1)
  latents, text = _inputs(1)
  neg = jnp.flip(text, axis=1)
  sampler = wan_pipeline.SamplerConfig(num_steps=3, boundary_ratio=0.9,
                                       solver=unipc.FlowUniPC(flow_shift=3.0))
  ref = wan_pipeline.denoise(CFG, sampler, high, low, latents, text, neg)
  mesh = wan_parallel.make_mesh(seq=2, cfg=2, tensor=2)
  shard = lambda p: jax.device_put(p, wan_parallel.param_shardings(CFG, mesh))
  ours = wan_pipeline.denoise(CFG, sampler, shard(high), shard(low), latents, text, neg, mesh=mesh)
  err = float(jnp.max(jnp.abs(ours - ref)) / jnp.max(jnp.abs(ref)))
  print(f"sampling seq=2 cfg=2 tensor=2: max|sharded - single| / max|single| = {err:.2e}")
  assert err < 1e-5


def test_mesh_errors():
  latents, text = _inputs(1)
  with pytest.raises(ValueError, match="must divide ffn_dim"):
    wan_parallel.check_mesh(dataclasses.replace(CFG, ffn_dim=30),
                            wan_parallel.make_mesh(seq=2, tensor=4), latents.shape, batch=2)
  with pytest.raises(ValueError, match="must divide num_heads"):
    wan_parallel.check_mesh(dataclasses.replace(CFG, num_heads=6), wan_parallel.make_mesh(seq=4),
                            latents.shape, batch=2)
  with pytest.raises(ValueError, match="must divide the video tokens"):
    wan_parallel.check_mesh(CFG, wan_parallel.make_mesh(seq=8), (1, 16, 1, 2, 6), batch=2)
  with pytest.raises(ValueError, match="must divide the DiT batch"):
    wan_parallel.check_mesh(CFG, wan_parallel.make_mesh(seq=2, cfg=4), latents.shape, batch=2)
  np.testing.assert_equal(wan_parallel.make_mesh(seq=4, cfg=2).axis_names,
                          ("data", "seq", "tensor"))


def test_ring_attention_in_key_blocks_equals_full_attention():
  """Ring attention over 8 devices with key blocks of 3 inside each hop
  (the last one padded) equals one device's softmax attention."""
  ks = jax.random.split(jax.random.key(3), 3)
  q, k, v = (jax.random.normal(kk, (2, 40, 4, 12)) for kk in ks)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]), ("ring",))
  spec = jax.sharding.PartitionSpec(None, "ring")
  ring = jax.shard_map(lambda q, k, v: wan_dit.ring_attention(q, k, v, scale=0.3, axis="ring",
                                                               size=8, block=3),
                       mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
  ours = jax.jit(ring)(q, k, v)
  s = jnp.einsum("BTNH,BSNH->BNTS", q, k) * 0.3
  ref = jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(s, axis=-1), v)
  np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)
