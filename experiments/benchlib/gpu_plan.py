"""GPU plans: the Engine's own step programs compiled for GPUs from a CPU process.

`gpu_plan(preset=..., mesh_axes=..., layout=..., gpu="h100", hosts=1, ...)`
builds abstract params (the spec tree with `sharding.param_shardings`), an
abstract page pool (`kv.cache.init_pool` under `jax.eval_shape`, placed by
`sharding.kv_pool_spec`) and step batches made by the engine's own
`steps.pad_batch`, on a mesh of compile-only GPUs (`jaxinfer.gpu_compile`),
and lowers + compiles the Engine's jitted steps with the config's kernel
target set to "gpu" (Pallas kernels through Triton):

  decode      `steps.step`: `batch` sequences, one token each, `context` tokens
  mixed       `steps.step`: one prefill chunk of `prefill_tokens` + decodes
  speculative `steps.step` with `speculative.Mtp` (MTP models): each sequence verifies
              `num_draft_tokens` drafts
  dp_attn_ep  each of the above whole per rank in `shard_map` (`steps.Ranks`:
              attention DP, experts split over every mesh axis, ragged
              all-to-all dispatch): `batch` per rank

Each program's optimized HLO is read for what it costs on the GPU
(`hlo_report`): kernel launches a step and a layer, bytes of weight copies a
step, while loops without a known trip count; beside it XLA's own estimate
of bytes accessed and FLOPs (`xla_cost`) and the compile time. `hlo_dir`
keeps the HLO text (`<program>.hlo`), `num_layers` compiles the preset with
fewer layers.
The steps hold the weights as a GPU Engine does by default, per layer
(`weights="per_layer"`, `engine_params`: the step reads each in place);
`weights="stacked"` compiles the scanned steps over the stacked weights
(`EngineConfig(unroll_layers=False)`), which compile several times faster
at full depth and copy each layer's weights out of the stack.
`decode_budget` reads a deep model's launches a layer off two shallow
compiles.

Nothing is allocated. Per device and program: params and KV bytes (exact,
from the shard shapes), `memory_analysis()` (arguments, temporaries, peak)
against the GPU's memory, and FLOPs and bytes moved from shapes alone
(`step_cost`) with a roofline time max(FLOPs / peak, bytes / bandwidth) from
`gpu_compile.target`. Collectives are not in the roofline.

When the params, or params + KV, do not fit one device, nothing is compiled:
the report says what does not fit and by how much.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from benchlib import hlo_report, results
# collective_ops: gpu_plan.collective_ops, as the tests read it
from benchlib.hlo_report import (MOSAIC_CALL, TRITON_CALL, collective_ops, collectives,  # noqa: F401
                                 kernel_gathers, quantized_gathers, xla_cost)
from benchlib.sharding_report import parse_mesh
from jaxinfer import EngineConfig, gpu_compile, presets, sharding
from jaxinfer.config import ModelConfig
from jaxinfer.engine import speculative, steps, weight_layout
from jaxinfer.engine.steps import Ranks
from jaxinfer.kv import cache as kv_cache
from jaxinfer.kv.pool import KV_CACHE_DTYPES, PoolLayout
from jaxinfer.models import quant, transformer
from jaxinfer.models import specs as specs_lib
from jaxinfer.models.moe_ep import plan_from_params
from jaxinfer.sim.cost import param_counts

_GB = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
  """Per attention rank (the whole step outside dp_attn_ep): `batch` sequences
  of `context` tokens; the mixed step replaces one decode by a prefill chunk
  of `prefill_tokens`; the speculative step verifies `num_draft_tokens`;
  kv_cache_dtype: the Engine's (`EngineConfig.kv_cache_dtype`), the pool's
  pages in fp8 / int8 with their per-layer scales."""

  batch: int = 8
  context: int = 1024
  prefill_tokens: int = 256
  page_size: int = 16
  kv_pages: int = 0  # pages per rank; 0: what `batch` x `context` needs (+ the null page)
  num_draft_tokens: int = 0  # 0: no speculative program
  greedy: bool = True  # every row temperature 0 (skips the sampling filters' sort)
  kv_cache_dtype: str | None = None  # None (the compute dtype) | "fp8" | "int8"

  def __post_init__(self):
    for name in ("batch", "context", "prefill_tokens", "page_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.kv_pages < 0 or not 0 <= self.num_draft_tokens <= 8:
      raise ValueError(f"kv_pages must be >= 0 and num_draft_tokens in [0, 8], got "
                       f"{self.kv_pages}, {self.num_draft_tokens}")
    if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
      raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)} or None, got "
                       f"{self.kv_cache_dtype!r}")

  def pages_per_seq(self) -> int:
    return -(-max(self.context, self.prefill_tokens) // self.page_size)

  def pool_pages(self) -> int:
    return self.kv_pages or self.batch * self.pages_per_seq() + 1


def gpu_config(cfg: ModelConfig, dtype: str) -> ModelConfig:
  """cfg with its kernels built for GPU and params/KV in `dtype`."""
  return dataclasses.replace(cfg, backend=dataclasses.replace(cfg.backend, target="gpu"),
                             dtype=dtype)


def abstract_params(cfg: ModelConfig, mesh, layout: str):
  """The spec tree as ShapeDtypeStructs in the layout's shardings (no
  allocation); quantized weights marked for the kernels as the Engine marks
  them."""
  return quant.with_kernel(_stacked(cfg, mesh, layout), sharding.kernel_mesh(mesh, layout))


def _stacked(cfg: ModelConfig, mesh, layout: str):
  return gpu_compile.abstract(specs_lib.abstract_params(cfg),
                              sharding.param_shardings(cfg, mesh, layout))


WEIGHTS = ("stacked", "per_layer")


def engine_params(cfg: ModelConfig, mesh, layout: str, weights: str = "per_layer"):
  """The params a GPU Engine's steps take, abstract -> (params, the
  expert-parallel plan of their placement). weights: "per_layer" (the
  Engine's GPU default, `EngineConfig(unroll_layers=None or True)`:
  `transformer.step_layout` in the form `weight_layout.choose` gives a GPU,
  placed where XLA puts that layout's outputs from the placed stacked
  weights, as the Engine's load does) or "stacked" (the layers scanned,
  `unroll_layers=False`)."""
  if weights not in WEIGHTS:
    raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
  stacked = _stacked(cfg, mesh, layout)
  ep = plan_from_params(stacked)
  if weights == "per_layer":
    form = weight_layout.choose(cfg, EngineConfig(unroll_layers=True), stacked, mesh,
                                expert_parallel=ep is not None, backend="gpu")
    to_steps = jax.jit(lambda p: transformer.step_layout(cfg, p, form))
    with gpu_compile.lowering(mesh):
      placed = to_steps.lower(stacked).compile().output_shardings
    stacked = gpu_compile.abstract(jax.eval_shape(to_steps, stacked), placed)
  return quant.with_kernel(stacked, sharding.kernel_mesh(mesh, layout)), ep


def abstract_pool(cfg: ModelConfig, mesh, layout: str, pages_per_rank: int, page_size: int,
                  mtp: bool = False, kv_cache_dtype: str | None = None):
  """The Engine's page pool (`kv.cache.init_pool`, every rank's pages) as
  ShapeDtypeStructs, pages sharded by `sharding.kv_pool_spec` (a quantized
  pool's scales replicated)."""
  dp = sharding.dp_axes(mesh, layout)
  ranks = math.prod(mesh.shape[a] for a in dp) if dp else 1
  dtype = KV_CACHE_DTYPES[kv_cache_dtype][0] if kv_cache_dtype else cfg.compute_dtype()
  scales = None
  if kv_cache_dtype:
    counts = [n for _, _, n in cfg.segments()] + ([cfg.num_mtp_layers] if mtp else [])
    names = PoolLayout.for_attention(cfg.attention, dtype).scale_names
    scales = [{n: np.ones(c, np.float32) for n in names} for c in counts]
  pool = jax.eval_shape(lambda: kv_cache.init_pool(cfg, pages_per_rank * ranks, page_size,
                                                   dtype, mtp=mtp, scales=scales))
  pages = NamedSharding(mesh, sharding.kv_pool_spec(cfg, mesh, layout))
  return gpu_compile.abstract(pool, pool.shardings(pages))


def host_batch(seqs, page_size: int, pages: int, seq_cap: int):
  """seqs [(query tokens, KV length after the step)] -> (StepBatch of numpy
  arrays from `steps.pad_batch`, its StepShapes), bucketed as `Engine._shapes`."""
  q_lens = [q for q, _ in seqs]
  shapes = steps.StepShapes(tokens=steps.bucket(sum(q_lens), 1 << 30),
                            seqs=steps.bucket(len(seqs), seq_cap),
                            pages=steps.page_bucket(pages, 1 << 30),
                            max_q=steps.bucket(max(q_lens), 1 << 30))
  positions, token_seq = [], []
  for i, (q, kv) in enumerate(seqs):
    positions += range(kv - q, kv)
    token_seq += [i] * q
  T, B = sum(q_lens), len(seqs)
  tables = [list(range(1 + i * pages, 1 + i * pages + -(-kv // page_size)))
            for i, (_, kv) in enumerate(seqs)]
  batch = steps.pad_batch(
      shapes, tokens=[1] * T, from_prev=[-1] * T, positions=positions, token_seq=token_seq,
      q_lens=q_lens, kv_lens=[kv for _, kv in seqs], page_tables=tables,
      temperature=[0.0] * B, top_k=[0] * B, top_p=[1.0] * B, seeds=[0] * B,
      sample_idx=[0] * B)
  return batch, shapes


def spec_host_batch(seqs, K: int, page_size: int, pages: int, seq_cap: int):
  """Decode sequences each verifying K drafts -> (`StepBatch`, `DraftRows`, StepShapes)."""
  batch, shapes = host_batch([(K + 1, kv) for _, kv in seqs], page_size, pages, seq_cap)
  B, T = shapes.seqs, shapes.tokens
  n = len(seqs)
  fill = lambda v, dtype=np.int32: steps.pad([v] * n, B, dtype)
  rows = steps.DraftRows(
      draft_j=steps.pad([j - 1 for _ in seqs for j in range(K + 1)], T, np.int32, -1),
      slot=steps.pad(range(n), B, np.int32), num_draft=fill(K), samples=fill(True, bool),
      from_state=fill(False, bool), chunk_next=fill(0),
      capacity=steps.pad([-(-kv // page_size) * page_size for _, kv in seqs], B, np.int32),
      max_len=fill(1 << 30), prompt_len=fill(1))
  return batch, rows, shapes


def _replicated(mesh, tree):
  return gpu_compile.abstract(tree, NamedSharding(mesh, P()))


def _load(cfg: ModelConfig, mesh):
  """The Engine's EPLB load counter [Lm, E] (recorded by default), or None."""
  if not cfg.is_moe:
    return None
  moe_layers = sum(n for is_moe, _, n in cfg.segments() if is_moe)
  return _replicated(mesh, jax.ShapeDtypeStruct((moe_layers, cfg.num_experts), jnp.int32))


def _placement(params, mesh, layout: str) -> tuple[int, dict]:
  """The Engine's placement of its steps -> (ranks n, kwargs): attention DP
  (`steps.Ranks` of the placed params) under dp_attn_ep, else the head
  split where the layout splits heads (dict(mesh=, head_axis=)) or none."""
  axes = sharding.dp_axes(mesh, layout)
  if axes:
    return math.prod(mesh.shape[a] for a in axes), dict(ranks=Ranks.of(params, mesh, axes))
  axis = sharding.head_axis(mesh, layout)
  return 1, {} if axis is None else dict(mesh=mesh, head_axis=axis)


def _ranked(mesh, layout: str, tree, n: int):
  """tree's arrays stacked [n, ...] as the Engine passes a step's inputs:
  split over the DP axes under attention DP, else replicated."""
  axes = sharding.dp_axes(mesh, layout)
  where = NamedSharding(mesh, P(axes) if axes else P())
  return gpu_compile.abstract(jax.tree.map(lambda a: np.stack([a] * n), tree), where)


def _step_inputs(params, mesh, layout: str, seqs, w: Workload):
  """A step's abstract inputs as the Engine passes them -> (batch, previous
  samples, placement kwargs, StepShapes): every rank runs `seqs`."""
  batch, shapes = host_batch(seqs, w.page_size, w.pages_per_seq(), len(seqs))
  n, where = _placement(params, mesh, layout)
  prev = np.zeros(shapes.seqs, np.int32)
  return _ranked(mesh, layout, batch, n), _ranked(mesh, layout, prev, n), where, shapes


_FROM_PARAMS = object()


def _model(cfg: ModelConfig, params, ep, where: dict) -> steps.StepModel:
  """The `steps.StepModel` of `_placement`'s kwargs (ranks, or the head split)."""
  return steps.StepModel(cfg, params, ep, where.get("ranks"),
                         {k: v for k, v in where.items() if k != "ranks"})


def _plan(params, ep):
  """A lowering's expert-parallel plan: `ep` as given, or by default the one
  the (stacked) params' sharding implies."""
  return plan_from_params(params) if ep is _FROM_PARAMS else ep


def lower_step(cfg: ModelConfig, params, pool, mesh, layout: str, seqs, w: Workload, *,
               ep=_FROM_PARAMS, fresh: bool = False):
  """`steps.step` lowered as the Engine runs it (per head shard where the
  layout splits heads, whole per rank under attention DP, every rank
  running `seqs`) -> (Lowered, StepShapes). ep: the expert-parallel plan
  (default: the one stacked params' sharding implies; give it for params in
  another layout, as the Engine computes it before `transformer.step_layout`).
  fresh: `seqs` are fresh prompt chunks (query rows == context each), lowered
  as the Engine marks them for library attention (`steps.fresh_shapes`)."""
  batch, prev, where, shapes = _step_inputs(params, mesh, layout, seqs, w)
  if fresh and any(q != kv for q, kv in seqs):
    raise ValueError(f"lower_step: fresh chunks have as many query rows as keys, got {seqs}")
  shapes = dataclasses.replace(shapes, fresh=fresh)
  ep = _plan(params, ep)
  with gpu_compile.lowering(mesh):
    lowered = steps.step.lower(_model(cfg, params, ep, where),
                               steps.StepState(pool, _load(cfg, mesh)),
                               steps.StepInputs(batch, prev),
                               steps.Program(steps.Plain(), max_q=shapes.max_q, greedy=w.greedy,
                                             fresh=fresh))
  return lowered, shapes


def lower_decode_steps(cfg: ModelConfig, params, pool, mesh, layout: str, seqs, w: Workload,
                       num_steps: int, extras=None, *, ep=_FROM_PARAMS):
  """`steps.step` with `steps.MultiStep` (multi-step decode, `EngineConfig.decode_steps`)
  lowered for decode-only `seqs` (as `lower_step`) -> (Lowered, StepShapes).
  extras: a host `sampling_extras.Extras` for the step's rows (replicated),
  or None."""
  batch, prev, where, shapes = _step_inputs(params, mesh, layout, seqs, w)
  extras = None if extras is None else _replicated(mesh, extras)
  ep = _plan(params, ep)
  with gpu_compile.lowering(mesh):
    lowered = steps.step.lower(_model(cfg, params, ep, where),
                               steps.StepState(pool, _load(cfg, mesh)),
                               steps.StepInputs(batch, prev, extras=extras),
                               steps.Program(steps.MultiStep(num_steps), greedy=w.greedy))
  return lowered, shapes


def lower_spec(cfg: ModelConfig, params, pool, mesh, layout: str, seqs, w: Workload, *,
               ep=_FROM_PARAMS):
  """`steps.step` with `speculative.Mtp` (MTP draft + verify), pool with its MTP entry,
  placed as `lower_step` places a step; under attention DP each rank's
  draft-state rows split over the DP axes."""
  K = w.num_draft_tokens
  batch, rows, shapes = spec_host_batch(seqs, K, w.page_size, w.pages_per_seq(), len(seqs))
  n, where = _placement(params, mesh, layout)
  axes = sharding.dp_axes(mesh, layout)
  state = jax.eval_shape(lambda: speculative.init_state(cfg, n * shapes.seqs, K))
  ep = _plan(params, ep)
  with gpu_compile.lowering(mesh):
    lowered = steps.step.lower(
        _model(cfg, params, ep, where),
        steps.StepState(pool, _load(cfg, mesh),
                        gpu_compile.abstract(state, NamedSharding(mesh, P(axes) if axes else P()))),
        steps.StepInputs(_ranked(mesh, layout, batch, n),
                         drafts=_ranked(mesh, layout, rows, n)),
        steps.Program(speculative.Mtp(K), max_q=shapes.max_q, greedy=w.greedy))
  return lowered, shapes


def _shard_bytes(tree) -> int:
  return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
             for a in jax.tree.leaves(tree))


def param_bytes(cfg: ModelConfig, params) -> dict:
  """Per-device bytes of abstract sharded params by role: all, embed (read
  by row), routed experts of the main layers, mtp (the MTP modules)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(specs_lib.param_specs(cfg),
                                                 is_leaf=specs_lib.is_spec)
  out = dict(all=0, embed=0, routed=0, mtp=0)
  for (kp, spec), a in zip(flat, jax.tree.leaves(params)):
    top = getattr(kp[0], "key", None)
    b = _shard_bytes(a)
    out["all"] += b
    if top in ("embed", "mtp"):
      out[top] += b
    elif "expert" in spec.logical_axes:
      out["routed"] += b
  return out


def _split(mesh, axis) -> int:
  names = () if axis is None else axis if isinstance(axis, tuple) else (axis,)
  return math.prod(mesh.shape[a] for a in names)


def step_cost(cfg: ModelConfig, mesh, layout: str, seqs, pbytes: dict, *, ranks: int = 1,
              draft: int = 0) -> dict:
  """Per-device FLOPs and HBM bytes of one step from shapes. seqs [(query
  tokens, KV length)] of one rank; `ranks` attention-DP ranks run such a
  batch each (their routed tokens share the expert-parallel devices). FLOPs:
  2 x params used per token (top-k routed experts), attention 2 q.kv pairs x
  (qk + v dims) (causal pairs counted whole: an upper bound), logits rows.
  Bytes: weights read once (routed experts by the fraction a uniform router
  touches, embedding rows only, MTP only when drafting) + the KV read.
  draft: K of a speculative step (MTP module over every row + K - 1 drafts)."""
  c, t = param_counts(cfg), sharding.rules(layout, mesh)
  a, m, v, e = (_split(mesh, t[k]) for k in ("q_heads", "mlp", "vocab", "expert"))
  T, B = sum(q for q, _ in seqs), len(seqs)
  k = max(cfg.num_experts_per_tok, 1)
  entry = kv_cache.page_bytes(cfg, 1, jnp.int8)  # cached values per token, all layers
  if cfg.attention.latent:  # absorbed: scores over latent + rope key, values the latent
    qk_v = 2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim
  else:
    qk_v = cfg.head_dim * 2
  pairs = sum(q * kv for q, kv in seqs)
  flops = 2 * cfg.num_layers * (T * c.attn + pairs * cfg.num_heads * qk_v) / a
  flops += 2 * T * (c.dense_mlp * c.dense_layers + c.shared * c.moe_layers) / m
  flops += 2 * T * ranks * k * c.expert * c.moe_layers / (max(e, 1) * m)
  flops += 2 * B * (draft + 1) * c.head / v
  if draft:
    flops += 2 * (T + (draft - 1) * B) * (c.mtp_dense + k * c.mtp_expert) / m
  touched = 1.0
  if cfg.is_moe:
    touched = 1 - (1 - k / cfg.num_experts) ** (T * ranks)
  weights = pbytes["all"] - pbytes["embed"] - (1 - touched) * pbytes["routed"]
  weights -= 0 if draft else pbytes["mtp"]
  kv_split = _split(mesh, t["kv_heads"]) if not cfg.attention.latent and ranks == 1 else 1
  item = jnp.dtype(cfg.compute_dtype()).itemsize
  kv = sum(kv for _, kv in seqs) * entry * item / kv_split
  return dict(flops=float(flops), weight_bytes=float(weights), kv_read_bytes=float(kv),
              bytes=float(weights + kv))


def roofline(cost: dict, gpu: str) -> dict:
  """max(FLOPs / peak bf16 FLOP/s, bytes / HBM bandwidth) of `gpu_compile.target(gpu)`."""
  g = gpu_compile.target(gpu)
  compute_s, memory_s = cost["flops"] / g.bf16_flops, cost["bytes"] / g.hbm_bandwidth
  return dict(compute_s=compute_s, memory_s=memory_s, step_s=max(compute_s, memory_s),
              bound="compute" if compute_s > memory_s else "memory")


def fit_verdict(params_bytes: int, kv_bytes: int, hbm_bytes: float) -> dict:
  """Whether params, then params + KV, fit one device; `message` names what
  does not fit and by how much."""
  gb = lambda b: f"{b / _GB:.1f} GB"
  if params_bytes > hbm_bytes:
    return dict(fits=False, message=f"params do not fit: {gb(params_bytes)} per device > "
                f"{gb(hbm_bytes)} of device memory (over by {gb(params_bytes - hbm_bytes)})")
  if params_bytes + kv_bytes > hbm_bytes:
    over = params_bytes + kv_bytes - hbm_bytes
    return dict(fits=False, message=f"params + KV do not fit: {gb(params_bytes)} + "
                f"{gb(kv_bytes)} per device > {gb(hbm_bytes)} (over by {gb(over)}; "
                f"{gb(hbm_bytes - params_bytes)} is left for KV)")
  return dict(fits=True, message=f"params + KV fit: {gb(params_bytes + kv_bytes)} per device "
              f"<= {gb(hbm_bytes)}")


def compile_program(lowered, hbm_bytes: float, pool=None, *, num_layers: int | None = None,
                    hlo_path: str | None = None) -> dict:
  """Compiles a Lowered step -> memory_analysis per device, peak vs HBM,
  whether the Pallas kernels are in it (`TRITON_CALL`), how many Mosaic GPU
  kernel calls (`MOSAIC_CALL`: attention and grouped matmuls), `kernel_gathers`
  (of `pool`, the step's abstract page pool), the `collectives`, and `hlo`:
  `hlo_report`'s launches (a layer: of `num_layers`), weight copies and loops.
  hlo_path: write the optimized HLO text there."""
  pool_shapes = {a.shape for a in jax.tree.leaves(pool)} if pool is not None else ()
  t0 = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  mem = gpu_compile.MemoryReport.of(compiled)
  hlo = compiled.as_text()
  if hlo_path:
    with open(hlo_path, "w") as f:
      f.write(hlo)
  return dict(hlo=hlo_report.read(hlo).as_dict(num_layers), compile_s=compile_s,
              xla_cost=xla_cost(compiled),
              memory=dataclasses.asdict(mem), peak_bytes=mem.peak_bytes,
              fits=mem.peak_bytes <= hbm_bytes, triton_kernels=TRITON_CALL in hlo,
              mosaic_kernels=hlo.count(MOSAIC_CALL),
              quantized_matmul_kernel="jit(_quantized_matmul)" in hlo,
              quantized_grouped_kernel="jit(_quantized_grouped_matmul)" in hlo,
              kernel_all_gathers=kernel_gathers(hlo, pool_shapes), quantized_gathers=quantized_gathers(hlo),
              collectives=collectives(hlo))


def decode_budget(model: str | ModelConfig, *, batch: int, context: int = 1024,
                  mesh_axes: dict | None = None, layout: str = "tp", gpu: str = "h100",
                  depths: tuple[int, int] = (2, 3), weights: str = "per_layer") -> dict:
  """What the compiled decode step costs a layer, from two shallow compiles:
  the preset cut to depths[0] and depths[1] layers (`with_layers`), decode
  of `batch` sequences per rank at `context` tokens. An unrolled step's
  launches grow by the same count with each layer, so launches(n) = fixed +
  n * per_layer, and the full model's launches a layer are (fixed +
  L * per_layer) / L without compiling its L layers (the layers compiled
  must be alike: past a preset's dense-first layers). -> dict(launches
  {depth: n}, per_layer, fixed, num_layers L, launches_per_layer at L,
  weight_copy_bytes (the most of either compile), unknown_trip_loops,
  compile_s {depth: s})."""
  base = presets.get(model) if isinstance(model, str) else model
  a, b = depths
  if not (isinstance(a, int) and isinstance(b, int) and 1 <= a < b <= base.num_layers):
    raise ValueError(f"depths must be two ints 1 <= a < b <= {base.num_layers}, got {depths!r}")
  w = Workload(batch=batch, context=context)
  mesh = gpu_compile.mesh(dict(mesh_axes or {"data": 1}), gpu=gpu)
  runs = {}
  for n in depths:
    cfg = gpu_config(with_layers(base, n), "bfloat16")
    params, ep = engine_params(cfg, mesh, layout, weights)
    pool = abstract_pool(cfg, mesh, layout, w.pool_pages(), w.page_size)
    lowered, _ = lower_step(cfg, params, pool, mesh, layout, _step_seqs(w)["decode"], w, ep=ep)
    runs[n] = compile_program(lowered, gpu_compile.target(gpu).hbm_bytes, pool, num_layers=n)
  la, lb = (runs[n]["hlo"]["launches"] for n in depths)
  per_layer = (lb - la) / (b - a)
  fixed = la - a * per_layer
  L = base.num_layers
  return dict(model=base.model_type if not isinstance(model, str) else model, batch=batch,
              context=context, layout=layout, mesh_axes=dict(mesh_axes or {"data": 1}),
              weights=weights, launches={n: runs[n]["hlo"]["launches"] for n in depths},
              per_layer=per_layer, fixed=fixed, num_layers=L,
              launches_per_layer=(fixed + L * per_layer) / L,
              weight_copy_bytes=max(r["hlo"]["weight_copy_bytes"] for r in runs.values()),
              unknown_trip_loops=sorted({x for r in runs.values()
                                         for x in r["hlo"]["unknown_trip_loops"]}),
              compile_s={n: runs[n]["compile_s"] for n in depths})


def _step_seqs(w: Workload) -> dict:
  """The plain step programs' (query rows, context) per sequence: "decode"
  (every sequence one row) and "mixed" (one prefill chunk beside decodes)."""
  return dict(decode=[(1, w.context)] * w.batch,
              mixed=[(w.prefill_tokens, w.prefill_tokens)] + [(1, w.context)] * (w.batch - 1))


def compile_step(cfg: ModelConfig, mesh_axes: dict, layout: str, program: str, *,
                 workload: Workload = Workload(), gpu: str = "h100") -> dict:
  """One plain step program of `cfg` ("decode" or "mixed", a config as
  `gpu_config` gives it) lowered and compiled for `gpu`s on a mesh of
  `mesh_axes`, as `gpu_plan` does for each -> `compile_program`'s dict."""
  w = workload
  mesh = gpu_compile.mesh(dict(mesh_axes), gpu=gpu)
  params = abstract_params(cfg, mesh, layout)
  pool = abstract_pool(cfg, mesh, layout, w.pool_pages(), w.page_size,
                       kv_cache_dtype=w.kv_cache_dtype)
  lowered, _ = lower_step(cfg, params, pool, mesh, layout, _step_seqs(w)[program], w)
  return compile_program(lowered, gpu_compile.target(gpu).hbm_bytes, pool)


def _programs(cfg: ModelConfig, mesh, layout: str, w: Workload, ep) -> tuple[list, list]:
  """-> ([(name, seqs, ranks, draft, lower(params, pools))], notes on skipped programs)."""
  dp = sharding.dp_axes(mesh, layout)
  out, notes = [], []
  n = math.prod(mesh.shape[a] for a in dp) if dp else 1
  prefix = "dp_attn_ep " if dp else ""
  for name, seqs in _step_seqs(w).items():
    out.append((prefix + name, seqs, n, 0, lambda p, pools, s=seqs: lower_step(
        cfg, p, pools[0], mesh, layout, s, w, ep=ep)))
  K = w.num_draft_tokens
  if K and not cfg.num_mtp_layers:
    notes.append("speculative: skipped, the model has no MTP modules")
  elif K:
    spec = [(K + 1, w.context)] * w.batch
    out.append((f"{prefix}speculative K={K}", spec, n, K,
                lambda p, pools: lower_spec(cfg, p, pools[1], mesh, layout, spec, w, ep=ep)))
  return out, notes


def with_layers(cfg: ModelConfig, num_layers: int | None) -> ModelConfig:
  """cfg with its first `num_layers` layers (None: as it is): per-layer
  settings (dense-first layers, attention kinds, DeepStack taps) kept for
  those layers as the preset has them."""
  if num_layers is None:
    return cfg
  if not isinstance(num_layers, int) or not 1 <= num_layers <= cfg.num_layers:
    raise ValueError(f"num_layers must be an int in [1, {cfg.num_layers}] for "
                     f"{cfg.model_type}, got {num_layers!r}")
  vision = cfg.vision
  if vision is not None and vision.deepstack_indexes:
    vision = dataclasses.replace(vision, deepstack_indexes=tuple(
        i for i in vision.deepstack_indexes if i < num_layers))
  return dataclasses.replace(
      cfg, num_layers=num_layers, dense_layers=tuple(i for i in cfg.dense_layers if i < num_layers),
      layer_types=cfg.layer_types[:num_layers], vision=vision)


def _program_file(name: str) -> str:
  """A report's program name as a file name: spaces and '=' as '_'."""
  return re.sub(r"[ =]", "_", name) + ".hlo"


def gpu_plan(*, model: str | ModelConfig, mesh_axes: dict, layout: str, gpu: str = "h100",
             hosts: int = 1, dtype: str = "bfloat16", workload: Workload = Workload(),
             num_layers: int | None = None, hlo_dir: str | None = None,
             weights: str = "per_layer") -> dict:
  """The Engine's steps for `model` (a preset name or a ModelConfig) compiled
  for `gpu`s on a mesh of `mesh_axes` over `hosts` hosts (see the module
  docstring). -> a JSON-able dict; `fit` says whether params + KV fit, and
  when they do not, `programs` is empty. num_layers: the model with that
  many layers (`with_layers`); hlo_dir: each program's optimized HLO text
  there as `<program>.hlo`; weights: how the steps hold the weights
  (`engine_params`)."""
  base = presets.get(model) if isinstance(model, str) else model
  cfg = gpu_config(with_layers(base, num_layers), dtype)
  w, target = workload, gpu_compile.target(gpu)
  mesh = gpu_compile.mesh(dict(mesh_axes), gpu=gpu, hosts=hosts)
  stacked = abstract_params(cfg, mesh, layout)
  pb = param_bytes(cfg, stacked)  # as loaded
  ep = plan_from_params(stacked)
  specs, notes = _programs(cfg, mesh, layout, w, ep)
  spec = any(d for _, _, _, d, _ in specs)
  kw = dict(kv_cache_dtype=w.kv_cache_dtype)
  pools = [abstract_pool(cfg, mesh, layout, w.pool_pages(), w.page_size, **kw)]
  pools.append(abstract_pool(cfg, mesh, layout, w.pool_pages(), w.page_size, mtp=True, **kw)
               if spec else None)
  kv = _shard_bytes(pools[-1] if spec else pools[0])
  fit = fit_verdict(pb["all"], kv, target.hbm_bytes)
  report = dict(model=cfg.model_type if not isinstance(model, str) else model, layout=layout,
                num_layers=cfg.num_layers, weights=weights,
                mesh_axes=dict(mesh_axes), gpu=gpu, hosts=hosts, devices=mesh.size,
                devices_per_host=mesh.size // hosts, dtype=dtype,
                workload=dataclasses.asdict(w), hbm_bytes=target.hbm_bytes,
                params_bytes_per_device=pb["all"], kv_bytes_per_device=kv,
                kv_pages_per_rank=w.pool_pages(), fit=fit, notes=notes, programs=[], verdicts=[])
  if not fit["fits"]:
    return report
  params, _ = engine_params(cfg, mesh, layout, weights)
  if hlo_dir:
    os.makedirs(hlo_dir, exist_ok=True)
  for name, seqs, ranks, draft, lower in specs:
    lowered, shapes = lower(params, pools)
    hlo_path = os.path.join(hlo_dir, _program_file(name)) if hlo_dir else None
    entry = dict(name=name, shapes=dataclasses.asdict(shapes), ranks=ranks,
                 **compile_program(lowered, target.hbm_bytes, pools[1] if draft else pools[0],
                                   num_layers=cfg.num_layers, hlo_path=hlo_path))
    entry["cost"] = step_cost(cfg, mesh, layout, seqs, pb, ranks=ranks, draft=draft)
    entry["roofline"] = roofline(entry["cost"], gpu)
    report["programs"].append(entry)
  report["verdicts"] = [program_verdict(p, target.hbm_bytes) for p in report["programs"]]
  return report


def program_verdict(program: dict, hbm_bytes: float) -> str:
  """One line: whether a compiled program's peak fits, naming the parts."""
  m = program["memory"]
  peak, name = program["peak_bytes"] / _GB, program["name"]
  parts = (f"arguments (params + KV + batch) {m['argument_bytes'] / _GB:.1f} GB + temporaries "
           f"{m['temp_bytes'] / _GB:.1f} GB")
  if program["fits"]:
    return f"{name}: fits, peak {peak:.1f} GB <= {hbm_bytes / _GB:.0f} GB ({parts})"
  return (f"{name}: DOES NOT FIT, peak {peak:.1f} GB > {hbm_bytes / _GB:.0f} GB (over by "
          f"{peak - hbm_bytes / _GB:.1f} GB; {parts})")


def format_plan(r: dict) -> str:
  """A plain-text table of `gpu_plan`'s dict (GB = 1e9 bytes, per device)."""
  mesh = ",".join(f"{k}={v}" for k, v in r["mesh_axes"].items())
  w = r["workload"]
  lines = [f"{r['model']}  layout={r['layout']}  mesh {mesh}  {r['hosts']} host(s) x "
           f"{r['devices_per_host']} {r['gpu'].upper()} ({r['devices']} devices)  {r['dtype']}  "
           f"{r['num_layers']} layers, weights {r['weights']}",
           f"workload per rank: batch {w['batch']} x context {w['context']}, prefill chunk "
           f"{w['prefill_tokens']}, page size {w['page_size']}, {r['kv_pages_per_rank']} pages, "
           f"draft tokens {w['num_draft_tokens']}",
           f"per device: params {r['params_bytes_per_device'] / _GB:.2f} GB, KV "
           f"{r['kv_bytes_per_device'] / _GB:.2f} GB, device memory {r['hbm_bytes'] / _GB:.0f} GB",
           ("FITS: " if r["fit"]["fits"] else "DOES NOT FIT: ") + r["fit"]["message"]]
  lines += [f"note: {n}" for n in r["notes"]]
  if not r["programs"]:
    lines.append("nothing compiled")
    return "\n".join(lines)
  lines += ["", f"{'program':<22}{'T':>6}{'B':>5}{'pages':>6}{'args GB':>9}{'temp GB':>9}"
                f"{'peak GB':>9}{'fits':>6}{'triton':>7}{'gathers':>8}{'GFLOP':>10}{'GB moved':>9}"
                f"{'roofline ms':>12}  bound{'launches/layer':>16}{'weight copies GB':>18}"]
  for p in r["programs"]:
    m, s, c, t = p["memory"], p["shapes"], p["cost"], p["roofline"]
    lines.append(f"{p['name']:<22}{s['tokens']:>6}{s['seqs']:>5}{s['pages']:>6}"
                 f"{m['argument_bytes'] / _GB:>9.2f}{m['temp_bytes'] / _GB:>9.2f}"
                 f"{p['peak_bytes'] / _GB:>9.2f}{'yes' if p['fits'] else 'NO':>6}"
                 f"{'yes' if p['triton_kernels'] else 'no':>7}{p['kernel_all_gathers']:>8}"
                 f"{c['flops'] / 1e9:>10.1f}{c['bytes'] / _GB:>9.2f}{t['step_s'] * 1e3:>12.3f}"
                 f"  {t['bound']:<7}{p['hlo']['launches_per_layer']:>14.1f}"
                 f"{p['hlo']['weight_copy_bytes'] / _GB:>18.3f}")
    if p["hlo"]["unknown_trip_loops"]:
      lines.append(f"  {p['name']}: loops without a known trip count: "
                   f"{', '.join(p['hlo']['unknown_trip_loops'])}")
  lines += [""] + r["verdicts"]
  lines += ["", "T tokens / B sequences per rank (bucketed); args = params + pool + batch; "
                "gathers: all-gathers around the Pallas kernels (GSPMD replicates a custom "
                "call's operands outside shard_map); roofline: max(FLOPs / peak, bytes / HBM "
                "bandwidth) per device, collectives not included; launches/layer: kernel "
                "launches a step over the layers; weight copies: bytes a step the compiled "
                "program writes copying weights (hlo_report)."]
  return "\n".join(lines)


def run_gpu_plan(*, model: str, mesh: str, layout: str, gpu: str = "h100", hosts: int = 1,
                 dtype: str = "bfloat16", json_out: str | None = None,
                 num_layers: int | None = None, hlo_dir: str | None = None,
                 weights: str = "per_layer", **workload) -> dict:
  """`gpu_plan` for a 'data=4,expert=8' mesh string and `Workload` fields as
  keywords; prints the table and writes the dict as JSON to `json_out` when given."""
  report = gpu_plan(model=model, mesh_axes=parse_mesh(mesh), layout=layout, gpu=gpu,
                    hosts=hosts, dtype=dtype, workload=Workload(**workload),
                    num_layers=num_layers, hlo_dir=hlo_dir, weights=weights)
  print(format_plan(report))
  if json_out:
    results.write_report(report, json_out)
  return report
