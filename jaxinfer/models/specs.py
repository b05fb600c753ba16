"""The abstract param tree: one `ParamSpec` per weight.

`param_specs(cfg)` is the single source of shapes, dtypes, logical axes and
initializers; `init_params`, the shardings and checkpoint restore all derive
from it, so they cannot drift apart. It is read off the weight declarations
of `models.weights`, which name each leaf's HF tensors too (`checkpoint.hf_names`).

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

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig, QuantConfig
from jaxinfer.models import quant as quant_lib
from jaxinfer.models.quant import QuantizedWeight
from jaxinfer.models.weights import Stacked, Weight, model_weights


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


def _spec(w: Weight, dtype, q: QuantConfig | None):
  spec = ParamSpec(w.shape, jnp.dtype(w.dtype) if w.dtype else dtype, w.axes, w.init)
  if q is not None and w.quant is not None and q.quantizes(w.quant):
    return quantized_spec(spec, q, w.in_dims, w.lead)
  return spec


def _specs(tree, dtype, q: QuantConfig | None):
  """A declaration (sub)tree -> its specs, `Stacked` runs stacked."""
  def one(node):
    if isinstance(node, Stacked):
      return _stack(_specs(node.tree, dtype, q), node.count)
    return _spec(node, dtype, q)
  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, (Weight, Stacked)))


def declared_specs(tree, dtype) -> dict:
  """The ParamSpec tree of any declaration tree of `Weight` / `Stacked`
  leaves (another model family's, e.g. `diffusion.wan_weights`)."""
  return _specs(tree, jnp.dtype(dtype), None)


def param_specs(cfg: ModelConfig, dtype=None) -> dict:
  """The abstract param tree of `cfg` (see the module docstring), from the
  declarations of `weights.model_weights`."""
  dtype = jnp.dtype(dtype) if dtype is not None else cfg.compute_dtype()
  return _specs(model_weights(cfg), dtype, cfg.quant)


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
  return init_from_specs(param_specs(cfg, dtype), key)


def init_from_specs(specs, key, init_leaf=None):
  """Random params of a ParamSpec tree (normal / ones / zeros per spec);
  init_leaf(spec, key) draws one leaf (default: the fan-in scaled normal above)."""
  init_leaf = init_leaf or _init_leaf
  leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [init_leaf(s, k) for s, k in zip(leaves, keys)])


def abstract_from_specs(specs):
  """`jax.ShapeDtypeStruct` tree of a ParamSpec tree (nothing allocates)."""
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), specs, is_leaf=is_spec)
