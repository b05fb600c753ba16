"""The Wan DiT pass sharded over a mesh: CFG, sequence and tensor parallel.

Mesh axes (any may be absent or of size 1):
  CFG ("data")     the batch split: the pipeline's [cond; uncond] halves run
                   on different devices (the guidance combination after the
                   pass is the only exchange).
  SEQ ("seq")      the video tokens split into contiguous shards; the blocks
                   run per shard and self-attention exchanges shards for
                   heads by an all-to-all (Ulysses, `wan_dit.self_attention`):
                   per device N / (t n) heads over all T tokens, then back.
                   Cross-attention, FFN, norms and modulation are
                   token-local.
  RING ("ring")    the video tokens split again, outside the SEQ groups: after
                   the Ulysses all-to-all each device holds T / r tokens of
                   its heads, and self-attention is `wan_dit.ring_attention`
                   (K/V blocks passed round the r devices, online softmax):
                   past the head count, for the longest sequences.
  TENSOR ("tensor") the blocks' heads and FFN columns split (Megatron TP):
                   each device holds 1 / t of the 14B blocks' weights (the
                   `q_heads` and `mlp` logical axes), and the attention
                   outputs and FFN partial sums are psum-ed over it.
n * t divides the head count, r * n the token count, t the FFN width.
Patch embedding, conditioning and the head run under jit on the sharded
arrays (GSPMD); the blocks, where the exchange pattern matters, run in one
shard_map whose weight specs come from the declared logical axes.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.diffusion import wan_dit, wan_weights
from jaxinfer.diffusion.wan_config import WanConfig
from jaxinfer.models.specs import is_spec

CFG, SEQ, TENSOR, RING = "data", "seq", "tensor", "ring"
_SPLIT = ("q_heads", "mlp")  # logical axes the tensor axis splits


def make_mesh(*, seq: int = 1, cfg: int = 1, tensor: int = 1, ring: int = 1,
              devices=None) -> Mesh:
  """A (CFG, RING, SEQ, TENSOR) mesh over the first cfg * ring * seq *
  tensor devices (RING only when ring > 1)."""
  devices = list(jax.devices() if devices is None else devices)
  n = cfg * ring * seq * tensor
  if min(seq, cfg, tensor, ring) < 1 or n > len(devices):
    raise ValueError(f"make_mesh: cfg ({cfg}) x ring ({ring}) x seq ({seq}) x tensor ({tensor}) "
                     f"must be >= 1 and at most the {len(devices)} devices")
  if ring > 1:
    return Mesh(np.asarray(devices[:n]).reshape(cfg, ring, seq, tensor), (CFG, RING, SEQ, TENSOR))
  return Mesh(np.asarray(devices[:n]).reshape(cfg, seq, tensor), (CFG, SEQ, TENSOR))


def axis_size(mesh: Mesh, name: str) -> int:
  return dict(mesh.shape).get(name, 1)


def check_mesh(cfg: WanConfig, mesh: Mesh, latent_shape, *, batch: int) -> None:
  """ValueError naming the axis whose size does not divide what it splits."""
  extra = sorted(set(mesh.axis_names) - {SEQ, CFG, TENSOR, RING})
  if extra:
    raise ValueError(f"mesh axes {extra} are not used by the Wan DiT (axes: {CFG!r}, {SEQ!r}, "
                     f"{TENSOR!r}, {RING!r})")
  n_seq, n_cfg, n_tp = axis_size(mesh, SEQ), axis_size(mesh, CFG), axis_size(mesh, TENSOR)
  n_ring = axis_size(mesh, RING)
  tokens = cfg.tokens(*latent_shape[2:])
  if cfg.num_heads % (n_seq * n_tp):
    raise ValueError(f"mesh axes {SEQ!r} x {TENSOR!r} ({n_seq} x {n_tp}) must divide num_heads "
                     f"({cfg.num_heads})")
  if cfg.ffn_dim % n_tp:
    raise ValueError(f"mesh axis {TENSOR!r} ({n_tp}) must divide ffn_dim ({cfg.ffn_dim})")
  if tokens % (n_seq * n_ring):
    raise ValueError(f"mesh axes {RING!r} x {SEQ!r} ({n_ring} x {n_seq}) must divide the video "
                     f"tokens ({tokens})")
  if batch % n_cfg:
    raise ValueError(f"mesh axis {CFG!r} ({n_cfg}) must divide the DiT batch ({batch})")


def _present(mesh: Mesh, name: str):
  return name if name in mesh.axis_names else None


def _tokens(mesh: Mesh):
  """The token axes' spec entry: RING outside SEQ (either may be absent)."""
  axes = tuple(a for a in (RING, SEQ) if a in mesh.axis_names)
  return axes if len(axes) > 1 else (axes[0] if axes else None)


def param_pspecs(cfg: WanConfig, mesh: Mesh):
  """PartitionSpec per param: `q_heads` / `mlp` dims over TENSOR, the rest whole."""
  tp = _present(mesh, TENSOR)
  return jax.tree.map(lambda s: P(*(tp if a in _SPLIT else None for a in s.logical_axes)),
                      wan_weights.param_specs(cfg), is_leaf=is_spec)


def param_shardings(cfg: WanConfig, mesh: Mesh):
  """NamedSharding per param (`param_pspecs`): place params with these."""
  return jax.tree.map(lambda p: NamedSharding(mesh, p), param_pspecs(cfg, mesh),
                      is_leaf=lambda x: isinstance(x, P))


def sharded_blocks(cfg: WanConfig, mesh: Mesh):
  """blocks(params, x [B, T, D], mod, ctx, cos, sin) with x split (CFG, SEQ)
  and the block weights over TENSOR."""
  b, s = _present(mesh, CFG), _tokens(mesh)
  axes = wan_dit.MeshAxes(seq=_present(mesh, SEQ), tensor=_present(mesh, TENSOR),
                          ring=_present(mesh, RING), ring_size=axis_size(mesh, RING))
  body = functools.partial(wan_dit.blocks, cfg, axes=axes)
  weights = {"blocks": param_pspecs(cfg, mesh)["blocks"]}
  return jax.shard_map(
      lambda p, x, mod, ctx, cos, sin: body(p, x, mod, ctx, cos, sin), mesh=mesh,
      in_specs=(weights, P(b, s), P(b), P(b), P(s), P(s)), out_specs=P(b, s), check_vma=False)


def forward(cfg: WanConfig, params, latents, timestep, text, mesh: Mesh):
  """`wan_dit.forward` with the blocks sharded over `mesh` (module docstring).
  Call inside jit (the pipeline's) or alone; shapes as `wan_dit.forward`."""
  wan_dit.check_inputs(cfg, latents, timestep, text)
  b, s = _present(mesh, CFG), _tokens(mesh)
  put = lambda a, spec: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))
  B = latents.shape[0]
  timestep = jax.numpy.broadcast_to(jax.numpy.asarray(timestep, "float32"), (B,))
  x, grid = wan_dit.embed(cfg, params, latents)
  temb, mod, ctx = wan_dit.condition(cfg, params, timestep, text)
  cos, sin = wan_dit.rope_tables(cfg, grid)
  x = sharded_blocks(cfg, mesh)({"blocks": params["blocks"]}, put(x, P(b, s)), put(mod, P(b)),
                                put(ctx, P(b)), put(cos, P(s)), put(sin, P(s)))
  return wan_dit.head(cfg, params, x, temb, grid)
