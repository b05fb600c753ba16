"""Per-device memory and per-layer collectives of a model on a mesh, from shapes alone.

`sharding_report(model=..., mesh_axes=..., layout=...)` walks the spec tree
(`models.param_specs`) on a `jax.sharding.AbstractMesh`, so the mesh may be far
larger than this machine (288 devices for DeepSeek-V3) and nothing is allocated.
Every PartitionSpec comes from `sharding.spec_for`, the function the runtime
uses, so a mesh the runtime rejects is rejected here with the same message.

  params       bytes per device of every weight: bytes / (shards along its split
               dims). Shards are equal (spec_for rejects indivisible dims), so the
               maximum over devices is the sum over params of one shard each.
  kv           the page pool holding `kv_tokens` tokens, sharded as
               `Engine._zero_pool`: GQA splits KV heads like wk/wv, MLA's
               latent pool is replicated.
  collectives  ANALYTIC, not read from a compiled program: for each layer kind
               the collectives the layout implies for one forward over
               `batch_tokens` tokens (global, split over the layout's batch axes).
               buffer_bytes: the array each rank reduces (all_reduce), receives
               (all_gather) or sends (all_to_all); wire_bytes_per_rank: what each
               rank sends, ring all-reduce 2(n-1)/n, all-gather and all-to-all
               (n-1)/n of the buffer.

Redundant experts (DeepSeek's EPLB replicas: 256 + 32 experts on 288 ranks) are
modelled on request only (`redundant_experts`): every MoE block, MTP included,
then holds E + r expert copies split over the EP axes. `sharding.param_shardings`
(the spec tree) has no replicas and rejects such meshes.
"""

from __future__ import annotations

import contextlib
import io
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from benchlib import results
from jaxinfer import presets, sharding
from jaxinfer.kv.pool import PoolLayout
from jaxinfer.models import specs as specs_lib
from jaxinfer.models.moe_ep import ExpertParallel

GROUPS = ("embed_head", "attention", "dense_mlp", "routed_experts", "shared_experts", "router",
          "norms", "mtp")
_WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
         "all_to_all": lambda n: (n - 1) / n}
_GIB = 2 ** 30


def abstract_mesh(axes: Mapping[str, int]) -> AbstractMesh:
  """A device-free mesh with `make_mesh`'s axis checks (no device count)."""
  if not axes:
    raise ValueError("mesh: give at least one axis, e.g. {'data': 8}")
  bad = [a for a in axes if a not in sharding.AXES]
  if bad:
    raise ValueError(f"mesh: unknown axis names {bad}; use {sharding.AXES}")
  if any(not isinstance(s, int) or s < 1 for s in axes.values()):
    raise ValueError(f"mesh: axis sizes must be ints >= 1, got {dict(axes)}")
  return AbstractMesh(tuple(axes.values()), tuple(axes))


def parse_mesh(text: str) -> dict:
  """'data=8,expert=36' -> {'data': 8, 'expert': 36}."""
  out = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    name, eq, size = item.partition("=")
    if not eq or not size.strip().isdigit():
      raise ValueError(f"mesh: expected name=size items like 'data=8,expert=36', got {item!r}")
    out[name.strip()] = int(size)
  return out


def _size(mesh, axis) -> int:
  if axis is None:
    return 1
  return math.prod(mesh.shape[a] for a in (axis if isinstance(axis, tuple) else (axis,)))


def _nbytes(shape, dtype) -> int:
  return math.prod(shape) * jnp.dtype(dtype).itemsize


def _group(keys, seg_is_moe) -> str:
  if keys[0] in ("embed", "lm_head"):
    return "embed_head"
  if keys[0] == "final_norm":
    return "norms"
  if keys[0] == "mtp":
    return "mtp"
  seg, part = keys[1], keys[2]  # ("layers", segment, part, ...)
  if part in ("attn_norm", "mlp_norm"):
    return "norms"
  if part == "attn":
    return "attention"
  if not seg_is_moe[seg]:
    return "dense_mlp"
  if keys[3] == "shared":
    return "shared_experts"
  return "router" if keys[3] in ("router", "router_bias", "score_bias") else "routed_experts"


def _param_walk(cfg, dtype, mesh, table, redundant_experts):
  """Per group: params, bytes, bytes per device; and rows for representative arrays."""
  seg_is_moe = [moe for moe, _, _ in cfg.segments()]
  n_ep = _size(mesh, table["expert"])
  physical = cfg.num_experts + redundant_experts
  groups = {g: dict(count=0, total_bytes=0, per_device_bytes=0) for g in GROUPS}
  rows = {}
  flat, _ = jax.tree_util.tree_flatten_with_path(specs_lib.param_specs(cfg, dtype),
                                                 is_leaf=specs_lib.is_spec)
  for kp, s in flat:  # a quantized weight's keys end in its field (values, scale)
    keys = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in kp)
    name = jax.tree_util.keystr(kp)
    shape = s.shape
    if "expert" in s.logical_axes:  # routed experts as placed: logical + redundant copies
      e = s.logical_axes.index("expert")
      shape = shape[:e] + (physical,) + shape[e + 1:]
      if physical % n_ep:
        raise ValueError(
            f"{name}: dimension {e} (expert={physical}) is not divisible by mesh axis "
            f"{table['expert']} (size {n_ep}), so sharding.param_shardings rejects this mesh. "
            f"To model DeepSeek-style redundant expert copies (EPLB) pass "
            f"redundant_experts={redundant_experts + (-physical) % n_ep}")
    spec = sharding.spec_for(s.logical_axes, shape, table, mesh, name=name)
    shard = NamedSharding(mesh, spec).shard_shape(shape)
    g = groups[_group(keys, seg_is_moe)]
    g["count"] += math.prod(s.shape)
    g["total_bytes"] += _nbytes(s.shape, s.dtype)
    g["per_device_bytes"] += _nbytes(shard, s.dtype)
    rows[keys] = _array_row(f"params{name}", shape, s.logical_axes, spec, shard)
  # Representatives: embed, the first block's q projection, the first MoE block's
  # expert w_gate (dense models: the first dense w_gate).
  mlp_seg = seg_is_moe.index(True) if True in seg_is_moe else 0
  picks = [("embed",), ("layers", 0, "attn", "wq"), ("layers", 0, "attn", "wq_b"),
           ("layers", mlp_seg, "mlp", "w_gate")]
  picks = [k if k in rows else (*k, "values") for k in picks]
  return groups, [rows[k] for k in picks if k in rows]


def _array_row(name, shape, logical_axes, spec, shard_shape) -> dict:
  return dict(name=name, shape=list(shape), logical_axes=list(logical_axes), spec=str(spec),
              shard_shape=list(shard_shape), spec_obj=spec)


def _kv(cfg, dtype, mesh, table, kv_tokens, layout):
  """The pool as [L, K, S, H] per k/v (GQA) or [L, S, R + Hr] (MLA); the engine
  stores one pool per layer segment and splits S into pages."""
  L, S, rows, total, per_device = cfg.num_layers, kv_tokens, [], 0, 0
  pool_layout = PoolLayout.for_attention(cfg.attention)
  pool = tuple(sharding.kv_pool_spec(cfg, mesh, layout))  # the Engine's pool sharding
  pool = dict(zip(pool_layout.axes, pool + (None,) * (len(pool_layout.axes) - len(pool))))
  dp = sharding.dp_axes(mesh, layout)
  n_dp = _size(mesh, dp) if dp else 1
  S = -(-S // n_dp) * n_dp  # each DP rank holds whole pages of its own requests
  # The pool's pages x slots seen as S tokens: [L, (K,) P, ps, H] -> [L, (K,) S, H].
  spec = P(*(pool[a] for a in pool_layout.axes if a != "slot"))
  for key, e in cfg.cache_entry_shapes().items():
    if pool_layout.latent:
      shape, axes = (L, S, *e), ("layers", None, "kv_lora")
    else:
      shape, axes = (L, e[0], S, e[1]), ("layers", "kv_heads", None, "head_dim")
      if not dp:
        sharding.spec_for(axes, shape, table, mesh, name=f"kv_pool.{key}")  # divisibility
    shard = NamedSharding(mesh, spec).shard_shape(shape)
    total += _nbytes(shape, dtype)
    per_device += _nbytes(shard, dtype)
    rows.append(_array_row(f"kv_pool.{key}", shape, axes, spec, shard))
  values = sum(math.prod(e) for e in cfg.cache_entry_shapes().values())
  return dict(kv_tokens=kv_tokens, layers=L, values_per_token_per_layer=values, total_bytes=total,
              per_device_bytes=per_device, spec=rows[0]["spec"],
              note="per_device_bytes follows sharding.kv_pool_spec, the Engine's pool sharding "
                   "(dp_attn_ep: pages split over the attention-DP ranks; otherwise GQA KV heads "
                   "split like wk/wv, MLA replicated); page rounding and the null page are "
                   "ignored"), rows


def _coll(op, where, axes, n, shape, dtype) -> dict:
  buf = _nbytes(shape, dtype)
  return dict(op=op, where=where, axes=axes, group_size=n, shape=list(shape),
              dtype=jnp.dtype(dtype).name, buffer_bytes=buf,
              wire_bytes_per_rank=int(_WIRE[op](n) * buf))


def _sum(entries, times: int = 1) -> dict:
  out = {}
  for c in entries:
    o = out.setdefault(c["op"], dict(count=0, buffer_bytes=0, wire_bytes_per_rank=0))
    o["count"] += times
    o["buffer_bytes"] += times * c["buffer_bytes"]
    o["wire_bytes_per_rank"] += times * c["wire_bytes_per_rank"]
  return out


def _merge(*sums) -> dict:
  out = {}
  for s in sums:
    for op, v in s.items():
      o = out.setdefault(op, dict(count=0, buffer_bytes=0, wire_bytes_per_rank=0))
      for k in o:
        o[k] += v[k]
  out["all"] = dict(count=sum(v["count"] for v in out.values()),
                    buffer_bytes=sum(v["buffer_bytes"] for v in out.values()),
                    wire_bytes_per_rank=sum(v["wire_bytes_per_rank"] for v in out.values()))
  return out


def _collectives_tp(cfg, mesh, table, attn, t_b, act, notes):
  """tp: -> (dense layer, MoE layer, once-per-forward) collectives."""
  D, k, n_batch = cfg.d_model, cfg.num_experts_per_tok, _size(mesh, table["batch"])
  per_forward, moe = [], []
  n_mlp, n_v = _size(mesh, table["mlp"]), _size(mesh, table["vocab"])
  dense = attn + ([_coll("all_reduce", "dense MLP output (w_down)", table["mlp"], n_mlp,
                         (t_b, D), act)] if n_mlp > 1 else [])
  if cfg.is_moe:
    moe = attn + ([_coll("all_reduce", "routed experts (w_down), per (token, expert) copy "
                         "before the top-k combine", table["mlp"], n_mlp, (t_b * k, D), act)]
                  if n_mlp > 1 else [])
    if cfg.num_shared_experts and n_mlp > 1:
      moe.append(_coll("all_reduce", "shared experts output (w_down)", table["mlp"], n_mlp,
                       (t_b, D), act))
    if n_batch > 1 and n_mlp > 1:
      notes.append("tp + MoE with a data axis: the compiled grouped-expert path also "
                   "all-gathers routing tensors over 'data' (a global argsort over the "
                   "data-split token axis) and reduces [batch_tokens * top_k, D]; not counted.")
  if n_v > 1:
    per_forward.append(_coll("all_reduce", "embedding lookup (vocab-split table)",
                             table["vocab"], n_v, (t_b, D), act))
    notes.append(f"logits stay vocab-split ([{t_b}, {cfg.vocab_size // n_v}] per rank); a "
                 "sampler needing whole rows adds an all-gather; not counted.")
  return dense, moe, per_forward


def _collectives_ep(cfg, mesh, layout, table, attn, batch_tokens, act, notes):
  """tp_attn_ep / dp_attn_ep: -> (dense layer, MoE layer, expert-parallel
  summary, the other EP strategy) collectives."""
  D, k, n_t = cfg.d_model, cfg.num_experts_per_tok, _size(mesh, table["q_heads"])
  ep, alt, moe = None, None, []
  dense = list(attn)
  n = _size(mesh, table["expert"])
  if cfg.is_moe and n > 1:
    t = -(-batch_tokens // n)  # moe_ep pads tokens to a multiple of the EP size
    plan = ExpertParallel(mesh=None, axes=())
    # Rows per destination per round (`ep_dispatch.capacity_all_to_all`): one
    # round when routing is within the capacity factor of even.
    cap = max(1, math.ceil(t * k * plan.capacity_factor / n))
    limit = plan.replicated_max_tokens
    a2a = [_coll("all_to_all", "dispatch: token copies to the experts' ranks",
                 table["expert"], n, (n, cap, D), act),
           _coll("all_to_all", "dispatch metadata: local expert ids", table["expert"], n,
                 (n, cap), jnp.int32),
           _coll("all_to_all", "dispatch metadata: valid flags", table["expert"], n,
                 (n, cap), jnp.bool_),
           _coll("all_to_all", "combine: expert outputs back", table["expert"], n,
                 (n, cap, D), act)]
    rep = [_coll("all_gather", "tokens", table["expert"], n, (n * t, D), act),
           _coll("all_gather", "expert ids", table["expert"], n, (n * t, k), jnp.int32),
           _coll("all_gather", "routing weights", table["expert"], n, (n * t, k), jnp.float32),
           _coll("all_reduce", "psum of local experts' contributions", table["expert"], n,
                 (n * t, D), act)]  # combined in the activations' dtype
    strategy = "replicated" if t <= limit else "all_to_all"
    ep = dict(axes=table["expert"], size=n, tokens_per_rank=t, buffer_rows_per_dest=cap,
              auto_strategy=strategy, replicated_max_tokens=limit)
    chosen, other = (rep, a2a) if strategy == "replicated" else (a2a, rep)
    moe = attn + chosen
    alt = dict(strategy="all_to_all" if strategy == "replicated" else "replicated",
               moe=attn + other)
    notes.append("EP: on CPU 'auto' picks replicated when tokens per rank <= "
                 f"{limit} (moe_ep.ExpertParallel); both strategies are listed. all_to_all "
                 f"is the CPU capacity exchange, per round ({cap} rows per destination, "
                 f"capacity factor {plan.capacity_factor}; more rounds when one destination "
                 "gets more). A GPU target always sends the routed rows only "
                 "(ragged_all_to_all, not listed: its sizes are run-time values). "
                 "Shared experts, dense MLPs and the router run locally (replicated weights).")
  elif cfg.is_moe:
    moe = list(attn)
  if layout.q_heads and n_t > 1 and cfg.is_moe:  # attention TP beside EP (tp_attn_ep)
    notes.append(f"{layout}: in compiled CPU programs (jax 0.10.2, tiny configs) the MoE's "
                 "token split over 'tensor' propagates into attention and XLA all-gathers the "
                 "attention weights over 'tensor' instead of all-reducing activations; the "
                 "entries here are the intended TP all-reduce.")
  return dense, moe, ep, alt


def _collectives(cfg, mesh, layout, table, batch_tokens, dtype) -> dict:
  act, D = jnp.dtype(dtype), cfg.d_model
  t_b = -(-batch_tokens // _size(mesh, table["batch"]))  # tokens per batch shard
  n_t = _size(mesh, table["q_heads"])
  attn = ([_coll("all_reduce", "attention output (wo), partial sums over heads",
                 table["q_heads"], n_t, (t_b, D), act)] if n_t > 1 else [])
  notes = ["ANALYTIC: derived from the layout's rules table and the model's shapes, not read "
           "from a compiled program; tokens assumed split over the layout's batch axes "
           "(sharding.batch_sharding); ceil division where tokens do not divide."]
  per_forward, ep, alt = [], None, None  # once-per-forward, EP summary, other EP strategy
  if not layout.expert:  # experts whole on every rank, their FFN split (tp)
    dense, moe, per_forward = _collectives_tp(cfg, mesh, table, attn, t_b, act, notes)
  else:
    dense, moe, ep, alt = _collectives_ep(cfg, mesh, layout, table, attn, batch_tokens, act,
                                          notes)
  n_moe = sum(c for m, _, c in cfg.segments() if m)
  n_dense = cfg.num_layers - n_moe
  if cfg.num_mtp_layers:
    notes.append(f"{cfg.num_mtp_layers} MTP module(s) add one "
                 f"{'MoE' if cfg.is_moe and cfg.num_layers not in cfg.dense_layers else 'dense'}"
                 " block each when drafting; not in the totals.")
  totals = _merge(_sum(per_forward), _sum(dense, n_dense), _sum(moe, n_moe))
  out = dict(analytic=True, batch_tokens=batch_tokens, batch_axes=table["batch"],
             tokens_per_batch_shard=t_b, layers=dict(dense=n_dense, moe=n_moe),
             per_layer=dict(dense=dense, moe=moe), per_forward_once=per_forward,
             totals_per_forward=totals, expert_parallel=ep, notes=notes)
  if alt is not None:
    alt["totals_per_forward"] = _merge(_sum(per_forward), _sum(dense, n_dense),
                                       _sum(alt["moe"], n_moe))
    out["moe_alternative"] = alt
  return out


def _visualize(row, mesh_axes) -> str | None:
  """jax.debug.visualize_array_sharding of a small 2-D array sharded like two of
  the array's dims (its split ones first), when the mesh fits the local devices."""
  n = math.prod(mesh_axes.values())
  if n > jax.device_count():
    return None
  ndim = len(row["shape"])
  spec = tuple(row["spec_obj"]) + (None,) * (ndim - len(row["spec_obj"]))
  # The split dims, then unsplit ones (a model dim before the stacked layer axis).
  order = sorted(range(ndim), key=lambda d: (spec[d] is None, row["logical_axes"][d] == "layers"))
  dims = sorted(order[:2])
  mesh = sharding.make_mesh(mesh_axes, jax.devices()[:n])
  spec2 = P(*(spec[d] for d in dims))
  x = jax.device_put(np.zeros(tuple(4 * _size(mesh, spec[d]) for d in dims), np.float32),
                     NamedSharding(mesh, spec2))
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    jax.debug.visualize_array_sharding(x, use_color=False, scale=0.5, max_width=64)
  names = ", ".join(str(row["logical_axes"][d]) for d in dims)
  return f"dims {tuple(dims)} ({names}) as {spec2}:\n{buf.getvalue()}"


def sharding_report(*, model: str, mesh_axes: Mapping[str, int], layout: sharding.LayoutLike,
                    dtype: str = "bfloat16", kv_tokens: int = 0, batch_tokens: int = 256,
                    redundant_experts: int = 0, quant: str | None = None) -> dict:
  """Params and KV bytes per device, analytic collectives per layer, and
  representative array shardings of preset `model` on a mesh of `mesh_axes`
  under `layout`; from shapes alone (see the module docstring). quant: the
  weights' format (`presets.QUANT`: "fp8", "nvfp4", ...; None: `dtype`)."""
  cfg = presets.get(model, quant=presets.quant(quant))
  mesh_axes = dict(mesh_axes)
  mesh = abstract_mesh(mesh_axes)
  layout = sharding.as_layout(layout)
  table = sharding.rules(layout, mesh)
  dtype = jnp.dtype(dtype)
  if kv_tokens < 0 or batch_tokens < 1:
    raise ValueError(f"kv_tokens must be >= 0 and batch_tokens >= 1, got {kv_tokens}, "
                     f"{batch_tokens}")
  if redundant_experts < 0 or (redundant_experts and not cfg.is_moe):
    raise ValueError(f"redundant_experts must be 0, or >= 0 for a MoE model; got "
                     f"{redundant_experts} for {model}")
  groups, arrays = _param_walk(cfg, dtype, mesh, table, redundant_experts)
  kv, kv_rows = _kv(cfg, dtype, mesh, table, kv_tokens, layout)
  arrays += kv_rows[:1]
  for row in arrays:
    row["visualization"] = _visualize(row, mesh_axes)
    del row["spec_obj"]
  params = dict(count=sum(g["count"] for g in groups.values()),
                total_bytes=sum(g["total_bytes"] for g in groups.values()),
                per_device_bytes=sum(g["per_device_bytes"] for g in groups.values()),
                groups=groups)
  return dict(model=model, layout=layout.name, mesh_axes=mesh_axes, num_devices=mesh.size,
              dtype=dtype.name, quant=quant, rules=table, redundant_experts=redundant_experts,
              physical_experts=cfg.num_experts + redundant_experts if cfg.is_moe else 0,
              params=params, kv=kv,
              per_device_bytes=params["per_device_bytes"] + kv["per_device_bytes"],
              collectives=_collectives(cfg, mesh, layout, table, batch_tokens, dtype),
              arrays=arrays)


def _gib(b) -> str:
  return f"{b / _GIB:10.3f}"


def _mib(b) -> str:
  return f"{b / 2 ** 20:10.2f}"


def _axes(a) -> str:
  return "-" if a is None else "(" + ",".join(a) + ")" if isinstance(a, tuple) else a


def _format_collectives(c: dict) -> list[str]:
  """The collectives section of `format_report`."""
  lines = []
  lines += ["", f"collectives (ANALYTIC) for one forward of {c['batch_tokens']} tokens "
                f"({c['tokens_per_batch_shard']} per batch shard over {_axes(c['batch_axes'])})"]
  if c["expert_parallel"]:
    e = c["expert_parallel"]
    lines.append(f"  EP over {_axes(e['axes'])} ({e['size']} ranks): {e['tokens_per_rank']} "
                 f"tokens/rank, auto strategy: {e['auto_strategy']}")
  head = f"  {'layer':<7}{'op':<11}{'axes':<18}{'shape':<20}{'dtype':<9}{'buf MiB':>10}" \
         f"{'wire MiB':>11}  where"
  lines.append(head)

  def rows(kind, entries):
    for x in entries:
      lines.append(f"  {kind:<7}{x['op']:<11}{_axes(x['axes']):<18}{str(x['shape']):<20}"
                   f"{x['dtype']:<9}{_mib(x['buffer_bytes'])} {_mib(x['wire_bytes_per_rank'])}"
                   f"  {x['where']}")

  rows("once", c["per_forward_once"])
  for kind in ("dense", "moe"):
    if c["layers"][kind]:
      rows(kind, c["per_layer"][kind])
      if not c["per_layer"][kind]:
        lines.append(f"  {kind:<7}(none)")
  alt = c.get("moe_alternative")
  if alt:
    rows("moe*", alt["moe"])
    lines.append(f"  moe*: the {alt['strategy']} alternative")
  lines.append(f"  layers: {c['layers']['dense']} dense, {c['layers']['moe']} MoE")

  def total(name, t):
    a = t["all"]
    ops = ", ".join(f"{v['count']} {op}" for op, v in t.items() if op != "all")
    lines.append(f"  per forward ({name}): {ops}; buffers {_mib(a['buffer_bytes']).strip()} MiB, "
                 f"wire {_mib(a['wire_bytes_per_rank']).strip()} MiB/rank")

  total(c["expert_parallel"]["auto_strategy"] if c["expert_parallel"] else "layout",
        c["totals_per_forward"])
  if alt:
    total(alt["strategy"], alt["totals_per_forward"])
  lines += [f"  note: {n}" for n in c["notes"]]
  return lines


def format_report(r: dict) -> str:
  """A plain-text rendering of `sharding_report`'s dict."""
  mesh = " x ".join(f"{k}={v}" for k, v in r["mesh_axes"].items())
  lines = [f"{r['model']}  layout={r['layout']}  mesh {mesh} ({r['num_devices']} devices)  "
           f"dtype={r['dtype']}" + (f"  weights={r['quant']}" if r.get('quant') else ""),
           "rules: " + ", ".join(f"{k}={_axes(v)}" for k, v in r["rules"].items())]
  if r["redundant_experts"]:
    lines.append(f"routed experts placed: {r['physical_experts']} (incl. "
                 f"{r['redundant_experts']} redundant copies, MTP included; not in the spec tree)")
  p = r["params"]
  lines += ["", f"{'params':<16}{'count':>16}{'total GiB':>12}{'GiB/device':>12}"]
  for g, v in p["groups"].items():
    if v["count"]:
      lines.append(f"{g:<16}{v['count']:>16,}  {_gib(v['total_bytes'])}  "
                   f"{_gib(v['per_device_bytes'])}")
  lines.append(f"{'total':<16}{p['count']:>16,}  {_gib(p['total_bytes'])}  "
               f"{_gib(p['per_device_bytes'])}")
  kv = r["kv"]
  lines += ["", f"KV pool: {kv['kv_tokens']:,} tokens x {kv['layers']} layers x "
                f"{kv['values_per_token_per_layer']} values; spec {kv['spec']}",
            f"  total {_gib(kv['total_bytes']).strip()} GiB, per device "
            f"{_gib(kv['per_device_bytes']).strip()} GiB",
            f"per device: params + KV = {_gib(r['per_device_bytes']).strip()} GiB"]
  lines += _format_collectives(r["collectives"])
  lines += ["", "arrays (global shape -> PartitionSpec -> per-device shard shape):"]
  for a in r["arrays"]:
    lines.append(f"  {a['name']}  {a['shape']} {tuple(a['logical_axes'])}")
    lines.append(f"    {a['spec']}  shard {a['shard_shape']}")
    if a["visualization"]:
      lines += ["    " + l for l in a["visualization"].rstrip().splitlines()]
  return "\n".join(lines)


def run_sharding_report(*, model: str, mesh: str, layout: str, dtype: str = "bfloat16",
                        kv_tokens: int = 0, batch_tokens: int = 256, redundant_experts: int = 0,
                        quant: str | None = None, json_out: str | None = None) -> dict:
  """`sharding_report` for a 'data=8,expert=36' mesh string; prints the table and
  writes the dict as JSON to `json_out` when given."""
  report = sharding_report(model=model, mesh_axes=parse_mesh(mesh), layout=layout, dtype=dtype,
                           kv_tokens=kv_tokens, batch_tokens=batch_tokens,
                           redundant_experts=redundant_experts, quant=quant)
  print(format_report(report))
  if json_out:
    results.write_report(report, json_out)
  return report
