"""The decoder: embed, scanned blocks per segment, final norm, output head.

Pure functions over the param tree of `specs.param_specs`. The contiguous KV
cache is an explicit pytree threaded through and returned:
  {"layers": tuple over segments of {k, v [L, B, S, K, H]} or {kv [L, B, S, R + Hr]},
   "lengths": [B] int32 tokens already cached per sequence}
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.kv.contexts import ContiguousContext, FullContext
from jaxinfer.models import attention as attn_lib
from jaxinfer.models import moe as moe_lib
from jaxinfer.models.layers import (fuse_gate_up, linear, mlp, mrope_cos_sin, pack_linear, rms_norm,
                                   rms_scaled, rope_cos_sin, unpack_linear)
from jaxinfer.models.layouts import FusedMLP, FusedQKV, SplitExperts, WeightForm
from jaxinfer.models.moe_ep import plan_from_params
from jaxinfer.models.quant import QuantizedWeight


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisualInputs:
  """A multimodal prompt's LM inputs (`models.multimodal.visual_inputs`):
  token embeddings with the visual tokens in place, the 3-D MRoPE
  positions, and the DeepStack features added after layers 0..k-1 (zero
  outside visual tokens)."""

  embeds: jax.Array  # [B, T, D]
  positions: jax.Array  # [3, B, T] int32
  deepstack: jax.Array  # [k, B, T, D]


def _deepstack(vis: VisualInputs | None, x, layer):
  """x plus the DeepStack features of (global) layer `layer`, if it has any."""
  if vis is None or vis.deepstack.shape[0] == 0:
    return x
  k = vis.deepstack.shape[0]
  add = vis.deepstack[jnp.minimum(layer, k - 1)].astype(x.dtype)
  return jnp.where(layer < k, x + add, x)


def block(cfg: ModelConfig, is_moe: bool, p, x, cos, sin, ctx, window, cache, ep=None,
          count_experts=None):
  """One pre-norm transformer block; returns (x, cache slice, expert counts).

  count_experts, a `moe_core.ExpertCount` (statistics runs, e.g. EPLB): the MoE
  layer's routed copies per expert (per slot of EPLB-placed params); else None.
  The MLP runs the path its params' type names (`layouts`); `cfg.moe_impl`
  becomes that type here (`moe.with_impl`). In the GPU form (a grouped
  `FusedQKV`) a norm whose output only one matmul reads, the attention's
  and a dense `FusedMLP`'s, scales the matmul's product
  (`layers.rms_scaled`): a launch fewer a norm in the compiled step.
  """
  gpu_form = isinstance(p["attn"], FusedQKV) and p["attn"].grouped
  attn_norm = rms_scaled if gpu_form else rms_norm
  a, cache = attn_lib.attention(cfg, p["attn"], attn_norm(x, p["attn_norm"], cfg.norm_eps),
                                cos, sin, ctx, window, cache)
  x = x + a
  mlp_norm = rms_scaled if gpu_form and isinstance(p["mlp"], FusedMLP) else rms_norm
  h = mlp_norm(x, p["mlp_norm"], cfg.norm_eps)
  if not is_moe:
    return x + mlp(cfg, p["mlp"], h), cache, None
  y, counts = moe_lib.moe(cfg, moe_lib.with_impl(cfg, p["mlp"]), h, ep, valid=ctx.token_valid(),
                          count=count_experts)
  return x + y, cache, counts


def trunk(cfg: ModelConfig, params, tokens, ctx, layer_caches=None, ep=None):
  """tokens [B, T] -> (final-normed hidden [B, T, D], new layer caches).

  ctx: a KV context (`kv/contexts.py`); layer_caches: a tuple over
  segments of stacked cache slices, or None for a cacheless forward;
  ep: an expert-parallel plan (`moe_ep.ExpertParallel`) or None.
  """
  x, caches, _ = trunk_with_counts(cfg, params, tokens, ctx, layer_caches, ep)
  return x, caches


def trunk_with_counts(cfg: ModelConfig, params, tokens, ctx, layer_caches=None, ep=None,
                      count_experts=None, visual: VisualInputs | None = None):
  """`trunk`, plus per-MoE-layer expert counts [Lm, E] when count_experts is
  an `moe_core.ExpertCount` (see `block`); else None. visual: a multimodal
  prompt's embeddings, MRoPE positions and DeepStack features."""
  if visual is None:
    x = params["embed"][tokens].astype(cfg.compute_dtype())
    cos, sin = rope_cos_sin(cfg, ctx.token_positions(tokens.shape[1]))
  else:
    x = visual.embeds.astype(cfg.compute_dtype())
    cos, sin = mrope_cos_sin(cfg, visual.positions)
  new_caches, counts = [], []
  for seg, (is_moe, first, count) in enumerate(cfg.segments()):
    wins = [cfg.layer_window(i) for i in range(first, first + count)]
    windows = jnp.asarray(wins, jnp.int32)
    # Static where it can be (an unrolled layer's, or a segment's one
    # window): kernels and libraries that need a static window take it.
    same = wins[0] if len(set(wins)) == 1 else None
    seg_cache = layer_caches[seg] if layer_caches is not None else None

    # The segment's stacked cache rides in the carry and is updated in place
    # at [layer]; scanning it as xs/ys would copy the whole cache every step.
    def body(carry, xs, is_moe=is_moe, first=first, same=same):
      x, cache = carry
      p, window, layer = xs
      window = window if same is None else same  # a segment's one window: static
      x, cache, n = block(cfg, is_moe, p, x, cos, sin, ctx, window,
                          None if cache is None else (cache, layer), ep, count_experts)
      x = _deepstack(visual, x, first + layer)
      return (x, None if cache is None else cache[0]), n

    seg_params = params["layers"][seg]
    if isinstance(seg_params, (list, tuple)):  # per-layer params (`step_layout`): unrolled
      seg_counts = []
      for layer, p in enumerate(seg_params):
        (x, seg_cache), n = body((x, seg_cache), (p, wins[layer], layer))
        seg_counts.append(n)
      seg_counts = None if seg_counts[0] is None else jnp.stack(seg_counts)
    else:
      layers = jnp.arange(count, dtype=jnp.int32)
      (x, seg_cache), seg_counts = jax.lax.scan(body, (x, seg_cache),
                                                (seg_params, windows, layers))
    new_caches.append(seg_cache)
    if seg_counts is not None:
      counts.append(seg_counts)
  x = rms_norm(x, params["final_norm"], cfg.norm_eps)
  caches = tuple(new_caches) if layer_caches is not None else None
  return x, caches, (jnp.concatenate(counts) if counts else None)


_EXPERT_KEYS = ("w_gate", "w_up", "w_down")


def step_layout(cfg: ModelConfig, params, form: WeightForm = WeightForm()):
  """Params as `init_params` makes them -> the engine's unrolled CPU step's
  `WeightForm`: each segment a tuple of per-layer trees (`trunk` runs them
  unrolled), MLA's attention an `AbsorbedMLA` (`attention.step_layout`),
  dense and shared MLPs a `FusedMLP` (gate and up one [D, 2F] matrix), and
  with form.split_experts each MoE layer a `SplitExperts` (each routed
  expert its own array: `moe` then runs only the chosen experts), and with
  form.transposed the projections (attention, dense and shared MLPs,
  lm_head) stored transposed (`layers.PackedLinear`), quantized ones with
  their codes unpacked (`quant_cpu`), float ones unless form.floats_in_out.
  Same outputs. (`layouts` has the types.)

  Why: a scanned layer slices its weights out of the stack with a
  dynamic-slice that XLA:CPU copies every step, and a weight transposed
  inside the step is copied too (measured on `bench_dense` and `bench_moe`:
  the copies took longer than the matmuls). Per-layer arrays in the wanted
  layout are read in place. Costs a longer compile; the Engine keeps only
  this layout (`stacked_layout` is the inverse)."""
  def pack(w):  # float weights stay [In, Out] with floats_in_out; quantized ones always pack
    keep = form.floats_in_out and not isinstance(w, QuantizedWeight)
    if not form.transposed or keep:
      return w
    return pack_linear(w, out_major=form.out_major, panels=form.panels)

  def fused(p):
    if any(isinstance(p[k], QuantizedWeight) for k in _EXPERT_KEYS):
      return {k: pack(v) for k, v in p.items()}  # quantized: each matmul reads its own
    return FusedMLP(w_gate_up=pack(fuse_gate_up(p["w_gate"], p["w_up"])), w_down=pack(p["w_down"]))

  def layer_layout(layer, is_moe):
    layer = {**layer, "attn": attn_lib.step_layout(cfg, layer["attn"], form)}
    mlp = layer["mlp"]
    if not is_moe:
      mlp = fused(mlp)
    else:
      if cfg.num_shared_experts:
        mlp = {**mlp, "shared": fused(mlp["shared"])}
      if form.split_experts and not isinstance(mlp["w_down"], QuantizedWeight):
        rest = {k: v for k, v in mlp.items() if k not in _EXPERT_KEYS}
        E = mlp["w_down"].shape[0]
        mlp = SplitExperts(w_down=tuple(mlp["w_down"][e] for e in range(E)),
                           w_gate_up=tuple(fuse_gate_up(mlp["w_gate"][e], mlp["w_up"][e])
                                           for e in range(E)), native=form.native_experts, **rest)
    return {**layer, "mlp": mlp}

  segs = []
  for seg, (is_moe, _, n) in zip(params["layers"], cfg.segments()):
    if isinstance(seg, (list, tuple)):
      raise ValueError("step_layout: params are already in the step layout")
    segs.append(tuple(layer_layout(jax.tree.map(lambda w, i=i: w[i], seg), is_moe)
                      for i in range(n)))
  out = {**params, "layers": tuple(segs)}
  if not cfg.tie_embeddings:
    out["lm_head"] = pack(params["lm_head"])
  if "mtp" in params:
    out["mtp"] = _mtp_attention(params["mtp"], lambda p: attn_lib.step_layout(cfg, p))
  return out


def _mtp_attention(mtp: dict, fn) -> dict:
  """The MTP modules' params with fn applied to each module's attention
  weights, restacked [M, ...]. The step layout absorbs MLA's wkv_b there as
  in the layers (`attention.step_layout`): split per head inside the step it
  was copied every speculative step (compiled for 8 H100s under dp_attn_ep,
  DeepSeek-V3: 33.5 MB a step, `benchlib.hlo_report`), the one weight copy
  left; a module's own slice of the stack is read in place."""
  attn = mtp["block"]["attn"]
  M = jax.tree.leaves(attn)[0].shape[0]
  mods = [fn(jax.tree.map(lambda a, m=m: a[m], attn)) for m in range(M)]
  return {**mtp, "block": {**mtp["block"], "attn": jax.tree.map(lambda *a: jnp.stack(a), *mods)}}


def stacked_layout(cfg: ModelConfig, step):
  """The inverse of `step_layout`: params in the step layout -> the stacked
  tree `init_params` makes, with the same values (the Engine keeps only the
  step layout and rebuilds this when asked: `Engine.params`)."""
  def unfused(p):
    if type(p) is dict:  # quantized MLP weights, held one by one
      return {k: unpack_linear(v) for k, v in p.items()}
    if not isinstance(p, FusedMLP):
      return p
    gate, up = jnp.split(unpack_linear(p.w_gate_up), 2, axis=-1)
    return {"w_gate": gate, "w_up": up, "w_down": unpack_linear(p.w_down)}

  def layer_params(layer):
    mlp = unfused(layer["mlp"])
    if isinstance(mlp, SplitExperts):
      gate, up = jnp.split(jnp.stack(mlp.w_gate_up), 2, axis=-1)
      rest = {k: v for k, v in mlp.items() if k not in ("w_gate_up", "w_down")}
      mlp = {**rest, "w_gate": gate, "w_up": up, "w_down": jnp.stack(mlp.w_down)}
    if "shared" in mlp:
      mlp = {**mlp, "shared": unfused(mlp["shared"])}
    return {**layer, "attn": attn_lib.stacked_layout(layer["attn"]), "mlp": mlp}

  segs = []
  for seg in step["layers"]:
    if not isinstance(seg, (list, tuple)):
      raise ValueError("stacked_layout: params are already stacked")
    segs.append(jax.tree.map(lambda *ws: jnp.stack(ws), *(layer_params(x) for x in seg)))
  out = {**step, "layers": tuple(segs)}
  if "lm_head" in out:
    out["lm_head"] = unpack_linear(out["lm_head"])
  if "mtp" in out:
    out["mtp"] = _mtp_attention(out["mtp"], attn_lib.stacked_layout)
  return out


def head(cfg: ModelConfig, params, x):
  """Hidden [..., D] -> float32 logits [..., V]."""
  if cfg.tie_embeddings:
    return jnp.einsum("...D,VD->...V", x, params["embed"], preferred_element_type=jnp.float32)
  return linear(x, params["lm_head"], preferred_element_type=jnp.float32, backend=cfg.backend)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _logits(cfg, params, tokens, ep):
  return logits_and_counts(cfg, params, tokens, ep)[0]


def logits_and_counts(cfg: ModelConfig, params, tokens, ep=None, count_experts=None):
  """Full causal forward -> (float32 logits [B, T, V], expert counts or None)."""
  B, T = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  x, _, counts = trunk_with_counts(cfg, params, tokens,
                                   FullContext(positions, cfg.window_choices()), ep=ep,
                                   count_experts=count_experts)
  return head(cfg, params, x), counts


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=3)
def _forward(cfg, params, tokens, cache, ep):
  x, cache = forward_hidden(cfg, params, tokens, cache, ep)
  return head(cfg, params, x), cache


def forward_hidden(cfg: ModelConfig, params, tokens, cache, ep=None):
  """Cached trunk over the contiguous cache -> (hidden [B, T, D], new cache)."""
  starts = cache["lengths"]
  x, layers = trunk(cfg, params, tokens, ContiguousContext(starts), cache["layers"], ep)
  return x, dict(layers=layers, lengths=starts + tokens.shape[1])


def check_tokens(cfg: ModelConfig, tokens, name: str = "tokens") -> None:
  """Raises a clear error for a bad token batch (shape, dtype, ids out of vocab)."""
  shape, dtype = getattr(tokens, "shape", None), getattr(tokens, "dtype", None)
  if shape is None or len(shape) != 2:
    raise ValueError(f"{name} must be a 2-D [batch, seq] integer array, got shape {shape}")
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {dtype}")
  if shape[0] == 0 or shape[1] == 0:
    raise ValueError(f"{name} must be non-empty, got shape {shape}")
  if not isinstance(tokens, jax.core.Tracer):
    lo, hi = int(np.min(tokens)), int(np.max(tokens))
    if lo < 0 or hi >= cfg.vocab_size:
      raise ValueError(f"{name}: ids must be in [0, {cfg.vocab_size}), got min {lo}, max {hi}")


def logits(cfg: ModelConfig, params, tokens):
  """Full causal forward: int [B, T] -> float32 logits [B, T, V].

  Works unchanged on sharded params (`jaxinfer.sharding.shard_params`): when
  the routed experts are split over mesh axes, MoE layers run expert-parallel.
  """
  check_tokens(cfg, tokens)
  if tokens.shape[1] > cfg.max_position_embeddings:
    raise ValueError(f"tokens: length {tokens.shape[1]} exceeds the context "
                     f"(max_position_embeddings={cfg.max_position_embeddings})")
  return _logits(cfg, params, jnp.asarray(tokens, jnp.int32), plan_from_params(params))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None):
  """An empty contiguous KV cache for `batch` sequences of up to max_len tokens."""
  if batch <= 0 or max_len <= 0:
    raise ValueError(f"init_cache: batch and max_len must be > 0, got {batch}, {max_len}")
  if max_len > cfg.max_position_embeddings:
    raise ValueError(f"init_cache: max_len {max_len} exceeds max_position_embeddings "
                     f"{cfg.max_position_embeddings}")
  dtype = jnp.dtype(dtype) if dtype is not None else cfg.compute_dtype()
  entry = cfg.cache_entry_shapes()
  layers = tuple({k: jnp.zeros((n, batch, max_len, *e), dtype) for k, e in entry.items()}
                 for _, _, n in cfg.segments())
  return dict(layers=layers, lengths=jnp.zeros((batch,), jnp.int32))


def forward(cfg: ModelConfig, params, tokens, cache):
  """Appends tokens [B, T] to each sequence of the cache.

  Returns (float32 logits [B, T, V], new cache). The cache is donated.
  """
  check_tokens(cfg, tokens)
  B, T = tokens.shape
  lengths = cache["lengths"]
  if lengths.shape != (B,):
    raise ValueError(f"forward: cache holds {lengths.shape[0]} sequences, tokens has batch {B}")
  max_len = jax.tree.leaves(cache["layers"])[0].shape[2]
  if not isinstance(lengths, jax.core.Tracer):
    longest = int(np.max(lengths)) + T
    if longest > max_len:
      raise ValueError(f"forward: {longest} tokens would overflow the cache (max_len {max_len})")
  return _forward(cfg, params, jnp.asarray(tokens, jnp.int32), cache, plan_from_params(params))
