"""Calibrated scales of a quantized KV cache: the model's forward over a
fixed prompt, for every segment whose params carry no scales (`kv.scales`).

`resolve` is what the Engine asks: the params' scales where a segment has
all of its names, else `calibrate`: one full cached forward
(`transformer.forward`, the contiguous reference cache in the compute
dtype) over a fixed calibration prompt, then per layer int8: scale =
amax(|K|) / 127; fp8: scale = 2^ceil(log2(amax / 448)), the power of two at
or above amax / 448 (`kv.scales.from_amax`). The MTP modules' scales come
from the same prompt through `mtp.apply`. It runs the model, so it sits
with the engine, above the models; the cache package (`kv/`) below them
only reads names and arrays.

Why amax over a prompt: the K/V a layer writes are RMS-normed projections
(MLA's latent) or projections of RMS-normed activations, whose range is a
property of the weights more than of the text; one short forward sees it,
costs one compile at engine build, and needs no data set. Values beyond the
calibrated range saturate (clip), they never overflow. fp8 keeps 3 mantissa
bits at every magnitude down to 2^-6 x scale, so headroom against prompts
that reach further than the calibration one costs it nothing, and a power of
two gives 1-2x of it while making x / scale and q * scale exact in float: the
kernel (scale folded into its f32 products), the XLA path and the references
then dequantize identically, and engines calibrating under different
shardings (a disaggregated prefill and decode pair) get bit-equal scales
unless an amax sits on a power-of-two boundary. int8's resolution is uniform,
so its scale is amax / 127 exactly. Measured on the default model
(`experiments/kv_quant.py`): real stdlib text reaches up to 1.35x the amax of
a 64-token random prompt and 1.13x that of a 256-token one (RoPE'd keys see
more rotations), hence 256 tokens; next-token agreement with the
full-precision cache on the full-precision outputs was 0.98-0.99 for every
length / headroom pair tried (64, 256 tokens x 1, 2x amax / qmax),
differences within noise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.kv import scales as kv_scales
from jaxinfer.kv.contexts import ContiguousContext
from jaxinfer.kv.pool import KV_CACHE_DTYPES, PoolLayout
from jaxinfer.models import mtp, transformer
from jaxinfer.models.layers import rope_cos_sin
from jaxinfer.models.moe_ep import plan_from_params

CALIBRATION_TOKENS = 256  # calibration prompt length (capped at the context)
CALIBRATION_SEED = 0


def calibration_prompt(cfg: ModelConfig, length: int | None = None) -> np.ndarray:
  """The fixed calibration prompt: seeded uniform token ids [1, T]
  (T = length or CALIBRATION_TOKENS, capped at the context)."""
  T = min(length or CALIBRATION_TOKENS, cfg.max_position_embeddings)
  return np.random.default_rng(CALIBRATION_SEED).integers(0, cfg.vocab_size, (1, T), np.int32)


def _amax(stack: dict, names) -> dict:
  """{scale name: per-layer amax [L]} of a contiguous cache segment {n: [L, ...]}."""
  return {f"{n}_scale": jnp.max(jnp.abs(stack[n].astype(jnp.float32)),
                                axis=tuple(range(1, stack[n].ndim))) for n in names}


def _mtp_amax(cfg: ModelConfig, params, hidden, tokens, names, ep) -> dict:
  """Per-module amax of the MTP modules' K/V over the calibration prompt
  (depth k through module_for(k), as the speculative step drafts)."""
  B, T = tokens.shape
  M = cfg.num_mtp_layers
  entry = cfg.cache_entry_shapes()
  stack = {n: jnp.zeros((M, B, T, *entry[n]), cfg.compute_dtype()) for n in names}
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  cos, sin = rope_cos_sin(cfg, positions)
  ctx = ContiguousContext(jnp.zeros((B,), jnp.int32))
  h = hidden
  for k in range(1, M + 1):
    nxt = jnp.pad(tokens[:, k:], ((0, 0), (0, k)))  # t_{i+k}
    h, stack = mtp.apply(cfg, params, mtp.module_for(cfg, k), h, nxt, cos, sin, ctx, stack, ep)
  return _amax(stack, names)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _calibration_amax(cfg: ModelConfig, params, tokens, ep, mtp_too: bool) -> list[dict]:
  """Per segment (+ MTP) {scale name: amax [L]} of the K/V a forward over tokens writes."""
  names = PoolLayout(latent=cfg.attention.latent).names
  cache = transformer.init_cache(cfg, tokens.shape[0], tokens.shape[1])
  hidden, cache = transformer.forward_hidden(cfg, params, tokens, cache, ep)
  amax = [_amax(seg, names) for seg in cache["layers"]]
  if mtp_too:
    amax.append(_mtp_amax(cfg, params, hidden, tokens, names, ep))
  return amax


def calibrate(cfg: ModelConfig, params, kind: str, *, mtp_too: bool = False,
              tokens=None) -> list[dict]:
  """Scales from one forward over `tokens` [1, T] (default
  `calibration_prompt`): per segment (then the MTP modules' with mtp_too)
  {scale name: float32 [L]} = amax / qmax, for fp8 rounded up to a power of two."""
  if kind not in KV_CACHE_DTYPES:
    raise ValueError(f"calibrate: kind must be one of {tuple(KV_CACHE_DTYPES)}, got {kind!r}")
  tokens = jnp.asarray(calibration_prompt(cfg) if tokens is None else tokens, jnp.int32)
  transformer.check_tokens(cfg, tokens)
  amax = _calibration_amax(cfg, params, tokens, plan_from_params(params), mtp_too)
  return [{n: kv_scales.from_amax(a, kind) for n, a in seg.items()} for seg in amax]


def resolve(cfg: ModelConfig, params, found: list[dict], kind: str, *,
            mtp_too: bool = False) -> tuple[list[dict], str]:
  """-> (scales per segment (+ MTP with mtp_too), source). found: the
  scales `kv.scales.split_params` took out of the params, used for every
  segment that has all of its names; the others are calibrated on `params`
  (the stripped ones). source: "params" | "calibrated" | "params+calibrated"."""
  names = kv_scales.scale_names(cfg)
  found = list(found[:len(params["layers"]) + (1 if mtp_too else 0)])
  complete = [all(n in f for n in names) for f in found]
  if all(complete):
    return [kv_scales.own(f, names) for f in found], "params"
  calibrated = calibrate(cfg, params, kind, mtp_too=mtp_too)
  scales = [kv_scales.own(f, names) if ok else c for f, ok, c in zip(found, complete, calibrated)]
  return scales, "params+calibrated" if any(complete) else "calibrated"
