"""Meshes, logical-axis rules and param shardings.

The spec tree (`models.param_specs`) names every weight dimension with a
logical axis; a layout's rules table maps logical axes to mesh axes. Params
are then placed (or created, or loaded) straight into those shardings.

A layout is a `Layout` value: for each logical axis, the mesh axes it may be
split over (those of them the mesh has with size > 1, in the mesh's order),
and whether the batch axes are attention-data-parallel ranks. Three are
named (mesh axes may be any of "data", "expert", "tensor"); `as_layout`
turns a name into its value, the one place a name is read:
  tp          Megatron tensor parallel over "tensor": q/kv heads and FFN width
              split; experts whole but their FFN width split; vocab split.
              Batch over "data".
  dp_attn_ep  DeepSeek style: attention replicated (data parallel: each rank
              owns whole requests), MoE experts split over every mesh axis
              (wide expert parallelism), batch over every mesh axis.
  tp_attn_ep  attention tensor parallel over "tensor", experts over every axis.
A dimension that an axis does not divide raises, naming both: a KV head is
never silently duplicated across tensor ranks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.kv.pool import PoolLayout
from jaxinfer.models import specs as specs_lib

AXES = ("data", "expert", "tensor")
LOGICAL_AXES = ("q_heads", "kv_heads", "mlp", "vocab", "expert", "batch")


@dataclasses.dataclass(frozen=True)
class Layout:
  """Logical axis -> the mesh axes it may be split over (`rules` keeps those
  the mesh has with size > 1, in the mesh's order); attention_dp: the batch
  axes are attention-data-parallel ranks, each owning whole requests and
  their KV pages (`dp_axes`), and a step runs per rank (`engine.steps.per_rank`)."""
  name: str
  q_heads: tuple[str, ...] = ()
  kv_heads: tuple[str, ...] = ()
  mlp: tuple[str, ...] = ()
  vocab: tuple[str, ...] = ()
  expert: tuple[str, ...] = ()
  batch: tuple[str, ...] = ()
  attention_dp: bool = False

  def __str__(self) -> str:
    return self.name


TP = Layout("tp", q_heads=("tensor",), kv_heads=("tensor",), mlp=("tensor",), vocab=("tensor",),
            batch=("data",))
DP_ATTN_EP = Layout("dp_attn_ep", expert=AXES, batch=AXES, attention_dp=True)
TP_ATTN_EP = Layout("tp_attn_ep", q_heads=("tensor",), kv_heads=("tensor",), expert=AXES,
                    batch=("data",))
NAMED = {layout.name: layout for layout in (TP, DP_ATTN_EP, TP_ATTN_EP)}
LAYOUTS = tuple(NAMED)  # the names, for flags
LayoutLike = Union[Layout, str]


def as_layout(layout: LayoutLike) -> Layout:
  """A `Layout` as it is, or the named one ("tp", "dp_attn_ep", "tp_attn_ep")."""
  if isinstance(layout, Layout):
    return layout
  if layout not in NAMED:
    raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS} or a sharding.Layout")
  return NAMED[layout]


def make_mesh(axes: Mapping[str, int], devices=None) -> Mesh:
  """A mesh over `devices` (default: all, global under multi-host) with named
  axes, e.g. {"data": 2, "expert": 4}; the sizes' product must be the device count."""
  devices = list(jax.devices() if devices is None else devices)
  if not axes:
    raise ValueError("make_mesh: give at least one axis, e.g. {'data': len(devices)}")
  bad = [a for a in axes if a not in AXES]
  if bad:
    raise ValueError(f"make_mesh: unknown axis names {bad}; use {AXES}")
  sizes = list(axes.values())
  if any(not isinstance(s, int) or s < 1 for s in sizes):
    raise ValueError(f"make_mesh: axis sizes must be ints >= 1, got {dict(axes)}")
  if math.prod(sizes) != len(devices):
    raise ValueError(f"make_mesh: axis sizes {dict(axes)} multiply to {math.prod(sizes)}, "
                     f"but there are {len(devices)} devices")
  return Mesh(np.asarray(devices).reshape(sizes), tuple(axes))


def _present(mesh: Mesh, names: tuple[str, ...]):
  """The mesh axes among `names` that split (size > 1), in the mesh's order:
  None, one axis, or a tuple of them."""
  axes = tuple(a for a in mesh.axis_names if a in names and mesh.shape[a] > 1)
  return axes if len(axes) > 1 else (axes[0] if axes else None)


def rules(layout: LayoutLike, mesh: Mesh) -> dict:
  """Logical axis -> mesh axis (or tuple of axes, or None) for a layout."""
  layout = as_layout(layout)
  return {axis: _present(mesh, getattr(layout, axis)) for axis in LOGICAL_AXES}


def _axis_size(mesh: Mesh, axis) -> int:
  if axis is None:
    return 1
  return math.prod(mesh.shape[a] for a in (axis if isinstance(axis, tuple) else (axis,)))


def spec_for(logical_axes, shape, table: dict, mesh: Mesh, *, name: str = "param") -> P:
  """PartitionSpec of one array; raises on collisions and indivisible dims."""
  used, spec = set(), []
  for dim, (logical, size) in enumerate(zip(logical_axes, shape)):
    axis = table.get(logical) if logical else None
    if axis is not None:
      names = axis if isinstance(axis, tuple) else (axis,)
      if used & set(names):
        raise ValueError(f"{name}: mesh axis {sorted(used & set(names))} assigned to two "
                         f"dimensions (logical axes {logical_axes})")
      used |= set(names)
      n = _axis_size(mesh, axis)
      if size % n:
        hint = ("; KV heads are never duplicated across tensor ranks: use a tensor axis that "
                "divides them, or layout 'dp_attn_ep' (attention data parallel)"
                if logical == "kv_heads" else "")
        raise ValueError(f"{name}: dimension {dim} ({logical}={size}) is not divisible by mesh "
                         f"axis {axis} (size {n}){hint}")
    spec.append(axis)
  return P(*spec)


def param_shardings(cfg: ModelConfig, mesh: Mesh, layout: LayoutLike = TP,
                    table: dict | None = None):
  """NamedSharding tree matching `models.param_specs(cfg)`."""
  table = table or rules(layout, mesh)
  specs = specs_lib.param_specs(cfg)
  flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=specs_lib.is_spec)
  out = [NamedSharding(mesh, spec_for(s.logical_axes, s.shape, table, mesh,
                                      name=jax.tree_util.keystr(kp)))
         for kp, s in flat]
  return jax.tree_util.tree_unflatten(treedef, out)


def shard_params(cfg: ModelConfig, params, mesh: Mesh, layout: LayoutLike = TP,
                 rules_table=None):
  """Places params into the layout's shardings.

  EPLB-placed params (`eplb.apply_placement`: expert weights [L, E + R, ...]
  plus slot tables, in trunk segments and the MTP block) are accepted: the
  slot dim is split like the logical expert dim, the tables are replicated.
  """
  table = rules_table or rules(layout, mesh)
  shardings = param_shardings(cfg, mesh, layout, table)
  specs = specs_lib.param_specs(cfg)

  def placed(mlp_p, mlp_s, mlp_spec, name):
    """A placed block group's shardings: slots split like experts, tables replicated."""
    if "eplb_replicas" not in mlp_p:
      return mlp_s
    mlp_s = dict(mlp_s)
    for k, w in mlp_p.items():
      if k in ("eplb_replicas", "eplb_num_replicas"):
        mlp_s[k] = NamedSharding(mesh, P())
      elif k in mlp_s and k != "shared":
        spec = mlp_spec[k]
        mlp_s[k] = NamedSharding(mesh, spec_for(spec.logical_axes, w.shape, table, mesh,
                                                name=f"{name}.{k} (placed)"))
    return mlp_s

  layers = tuple(dict(seg_s, mlp=placed(seg["mlp"], seg_s["mlp"], specs["layers"][i]["mlp"],
                                        f"layers[{i}].mlp"))
                 for i, (seg, seg_s) in enumerate(zip(params["layers"], shardings["layers"])))
  shardings = dict(shardings, layers=layers)
  if "mtp" in params:
    block_s = shardings["mtp"]["block"]
    mlp_s = placed(params["mtp"]["block"]["mlp"], block_s["mlp"],
                   specs["mtp"]["block"]["mlp"], "mtp.block.mlp")
    shardings["mtp"] = dict(shardings["mtp"], block=dict(block_s, mlp=mlp_s))
  return jax.device_put(params, shardings)


def init_params(cfg: ModelConfig, key, mesh: Mesh, layout: LayoutLike = TP):
  """Random params created directly in their shardings (never whole on one device)."""
  shardings = param_shardings(cfg, mesh, layout)
  return jax.jit(lambda k: specs_lib.init_params(cfg, k), out_shardings=shardings)(key)


def dp_axes(mesh: Mesh, layout: LayoutLike) -> tuple[str, ...]:
  """Attention-data-parallel axes: under an attention_dp layout (dp_attn_ep)
  each rank of these owns whole requests and their KV pages; () otherwise."""
  if not as_layout(layout).attention_dp:
    return ()
  batch = rules(layout, mesh)["batch"]
  return () if batch is None else (batch if isinstance(batch, tuple) else (batch,))


def head_axis(mesh: Mesh, layout: LayoutLike):
  """The mesh axis attention heads (q and GQA KV heads, contiguous blocks of
  them) are split over: "tensor" under tp / tp_attn_ep when the mesh has it,
  else None. The engine's paged attention runs per device of this axis
  (`kv.contexts.PagedContext`), since GSPMD cannot split the kernel."""
  return rules(layout, mesh)["q_heads"]


def kernel_mesh(mesh: Mesh | None, layout: LayoutLike) -> Mesh | None:
  """The mesh the quantized weights' kernel calls split over
  (`models.quant.with_kernel`): None where a step holds its weights whole
  (no mesh or one device, or per rank under attention DP, whose step runs
  in shard_map); else the mesh, and each weight runs per device as its
  sharding splits it."""
  if mesh is None or mesh.size == 1 or as_layout(layout).attention_dp:
    return None
  return mesh


def kv_pool_spec(cfg: ModelConfig, mesh: Mesh, layout: LayoutLike) -> P:
  """PartitionSpec of every array of the engine's page pool
  (`kv.pool.PoolLayout`): pages split over the attention-DP ranks under
  dp_attn_ep; otherwise GQA KV heads split like wk/wv and MLA's latent pool
  replicated."""
  pool = PoolLayout.for_attention(cfg.attention)
  dp = dp_axes(mesh, layout)
  if dp:
    return pool.spec(pages=dp)
  return pool.spec(heads=rules(layout, mesh)["kv_heads"])


def batch_sharding(mesh: Mesh, layout: LayoutLike, ndim: int) -> NamedSharding:
  """Sharding of a [B, ...] activation (tokens) under a layout."""
  axis = rules(layout, mesh)["batch"]
  return NamedSharding(mesh, P(axis, *([None] * (ndim - 1))))


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int, *,
                           local_device_count: int | None = None,
                           cpu_collectives: str = "gloo") -> None:
  """Joins the multi-controller runtime (one process per host, one global
  mesh over every process's devices). Call before any other JAX work.

  local_device_count: CPU devices this process exposes (tests: 4 per process);
  cpu_collectives: the CPU cross-process collectives ("gloo").
  """
  if not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
  if local_device_count is not None:
    jax.config.update("jax_num_cpu_devices", local_device_count)
  jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                             process_id=process_id)
