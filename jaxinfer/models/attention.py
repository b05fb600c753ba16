"""Attention blocks: grouped-query (Llama, Mixtral, Qwen3, GPT-OSS) and
multi-head latent attention (DeepSeek-V2/V3).

Each takes one layer's params, the normed input x [B, T, D], RoPE cos/sin, a
KV context (`kv/contexts.py`: where the keys and values live) and that
layer's cache slice, and returns (out [B, T, D], new cache slice).
"""

from __future__ import annotations

from einops import rearrange
import jax
import jax.numpy as jnp

from jaxinfer import ops
from jaxinfer.backend import Backend
from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import apply_rope, linear, pack_linear, rms_norm, unpack_linear
from jaxinfer.models.layouts import AbsorbedMLA, FusedQKV, WeightForm
from jaxinfer.models.quant import QuantizedWeight, dense


def out_proj(out, wo, backend: Backend = Backend()):
  """[B, T, N, H] x [N, H, D] (or its `PackedLinear`) -> [B, T, D] as one
  [B, T, N*H] x [N*H, D] matmul, so the weight is read in its stored layout
  (the einsum made XLA:CPU transpose wo into a copy every step)."""
  return linear(out, wo, in_dims=2, backend=backend).astype(out.dtype)


def gqa(cfg: ModelConfig, p, x, cos, sin, ctx, window, cache):
  """Grouped-query attention with optional biases, q/k norm and sinks."""
  if isinstance(p, FusedQKV) and p.grouped:
    qkv = linear(x, p.wqkv, backend=cfg.backend)  # [B, T, K, G + 2, H]
    q = rearrange(qkv[..., :-2, :], "... K G H -> ... (K G) H")
    k, v = qkv[..., -2, :], qkv[..., -1, :]
  elif isinstance(p, FusedQKV):
    N, K, H = p.heads
    qkv = linear(x, p.wqkv, backend=cfg.backend)
    q, k, v = (a.reshape(*a.shape[:-1], -1, H)
               for a in jnp.split(qkv, [N * H, (N + K) * H], axis=-1))
  else:
    q, k, v = (linear(x, p[name], backend=cfg.backend) for name in ("wq", "wk", "wv"))
  if cfg.qkv_bias:
    q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
  if cfg.qk_norm:  # Qwen3: per-head RMSNorm before RoPE
    q, k = rms_norm(q, p["q_norm"], cfg.norm_eps), rms_norm(k, p["k_norm"], cfg.norm_eps)
  q, k = (apply_rope(a, cos, sin, cfg.rope_interleave) for a in (q, k))
  out, cache = ctx.attend(q, dict(k=k, v=v), cache, window=window, sinks=p.get("sinks"),
                          scale=cfg.softmax_scale(), backend=cfg.backend)
  out = out_proj(out, p["wo"], cfg.backend)
  if cfg.o_bias:
    out = out + p["bo"]
  return out, cache


def absorbed_weights(cfg: ModelConfig, p):
  """MLA's per-head up-projections from the latent, in the layouts the
  per-head matmuls read, each head's contracted dim minor: (w_uk [N, R, Hn],
  w_uv [N, Hv, R]). Stored so in a `layouts.AbsorbedMLA`, else sliced from
  the stacked wkv_b here. XLA:CPU runs the decode products 2.5-6x faster so
  than contracting a major dim (`layouts.AbsorbedMLA`)."""
  if isinstance(p, AbsorbedMLA):
    return p.w_uk, p.w_uv
  Hn = cfg.qk_nope_head_dim
  wkv_b = dense(p["wkv_b"], cfg.compute_dtype())  # [R, N, Hn + Hv]
  return (rearrange(wkv_b[..., :Hn], "R N Hn -> N R Hn"),
          rearrange(wkv_b[..., Hn:], "R N Hv -> N Hv R"))


_PROJECTIONS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "wq_a": 1, "wq_b": 1, "wkv_a": 1}  # -> in_dims


def step_layout(cfg: ModelConfig, p, form: WeightForm = WeightForm()):
  """One layer's attention weights in the step's `WeightForm`: MLA's as an
  `AbsorbedMLA` (up-projections pre-transposed); with form.fused_qkv
  (projections untransposed) grouped-query float q/k/v as a grouped
  `FusedQKV` (`grouped_qkv`); with form.transposed,
  grouped-query float q/k/v as a `FusedQKV` and the projections as
  `layers.PackedLinear` (float ones unless form.floats_in_out, out-major
  with form.out_major, in panels with form.panels; quantized ones always)."""
  if cfg.attention.latent and not isinstance(p["wkv_b"], QuantizedWeight):
    w_uk, w_uv = absorbed_weights(cfg, p)
    p = AbsorbedMLA(w_uk=w_uk, w_uv=w_uv, **{k: v for k, v in p.items() if k != "wkv_b"})
  float_qkv = not cfg.attention.latent and not any(isinstance(p[k], QuantizedWeight) for k in _QKV)
  if not form.transposed:
    if form.fused_qkv and float_qkv:
      return grouped_qkv(p)
    return p
  def pack(v, in_dims=1):
    if form.floats_in_out and not isinstance(v, QuantizedWeight):
      return v
    return pack_linear(v, in_dims, form.out_major, form.panels)
  if float_qkv:
    D = p["wq"].shape[0]
    wqkv = jnp.concatenate([p[k].reshape(D, -1) for k in _QKV], axis=-1)
    rest = {k: v for k, v in p.items() if k not in _QKV}
    return FusedQKV(wqkv=pack(wqkv), heads=tuple(p["wq"].shape[1:2]) + tuple(p["wk"].shape[1:]),
                    **{**rest, "wo": pack(rest["wo"], 2)})
  packed = {k: pack(v, _PROJECTIONS[k]) for k, v in p.items() if k in _PROJECTIONS}
  if isinstance(p, AbsorbedMLA) and "wq_a" in p and not any(
      isinstance(p[k], QuantizedWeight) for k in ("wq_a", "wkv_a")):
    packed.update(wqkv_a=pack(jnp.concatenate([p["wq_a"], p["wkv_a"]], axis=-1)),
                  wq_a=None, wkv_a=None)
  return p.replace(**packed) if isinstance(p, AbsorbedMLA) else {**p, **packed}


_QKV = ("wq", "wk", "wv")


def grouped_qkv(p) -> FusedQKV:
  """One layer's grouped-query wq [D, N, H], wk and wv [D, K, H] as a grouped
  `FusedQKV`: wqkv [D, K, G + 2, H], each KV head's G query heads, key and
  value side by side (query head n = k G + g reads KV head k, as the
  attention's grouping has it)."""
  D, N, H = p["wq"].shape
  K = p["wk"].shape[1]
  wq = rearrange(p["wq"], "D (K G) H -> D K G H", K=K)
  wqkv = jnp.concatenate([wq, p["wk"][:, :, None], p["wv"][:, :, None]], axis=2)
  rest = {k: v for k, v in p.items() if k not in _QKV}
  return FusedQKV(wqkv=wqkv, heads=(N, K, H), grouped=True, **rest)


def stacked_layout(p):
  """The inverse of `step_layout`: one layer's attention weights as the
  stacked params hold them (projections [*In, *Out], MLA's wkv_b
  [R, N, Hn + Hv], grouped-query wq / wk / wv apart). Same values."""
  if isinstance(p, FusedQKV) and p.grouped:
    wqkv = p.wqkv
    p = {**{k: v for k, v in p.items() if k != "wqkv"},
         "wq": rearrange(wqkv[:, :, :-2], "D K G H -> D (K G) H"),
         "wk": wqkv[:, :, -2], "wv": wqkv[:, :, -1]}
  elif isinstance(p, FusedQKV):
    N, K, H = p.heads
    wqkv = unpack_linear(p.wqkv)
    D = wqkv.shape[0]
    wq, wk, wv = jnp.split(wqkv, [N * H, (N + K) * H], axis=-1)
    p = {**{k: v for k, v in p.items() if k != "wqkv"},
         "wq": wq.reshape(D, N, H), "wk": wk.reshape(D, K, H), "wv": wv.reshape(D, K, H)}
  p = {k: unpack_linear(v) for k, v in p.items()}
  if "wqkv_a" in p:
    p["wq_a"], p["wkv_a"] = jnp.split(p.pop("wqkv_a"), [p["q_norm"].shape[0]], axis=-1)
  if "w_uk" in p:
    w_uk, w_uv = p.pop("w_uk"), p.pop("w_uv")
    p["wkv_b"] = jnp.concatenate([rearrange(w_uk, "N R Hn -> R N Hn"),
                                  rearrange(w_uv, "N Hv R -> R N Hv")], axis=-1)
  return p


def mla(cfg: ModelConfig, p, x, cos, sin, ctx, window, cache):
  """DeepSeek multi-head latent attention.

  Without a cache, K/V are expanded per head from the latent (prefill form).
  With one, attention runs in the absorbed form over the cached latent
  c [S, R] and shared rope key kr [S, Hr], as multi-query attention with one
  KV head: score = (q_nope W_uk) . c + q_rope . kr, out = (probs @ c) W_uv
  (W_uv passed as the call's `values`). Where the context may attend a step's fresh prompts
  apart (`ctx.fresh_prompts`: the paged XLA path), they take the expanded
  form instead (`_fresh_or_absorbed`: bench_moe's 512-token prefill step
  1.13 s against 1.48 s in the absorbed form, 2-core CPU): the choice is
  made here, the context and `ops` get plain tensors.
  """
  R, Hn = cfg.kv_lora_rank, cfg.qk_nope_head_dim
  if "wqkv_a" in p:  # wq_a and wkv_a fused (`layouts.AbsorbedMLA`)
    q, kv = jnp.split(linear(x, p["wqkv_a"], backend=cfg.backend), [cfg.q_lora_rank], axis=-1)
  else:
    q = linear(x, p["wq_a" if cfg.q_lora_rank else "wq"], backend=cfg.backend)
    kv = linear(x, p["wkv_a"], backend=cfg.backend)  # [B, T, R + Hr]
  if cfg.q_lora_rank:
    q = linear(rms_norm(q, p["q_norm"], cfg.norm_eps), p["wq_b"], backend=cfg.backend)
  q_nope, q_rope = q[..., :Hn], q[..., Hn:]
  q_rope = apply_rope(q_rope, cos, sin, cfg.rope_interleave)
  c = rms_norm(kv[..., :R], p["kv_norm"], cfg.norm_eps)
  k_rope = apply_rope(kv[:, :, None, R:], cos, sin, cfg.rope_interleave)[:, :, 0]
  w_uk, w_uv = absorbed_weights(cfg, p)  # [N, R, Hn], [N, Hv, R]
  scale = cfg.softmax_scale()

  if not ctx.caches_latent:
    q, k, v = _expanded(q_nope, q_rope, c, k_rope, w_uk, w_uv)
    out, cache = ctx.attend(q, dict(k=k, v=v), cache, window=window, scale=scale,
                            backend=cfg.backend)
    return out_proj(out, p["wo"], cfg.backend), cache

  def absorbed(rows=None):  # the queries of tokens rows (None: all) in the absorbed form
    qn, qr = (q_nope, q_rope) if rows is None else (q_nope[:, rows], q_rope[:, rows])
    q_lat = jnp.einsum("BTNH,NRH->BTNR", qn, w_uk)
    return jnp.concatenate([q_lat, qr.astype(q_lat.dtype)], axis=-1)

  new = dict(kv=jnp.concatenate([c, k_rope], axis=-1))
  # No layer with a window: a static 0, so kernels without windows (the
  # Mosaic MLA decode) can take the step.
  window = 0 if cfg.window_choices() == (0,) else window
  kw = dict(latent_dim=R, window=window, scale=scale, backend=cfg.backend)
  fresh = ctx.fresh_prompts(jax.eval_shape(absorbed), cache, **kw)
  if fresh is None:
    out, cache = ctx.attend(absorbed(), new, cache, values=w_uv, **kw)
  else:
    out, cache = _fresh_or_absorbed(ctx, new, cache, fresh, absorbed,
                                    lambda: _expanded(q_nope, q_rope, c, k_rope, w_uk, w_uv),
                                    w_uv, kw)
  return out_proj(out, p["wo"], cfg.backend), cache


def _fresh_or_absorbed(ctx, new, cache, fresh, absorbed, expanded, w_uv, kw):
  """MLA's paged step where the context may attend fresh prompts apart
  (`ctx.fresh_prompts`: the XLA path): a step whose sequences are each a
  fresh prompt or one decode token attends the prompts packed in the
  expanded form (`expanded()`: q, k, v [1, T, N, H], traced in that branch
  only; bench_moe: Dq 96, not 288 + 256) and the decode tokens in the
  absorbed form over their pages (absorbed queries for their rows only);
  any other step in the absorbed form over the pages. -> ([1, T, N, Hv],
  cache)."""
  every_fresh, decodes = fresh
  kv, cache = ctx.write(new, cache, latent_dim=kw["latent_dim"])
  window, scale = kw["window"], kw["scale"]

  def prompts():
    q, k, v = (a[0] for a in expanded())
    packed = ops.packed_attention(q, k, v, kv.cu_q_lens, window=window, scale=scale)
    firsts = absorbed(jnp.clip(kv.cu_q_lens[:-1], 0, q.shape[0] - 1))[0]
    return ops.fresh_and_decodes(firsts, kv, packed, decodes, window=window, scale=scale,
                                 values=w_uv)

  def pages():
    call = ops.AttentionCall(q=absorbed()[0], kv=kv, window=window, scale=scale, values=w_uv)
    return ops.ragged_paged_attention(call, kw["backend"])

  return jax.lax.cond(every_fresh, prompts, pages)[None], cache


def _expanded(q_nope, q_rope, c, k_rope, w_uk, w_uv):
  """MLA's expanded (prefill) form: per-head q, k [B, T, N, Hn + Hr] and v
  [B, T, N, Hv] from the latent c [B, T, R] and the shared rope key."""
  k_nope = jnp.einsum("BSR,NRH->BSNH", c, w_uk)
  v = jnp.einsum("BSR,NHR->BSNH", c, w_uv)
  k_rope_n = jnp.broadcast_to(k_rope[:, :, None], (*k_nope.shape[:3], k_rope.shape[-1]))
  return (jnp.concatenate([q_nope, q_rope], axis=-1),
          jnp.concatenate([k_nope, k_rope_n], axis=-1), v)


def attention(cfg: ModelConfig, p, x, cos, sin, ctx, window, cache):
  fn = mla if cfg.attention.latent else gqa
  return fn(cfg, p, x, cos, sin, ctx, window, cache)
