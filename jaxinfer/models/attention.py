"""Attention blocks: grouped-query (Llama, Mixtral, Qwen3, GPT-OSS) and
multi-head latent attention (DeepSeek-V2/V3).

Each takes one layer's params, the normed input x [B, T, D], the token
positions and that layer's slice of the contiguous KV cache (or None for a
cacheless full forward) and returns (out [B, T, D], new cache slice).

Contiguous cache slices: GQA {k [B, S, K, H], v [B, S, K, H]}; MLA
{kv [B, S, R + Hr]}: the normed latent and the roped shared key, never the
expanded per-head K/V.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer import ops
from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import apply_rope, rms_norm


def _write(cache, new, starts):
  """cache [B, S, ...] <- new [B, T, ...] at row starts[b] of each sequence."""
  return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n, s, axis=0))(
      cache, new.astype(cache.dtype), starts)


def _kv_range(x, starts):
  """Query positions [B, T] and visible key counts [B] for a chunk at starts."""
  T = x.shape[1]
  return starts[:, None] + jnp.arange(T, dtype=jnp.int32)[None], starts + T


def gqa(cfg: ModelConfig, p, x, cos, sin, window, cache, starts):
  """Grouped-query attention with optional biases, q/k norm and sinks."""
  q = jnp.einsum("BTD,DNH->BTNH", x, p["wq"])
  k = jnp.einsum("BTD,DKH->BTKH", x, p["wk"])
  v = jnp.einsum("BTD,DKH->BTKH", x, p["wv"])
  if cfg.qkv_bias:
    q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
  if cfg.qk_norm:  # Qwen3: per-head RMSNorm before RoPE
    q, k = rms_norm(q, p["q_norm"], cfg.norm_eps), rms_norm(k, p["k_norm"], cfg.norm_eps)
  q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
  q_pos, kv_len = _kv_range(x, starts)
  if cache is not None:
    cache = dict(k=_write(cache["k"], k, starts), v=_write(cache["v"], v, starts))
    k, v = cache["k"], cache["v"]
  out = ops.attention(q, k, v, q_positions=q_pos, kv_lengths=kv_len, window=window,
                      sinks=p.get("sinks"), scale=cfg.softmax_scale())
  out = jnp.einsum("BTNH,NHD->BTD", out, p["wo"])
  if cfg.o_bias:
    out = out + p["bo"]
  return out, cache


def mla(cfg: ModelConfig, p, x, cos, sin, window, cache, starts):
  """DeepSeek multi-head latent attention.

  Without a cache, K/V are expanded per head from the latent (prefill form).
  With a cache, attention runs in the absorbed form over the cached latent
  c [S, R] and shared rope key kr [S, Hr], as multi-query attention with one
  KV head: score = (q_nope W_uk) . c + q_rope . kr, out = (probs @ c) W_uv.
  """
  R, Hn = cfg.kv_lora_rank, cfg.qk_nope_head_dim
  if cfg.q_lora_rank:
    q = jnp.einsum("BTD,DR->BTR", x, p["wq_a"])
    q = jnp.einsum("BTR,RNH->BTNH", rms_norm(q, p["q_norm"], cfg.norm_eps), p["wq_b"])
  else:
    q = jnp.einsum("BTD,DNH->BTNH", x, p["wq"])
  q_nope, q_rope = q[..., :Hn], q[..., Hn:]
  q_rope = apply_rope(q_rope, cos, sin, cfg.rope_interleave)
  kv = jnp.einsum("BTD,DC->BTC", x, p["wkv_a"])  # [B, T, R + Hr]
  c = rms_norm(kv[..., :R], p["kv_norm"], cfg.norm_eps)
  k_rope = apply_rope(kv[:, :, None, R:], cos, sin, cfg.rope_interleave)[:, :, 0]
  w_uk, w_uv = p["wkv_b"][..., :Hn], p["wkv_b"][..., Hn:]  # [R, N, Hn], [R, N, Hv]
  q_pos, kv_len = _kv_range(x, starts)
  scale = cfg.softmax_scale()

  if cache is None:
    k_nope = jnp.einsum("BSR,RNH->BSNH", c, w_uk)
    v = jnp.einsum("BSR,RNH->BSNH", c, w_uv)
    k_rope_n = jnp.broadcast_to(k_rope[:, :, None], (*k_nope.shape[:3], k_rope.shape[-1]))
    k = jnp.concatenate([k_nope, k_rope_n], axis=-1)
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    out = ops.attention(q, k, v, q_positions=q_pos, kv_lengths=kv_len, window=window,
                        scale=scale)
  else:
    cache = dict(kv=_write(cache["kv"], jnp.concatenate([c, k_rope], axis=-1), starts))
    latent = cache["kv"][:, :, None]  # [B, S, 1, R + Hr]
    q_lat = jnp.einsum("BTNH,RNH->BTNR", q_nope, w_uk)
    q_abs = jnp.concatenate([q_lat, q_rope.astype(q_lat.dtype)], axis=-1)
    out_lat = ops.attention(q_abs, latent, latent[..., :R], q_positions=q_pos,
                            kv_lengths=kv_len, window=window, scale=scale)
    out = jnp.einsum("BTNR,RNH->BTNH", out_lat, w_uv)
  return jnp.einsum("BTNH,NHD->BTD", out, p["wo"]), cache


def attention(cfg: ModelConfig, p, x, cos, sin, window, cache, starts):
  fn = mla if cfg.attention == "mla" else gqa
  return fn(cfg, p, x, cos, sin, window, cache, starts)


def cache_shapes(cfg: ModelConfig, batch: int, max_len: int) -> dict:
  """Per-layer cache slice shapes."""
  if cfg.attention == "mla":
    return dict(kv=(batch, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim))
  shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  return dict(k=shape, v=shape)
