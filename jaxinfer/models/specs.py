"""The abstract param tree: one `ParamSpec` per weight.

`param_specs(cfg)` is the single source of shapes, dtypes, logical axes and
initializers; `init_params`, the shardings and checkpoint restore all derive
from it, so they cannot drift apart.

Tree layout (nested dicts; segment blocks stacked on a leading `layers` axis):
  embed [V, D]; final_norm [D]; lm_head [D, V] (untied only)
  layers: tuple over `cfg.segments()` of block dicts
    attn_norm, mlp_norm [L, D]
    attn (gqa): wq [L, D, N, H], wk/wv [L, D, K, H], wo [L, N, H, D],
                bq [L, N, H], bk/bv [L, K, H], bo [L, D], q_norm/k_norm [L, H], sinks [L, N]
    attn (mla): wq [L, D, N, Hqk] | wq_a [L, D, Rq], q_norm [L, Rq], wq_b [L, Rq, N, Hqk];
                wkv_a [L, D, R + Hr], kv_norm [L, R], wkv_b [L, R, N, Hn + Hv], wo [L, N, Hv, D]
    mlp (dense): w_gate/w_up [L, D, F], w_down [L, F, D]
    mlp (moe): router [L, D, E], router_bias/score_bias [L, E],
               w_gate/w_up [L, E, D, F], w_down [L, E, F, D], b_gate/b_up [L, E, F], b_down [L, E, D],
               shared: {w_gate, w_up [L, D, Fs], w_down [L, Fs, D]}
  mtp (DeepSeek MTP, stacked over depth M): enorm/hnorm/norm [M, D], eh_proj [M, 2D, D], block
  vision (Qwen3-VL, `models.vision`): patch_w [C*Tp*P*P, Cv], patch_b, pos_embed [G, Cv],
    blocks (stacked over depth): norm1_w/b, norm2_w/b [Cv], wqkv [Cv, 3, Nv, Hv], bqkv,
      wo [Nv, Hv, Cv], bo, fc1 [Cv, Fv], b1, fc2 [Fv, Cv], b2
    merger / deepstack (stacked over taps): norm_w/b, fc1 [4Cv, 4Cv], b1, fc2 [4Cv, D], b2
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig, QuantConfig, VisionConfig
from jaxinfer.models import quant as quant_lib
from jaxinfer.models.quant import QuantizedWeight


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  shape: tuple[int, ...]
  dtype: jnp.dtype
  logical_axes: tuple[str | None, ...]
  init: str = "normal"  # normal (fan-in scaled) | ones | zeros

  def __post_init__(self):
    if len(self.shape) != len(self.logical_axes):
      raise ValueError(f"ParamSpec: shape {self.shape} vs axes {self.logical_axes}")


def is_spec(x) -> bool:
  return isinstance(x, ParamSpec)


def _stack(tree, n: int):
  """Prepends a `layers` axis of size n to every spec in tree."""
  return jax.tree.map(
      lambda s: ParamSpec((n, *s.shape), s.dtype, ("layers", *s.logical_axes), s.init),
      tree, is_leaf=is_spec)


def _attn_specs(cfg: ModelConfig, P: Callable) -> dict:
  D, N, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads
  if cfg.attention == "mla":
    R, Hr, Hn, Hv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    p = {}
    if cfg.q_lora_rank:
      Rq = cfg.q_lora_rank
      p.update(wq_a=P((D, Rq), ("embed", "q_lora")), q_norm=P((Rq,), ("q_lora",), "ones"),
               wq_b=P((Rq, N, Hn + Hr), ("q_lora", "q_heads", "head_dim")))
    else:
      p["wq"] = P((D, N, Hn + Hr), ("embed", "q_heads", "head_dim"))
    p.update(wkv_a=P((D, R + Hr), ("embed", "kv_lora")), kv_norm=P((R,), ("kv_lora",), "ones"),
             wkv_b=P((R, N, Hn + Hv), ("kv_lora", "q_heads", "head_dim")),
             wo=P((N, Hv, D), ("q_heads", "head_dim", "embed")))
    if cfg.quant is not None and cfg.quant.kv_cache:  # the latent cache's scale (see below)
      p["kv_scale"] = ParamSpec((), jnp.dtype(jnp.float32), (), "ones")
    return p
  H = cfg.head_dim
  p = dict(wq=P((D, N, H), ("embed", "q_heads", "head_dim")),
           wk=P((D, K, H), ("embed", "kv_heads", "head_dim")),
           wv=P((D, K, H), ("embed", "kv_heads", "head_dim")),
           wo=P((N, H, D), ("q_heads", "head_dim", "embed")))
  if cfg.qkv_bias:
    p.update(bq=P((N, H), ("q_heads", "head_dim"), "zeros"),
             bk=P((K, H), ("kv_heads", "head_dim"), "zeros"),
             bv=P((K, H), ("kv_heads", "head_dim"), "zeros"))
  if cfg.o_bias:
    p["bo"] = P((D,), ("embed",), "zeros")
  if cfg.qk_norm:
    p.update(q_norm=P((H,), ("head_dim",), "ones"), k_norm=P((H,), ("head_dim",), "ones"))
  if cfg.attention_sinks:
    p["sinks"] = P((N,), ("q_heads",), "zeros")
  if cfg.quant is not None and cfg.quant.kv_cache:
    # The checkpoint's per-layer KV cache scales (float32 whatever the dtype):
    # the Engine's quantized cache reads them (`kv.scales`); the forward does not.
    p.update(k_scale=ParamSpec((), jnp.dtype(jnp.float32), (), "ones"),
             v_scale=ParamSpec((), jnp.dtype(jnp.float32), (), "ones"))
  return p


def _dense_mlp_specs(D: int, F: int, P: Callable) -> dict:
  return dict(w_gate=P((D, F), ("embed", "mlp")), w_up=P((D, F), ("embed", "mlp")),
              w_down=P((F, D), ("mlp", "embed")))


def _moe_specs(cfg: ModelConfig, P: Callable) -> dict:
  D, E, F = cfg.d_model, cfg.num_experts, cfg.moe_ffn_dim
  p = dict(router=P((D, E), ("embed", None)),
           w_gate=P((E, D, F), ("expert", "embed", "mlp")),
           w_up=P((E, D, F), ("expert", "embed", "mlp")),
           w_down=P((E, F, D), ("expert", "mlp", "embed")))
  if cfg.router_bias:
    p["router_bias"] = P((E,), (None,), "zeros")
  if cfg.router == "sigmoid_grouped":
    p["score_bias"] = P((E,), (None,), "zeros")
  if cfg.expert_bias:
    p.update(b_gate=P((E, F), ("expert", "mlp"), "zeros"), b_up=P((E, F), ("expert", "mlp"), "zeros"),
             b_down=P((E, D), ("expert", "embed"), "zeros"))
  if cfg.num_shared_experts:
    p["shared"] = _dense_mlp_specs(D, F * cfg.num_shared_experts, P)
  return p


def quantized_spec(spec: ParamSpec, q: QuantConfig, in_dims: int = 1, lead: int = 0):
  """A float weight's spec [*lead, *In, *Out] -> a `QuantizedWeight` of specs:
  values [*lead, Out, In] in the storage dtype, scales over its blocks (a
  scale dim is split like its weight dim unless one block spans it)."""
  shape, axes = spec.shape, spec.logical_axes
  in_shape, out_shape = shape[lead:lead + in_dims], shape[lead + in_dims:]
  out, d_in = math.prod(out_shape), math.prod(in_shape)
  block = quant_lib.FIXED_BLOCKS.get(q.method, tuple(q.block))
  bo, bi = quant_lib.block_sizes(block, out, d_in)
  o_ax, i_ax, lead_ax = axes[lead + in_dims], axes[lead], tuple(axes[:lead])
  values = ParamSpec((*shape[:lead], out, quant_lib.stored_in(q.method, d_in)),
                     jnp.dtype(quant_lib.VALUE_DTYPES[q.method]), (*lead_ax, o_ax, i_ax), "zeros")
  scale = ParamSpec((*shape[:lead], *quant_lib.scale_shape(block, out, d_in)),
                    jnp.dtype(quant_lib.SCALE_DTYPES[q.method]),
                    (*lead_ax, o_ax if bo < out else None, i_ax if bi < d_in else None), "ones")
  scale2 = (ParamSpec(tuple(shape[:lead]), jnp.dtype(jnp.float32), lead_ax, "ones")
            if q.method == "nvfp4" else None)
  return QuantizedWeight(values=values, scale=scale, scale2=scale2, method=q.method, block=block,
                         in_shape=tuple(in_shape), out_shape=tuple(out_shape))


def _quantize_block(q: QuantConfig | None, tree: dict, is_moe: bool) -> dict:
  """Replaces the block's targeted projections by quantized specs."""
  if q is None:
    return tree
  attn = {k: quantized_spec(v, q, 2 if k == "wo" else 1) if q.quantizes(f"attn.{k}") else v
          for k, v in tree["attn"].items()}
  mlp = dict(tree["mlp"])
  group = "experts" if is_moe else "mlp"
  for k in ("w_gate", "w_up", "w_down"):
    if q.quantizes(f"{group}.{k}"):
      mlp[k] = quantized_spec(mlp[k], q, lead=1 if is_moe else 0)
    if "shared" in mlp and q.quantizes(f"shared.{k}"):
      mlp["shared"] = {**mlp["shared"], k: quantized_spec(mlp["shared"][k], q)}
  return {**tree, "attn": attn, "mlp": mlp}


def block_specs(cfg: ModelConfig, is_moe: bool, dtype) -> dict:
  """Specs of one transformer block (unstacked)."""
  P = lambda shape, axes, init="normal": ParamSpec(tuple(shape), dtype, axes, init)
  D = cfg.d_model
  tree = dict(attn_norm=P((D,), ("embed",), "ones"), mlp_norm=P((D,), ("embed",), "ones"),
              attn=_attn_specs(cfg, P),
              mlp=_moe_specs(cfg, P) if is_moe else _dense_mlp_specs(D, cfg.ffn_dim, P))
  return _quantize_block(cfg.quant, tree, is_moe)


def _merger_specs(vc: VisionConfig, D: int, P, postshuffle: bool) -> dict:
  C4 = vc.hidden_size * vc.spatial_merge_size ** 2
  norm = C4 if postshuffle else vc.hidden_size
  return dict(norm_w=P((norm,), (None,), "ones"), norm_b=P((norm,), (None,), "zeros"),
              fc1=P((C4, C4), (None, None)), b1=P((C4,), (None,), "zeros"),
              fc2=P((C4, D), (None, "embed")), b2=P((D,), ("embed",), "zeros"))


def vision_specs(vc: VisionConfig, D: int, dtype) -> dict:
  """Specs of params["vision"] (vision weights are small: replicated)."""
  P = lambda shape, axes, init="normal": ParamSpec(tuple(shape), dtype, axes, init)
  C, F, N, H = vc.hidden_size, vc.intermediate_size, vc.num_heads, vc.head_dim
  block = dict(norm1_w=P((C,), (None,), "ones"), norm1_b=P((C,), (None,), "zeros"),
               norm2_w=P((C,), (None,), "ones"), norm2_b=P((C,), (None,), "zeros"),
               wqkv=P((C, 3, N, H), (None, None, None, None)),
               bqkv=P((3, N, H), (None, None, None), "zeros"),
               wo=P((N, H, C), (None, None, None)), bo=P((C,), (None,), "zeros"),
               fc1=P((C, F), (None, None)), b1=P((F,), (None,), "zeros"),
               fc2=P((F, C), (None, None)), b2=P((C,), (None,), "zeros"))
  tree = dict(patch_w=P((vc.patch_dim, C), (None, None)), patch_b=P((C,), (None,), "zeros"),
              pos_embed=P((vc.num_position_embeddings, C), (None, None)),
              blocks=_stack(block, vc.depth), merger=_merger_specs(vc, D, P, False))
  if vc.deepstack_indexes:
    tree["deepstack"] = _stack(_merger_specs(vc, D, P, True), len(vc.deepstack_indexes))
  return tree


def param_specs(cfg: ModelConfig, dtype=None) -> dict:
  """The abstract param tree of `cfg` (see the module docstring)."""
  dtype = jnp.dtype(dtype) if dtype is not None else cfg.compute_dtype()
  P = lambda shape, axes, init="normal": ParamSpec(tuple(shape), dtype, axes, init)
  D, V = cfg.d_model, cfg.vocab_size
  tree = dict(embed=P((V, D), ("vocab", "embed")), final_norm=P((D,), ("embed",), "ones"),
              layers=tuple(_stack(block_specs(cfg, moe, dtype), n) for moe, _, n in cfg.segments()))
  if not cfg.tie_embeddings:
    tree["lm_head"] = P((D, V), ("embed", "vocab"))
  if cfg.num_mtp_layers:
    # DeepSeek-V3 MTP: the block after the last main layer is MoE.
    is_moe = cfg.is_moe and cfg.num_layers not in cfg.dense_layers
    eh_proj = P((2 * D, D), (None, "embed"))
    if cfg.quant is not None and cfg.quant.quantizes("mtp.eh_proj"):
      eh_proj = quantized_spec(eh_proj, cfg.quant)
    mtp = dict(enorm=P((D,), ("embed",), "ones"), hnorm=P((D,), ("embed",), "ones"),
               eh_proj=eh_proj, norm=P((D,), ("embed",), "ones"),
               block=block_specs(cfg, is_moe, dtype))
    tree["mtp"] = _stack(mtp, cfg.num_mtp_layers)
  if cfg.vision is not None:
    tree["vision"] = vision_specs(cfg.vision, D, dtype)
  return tree


def abstract_params(cfg: ModelConfig, dtype=None):
  """`jax.ShapeDtypeStruct` tree (no allocation)."""
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype),
                      param_specs(cfg, dtype), is_leaf=is_spec)


def count_params(cfg: ModelConfig) -> int:
  """Number of parameters (weights counted unquantized), from shapes alone."""
  leaves = jax.tree.leaves(abstract_params(dataclasses.replace(cfg, quant=None), jnp.float32))
  return sum(int(x.size) for x in leaves)


def _init_leaf(spec: ParamSpec, key):
  if spec.init == "ones":
    return jnp.ones(spec.shape, spec.dtype)
  if spec.init == "zeros":
    return jnp.zeros(spec.shape, spec.dtype)
  # Fan-in scaled normal. Projections into the model dim ([N, H, D], [F, D])
  # take their fan-in from every axis but the last; others from the first.
  dims = [(n, a) for n, a in zip(spec.shape, spec.logical_axes) if a not in ("layers", "expert")]
  if dims[0][1] == "vocab":
    fan_in = 1
  elif dims[-1][1] == "embed" and len(dims) > 1:
    fan_in = math.prod(n for n, _ in dims[:-1])
  else:
    fan_in = dims[0][0]
  std = fan_in ** -0.5
  return (std * jax.random.normal(key, spec.shape, jnp.float32)).astype(spec.dtype)


def quantize_params(cfg: ModelConfig, params):
  """Float params (as `init_params` of cfg without `quant` makes them) ->
  cfg.quant's targets quantized (`models.quant.quantize`, on the host)."""
  specs = param_specs(cfg)
  is_q = lambda x: isinstance(x, QuantizedWeight)

  def one(spec, w):
    if not is_q(spec):
      return w
    lead = len(spec.values.shape) - 2
    q = quant_lib.quantize(jax.device_get(w), spec.method, spec.block, len(spec.in_shape), lead)
    return jax.tree.map(jnp.asarray, q)

  return jax.tree.map(one, specs, params, is_leaf=lambda x: is_spec(x) or is_q(x))


def init_params(cfg: ModelConfig, key, dtype=None):
  """Random params from the spec tree (normal / ones / zeros per spec); with
  cfg.quant, drawn in float and quantized (`quantize_params`)."""
  if cfg.quant is not None:
    float_params = init_params(dataclasses.replace(cfg, quant=None), key, dtype)
    return quantize_params(cfg, float_params)
  specs = param_specs(cfg, dtype)
  leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [_init_leaf(s, k) for s, k in zip(leaves, keys)])
