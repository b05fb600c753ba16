"""Per-layer scales of a quantized KV cache (`EngineConfig(kv_cache_dtype=...)`).

A quantized page pool (`kv.pool.KV_CACHE_DTYPES`: "fp8" e4m3 or "int8")
stores x / scale and reads q * scale, with one float32 scale per layer and
cache array. The Engine takes them, in this order, from:

1. the params: each attention param dict may carry per-layer scalars,
   stacked like the other layer params (float32 [L] per segment; the MTP
   modules' in params["mtp"]["block"]["attn"], [M]). The keys are the pool's
   scale names: GQA `k_scale` and `v_scale` (HF ModelOpt
   `self_attn.k_proj.k_scale` / `self_attn.v_proj.v_scale`, compressed-tensors
   `self_attn.k_scale`), MLA `kv_scale` (one scale for the whole cached latent
   row [c ; k_rope]; from ModelOpt `self_attn.kv_a_proj_with_mqa.k_scale` or
   compressed-tensors `self_attn.k_scale`, the larger of it and the matching
   v_scale when the checkpoint has one). `split_params` takes them out of the params the model
   runs (they describe the cache, not the forward).
2. calibration, for every segment whose params lack them: one forward of the
   model over a fixed prompt (`engine.kv_calibration`, above the models:
   running the model is the engine's), then per layer `from_amax` of the
   largest |K| / |V| it wrote: int8 scale = amax / 127; fp8 scale =
   2^ceil(log2(amax / 448)), the power of two at or above amax / 448.

This module reads names and arrays only: it imports no model code.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.kv.pool import KV_CACHE_DTYPES, PoolLayout

POW2_SCALES = {"fp8": True, "int8": False}  # fp8 scales rounded up to a power of two


def scale_names(cfg: ModelConfig) -> tuple[str, ...]:
  """The scale keys of this model's pool: ("k_scale", "v_scale") or ("kv_scale",)."""
  return PoolLayout(latent=cfg.attention.latent, quantized=True).scale_names


def _attn_dicts(params, mtp_too: bool) -> list:
  """The stacked attention param dicts: one per segment (+ the MTP modules')."""
  out = [seg["attn"] for seg in params["layers"]]
  if mtp_too and "mtp" in params:
    out.append(params["mtp"]["block"]["attn"])
  return out


def split_params(cfg: ModelConfig, params):
  """-> (params without KV scale keys, per attention dict (segments, then
  the MTP modules') {name: [L]} of the scales found, {} where none)."""
  names = scale_names(cfg)
  found = [{n: d[n] for n in names if n in d} for d in _attn_dicts(params, True)]
  if not any(found):
    return params, found

  def strip(d):
    return {k: v for k, v in d.items() if k not in names}

  layers = tuple({**seg, "attn": strip(seg["attn"])} for seg in params["layers"])
  out = {**params, "layers": layers}
  if "mtp" in params:
    block = params["mtp"]["block"]
    out["mtp"] = {**params["mtp"], "block": {**block, "attn": strip(block["attn"])}}
  return out, found


def from_amax(amax, kind: str):
  """Per-layer amax [L] -> float32 scales [L] for pages of `kind`: amax /
  qmax, for fp8 rounded up to a power of two; an all-zero layer (never
  written) keeps 1."""
  if kind not in KV_CACHE_DTYPES:
    raise ValueError(f"kind must be one of {tuple(KV_CACHE_DTYPES)}, got {kind!r}")
  scale = amax.astype(jnp.float32) / KV_CACHE_DTYPES[kind][1]
  if POW2_SCALES[kind]:
    scale = jnp.exp2(jnp.ceil(jnp.log2(jnp.where(amax > 0, scale, 1.0))))
  return jnp.where(amax > 0, scale, 1.0).astype(jnp.float32)


def own(found: dict, names) -> dict:
  """Scales taken from the params ({name: array}) as float32 [L] each."""
  return {n: jnp.asarray(found[n], jnp.float32).reshape(-1) for n in names}
