"""The Wan DiT pass sharded over a mesh: sequence parallel and CFG parallel.

Mesh axes (either may be absent or of size 1):
  SEQ ("seq")  the video tokens split into contiguous shards; the blocks run
               per shard and self-attention exchanges shards for heads by an
               all-to-all (Ulysses, `wan_dit.self_attention`): per device
               N / n heads over all T tokens, then back. Cross-attention,
               FFN, norms and modulation are token-local. n divides the
               head count and the token count.
  CFG ("data") the batch split: the pipeline's [cond; uncond] halves run
               on different devices (the guidance combination after the
               pass is the only exchange).
Patch embedding, conditioning and the head run under jit on the sharded
arrays (GSPMD); the blocks, where the exchange pattern matters, run in
one shard_map. Weights are replicated (one 14B expert in bfloat16 is 28 GB,
inside an H100's 80 GB at 720p x 81 frames: `experiments` prints the plan).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.diffusion import wan_dit
from jaxinfer.diffusion.wan_config import WanConfig

SEQ, CFG = "seq", "data"


def make_mesh(*, seq: int, cfg: int = 1, devices=None) -> Mesh:
  """A (CFG, SEQ) mesh over the first cfg * seq devices (default: all local)."""
  devices = list(jax.devices() if devices is None else devices)
  if seq < 1 or cfg < 1 or seq * cfg > len(devices):
    raise ValueError(f"make_mesh: cfg ({cfg}) x seq ({seq}) must be >= 1 and at most the "
                     f"{len(devices)} devices")
  return Mesh(np.asarray(devices[:cfg * seq]).reshape(cfg, seq), (CFG, SEQ))


def axis_size(mesh: Mesh, name: str) -> int:
  return dict(mesh.shape).get(name, 1)


def check_mesh(cfg: WanConfig, mesh: Mesh, latent_shape, *, batch: int) -> None:
  """ValueError naming the axis whose size does not divide what it splits."""
  extra = sorted(set(mesh.axis_names) - {SEQ, CFG})
  if extra:
    raise ValueError(f"mesh axes {extra} are not used by the Wan DiT (axes: {SEQ!r}, {CFG!r})")
  n_seq, n_cfg = axis_size(mesh, SEQ), axis_size(mesh, CFG)
  tokens = cfg.tokens(*latent_shape[2:])
  if cfg.num_heads % n_seq:
    raise ValueError(f"mesh axis {SEQ!r} ({n_seq}) must divide num_heads ({cfg.num_heads})")
  if tokens % n_seq:
    raise ValueError(f"mesh axis {SEQ!r} ({n_seq}) must divide the video tokens ({tokens})")
  if batch % n_cfg:
    raise ValueError(f"mesh axis {CFG!r} ({n_cfg}) must divide the DiT batch ({batch})")


def _specs(mesh: Mesh):
  b = CFG if CFG in mesh.axis_names else None
  s = SEQ if SEQ in mesh.axis_names else None
  return b, s


def sharded_blocks(cfg: WanConfig, mesh: Mesh):
  """blocks(params, x [B, T, D], mod, ctx, cos, sin) with x split (CFG, SEQ)."""
  b, s = _specs(mesh)
  body = functools.partial(wan_dit.blocks, cfg, seq_axis=s)
  return jax.shard_map(
      lambda p, x, mod, ctx, cos, sin: body(p, x, mod, ctx, cos, sin), mesh=mesh,
      in_specs=(P(), P(b, s), P(b), P(b), P(s), P(s)), out_specs=P(b, s), check_vma=False)


def forward(cfg: WanConfig, params, latents, timestep, text, mesh: Mesh):
  """`wan_dit.forward` with the blocks sharded over `mesh` (module docstring).
  Call inside jit (the pipeline's) or alone; shapes as `wan_dit.forward`."""
  wan_dit.check_inputs(cfg, latents, timestep, text)
  b, s = _specs(mesh)
  put = lambda a, spec: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))
  B = latents.shape[0]
  timestep = jax.numpy.broadcast_to(jax.numpy.asarray(timestep, "float32"), (B,))
  x, grid = wan_dit.embed(cfg, params, latents)
  temb, mod, ctx = wan_dit.condition(cfg, params, timestep, text)
  cos, sin = wan_dit.rope_tables(cfg, grid)
  x = sharded_blocks(cfg, mesh)({"blocks": params["blocks"]}, put(x, P(b, s)), put(mod, P(b)),
                                put(ctx, P(b)), put(cos, P(s)), put(sin, P(s)))
  return wan_dit.head(cfg, params, x, temb, grid)
