"""`Engine`: the paged KV cache, the scheduler and the jitted step together.

  engine = Engine(cfg, params, EngineConfig(...))
  outs = engine.generate(prompts, SamplingParams(...))        # batch form
  rid = engine.submit(prompt, sampling)                       # streaming form
  for rid, new_tokens, finished in engine.step(): ...
  engine.abort(rid); engine.stats()

Every request is validated on submit (ValueError naming the parameter) before
any device work, so a bad request never disturbs the running ones. The only
device-to-host read per step is the sampled tokens (with their logprobs, in
the same read, in steps whose requests ask for them).

The Engine holds a host core (`core.HostCore`: requests, per-rank schedulers
and page allocators) and owns the device state: the params in the step's
layout with their placement (`steps.StepModel`), the page pool, the
expert load and, with speculation, the MTP draft state. Its step runner
(`steps.Runner`, one for every decoder) takes them on each step as one
`steps.StepState` and returns what the step donated, made anew; only the
Engine assigns them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import eplb, sharding
from jaxinfer.config import ModelConfig
from jaxinfer.engine import kv_calibration, speculative, warmup, weight_layout
from jaxinfer.engine.core import (HostCore, RequestMetrics, RequestOutput, prefill_chunk,  # noqa: F401 (API)
                                  forward, forward_attribute)
from jaxinfer.engine.images import Images, per_prompt
from jaxinfer.engine import steps
from jaxinfer.engine.steps import Ranks, Runner, StepModel, StepState
from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.kv import cache as kv_cache, scales as kv_scales
from jaxinfer.kv.pool import KV_CACHE_DTYPES
from jaxinfer.models import mtp, quant, transformer
from jaxinfer.models.moe_ep import plan_from_params
from jaxinfer.vision_inputs import ProcessorConfig


DP_BALANCE = ("split", "none")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Engine settings: frozen, keyword-only, checked on construction.

  KV cache: page_size tokens per page; num_pages per attention-DP rank (None:
  sized from kv_cache_bytes, else from kv_cache_memory_fraction of the free
  device memory, host memory on CPU). Step: max_num_seqs sequences and
  max_num_batched_tokens tokens, prompts prefilled in chunks of
  prefill_chunk_size (None: the token budget). Requests: max_model_len (None:
  the model's), enable_prefix_caching, ignore_eos. kv_cache_dtype: None
  (pages in the model's compute dtype), "fp8" (float8_e4m3fn) or "int8":
  quantized pages with per-layer scales (`jaxinfer.kv.scales`: the params'
  k_scale / v_scale (MLA kv_scale), else calibrated at build), 2x / 4x the
  tokens of bf16 / f32 pages in the same bytes. The comments on the
  remaining fields say what they switch: async_scheduling,
  record_expert_load, fixed_step_shapes, fixed_prefill_shapes, speculative
  (an `MTPConfig`), unroll_layers, cpu_weight_layout, decode_steps, and the
  attention-DP step budget (dp_balance, dp_min_step_tokens).
  """

  page_size: int = 16
  num_pages: int | None = None  # None: sized from kv_cache_bytes / free memory
  kv_cache_bytes: int | None = None
  kv_cache_memory_fraction: float = 0.5  # of free device (or host, on CPU) memory
  max_num_seqs: int = 32  # sequences per step
  # Token budget per step: vLLM's CPU default. Prompts of a batch prefill
  # together up to it; on a 2-core CPU, 32 prompts x 128 tokens -> 64 new ran
  # 1.5x faster at 4096 than at 512 (experiments/bench_vs_vllm.py).
  max_num_batched_tokens: int = 4096
  prefill_chunk_size: int | None = None  # None: the token budget
  max_model_len: int | None = None  # None: the model's max_position_embeddings
  enable_prefix_caching: bool = True
  ignore_eos: bool = False
  # Dispatch step N+1 before reading step N's tokens, so the host's work
  # overlaps the device's. Off: read each step's tokens before the next.
  async_scheduling: bool = True
  # MoE models: count each expert's routed tokens in every step (on device,
  # padding excluded) for `Engine.expert_load` / `Engine.rebalance` (EPLB).
  record_expert_load: bool = True
  # Every step padded to max_num_batched_tokens rows, max_num_seqs sequences
  # and the chunk's query length, so programs differ only in pages per
  # sequence: a handful of compiles under any traffic (serving benchmarks),
  # at the cost of padding small steps.
  fixed_step_shapes: bool = False
  # Steps with a prompt chunk padded to max_num_seqs and to the budget or a
  # quarter of it (`steps.prompt_token_buckets`), their pages in powers
  # of two; decode-only steps bucketed in powers of
  # two (sequences, pages). The programs are then few enough to compile before serving
  # (`Engine.warmup`) while decode steps stay near the size of their batch.
  fixed_prefill_shapes: bool = False
  # Speculative decoding with the model's MTP modules (decode steps pipelined
  # like the plain ones when async_scheduling is on).
  speculative: speculative.MTPConfig | None = None
  # Run the layers unrolled over per-layer weight arrays in the step's layout
  # (`models.transformer.step_layout`, `weight_layout.choose`) instead of
  # scanning the stacked ones.
  # None: always on a GPU backend, on the CPU backend when the layer weights
  # reach 64 MiB, where the scan's weight copies dominate a step; smaller
  # models keep the scan's faster compile. On a GPU the per-layer arrays
  # stay as loaded, q, k and v fused, which the compiled step reads in
  # place (the scanned one copies layers out of the stack: `gpu_plan
  # --weights`, docs/kernels.md); each step program then compiles longer.
  # Keeps a second copy of the layer weights while the caller holds the
  # stacked ones.
  unroll_layers: bool | None = None
  # Unrolled and unsharded: float projections held [In, Out] ("in_out") or
  # transposed, multiplied as rows x w^T ("out_in") or into [Out, rows]
  # ("out_major"), or float32 ones in 32-column panels for the C++ CPU
  # kernel ("panels", where it builds); "auto" reads this machine's probe
  # from disk, timing nothing (`engine.weight_layout`: which is faster
  # differs by CPU, up to 1.5x; `python -m jaxinfer.engine.cpu_setup` probes).
  cpu_weight_layout: str = "auto"
  # Multi-step decode: a step whose chunks are all lone decode tokens runs
  # this many decode steps in one program (`steps.MultiStep`), so the
  # host dispatches once per decode_steps tokens per sequence. Tokens past a
  # stop or max_tokens are computed (and counted in the expert load) and
  # dropped; waiting requests are admitted at the next dispatch. Plain
  # decoding (every attention-DP rank together); a speculative engine
  # pipelines its own steps.
  decode_steps: int = 1
  # Before compiling a step program, a process holding this fraction of
  # vm.max_map_count memory maps drops jax's compiled programs first
  # (`engine.map_guard`): past the limit XLA:CPU's compile segfaults.
  max_map_fraction: float = 0.85
  # Attention DP: every rank's step is as long as the longest (the ranks pad
  # to the same token count), so one rank's prefill chunk stalls the others.
  # "split": when most ranks have little to run, the step's token budget
  # shrinks to what they need (at least dp_min_step_tokens), splitting the
  # lone prefill into smaller chunks while the others keep decoding; when
  # most ranks prefill, nothing is capped. "none": each rank fills its own
  # max_num_batched_tokens. experiments/dp_balance.py measured "split" on 8
  # simulated CPU devices at 1.01x tokens/s, 0.86x mean and 0.92x p90 TTFT
  # (short prompts' TTFT down, long ones' up), too close to call with
  # step-shape compiles in every timed run, so "none" stays the default.
  dp_balance: str = "none"
  dp_min_step_tokens: int = 32
  kv_cache_dtype: str | None = None  # None | "fp8" | "int8"
  # Requests with images (vision models): the image processor (None: the
  # vision tower's patch sizes, `ProcessorConfig`'s pixel bounds) and the
  # encoder cache's capacity in visual tokens (0: encode every image).
  image_processor: ProcessorConfig | None = None
  encoder_cache_tokens: int = 1 << 16

  def __post_init__(self):
    if type(self.decode_steps) is not int:
      raise TypeError(f"EngineConfig: decode_steps must be an int, got {self.decode_steps!r}")
    for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "decode_steps"):
      if getattr(self, name) < 1:
        raise ValueError(f"EngineConfig: {name} must be >= 1, got {getattr(self, name)}")
    for name in ("num_pages", "kv_cache_bytes", "prefill_chunk_size", "max_model_len"):
      value = getattr(self, name)
      if value is not None and value < 1:
        raise ValueError(f"EngineConfig: {name} must be >= 1 or None, got {value}")
    if self.speculative is not None and not isinstance(self.speculative, speculative.MTPConfig):
      raise TypeError(f"EngineConfig: speculative must be an MTPConfig or None, "
                      f"got {type(self.speculative).__name__}")
    if self.decode_steps > 1 and self.speculative is not None:
      raise ValueError("EngineConfig: decode_steps > 1 is for plain decoding; speculative "
                       "decoding pipelines its own steps (leave decode_steps at 1)")
    if self.fixed_step_shapes and self.fixed_prefill_shapes:
      raise ValueError("EngineConfig: fixed_step_shapes pads every step, fixed_prefill_shapes "
                       "only prompt steps: set one of them")
    if self.dp_balance not in DP_BALANCE:
      raise ValueError(f"EngineConfig: dp_balance must be one of {DP_BALANCE}, "
                       f"got {self.dp_balance!r}")
    if self.cpu_weight_layout not in weight_layout.LAYOUTS:
      raise ValueError(f"EngineConfig: cpu_weight_layout must be one of {weight_layout.LAYOUTS}, "
                       f"got {self.cpu_weight_layout!r}")
    if self.dp_min_step_tokens < 1:
      raise ValueError(f"EngineConfig: dp_min_step_tokens must be >= 1, "
                       f"got {self.dp_min_step_tokens}")
    if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
      raise ValueError(f"EngineConfig: kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)} "
                       f"or None, got {self.kv_cache_dtype!r}")
    if self.encoder_cache_tokens < 0:
      raise ValueError(f"EngineConfig: encoder_cache_tokens must be >= 0, "
                       f"got {self.encoder_cache_tokens}")
    if self.image_processor is not None and not isinstance(self.image_processor, ProcessorConfig):
      raise TypeError(f"EngineConfig: image_processor must be a ProcessorConfig or None, "
                      f"got {type(self.image_processor).__name__}")
    if not 0 < self.kv_cache_memory_fraction <= 1:
      raise ValueError(f"EngineConfig: kv_cache_memory_fraction must be in (0, 1], "
                       f"got {self.kv_cache_memory_fraction}")


def _stacked_params(engine: "Engine"):
  """The inverse of `Engine._set_params`: its step params, stacked and placed."""
  params = quant.without_kernel(engine._model.params)
  if engine._form is None:
    return params
  params = transformer.stacked_layout(engine.cfg, params)
  if engine.mesh is None:
    return params
  return sharding.shard_params(engine.cfg, params, engine.mesh, engine.layout)


def _pool_dtype(cfg: ModelConfig):
  """The unquantized KV pool's dtype: the compute dtype, except 16-bit floats
  on a CPU target, kept in float32: around a bfloat16 scatter (each step's
  KV write) XLA:CPU converts the whole pool to float32 and back, every layer
  of every step (bench_dense, 8 prompts' prefill and 3 decode steps in
  bfloat16, float32 dot results: 9.5 s with a bf16 pool, 0.8 s with a float32
  one). Only for XLA attention: the Pallas and Mosaic kernels (interpreted on
  CPU) read pages in q's dtype."""
  dtype = jnp.dtype(cfg.compute_dtype())
  xla_on_cpu = not cfg.backend.on_gpu() and cfg.backend.attention_kernel()[0] == "xla"
  if dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating) and xla_on_cpu:
    return jnp.dtype(jnp.float32)
  return dtype


def _pool_pages(cfg: ModelConfig, c: EngineConfig, max_pages_per_seq: int, dtype) -> int:
  """Pages per rank for EngineConfig.num_pages=None: from kv_cache_bytes, else
  the memory fraction of the device's free memory (the host's, on CPU)."""
  # Never more than max_num_seqs full-length sequences can use (+ the null page).
  cap = c.max_num_seqs * max_pages_per_seq + 1
  device = jax.local_devices()[0]
  budget = c.kv_cache_bytes
  if budget is None and device.platform == "cpu":
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    budget = int(avail * c.kv_cache_memory_fraction)
  n = kv_cache.num_pages_for(cfg, c.page_size, dtype, kv_cache_bytes=budget,
                             memory_fraction=c.kv_cache_memory_fraction, device=device,
                             mtp=c.speculative is not None)
  return min(n, cap)


def _zero_load(cfg: ModelConfig, spec, mesh):
  """The zeroed expert load [Lm, E]: the trunk's MoE layers, then the MTP
  modules' when they run (spec: speculation), replicated on the mesh."""
  moe_layers = sum(n for is_moe, _, n in cfg.segments() if is_moe)
  if spec is not None and mtp.is_moe(cfg):
    moe_layers += cfg.num_mtp_layers
  load = jnp.zeros((moe_layers, cfg.num_experts), jnp.int32)
  if mesh is not None:
    load = jax.device_put(load, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  return load


def _zero_draft(engine: "Engine"):
  """An Engine's zeroed MTP draft state (each rank's slots), or None
  without speculation."""
  spec = engine.config.speculative
  if spec is None:
    return None
  return speculative.zero_state(engine.cfg, engine.num_ranks * engine.config.max_num_seqs,
                                spec.num_draft_tokens, engine._model.ranks)


def _pool_scales(cfg: ModelConfig, c: EngineConfig, params, found_scales):
  """-> (the pool's scales as numpy, where they came from) for a quantized
  kv_cache_dtype (`kv_calibration.resolve`), else (None, None)."""
  if c.kv_cache_dtype is None:
    return None, None
  scales, source = kv_calibration.resolve(cfg, params, found_scales, c.kv_cache_dtype,
                                          mtp_too=c.speculative is not None)
  return jax.tree.map(np.asarray, scales), source


def _checked_all(check, prompts, sampling, images) -> list:
  """`generate`'s requests, each checked (check: `Engine._check`) before any
  is queued; an error names the prompt's index."""
  if isinstance(sampling, SamplingParams) or sampling is None:
    sampling = [sampling] * len(prompts)
  if len(sampling) != len(prompts):
    raise ValueError(f"sampling: got {len(sampling)} SamplingParams for {len(prompts)} prompts")
  checked = []
  for i, (p, s, im) in enumerate(zip(prompts, sampling, per_prompt(images, len(prompts)))):
    try:
      checked.append(check(p, s, im))
    except (ValueError, TypeError) as e:
      raise type(e)(f"prompts[{i}]: {e}") from None
  return checked


class Engine:
  """Serves requests on one model: a paged KV cache, a scheduler and jitted steps.

  Batch form: `generate(prompts, sampling)`. Streaming form: `submit` each
  request, then call `step` while `has_unfinished()`. With mesh and layout
  (given together) the params and the page pool are placed on the mesh in
  that `jaxinfer.sharding` layout; under "dp_attn_ep" each attention-DP rank
  owns whole requests and its own slice of the pages.

  kv_cache_dtype "fp8" / "int8": `kv.scales` (per segment {name: [L]}) are
  the pool's scales; `kv_scales_source` says where they came from ("params",
  "calibrated" or both). Pages handed between engines (`read_pages` /
  `write_pages`) are stored values: both need one kv_cache_dtype and the
  same (deterministic) scales.
  """

  # The host API, its host core's (`core`: requests, schedulers, allocators).
  check_request, abort, output = forward("check_request"), forward("abort"), forward("output")
  logprobs_tail, submit_prefilled = forward("logprobs_tail"), forward("submit_prefilled")
  take_pages, take_drafts = forward("take_pages"), forward("take_drafts")
  reserve_pages, release_pages = forward("reserve_pages"), forward("release_pages")
  schedulers, allocators = forward_attribute("schedulers"), forward_attribute("allocators")
  allocator, vocab_size = forward_attribute("allocator"), forward_attribute("vocab_size")

  def __init__(self, cfg: ModelConfig, params, config: EngineConfig | None = None, *,
               mesh=None, layout=None):
    if (mesh is None) != (layout is None):
      raise ValueError("Engine: pass mesh and layout together (or neither)")
    self.mesh, self.layout = mesh, None if layout is None else sharding.as_layout(layout)
    params, found_scales = kv_scales.split_params(cfg, params)  # they describe the cache
    if cfg.quant is not None and cfg.quant.kv_cache:  # ... and so leave the spec tree too
      cfg = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, kv_cache=None))
    if mesh is not None:
      params = sharding.shard_params(cfg, params, mesh, layout)
    self.cfg = cfg
    self.config = config = config or EngineConfig()
    # How the steps hold the weights, chosen once (`weight_layout.choose`).
    self._form = weight_layout.choose(cfg, config, params, mesh,
                                      expert_parallel=plan_from_params(params) is not None)
    # Attention data parallelism (dp_attn_ep): each rank of the batch axes owns
    # whole requests and its own slice of the page pool; otherwise one rank.
    self._dp_axes = sharding.dp_axes(mesh, layout) if mesh is not None else ()
    self.num_ranks = math.prod(mesh.shape[a] for a in self._dp_axes) if self._dp_axes else 1
    self._set_params(params)
    self.max_model_len = min(cfg.max_position_embeddings,
                             config.max_model_len or cfg.max_position_embeddings)
    self.max_pages_per_seq = -(-self.max_model_len // config.page_size)
    kind = config.kv_cache_dtype
    self.kv_dtype = jnp.dtype(KV_CACHE_DTYPES[kind][0] if kind else _pool_dtype(cfg))
    self._spec = config.speculative
    if self._spec is not None:
      if not cfg.num_mtp_layers or "mtp" not in params:
        raise ValueError("EngineConfig.speculative needs a model with MTP modules "
                         f"(cfg.num_mtp_layers={cfg.num_mtp_layers}, params "
                         f"{'have' if 'mtp' in params else 'lack'} 'mtp')")
    num_pages = config.num_pages or _pool_pages(cfg, config, self.max_pages_per_seq,
                                                   self.kv_dtype)  # per rank
    # The host side: requests, per-rank schedulers and page allocators.
    self.core = HostCore(config, num_ranks=self.num_ranks, num_pages=num_pages,
                         max_model_len=self.max_model_len, vocab_size=cfg.vocab_size,
                         eos_ids=cfg.eos_token_ids)
    # A quantized pool: the params' scales or calibrated ones.
    self._pool_scales, self.kv_scales_source = _pool_scales(cfg, config, params, found_scales)
    self.pool = self._zero_pool(num_pages * self.num_ranks)
    self._load = (_zero_load(cfg, self._spec, mesh)
                  if cfg.is_moe and config.record_expert_load else None)
    # The EPLB placement the params carry (`rebalance`, or placed params passed in).
    ep = self._model.ep
    self._placements = eplb.placements_of(params, ep.size if ep else 1)
    # Requests with images: processor, encoder (cache) and prompt layout.
    # (Only the vision weights: they outlive a rebalance of the layers'.)
    vision = {k: v for k, v in self._model.params.items() if k == "vision"}
    self.images = Images(cfg, vision, config.image_processor, config.encoder_cache_tokens)
    self._draft = _zero_draft(self)  # the MTP draft state (None without speculation)
    self._runner = self._new_runner()  # builds, dispatches and reads the steps
    # Which kernels the steps run (Engine.stats): read off the shapes as the ops read them.
    self.kernels = steps.kernel_choice(cfg, self.pool, num_seqs=config.max_num_seqs,
                                       pages_per_seq=self.max_pages_per_seq,
                                       max_q=prefill_chunk(config), form=self._form)

  def _new_runner(self):
    return Runner(self.core, self.images, self._spec and speculative.Drafts(self.core))

  def _keep(self, state: StepState) -> None:
    """What a step donated, anew: the engine keeps it."""
    self.pool, self._load, self._draft = state.pool, state.load, state.draft

  def _set_params(self, params) -> None:
    """params (stacked, as `init_params` makes them) -> the `StepModel` the
    steps run: the params in their layout, the only copy the engine keeps
    (`params` rebuilds the stacked tree), and their placement."""
    ep = plan_from_params(params)
    step_params = params
    if self._form is not None:  # unrolled, per-layer weights in the form chosen at load
      step_params = transformer.step_layout(self.cfg, params, self._form)
    # Quantized weights go to the per-tile dequantizing kernels on a GPU target:
    # held whole on one device or per rank under attention DP, else per device
    # as their shardings split them.
    step_params = quant.with_kernel(step_params, sharding.kernel_mesh(self.mesh, self.layout))
    # The ranks the steps run on, with the placed params' specs (`steps.Ranks`).
    ranks = Ranks.of(step_params, self.mesh, self._dp_axes) if self._dp_axes else None
    # Heads split over a mesh axis (tp, tp_attn_ep): attention runs per device in shard_map.
    head_axis = sharding.head_axis(self.mesh, self.layout) if self.mesh is not None else None
    heads = dict(mesh=self.mesh, head_axis=head_axis) if head_axis else {}
    self._model = StepModel(self.cfg, step_params, ep, ranks, heads)

  @property
  def params(self):
    """The weights, stacked as `init_params` makes them (placed as
    `sharding.shard_params` places them); None once released. The engine
    holds one copy, in its step's layout: unrolled, this rebuilds a copy."""
    return None if self._model is None else _stacked_params(self)

  def _zero_pool(self, num_pages: int):
    where = (None if self.mesh is None else jax.sharding.NamedSharding(
        self.mesh, sharding.kv_pool_spec(self.cfg, self.mesh, self.layout)))
    return kv_cache.init_pool(self.cfg, num_pages, self.config.page_size, self.kv_dtype,
                              sharding=where, mtp=self._spec is not None, scales=self._pool_scales)

  @property
  def kv_scales(self) -> list[dict] | None:
    """The quantized pool's scales, per segment (the MTP entry last)
    {name: float32 [L]} as numpy; None for an unquantized pool."""
    if not self.pool.layout.quantized:
      return None
    return [{n: np.asarray(a) for n, a in seg.items()} for seg in self.pool.scales]

  # ------------------------------------------------------------ requests

  def submit(self, prompt: Sequence[int], sampling: SamplingParams | None = None, *,
             hold_pages: bool = False, images=None) -> int:
    """Queues a request; returns its id. Raises on bad input, queueing nothing.
    images: for a vision model, the prompt's images (encoded bytes, file
    paths, PIL images or uint8 [H, W, 3] arrays), one image placeholder
    token in the prompt per image, widened here to the image's tokens.
    hold_pages: when it finishes (not on abort), its KV pages stay allocated
    for `take_pages` (a disaggregated prefill hands them to a decode worker)."""
    tokens, sampling, mm = self._check(prompt, sampling, images)
    return self.core.enqueue(tokens, sampling, mm=mm, hold_pages=hold_pages)

  def _check(self, prompt, sampling, images):
    """-> (token ids, sampling, `MultimodalPrompt` or None); raises on bad input."""
    self._check_not_released()
    tokens, sampling = self.core.check_request(prompt, sampling)
    mm = self.images.check(tokens, images, plain_steps=self._spec is None)
    if mm is None:
      return tokens, sampling, None
    return (*self.core.check_request(mm.tokens, sampling), mm)

  def has_unfinished(self) -> bool:
    """Whether any request is queued, running, or has a step in flight."""
    return self.core.has_unfinished() or bool(self._runner.in_flight)

  # ------------------------------------------------------------ stepping

  def step(self) -> list[tuple[int, list[int], bool]]:
    """Dispatches one device step and returns the (request_id, new_token_ids,
    finished) events that became known: with async scheduling, those of the
    previous step, read back while this one runs. Under attention DP every
    rank steps together, an idle one on an all-padding batch."""
    self._check_not_released()
    self._keep(self._runner.dispatch(self._model, StepState(self.pool, self._load, self._draft)))
    return self._runner.read(self._draft)

  def recover(self) -> list[int]:
    """After `step` raised: ends every queued and running request with
    finish_reason "error" (their pages freed, none published to the prefix
    cache), drops the steps in flight, and rebuilds the device state the
    failed step may have consumed (a donated page pool is rebuilt zeroed and
    the prefix cache emptied; the expert load restarts). Requests submitted
    afterwards run as on a fresh engine. -> the ids of the requests it ended."""
    self._check_not_released()
    ended = self.core.fail_unfinished()
    counts, self._runner = self._runner.counts, self._new_runner()
    self._runner.counts = counts
    if any(a.is_deleted() for a in jax.tree.leaves(self.pool)):
      self.pool = self._zero_pool(self.allocator.num_pages * self.num_ranks)
      for a in self.allocators:
        a.forget_cached()
    if self._load is not None and self._load.is_deleted():
      self._load = _zero_load(self.cfg, self._spec, self.mesh)
    self._draft = _zero_draft(self)  # the slots start empty
    return ended

  def warmup(self, *, sampled: bool = True, top_k: bool = False, map_fraction=0.6,
             programs: list | None = None) -> dict:
    """Compiles, while idle, each of `warmup.programs` (or `programs`, part of
    it) on all-padding batches (`engine.warmup`; counters kept), up to
    map_fraction of vm.max_map_count memory maps (`map_guard`).
    -> {"programs": compiled now, "left_out": not compiled, "seconds"}."""
    todo = warmup.programs(self, sampled=sampled, top_k=top_k) if programs is None else programs
    start = time.perf_counter()
    compiled, left, state = self._runner.warm(
        self._model, StepState(self.pool, self._load, self._draft), todo, map_fraction)
    self._keep(state)
    return dict(programs=compiled, left_out=left, seconds=time.perf_counter() - start)

  def release(self) -> None:
    """Frees this engine's device memory for good: the KV pool, its weights,
    the draft state and cached image features (a stopped serving worker's
    engine). Requests, schedulers and `stats` stay readable; submitting or
    stepping afterwards is a RuntimeError."""
    self._runner.release()
    self.images.release()
    self.pool = self._load = self._draft = self._model = None

  @property
  def released(self) -> bool:
    """Whether `release` freed this engine (it holds no KV pool)."""
    return self.pool is None

  def _check_not_released(self) -> None:
    if self.released:
      raise RuntimeError("Engine: released (its device memory was freed); make a new Engine")

  def generate(self, prompts: Sequence[Sequence[int]],
               sampling: SamplingParams | Sequence[SamplingParams] | None = None,
               *, progress=None, images=None) -> list[RequestOutput]:
    """Runs prompts to completion; outputs in prompt order. All prompts are
    validated before any is queued. progress: optional callable(num_done).
    images: per prompt, its images or None (see `submit`)."""
    checked = _checked_all(self._check, prompts, sampling, images)
    ids = [self.core.enqueue(tokens, s, mm=mm) for tokens, s, mm in checked]
    pending, done = set(ids), 0
    while pending:
      for rid, _, finished in self.step():
        if finished and rid in pending:
          pending.discard(rid)
          done += 1
          if progress:
            progress(done)
    return [self.output(rid) for rid in ids]

  # ------------------------------------------------------------ KV hand-over

  def _global_pages(self, rank: int, pages) -> jax.Array:
    return jnp.asarray(np.asarray(pages, np.int32) + rank * self.allocator.num_pages)

  def read_pages(self, rank: int, pages):
    """The K/V of `pages` of a rank's slice, as device arrays (async)."""
    self._check_not_released()
    return kv_cache.gather_pages(self.pool, self._global_pages(rank, pages))

  def place_pages(self, blob):
    """Starts copying `read_pages` output (from another engine's devices and
    layout) onto this engine's devices; returns at once (check `is_ready`)."""
    target = (jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
              if self.mesh is not None else jax.local_devices()[0])
    return jax.device_put(blob, target)

  def write_pages(self, rank: int, pages, blob) -> None:
    """Writes placed K/V into a reservation (ordered before later steps)."""
    self._check_not_released()
    self.pool = kv_cache.scatter_pages(self.pool, self._global_pages(rank, pages), blob)

  # ------------------------------------------------------------ EPLB

  def expert_load(self) -> np.ndarray:
    """Routed (token, expert) copies per logical expert in each MoE layer,
    int [Lm, E] (with speculation [Lm + M, E]: the MTP modules' MoE blocks
    last), over the steps served since the start or the last `rebalance`
    (padding rows excluded)."""
    if self._load is None:
      raise ValueError("expert_load: nothing recorded (the model has no MoE layers, or "
                       "EngineConfig(record_expert_load=False))")
    return np.asarray(self._load)

  def rebalance(self, num_redundant: int = 0) -> dict:
    """EPLB from the load recorded while serving: plans a placement over the
    expert-parallel ranks (`eplb.plan_placement`), applies it to the params
    (outputs unchanged) and restarts the recording. Returns the per-rank
    imbalance of the recorded load before and after."""
    reshard = None
    if self.mesh is not None:
      reshard = lambda p: sharding.shard_params(self.cfg, p, self.mesh, self.layout)
    params, self._placements, report = eplb.rebalance(
        self.cfg, self.params, self.expert_load(), self._placements,
        num_ranks=self._model.ep.size if self._model.ep is not None else 1,
        num_redundant=num_redundant,
        reshard=reshard)
    self._set_params(params)
    self._load = _zero_load(self.cfg, self._spec, self.mesh)
    return report

  def stats(self) -> dict:
    """Engine-wide counters: steps, tokens_per_step, compiles (distinct step
    programs), kv_pages_{total,used,cached,free}, preemptions, prompt and
    cached prompt tokens, running, waiting, overlapped_steps (dispatched
    before the previous step was read), host_ms_per_step (host time to build
    and dispatch a compiled program, per model step it runs: the step time's
    floor when the device keeps up), dp_ranks, requests_per_rank; with
    speculation also spec_num_draft_tokens, spec_verify_steps,
    spec_mean_accepted_length (tokens per sequence per verify step),
    spec_acceptance_per_position and spec_drafted_per_position; kernels:
    decode-only and mixed steps' attention and the MoE matmul (`steps.kernel_choice`:
    "mosaic_gqa[_wide / _cluster]" / "mosaic_mla[_cluster]" / "pallas" / "xla", "mosaic" /
    "xla"; on a CPU target "cpu_experts" and "cpu_kernels": "native" or "xla: <reason>")."""
    return dict(**self.core.stats(self._runner.counts), kv_cache_dtype=self.kv_dtype.name,
                kernels=steps.kernels_now(self.kernels),
                **self.images.stats(), **self._runner.stats())
