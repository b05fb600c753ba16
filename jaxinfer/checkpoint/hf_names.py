"""HF tensor names of every param leaf, read off the weight declarations.

`model_sources(cfg, has, shape)` gives, for every leaf of `param_specs(cfg)`
(keyed by its path; a list over the layers of a stacked leaf), a `Source`:
the HF tensors it is built from, their expected shapes, and the conversion.
Which leaves exist and where HF keeps them is declared once, in
`models.weights`; this module turns each declared storage form into a conversion
(HF linear weights are [out, in]; ours are [in, out] with heads split out,
`[D, N, H]`, `[N, H, D]`) and picks the checkpoint's own layout of the
routed experts where one architecture has several on disk.

Expert weights: every layout transformers 5 itself reads.
  per expert  `experts.{e}.gate_proj/up_proj/down_proj.weight` (Mixtral: w1/w3/w2,
              under `block_sparse_moe` or `mlp`, its router `gate` likewise):
              published Qwen3-MoE, Mixtral and DeepSeek checkpoints, and what
              save_pretrained writes for them
  fused       `experts.gate_up_proj` [E, 2F, D] (gate rows first) and
              `experts.down_proj` [E, D, F]: transformers 5's in-memory layout,
              written by save_pretrained(save_original_format=False), and by
              plain save_pretrained for Qwen3-VL-MoE
  Qwen3-VL-MoE as published: `gate_up_proj` [E, D, 2F] (gate columns first),
              `down_proj` [E, F, D]; chosen by shape, and where a shape fits
              both (D == 2F, D == F) the in-memory layout, as transformers does
  GPT-OSS     `experts.gate_up_proj` [E, D, 2F] with gate/up interleaved on the
              last axis, `down_proj` [E, F, D], plus their `_bias` tensors (the
              one layout, saved and published)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import numpy as np

from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.config import ModelConfig
from jaxinfer.models.weights import Stacked, Weight, block_weights, model_weights


@dataclasses.dataclass(frozen=True)
class WeightRef:
  """Where a projection leaf lives as an [out, in] matrix, for checkpoints
  that store it quantized (`hf_quant`): the HF weight tensors (one per expert
  when `stacked`), each [*lead, out, in]; `rows` of out the leaf takes (a
  fused gate/up); `target`: its `QUANT_TARGETS` entry."""
  names: tuple[str, ...]
  out: int  # rows of each tensor
  d_in: int
  lead: tuple[int, ...] = ()  # dims inside each tensor before [out, in]
  rows: slice | None = None
  stacked: bool = False
  target: str | None = None


@dataclasses.dataclass(frozen=True)
class Source:
  names: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  convert: Callable[..., np.ndarray]  # HF arrays (in `names` order) -> our leaf
  ref: WeightRef | None = None  # projections: the matrix a quantized checkpoint holds


def _same(w: Weight, name: str) -> Source:
  """Stored as ours; with `part`, that slice of a last axis twice as wide.
  Quantized, such a tensor is [*lead, out, in] like any other."""
  if w.part is None:
    shape, fn = w.shape, lambda a: a
  else:
    shape, fn = (*w.shape[:-1], 2 * w.shape[-1]), lambda a: a[..., w.part]
  ref = None
  if w.quant is not None:
    ref = WeightRef((name,), shape[-1], math.prod(w.shape[w.lead:-1]), w.shape[:w.lead], w.part,
                    target=w.quant)
  return Source((name,), (tuple(shape),), fn, ref)


def _linear(w: Weight, name: str) -> Source:
  """nn.Linear [out, in] (per expert where the name holds {e}, else with the
  expert dims first) -> ours [*lead, *in, *out]."""
  split = w.lead + w.in_dims
  n_in, n_out = math.prod(w.shape[w.lead:split]), math.prod(w.shape[split:])
  rows = 2 * n_out if w.part is not None else n_out
  per_expert = "{e}" in name
  inner = () if per_expert else w.shape[:w.lead]  # dims inside each tensor before [out, in]
  ours = w.shape[w.lead:] if per_expert else w.shape
  shape = w.hf_shape or (*inner, rows, n_in)

  def one(a):
    a = a.reshape(*inner, rows, n_in)
    if w.part is not None:
      a = a[..., w.part, :]
    return np.swapaxes(a, -1, -2).reshape(ours)

  names = tuple(name.format(e=e) for e in range(w.shape[0])) if per_expert else (name,)
  ref = None if w.quant is None else WeightRef(names, rows, n_in, inner, w.part, per_expert,
                                               w.quant)
  if not per_expert:
    return Source(names, (tuple(shape),), one, ref)
  return Source(names, (tuple(shape),) * len(names),
                lambda *ws: np.stack([one(a) for a in ws]), ref)


def source(w: Weight, prefix: str, has: Callable[[str], bool]) -> Source:
  """The Source of declared weight w under module `prefix` ('' at the top)."""
  join = lambda n: f"{prefix}.{n}" if prefix else n
  if w.stored == "max":
    names = [join(n) for n in w.hf]
    names = names[:1] + [n for n in names[1:] if has(n)]
    return Source(tuple(names), (w.hf_shape,) * len(names),
                  lambda *s: np.max([np.reshape(x, ()) for x in s]))
  if w.stored == "flat":
    return Source((join(w.hf),), ((math.prod(w.shape),),), lambda a: a.reshape(w.shape))
  if w.stored == "same":
    return _same(w, join(w.hf))
  if w.stored == "linear":
    return _linear(w, join(w.hf))
  raise ValueError(f"weight {w.hf}: unknown HF storage {w.stored!r}")


def _published_vl_layout(cfg: ModelConfig, x: str, shape: Callable | None) -> bool:
  """Qwen3-VL-MoE's fused experts: True for the published [E, D, 2F] /
  [E, F, D], False for transformers' in-memory [E, 2F, D] / [E, D, F]
  (preferred where a shape fits both, as transformers reads it)."""
  D, E, F = cfg.d_model, cfg.num_experts, cfg.moe_ffn_dim
  layouts = {"gate_up_proj": ((E, 2 * F, D), (E, D, 2 * F)), "down_proj": ((E, D, F), (E, F, D))}
  published = []
  for leaf, (memory, pub) in layouts.items():
    got = shape(f"{x}.{leaf}") if shape is not None else pub
    if got is None:
      raise CheckpointError(f"missing tensor {x}.{leaf!r}")
    if tuple(got) not in (memory, pub):
      raise CheckpointError(
          f"tensor {x}.{leaf!r} has shape {list(got)}; expected {list(pub)} (as published) or "
          f"{list(memory)} (as transformers 5's save_pretrained writes it)")
    published.append(tuple(got) != memory)
  if published[0] != published[1]:
    raise CheckpointError(f"{x}: gate_up_proj and down_proj are in different layouts "
                          "(one published, one as transformers holds it in memory)")
  return published[0]


def _fused_experts(cfg: ModelConfig, mlp: dict, x: str, prefix: str,
                   shape: Callable | None) -> dict:
  """The experts at module x (relative to prefix) as fused `gate_up_proj` /
  `down_proj`: transformers 5's in-memory layout, or (Qwen3-VL-MoE only)
  the published one, which no quantized layout is known for."""
  F = cfg.moe_ffn_dim
  gu, down = f"{x}.gate_up_proj", f"{x}.down_proj"
  if cfg.model_type == "qwen3_vl_moe" and _published_vl_layout(cfg, f"{prefix}.{x}", shape):
    as_stored = lambda k, hf, part=None: dataclasses.replace(mlp[k], hf=hf, stored="same",
                                                             part=part, quant=None)
    return dict(w_gate=as_stored("w_gate", gu, slice(0, F)),
                w_up=as_stored("w_up", gu, slice(F, 2 * F)), w_down=as_stored("w_down", down))
  linear = lambda k, hf, part=None: dataclasses.replace(mlp[k], hf=hf, part=part)
  return dict(w_gate=linear("w_gate", gu, slice(0, F)), w_up=linear("w_up", gu, slice(F, 2 * F)),
              w_down=linear("w_down", down))


def _checkpoint_moe(cfg: ModelConfig, tree, prefix: str, has: Callable[[str], bool],
                    shape: Callable | None):
  """A tree's declared MoE groups (the dicts with a router) in the layout
  this checkpoint holds: Mixtral under `block_sparse_moe` (transformers 5
  renames it `mlp` on load), per-expert tensors fused where the checkpoint
  fuses them."""
  if not isinstance(tree, dict):
    return tree
  if "router" not in tree:
    return {k: _checkpoint_moe(cfg, v, prefix, has, shape) for k, v in tree.items()}
  mlp = tree
  if cfg.model_type == "mixtral" and has(f"{prefix}.block_sparse_moe.gate.weight"):
    mlp = jax.tree.map(lambda w: dataclasses.replace(w, hf="block_sparse_moe" + w.hf[len("mlp"):]),
                       mlp)
  if "{e}" in mlp["w_gate"].hf:
    x = mlp["w_gate"].hf.split(".{e}.")[0]
    if has(f"{prefix}.{x}.gate_up_proj"):
      mlp = {**mlp, **_fused_experts(cfg, mlp, x, prefix, shape)}
  return mlp


def path_key(kp) -> tuple:
  """A jax key path -> the plain tuple of its dict keys and sequence indices."""
  return tuple(getattr(k, "key", getattr(k, "idx", None)) for k in kp)


def _sources(cfg: ModelConfig, tree: dict, prefix: str, has: Callable[[str], bool],
             shape: Callable | None) -> dict:
  """Path -> Source for every leaf of a declaration tree under `prefix`
  (a list of them, one per copy, for a leaf under a `Stacked` node)."""
  out = {}
  leaves = jax.tree_util.tree_flatten_with_path(_checkpoint_moe(cfg, tree, prefix, has, shape))[0]
  for kp, node in leaves:
    if isinstance(node, Stacked):
      copies = [_sources(cfg, node.tree, node.prefix.format(i=node.first + j), has, shape)
                for j in range(node.count)]
      out.update({(*path_key(kp), *k): [c[k] for c in copies] for k in copies[0]})
    else:
      out[path_key(kp)] = source(node, prefix, has)
  return out


def declared_sources(tree: dict, has: Callable[[str], bool], prefix: str = "") -> dict:
  """Path -> Source for every leaf of any declaration tree (no MoE layouts to
  choose between): another model family's weights, e.g. a video DiT's."""
  out = {}
  for kp, node in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if isinstance(node, Stacked):
      copies = [declared_sources(node.tree, has, node.prefix.format(i=node.first + j))
                for j in range(node.count)]
      out.update({(*path_key(kp), *k): [c[k] for c in copies] for k in copies[0]})
    else:
      out[path_key(kp)] = source(node, prefix, has)
  return out


def model_sources(cfg: ModelConfig, has: Callable[[str], bool],
                  shape: Callable[[str], tuple | None] | None = None) -> dict:
  """Sources of every leaf of `param_specs(cfg)`, keyed by its path.
  `has(name)`: the checkpoint holds the tensor; `shape(name)`: its shape (or
  None), which picks between fused-expert layouts (None: the published one)."""
  return _sources(cfg, model_weights(cfg), "", has, shape)


def block_sources(cfg: ModelConfig, prefix: str, is_moe: bool, has: Callable[[str], bool],
                  shape: Callable[[str], tuple | None] | None = None) -> dict:
  """Sources of every leaf of the block at `prefix` (e.g. 'model.layers.3')."""
  return _sources(cfg, block_weights(cfg, is_moe), prefix, has, shape)


def top_sources(cfg: ModelConfig) -> dict:
  """Sources of the unstacked language-model leaves (embed, final_norm, lm_head)."""
  return {(k,): source(w, "", lambda _: False)
          for k, w in model_weights(cfg).items() if isinstance(w, Weight)}


def mtp_duplicates(cfg: ModelConfig) -> list[str]:
  """The tensors each DeepSeek MTP module holds that duplicate shared weights
  (embed_tokens, shared_head.head): consumed, not loaded."""
  return [f"model.layers.{cfg.num_layers + d}.{n}" for d in range(cfg.num_mtp_layers)
          for n in ("embed_tokens.weight", "shared_head.head.weight")]
