"""The Wan 2.x video DiT as pure functions over the `wan_weights` param tree.

One denoiser pass (diffusers' `WanTransformer3DModel.forward`, text to video):
  latents [B, C, F, Hh, Ww] -> 3D patches (pt, ph, pw) -> tokens [B, T, D]
  timestep -> sinusoid -> MLP -> temb [B, D] -> six modulations [B, 6, D]
  text [B, L, Dt] -> MLP -> context [B, L, D]
  L blocks: x += gate * SelfAttn(LN(x) * (1 + scale) + shift)   (3D RoPE, q/k RMS norm)
            x += CrossAttn(LN_affine(x), context)
            x += c_gate * FFN(LN(x) * (1 + c_scale) + c_shift)
  head: LN(x) * (1 + scale) + shift -> proj -> unpatchify [B, Cout, F, Hh, Ww]

Every op but self-attention is token-local, so the blocks run on a token
shard as well as on the whole sequence: with `MeshAxes.seq` (inside a
shard_map over that mesh axis) self-attention trades token shards for head
shards by an all-to-all (Ulysses) and back. With `MeshAxes.tensor` the
blocks hold a slice of the heads and FFN columns (Megatron TP): q/k RMS
norms sum their squares across it, and the attention outputs and the FFN
sum their partial projections (psum). `wan_parallel` builds the sharded pass.
Norms, modulation and residual adds run in float32, as diffusers does.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxinfer import ops
from jaxinfer.diffusion.wan_config import WanConfig

Grid = tuple[int, int, int]  # latent patches along frames, height, width


@dataclasses.dataclass(frozen=True)
class MeshAxes:
  """The mesh axes the blocks are split over inside a shard_map (None: not split)."""
  seq: str | None = None  # video tokens (Ulysses all-to-all in self-attention)
  tensor: str | None = None  # heads and FFN columns (partial sums psum-ed)
  ring: str | None = None  # video tokens, outer (ring attention: K/V passed round)
  ring_size: int = 1  # devices on the ring axis (the K/V blocks each query block meets)

  def psum(self, x):
    return jax.lax.psum(x, self.tensor) if self.tensor else x


SINGLE = MeshAxes()


def check_inputs(cfg: WanConfig, latents, timestep, text) -> None:
  """ValueError naming the argument for shapes the DiT cannot take."""
  if latents.ndim != 5 or latents.shape[1] != cfg.in_channels:
    raise ValueError(f"latents must be [B, {cfg.in_channels}, F, H, W], got {latents.shape}")
  for size, p, name in zip(latents.shape[2:], cfg.patch_size, ("frames", "height", "width")):
    if size % p or size < p:
      raise ValueError(f"latents {name} ({size}) must be a positive multiple of the patch "
                       f"size {p}")
  B = latents.shape[0]
  if text.ndim != 3 or text.shape[0] != B or text.shape[2] != cfg.text_dim:
    raise ValueError(f"text embeddings must be [{B}, L, {cfg.text_dim}], got {text.shape}")
  if jnp.ndim(timestep) not in (0, 1) or (jnp.ndim(timestep) == 1 and jnp.shape(timestep)[0] != B):
    raise ValueError(f"timestep must be a scalar or [{B}], got shape {jnp.shape(timestep)}")


def patchify(cfg: WanConfig, latents) -> tuple[jax.Array, Grid]:
  """[B, C, F, Hh, Ww] -> [B, T, C*pt*ph*pw] (tokens frame-major, then rows,
  columns; each patch flattened (C, pt, ph, pw) as the Conv3d kernel)."""
  B, C, F, Hh, Ww = latents.shape
  pt, ph, pw = cfg.patch_size
  f, h, w = F // pt, Hh // ph, Ww // pw
  x = latents.reshape(B, C, f, pt, h, ph, w, pw).transpose(0, 2, 4, 6, 1, 3, 5, 7)
  return x.reshape(B, f * h * w, C * pt * ph * pw), (f, h, w)


def unpatchify(cfg: WanConfig, x, grid: Grid):
  """[B, T, pt*ph*pw*Cout] (proj_out's (pt, ph, pw, C) order) -> [B, Cout, F, Hh, Ww]."""
  (f, h, w), (pt, ph, pw) = grid, cfg.patch_size
  B = x.shape[0]
  x = x.reshape(B, f, h, w, pt, ph, pw, cfg.out_channels).transpose(0, 7, 1, 4, 2, 5, 3, 6)
  return x.reshape(B, cfg.out_channels, f * pt, h * ph, w * pw)


def rope_tables(cfg: WanConfig, grid: Grid):
  """cos, sin [T, H/2] float32: token (i, j, k)'s angle per rotated pair; the
  head's pairs split (frame, height, width) by `cfg.rope_dims`, each pair d
  of a part of size n at frequency theta^(-2d/n) (diffusers' WanRotaryPosEmbed)."""
  f, h, w = grid
  parts = []
  for n, size, axis in zip(cfg.rope_dims, grid, range(3)):
    freqs = cfg.rope_theta ** (-jnp.arange(0, n, 2, dtype=jnp.float32) / n)  # [n/2]
    angle = jnp.arange(size, dtype=jnp.float32)[:, None] * freqs  # [size, n/2]
    shape = [1, 1, 1, n // 2]
    shape[axis] = size
    parts.append(jnp.broadcast_to(angle.reshape(shape), (f, h, w, n // 2)))
  angles = jnp.concatenate(parts, axis=-1).reshape(f * h * w, -1)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
  """x [B, T, N, H]; rotates the interleaved pairs (x[2d], x[2d+1])."""
  xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
  x1, x2 = xf[..., 0], xf[..., 1]
  c, s = cos[None, :, None, :], sin[None, :, None, :]
  return jnp.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).reshape(x.shape).astype(x.dtype)


def _layer_norm(x, eps):
  x = x.astype(jnp.float32)
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps)


def _rms_heads(cfg: WanConfig, x, w, axes: MeshAxes):
  """RMSNorm over all heads of a token (x [B, T, N, H], w [N, H]; under TP a
  slice of the heads, the sum of squares over all of them)."""
  xf = x.astype(jnp.float32)
  ss = axes.psum(jnp.sum(jnp.square(xf), axis=(-2, -1), keepdims=True))
  ms = ss / cfg.d_model
  return (xf * jax.lax.rsqrt(ms + cfg.eps) * w.astype(jnp.float32)).astype(x.dtype)


def _gelu(x):
  return jax.nn.gelu(x, approximate=True)


def timestep_features(cfg: WanConfig, t):
  """[B] -> [B, freq_dim] float32: (cos, sin) of t * 10000^(-i / (freq_dim / 2))."""
  half = cfg.freq_dim // 2
  freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
  arg = jnp.asarray(t, jnp.float32)[:, None] * freqs[None]
  return jnp.concatenate([jnp.cos(arg), jnp.sin(arg)], axis=-1)


def condition(cfg: WanConfig, params, timestep, text):
  """temb [B, D], the blocks' modulation [B, 6, D] (float32), context [B, L, D]."""
  dt = cfg.compute_dtype()
  t = timestep_features(cfg, timestep).astype(params["time_w1"].dtype)
  temb = jax.nn.silu(t @ params["time_w1"] + params["time_b1"]) @ params["time_w2"] + \
      params["time_b2"]
  mod = jnp.einsum("BD,DSE->BSE", jax.nn.silu(temb), params["time_proj_w"]) + \
      params["time_proj_b"]
  text = text.astype(dt)
  ctx = _gelu(text @ params["text_w1"] + params["text_b1"]) @ params["text_w2"] + params["text_b2"]
  return temb.astype(jnp.float32), mod.astype(jnp.float32), ctx


def _qkv(cfg: WanConfig, p, x, kv_src, axes: MeshAxes):
  q = jnp.einsum("BTD,DNH->BTNH", x, p["wq"]) + p["bq"]
  k = jnp.einsum("BSD,DNH->BSNH", kv_src, p["wk"]) + p["bk"]
  v = jnp.einsum("BSD,DNH->BSNH", kv_src, p["wv"]) + p["bv"]
  return _rms_heads(cfg, q, p["q_norm"], axes), _rms_heads(cfg, k, p["k_norm"], axes), v


def _out(p, o, axes: MeshAxes):
  return axes.psum(jnp.einsum("BTNH,NHD->BTD", o, p["wo"])) + p["bo"]


def self_attention(cfg: WanConfig, p, x, cos, sin, axes: MeshAxes = SINGLE):
  """x [B, T, D] (a token shard under `axes.seq`) -> [B, T, D]. Ulysses:
  the all-to-all gives each device every token of N / n heads, attention
  runs whole per head, and the inverse all-to-all restores the token shard.
  With `axes.ring` the tokens are split over the ring axis too (outside the
  Ulysses groups): attention then runs as `ring_attention`."""
  q, k, v = _qkv(cfg, p, x, x, axes)
  q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
  if axes.seq is not None:
    gather = lambda a: jax.lax.all_to_all(a, axes.seq, 2, 1, tiled=True)  # heads -> tokens
    q, k, v = gather(q), gather(k), gather(v)
  if axes.ring is not None:
    o = ring_attention(q, k, v, scale=cfg.head_dim ** -0.5, axis=axes.ring,
                       size=axes.ring_size)
  else:
    o = ops.full_attention(q, k, v, scale=cfg.head_dim ** -0.5, backend=cfg.backend)
  if axes.seq is not None:
    o = jax.lax.all_to_all(o, axes.seq, 1, 2, tiled=True)  # tokens -> heads
  return _out(p, o, axes)


def _kv_blocks(q, k, v, scale, block):
  """Unnormalised attention of q [B, T, N, H] over k, v [B, S, N, H] in key
  blocks of `block` (online softmax, so memory holds one [B, N, T, block]
  score tile) -> (o [B, T, N, H] float32, running max, sum [B, N, T])."""
  B, T, N, H = q.shape
  S = k.shape[1]
  block = min(block, S)
  nb = -(-S // block)
  pad = nb * block - S
  kb = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, nb, block, N, H)
  vb = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, nb, block, N, -1)
  valid = (jnp.arange(nb * block) < S).reshape(nb, block)
  qf = q.astype(jnp.float32) * scale

  def step(carry, xs):
    o, m, l = carry
    kj, vj, ok = xs
    s = jnp.einsum("BTNH,BSNH->BNTS", qf, kj.astype(jnp.float32))
    s = jnp.where(ok[None, None, None], s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    alpha = jnp.exp(m - m_new)
    o = o * alpha.transpose(0, 2, 1)[..., None] + jnp.einsum("BNTS,BSNH->BTNH", p,
                                                            vj.astype(jnp.float32))
    return (o, m_new, l * alpha + p.sum(-1)), None

  init = (jnp.zeros((B, T, N, v.shape[-1]), jnp.float32),
          jnp.full((B, N, T), -jnp.inf, jnp.float32), jnp.zeros((B, N, T), jnp.float32))
  (o, m, l), _ = jax.lax.scan(step, init, (kb.swapaxes(0, 1), vb.swapaxes(0, 1), valid))
  return o, m, l


def ring_attention(q, k, v, *, scale, axis: str, size: int, block: int = 1024):
  """Unmasked attention with the keys split over a ring of `size` devices
  (inside a shard_map over `axis`): q, k, v [B, T, N, H] are this device's
  token block. It attends its own K/V block, then passes the blocks round
  the ring (`ppermute`, size - 1 hops), attending each block it meets, in
  key blocks of `block`, merged by running max and sum (FlashAttention's
  online softmax): no device holds more than its own keys and one block in
  flight."""
  perm = [(j, (j + 1) % size) for j in range(size)]

  def hop(i, carry):
    o, m, l, k, v = carry
    k, v = jax.lax.ppermute(k, axis, perm), jax.lax.ppermute(v, axis, perm)
    o2, m2, l2 = _kv_blocks(q, k, v, scale, block)
    top = jnp.maximum(m, m2)
    a, b = jnp.exp(m - top), jnp.exp(m2 - top)
    o = o * a.transpose(0, 2, 1)[..., None] + o2 * b.transpose(0, 2, 1)[..., None]
    return o, top, l * a + l2 * b, k, v

  o, m, l = _kv_blocks(q, k, v, scale, block)  # this device's own block
  o, _, l, _, _ = jax.lax.fori_loop(1, size, hop, (o, m, l, k, v))
  return (o / l.transpose(0, 2, 1)[..., None]).astype(q.dtype)


def cross_attention(cfg: WanConfig, p, x, ctx, axes: MeshAxes = SINGLE):
  q, k, v = _qkv(cfg, p, x, ctx, axes)
  o = ops.full_attention(q, k, v, scale=cfg.head_dim ** -0.5, backend=cfg.backend)
  return _out(p, o, axes)


def block(cfg: WanConfig, p, x, mod, ctx, cos, sin, axes: MeshAxes = SINGLE):
  """One DiT block over x [B, T, D]; mod [B, 6, D] float32 (diffusers'
  WanTransformerBlock with temb [B, 6, D])."""
  m = p["table"].astype(jnp.float32) + mod  # [B, 6, D]
  shift, scale, gate, c_shift, c_scale, c_gate = (m[:, i, None, :] for i in range(6))
  dt = x.dtype
  h = (_layer_norm(x, cfg.eps) * (1 + scale) + shift).astype(dt)
  x = (x.astype(jnp.float32) + self_attention(cfg, p["self"], h, cos, sin, axes) * gate)
  x = x.astype(dt)
  h = (_layer_norm(x, cfg.eps) * p["norm2_w"].astype(jnp.float32)
       + p["norm2_b"].astype(jnp.float32)).astype(dt)
  x = x + cross_attention(cfg, p["cross"], h, ctx, axes)
  h = (_layer_norm(x, cfg.eps) * (1 + c_scale) + c_shift).astype(dt)
  ff = axes.psum(_gelu(h @ p["ffn_w1"] + p["ffn_b1"]) @ p["ffn_w2"]) + p["ffn_b2"]
  return (x.astype(jnp.float32) + ff.astype(jnp.float32) * c_gate).astype(dt)


def blocks(cfg: WanConfig, params, x, mod, ctx, cos, sin, axes: MeshAxes = SINGLE):
  """The stacked blocks, scanned (compile time flat in depth)."""
  def one(x, p):
    return block(cfg, p, x, mod, ctx, cos, sin, axes), None
  return jax.lax.scan(one, x, params["blocks"])[0]


def embed(cfg: WanConfig, params, latents):
  """Patch embedding: [B, C, F, Hh, Ww] -> tokens [B, T, D], the patch grid."""
  patches, grid = patchify(cfg, latents.astype(cfg.compute_dtype()))
  return patches @ params["patch_w"] + params["patch_b"], grid


def head(cfg: WanConfig, params, x, temb, grid: Grid):
  """Output norm, modulation by temb and projection, unpatchified."""
  m = params["head_table"].astype(jnp.float32) + temb[:, None, :]  # [B, 2, D]
  h = (_layer_norm(x, cfg.eps) * (1 + m[:, 1, None]) + m[:, 0, None]).astype(x.dtype)
  return unpatchify(cfg, h @ params["proj_w"] + params["proj_b"], grid)


def forward(cfg: WanConfig, params, latents, timestep, text):
  """The denoiser's prediction (flow velocity) for latents [B, C, F, Hh, Ww]
  at timestep (scalar or [B], on the 0..1000 training scale), conditioned on
  text [B, L, Dt]; [B, Cout, F, Hh, Ww] in the param dtype."""
  check_inputs(cfg, latents, timestep, text)
  B = latents.shape[0]
  timestep = jnp.broadcast_to(jnp.asarray(timestep, jnp.float32), (B,))
  x, grid = embed(cfg, params, latents)
  temb, mod, ctx = condition(cfg, params, timestep, text)
  cos, sin = rope_tables(cfg, grid)
  x = blocks(cfg, params, x, mod, ctx, cos, sin)
  return head(cfg, params, x, temb, grid)
