"""Step-time models for the cluster simulator (`sim/simulator.py`).

One interface: `step_time(shapes) -> StepCost`, where `shapes` holds one
`StepShape` per simulated attention-DP rank of an instance (what its
scheduler put into the step), plus `kv_transfer_s(tokens)` for a
disaggregated prefill's K/V and `kv_pages(page_size)` for the pool size.

  RooflineCost    from a model's shapes (the spec tree) and a `DeviceSpec`:
                  per layer max(bytes / bandwidth, FLOPs / FLOP rate) for the
                  attention, the dense weights and the experts, a latency
                  floor, TP all-reduces and EP all-to-alls, the head, MTP.
  CalibratedCost  a non-negative least-squares fit of measured step times
                  on features of the step (tokens, sequences, K/V read, the
                  engine's padded program shape).

Every number below that is not derived from a shape is an assumption and
says where it comes from.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.engine.steps import step_shapes
from jaxinfer.models import quant as quant_lib
from jaxinfer.models import specs as specs_lib

_GB = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
  """One accelerator and its links. Rates are datasheet peaks (dense, no
  sparsity); the *_eff factors scale them to what kernels achieve."""
  name: str
  hbm_bytes: float
  hbm_bw: float  # bytes/s
  bf16_flops: float
  fp8_flops: float
  fp4_flops: float  # 0: no FP4 tensor cores (FP4 weights then run at the FP8 rate)
  nvlink_bw: float  # bytes/s per GPU, one direction
  nvlink_domain: int  # GPUs one NVLink fabric joins
  net_bw: float  # bytes/s per GPU, one direction, between NVLink domains
  bw_eff: float
  flop_eff: float
  attn_flop_eff: float  # attention kernels' fraction of the bf16 peak

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name != "name" and not v >= 0:
        raise ValueError(f"DeviceSpec {self.name}: {f.name} must be >= 0, got {v}")
    for name in ("bw_eff", "flop_eff", "attn_flop_eff"):
      if not 0 < getattr(self, name) <= 1:
        raise ValueError(f"DeviceSpec {self.name}: {name} must be in (0, 1]")


# Efficiencies measured on this project's H100/H200 (perf_facts.md): device
# copy ~3.0 of 3.35 TB/s (H100), ~4.3 of 4.8 (H200); bf16 matmul ~798 / ~790
# of 989 TFLOP/s. Blackwell was not measured here: ASSUMED to reach the same
# fractions as H100. Attention: FlashAttention-3 reaches ~616 of 989 TFLOP/s
# causal on H100 (0.62); decode attention is bandwidth-bound (FlashMLA ~90%
# of bandwidth, covered by bw_eff).
_H100_BW_EFF, _H100_FLOP_EFF, _ATTN_EFF = 3.0 / 3.35, 798 / 989, 0.62

DEVICES = {
    # H100 SXM 80GB datasheet: 3.35 TB/s, 989 / 1979 TFLOP/s dense bf16 / fp8;
    # NVLink 4 900 GB/s bidirectional per GPU; HGX: 8 GPUs per NVLink domain;
    # one 400 Gb/s ConnectX-7 NIC per GPU between nodes.
    "h100": DeviceSpec(name="h100", hbm_bytes=80 * _GB, hbm_bw=3.35e12, bf16_flops=989e12,
                       fp8_flops=1979e12, fp4_flops=0.0, nvlink_bw=450e9, nvlink_domain=8,
                       net_bw=50e9, bw_eff=_H100_BW_EFF, flop_eff=_H100_FLOP_EFF,
                       attn_flop_eff=_ATTN_EFF),
    # H200 141GB: 4.8 TB/s, same tensor cores and links as H100.
    "h200": DeviceSpec(name="h200", hbm_bytes=141 * _GB, hbm_bw=4.8e12, bf16_flops=989e12,
                       fp8_flops=1979e12, fp4_flops=0.0, nvlink_bw=450e9, nvlink_domain=8,
                       net_bw=50e9, bw_eff=4.3 / 4.8, flop_eff=790 / 989,
                       attn_flop_eff=_ATTN_EFF),
    # HGX B200 datasheet: 180 GB HBM3e at 8 TB/s; 2.25 / 4.5 / 9 PFLOP/s dense
    # bf16 / fp8 / fp4 (half the sparse figures); NVLink 5 1.8 TB/s
    # bidirectional; 8 GPUs per domain; ConnectX-7 400 Gb/s per GPU.
    "b200": DeviceSpec(name="b200", hbm_bytes=180 * _GB, hbm_bw=8e12, bf16_flops=2.25e15,
                       fp8_flops=4.5e15, fp4_flops=9e15, nvlink_bw=900e9, nvlink_domain=8,
                       net_bw=50e9, bw_eff=_H100_BW_EFF, flop_eff=_H100_FLOP_EFF,
                       attn_flop_eff=_ATTN_EFF),
    # GB300 NVL72 (Blackwell Ultra) datasheet: 288 GB HBM3e at 8 TB/s; 2.5 / 5 /
    # 15 PFLOP/s dense bf16 / fp8 / fp4; NVLink 5 1.8 TB/s bidirectional across
    # all 72 GPUs of the rack; ConnectX-8 800 Gb/s per GPU between racks.
    "gb300": DeviceSpec(name="gb300", hbm_bytes=288 * _GB, hbm_bw=8e12, bf16_flops=2.5e15,
                        fp8_flops=5e15, fp4_flops=15e15, nvlink_bw=900e9, nvlink_domain=72,
                        net_bw=100e9, bw_eff=_H100_BW_EFF, flop_eff=_H100_FLOP_EFF,
                        attn_flop_eff=_ATTN_EFF),
}

# Bytes per weight. fp8: DeepSeek's block scales (one per 128x128) are
# negligible; fp4: NVFP4, 4-bit values plus one fp8 scale per 16.
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "fp4": 0.5625}
KV_BYTES = {"bf16": 2, "fp8": 1}


def device(name: str) -> DeviceSpec:
  if name not in DEVICES:
    raise ValueError(f"unknown device {name!r}; known: {sorted(DEVICES)}")
  return DEVICES[name]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parallelism:
  """One instance (model replica): dp attention ranks of tp GPUs each; the
  experts split over ep of its tp * dp GPUs (replicated across the rest)."""
  tp: int = 1
  dp: int = 1
  ep: int = 1

  def __post_init__(self):
    for name in ("tp", "dp", "ep"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise ValueError(f"Parallelism: {name} must be an int >= 1, got {getattr(self, name)!r}")
    if self.gpus % self.ep:
      raise ValueError(f"Parallelism: ep={self.ep} must divide the instance's tp * dp = "
                       f"{self.gpus} GPUs")

  @property
  def gpus(self) -> int:
    return self.tp * self.dp


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepShape:
  """What one rank's scheduler put into one step (`step_shape`)."""
  prefill_tokens: int = 0  # tokens of prompt (or recompute) chunks
  prefill_seqs: int = 0
  sampling_prefills: int = 0  # prefill chunks that reach the end of their tokens (sample)
  decode_seqs: int = 0  # sequences decoding one token (plus drafts)
  draft_tokens: int = 0  # MTP drafts verified by those sequences
  kv_read_tokens: int = 0  # sum over sequences of the context attended (K/V read once)
  pairs_prefill: int = 0  # sum of query x key pairs of prefill chunks (causal)
  pairs_decode: int = 0
  mtp_k: int = 0  # drafts the MTP chain makes in this step (0: no speculation)
  # The engine's padded program shape (CPU calibration features).
  padded_tokens: int = 0
  padded_seqs: int = 0
  padded_pages: int = 0
  page_size: int = 1

  @property
  def tokens(self) -> int:
    return self.prefill_tokens + self.decode_seqs + self.draft_tokens

  @property
  def seqs(self) -> int:
    return self.prefill_seqs + self.decode_seqs


def step_shape(scheduled, *, core, spec_k: int = 0) -> StepShape:
  """The StepShape of one rank's `Scheduler.schedule()` output, with the
  padded program shape `steps.step_shapes` of an `engine.core.HostCore`
  gives it."""
  f = dict(prefill_tokens=0, prefill_seqs=0, sampling_prefills=0, decode_seqs=0,
           draft_tokens=0, kv_read_tokens=0, pairs_prefill=0, pairs_decode=0)
  for s in scheduled:
    n, end = s.num_tokens, s.start + s.num_tokens
    f["kv_read_tokens"] += end
    if s.samples and n - s.num_draft == 1 and s.start >= len(s.request.prompt):
      f["decode_seqs"] += 1
      f["draft_tokens"] += s.num_draft
      f["pairs_decode"] += n * end - n * (n - 1) // 2  # causal among the K + 1 rows
    else:
      f["prefill_seqs"] += 1
      f["prefill_tokens"] += n
      f["sampling_prefills"] += s.samples
      f["pairs_prefill"] += n * s.start + n * (n + 1) // 2
  if not scheduled:
    return StepShape(**f)
  # max_q does not enter a StepShape; any cap will do.
  program = step_shapes(core, [scheduled], core.config.max_num_batched_tokens)
  return StepShape(**f, mtp_k=spec_k, padded_tokens=program.tokens, padded_seqs=program.seqs,
                   padded_pages=program.pages, page_size=core.config.page_size)


@dataclasses.dataclass(frozen=True)
class StepCost:
  seconds: float
  parts: dict  # component -> seconds, summing to `seconds` (the "why")
  # Per simulated rank, the time of its own work (attention and the dense
  # layers on its tokens): the attention-DP balance is mean / max of these.
  rank_seconds: tuple = ()


# ----------------------------------------------------------------- roofline

@dataclasses.dataclass(frozen=True)
class _Counts:
  """Parameter counts by role, from the spec tree (one source of shapes)."""
  attn: float  # one layer's attention
  dense_mlp: float  # one dense layer's MLP
  shared: float  # one MoE layer's shared experts + router
  expert: float  # one routed expert of one MoE layer
  head: float
  mtp_dense: float  # one MTP module without its routed experts
  mtp_expert: float  # one routed expert of one MTP module
  dense_layers: int
  moe_layers: int


def param_counts(cfg: ModelConfig) -> _Counts:
  seg_moe = [moe for moe, _, _ in cfg.segments()]
  totals = dict(attn=0, dense_mlp=0, shared=0, expert=0, embed=0, head=0, mtp_dense=0,
                mtp_expert=0)
  # Logical weights: a quantized config counts its projections unquantized.
  flat, _ = jax.tree_util.tree_flatten_with_path(
      specs_lib.param_specs(dataclasses.replace(cfg, quant=None)), is_leaf=specs_lib.is_spec)
  for kp, s in flat:
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in kp]
    n = math.prod(s.shape)
    routed = "expert" in s.logical_axes
    if keys[0] in ("embed", "lm_head"):
      totals["head" if keys[0] == "lm_head" else "embed"] += n
    elif keys[0] == "mtp":
      totals["mtp_expert" if routed else "mtp_dense"] += n
    elif keys[0] == "layers" and keys[2] == "attn":
      totals["attn"] += n
    elif keys[0] == "layers" and keys[2] == "mlp":
      totals["expert" if routed else "shared" if seg_moe[keys[1]] else "dense_mlp"] += n
  moe_layers = sum(c for m, _, c in cfg.segments() if m)
  dense_layers = cfg.num_layers - moe_layers
  E, M = max(cfg.num_experts, 1), max(cfg.num_mtp_layers, 1)
  return _Counts(
      attn=totals["attn"] / cfg.num_layers,
      dense_mlp=totals["dense_mlp"] / max(dense_layers, 1),
      shared=totals["shared"] / max(moe_layers, 1),
      expert=totals["expert"] / max(moe_layers, 1) / E,
      head=totals["head"] or totals["embed"],  # tied: the embedding is the head
      mtp_dense=totals["mtp_dense"] / M, mtp_expert=totals["mtp_expert"] / M / E,
      dense_layers=dense_layers, moe_layers=moe_layers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RooflineCost:
  """Step time of one instance from shapes: see the module docstring.

  Per layer: max(layer_floor_s, slowest rank's attention + dense part +
  experts) + the collectives not hidden under compute. Each part is
  max(bytes / (hbm_bw * bw_eff), FLOPs / (peak * flop_eff)).
  """
  cfg: ModelConfig
  device: DeviceSpec
  par: Parallelism = Parallelism()
  weight_dtype: str = "fp8"
  kv_dtype: str = "bf16"
  act_bytes: int = 2  # activations (bf16) for TP all-reduces and the EP combine
  dispatch_bytes: int = 1  # EP dispatch sends fp8 activations (DeepEP)
  # ASSUMED: the least time one layer's kernels take at any batch (launch
  # gaps, latency-bound small kernels). 100 us puts batch-1 decode of
  # DeepSeek-R1 on 8 B200 (TP8, FP4) at 8.8 ms/step (114 tokens/s/user),
  # near TensorRT-LLM's published 111; see experiments/benchlib/sim_scale.py's anchors.
  layer_floor_s: float = 100e-6
  # False: layer_floor_s is the least time a layer takes (hidden under
  # larger work); True: a fixed latency every layer adds to its roofline
  # work (small kernels and collective latencies on the critical path).
  floor_adds: bool = False
  # ASSUMED: per step, sampling and the host's share not overlapped.
  step_overhead_s: float = 300e-6
  # ASSUMED: latency of one collective (NCCL/DeepEP low-latency kernels).
  nvlink_latency_s: float = 10e-6
  net_latency_s: float = 30e-6
  # Fraction of communication hidden under compute (two-batch overlap);
  # 0 is conservative.
  comm_overlap: float = 0.0
  # MoE load imbalance (max - mean) / mean over EP ranks, charged to the
  # busiest GPU's expert FLOPs and to the tokens it receives: DeepSeek's
  # EPLB brought EP32 from 1.56 to ~0.11 with redundant experts
  # (serving_facts.md).
  moe_imbalance: float = 0.11
  # Given fewer rank shapes than par.dp (ranks neither simulated nor
  # bootstrapped, as in analytic tables): the missing ranks' attention is
  # assumed this much slower than the slowest given one (max / mean).
  attn_imbalance: float = 1.0
  memory_reserve: float = 0.1  # of HBM kept for activations and workspace (ASSUMED)
  # Sensitivity: every bandwidth, FLOP and wire time times this (the floor
  # and the per-step overhead unchanged): a system reaching 1 / slowdown of
  # this roofline beyond the kernel efficiencies above.
  slowdown: float = 1.0
  # Per-part factors on top of `slowdown` (the parts of `StepCost.parts`:
  # "attention", "dense" (the head too), "experts", "comm"), as (part, factor)
  # pairs, each >= 1: kernels of one family reaching 1 / factor of this
  # roofline (sim/mlperf.py charges each family its measured fraction).
  part_slowdown: tuple = ()
  kv_link: str = "nvlink"  # "nvlink" | "network": where disaggregated K/V travels
  # HBM bytes the attention kernel reads per minimum K/V byte (planned /
  # minimum of experiments/results/kernel_report_h100.json, via
  # benchlib.kernel_report.kv_read_factor); 1: every K/V byte once.
  attn_kv_factor: float = 1.0

  def __post_init__(self):
    if self.weight_dtype not in WEIGHT_BYTES:
      raise ValueError(f"RooflineCost: weight_dtype must be one of {sorted(WEIGHT_BYTES)}, "
                       f"got {self.weight_dtype!r}")
    if self.kv_dtype not in KV_BYTES:
      raise ValueError(f"RooflineCost: kv_dtype must be one of {sorted(KV_BYTES)}, "
                       f"got {self.kv_dtype!r}")
    if self.kv_link not in ("nvlink", "network"):
      raise ValueError(f"RooflineCost: kv_link must be 'nvlink' or 'network', got {self.kv_link!r}")
    if not 0 <= self.comm_overlap <= 1:
      raise ValueError(f"RooflineCost: comm_overlap must be in [0, 1], got {self.comm_overlap}")
    if not self.slowdown >= 1:
      raise ValueError(f"RooflineCost: slowdown must be >= 1, got {self.slowdown}")
    for part, f in self.part_slowdown:
      if part not in ("attention", "dense", "experts", "comm") or not f >= 1:
        raise ValueError(f"RooflineCost: part_slowdown needs (part, factor >= 1) with part one of "
                         f"attention, dense, experts, comm; got {(part, f)!r}")
    if not self.attn_kv_factor >= 1:
      raise ValueError(f"RooflineCost: attn_kv_factor must be >= 1 (no kernel reads less than "
                       f"the minimum), got {self.attn_kv_factor}")
    if self.moe_imbalance < 0 or self.attn_imbalance < 1:
      raise ValueError("RooflineCost: moe_imbalance must be >= 0 and attn_imbalance >= 1")
    if self.par.ep > 1 and not self.cfg.is_moe:
      raise ValueError(f"RooflineCost: ep={self.par.ep} needs a MoE model")
    object.__setattr__(self, "_c", param_counts(self.cfg))

  # -- static quantities -------------------------------------------------------

  @property
  def max_model_len(self) -> int:
    return self.cfg.max_position_embeddings

  @property
  def _wb(self) -> float:
    return WEIGHT_BYTES[self.weight_dtype]

  def _bytes(self, group: str) -> float:
    """Bytes per weight of a group (attn, dense_mlp, shared, expert, head):
    `weight_dtype`'s, or with cfg.quant the real quantized size of the
    projections it covers (`quant.bytes_per_weight`) and bf16 for the rest."""
    q = self.cfg.quant
    if q is None:
      return self._wb
    prefix = {"attn": "attn.", "dense_mlp": "mlp.", "shared": "shared.", "expert": "experts."}
    if group in prefix and any(t.startswith(prefix[group]) for t in q.targets):
      return quant_lib.bytes_per_weight(q.method, q.block)
    return WEIGHT_BYTES["bf16"]

  @property
  def _flops(self) -> float:
    d = self.device
    rate = {"bf16": d.bf16_flops, "fp8": d.fp8_flops, "fp4": d.fp4_flops or d.fp8_flops}
    return rate[self.weight_dtype] * d.flop_eff

  @property
  def _bw(self) -> float:
    return self.device.hbm_bw * self.device.bw_eff

  def experts_per_gpu(self) -> int:
    """Expert slots per GPU: ceil(E / ep); the padding slots hold redundant
    copies of hot experts (EPLB), so they cost memory, not time."""
    return -(-self.cfg.num_experts // self.par.ep) if self.cfg.is_moe else 0

  def kv_bytes_per_token(self, layers: int | None = None) -> float:
    """K/V bytes of one token on one GPU, over `layers` (default: all,
    plus the MTP modules'). MLA's latent is replicated over TP ranks; GQA's
    KV heads split over them."""
    per_layer = sum(math.prod(e) for e in self.cfg.cache_entry_shapes().values())
    split = 1 if self.cfg.attention.latent else min(self.par.tp, self.cfg.num_kv_heads)
    if layers is None:
      layers = self.cfg.num_layers + self.cfg.num_mtp_layers
    return per_layer * KV_BYTES[self.kv_dtype] * layers / split

  def weight_bytes_per_gpu(self) -> float:
    c, tp = self._c, self.par.tp
    b = self._bytes
    dense = (c.attn * self.cfg.num_layers * b("attn") + c.dense_mlp * c.dense_layers * b("dense_mlp")
             + c.shared * c.moe_layers * b("shared")
             + c.head * (1 if self.cfg.tie_embeddings else 2) * b("head")
             + c.mtp_dense * self.cfg.num_mtp_layers * b("shared")) / tp
    experts = self.experts_per_gpu() * (c.expert * c.moe_layers
                                        + c.mtp_expert * self.cfg.num_mtp_layers) * b("expert")
    return dense + experts

  def kv_pages(self, page_size: int) -> int:
    """Pages of `page_size` tokens one rank's HBM holds after the weights."""
    free = self.device.hbm_bytes * (1 - self.memory_reserve) - self.weight_bytes_per_gpu()
    per_page = self.kv_bytes_per_token() * page_size
    if free < 2 * per_page:
      raise ValueError(
          f"{self.cfg.model_type} does not fit {self.device.name} with {self.par}: weights need "
          f"{self.weight_bytes_per_gpu() / _GB:.1f} GB per GPU of "
          f"{self.device.hbm_bytes * (1 - self.memory_reserve) / _GB:.1f} GB usable")
    return int(free // per_page)

  def kv_transfer_s(self, tokens: int) -> float:
    """A prompt's K/V (all layers) from a prefill GPU to a decode GPU."""
    d = self.device
    bw, lat = ((d.nvlink_bw, self.nvlink_latency_s) if self.kv_link == "nvlink"
               else (d.net_bw, self.net_latency_s))
    per_token = self.kv_bytes_per_token() * (1 if self.cfg.attention.latent
                                             else min(self.par.tp, self.cfg.num_kv_heads))
    return tokens * per_token / bw + lat

  # -- per step -------------------------------------------------------------------

  def _attn_flops_per_pair(self, decode: bool) -> float:
    cfg = self.cfg
    if cfg.attention.latent:
      if decode:  # absorbed: scores and values over the latent (FlashMLA)
        return 2 * cfg.num_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
      return 2 * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    return 4 * cfg.num_heads * cfg.head_dim

  def _a2a_s(self, tokens_per_gpu: float) -> float:
    """EP dispatch (fp8) + combine (bf16) of one MoE layer for one GPU. Each
    token's top-k copies reach their experts' GPUs over NVLink, (ep - 1) / ep
    of them off this GPU. Across NVLink domains a token travels once per
    remote domain holding one of its experts, then fans out inside it
    (DeepEP's forwarding); group-limited routing caps the domains at
    topk_group (DeepSeek's node limit)."""
    ep, d, cfg = self.par.ep, self.device, self.cfg
    if ep == 1:
      return 0.0
    k, row = cfg.num_experts_per_tok, cfg.d_model * (self.dispatch_bytes + self.act_bytes)
    intra = tokens_per_gpu * k * (ep - 1) / ep * row
    domains = -(-ep // d.nvlink_domain)
    if domains == 1:
      return intra / d.nvlink_bw + 2 * self.nvlink_latency_s
    hit = domains * (1 - (1 - 1 / domains) ** k)  # distinct domains among k uniform experts
    if cfg.n_group > 1:
      hit = min(hit, cfg.topk_group)
    inter = tokens_per_gpu * hit * (domains - 1) / domains * row
    return max(intra / d.nvlink_bw, inter / d.net_bw) + 2 * self.net_latency_s

  def _allreduce_s(self, tokens: float) -> float:
    tp = self.par.tp
    if tp == 1:
      return 0.0
    nbytes = tokens * self.cfg.d_model * self.act_bytes * 2 * (tp - 1) / tp
    return 2 * (nbytes / self.device.nvlink_bw + self.nvlink_latency_s)  # attention + MLP outputs

  def _layer(self, kind: str, shapes, rows, draft: bool, parts: dict, ext: float,
             times: int, rank_work: list | None = None) -> float:
    """`times` layers of `kind` ("dense" | "moe" | "mtp") over per-rank `rows`
    tokens; draft: an MTP draft pass (one query per sequence). Adds each
    component's seconds to `parts` and returns the total."""
    c, tp, bw, F = self._c, self.par.tp, self._bw, self._flops
    Fa = self.device.bf16_flops * self.device.attn_flop_eff
    kv_tok = self.kv_bytes_per_token(layers=1) * self.attn_kv_factor  # bytes the kernel reads
    nonexp = c.attn + (c.dense_mlp if kind == "dense" else c.mtp_dense if kind == "mtp"
                       else c.shared)
    mlp_group = "dense_mlp" if kind == "dense" else "shared"
    nonexp_bytes = c.attn * self._bytes("attn") + (nonexp - c.attn) * self._bytes(mlp_group)
    worst_attn = worst_dense = 0.0
    for i, (s, r) in enumerate(zip(shapes, rows)):
      if not draft:
        flops = (s.pairs_decode * self._attn_flops_per_pair(True)
                 + s.pairs_prefill * self._attn_flops_per_pair(False)) / tp
        attn = max(s.kv_read_tokens * kv_tok / bw, flops / Fa)
      else:  # one query per sequence over its context
        attn = max(s.kv_read_tokens * kv_tok / bw,
                   s.kv_read_tokens * self._attn_flops_per_pair(True) / tp / Fa)
      dense = max(nonexp_bytes / tp / bw, 2 * r * nonexp / tp / F)
      if rank_work is not None:
        rank_work[i] += (attn + dense) * times
      if attn + dense > worst_attn + worst_dense:
        worst_attn, worst_dense = attn, dense
    worst_attn *= ext
    experts = comm = 0.0
    mean_rows = sum(rows) / len(rows)
    if kind != "dense" and self.cfg.is_moe:
      E, k = self.cfg.num_experts, self.cfg.num_experts_per_tok
      per_gpu = mean_rows / tp  # TP ranks split their rank's tokens for the MoE
      group = per_gpu * self.par.ep  # tokens entering one EP group
      # Distinct local experts hit, routing uniform: E(1 - (1 - k/E)^tokens)
      # over the group, an ep-th of them here (redundant slots add no reads).
      touched = E / self.par.ep * (1 - (1 - k / E) ** group)
      size = c.mtp_expert if kind == "mtp" else c.expert
      experts = max(touched * size * self._bytes("expert") / bw,
                    2 * per_gpu * k * size * (1 + self.moe_imbalance) / F)
      # The all-to-all waits for its busiest GPU: the one sending the most
      # rows, or the one whose experts receive moe_imbalance over the mean.
      comm += self._a2a_s(max(max(rows), mean_rows * (1 + self.moe_imbalance)) / tp)
    comm += self._allreduce_s(max(rows))
    comm *= (1 - self.comm_overlap) * self._slow("comm")
    worst_attn, worst_dense, experts = (worst_attn * self._slow("attention"),
                                        worst_dense * self._slow("dense"),
                                        experts * self._slow("experts"))
    work = worst_attn + worst_dense + experts
    floor = self.layer_floor_s if self.floor_adds else max(0.0, self.layer_floor_s - work)
    for name, v in (("attention", worst_attn), ("dense", worst_dense), ("experts", experts),
                    ("comm", comm), ("latency_floor", floor)):
      key = "mtp" if kind == "mtp" else name
      parts[key] = parts.get(key, 0.0) + v * times
    return (work + floor + comm) * times

  def _slow(self, part: str) -> float:
    return self.slowdown * dict(self.part_slowdown).get(part, 1.0)

  def _head(self, rows: float) -> float:
    c, tp = self._c, self.par.tp
    return self._slow("dense") * max(c.head * self._bytes("head") / tp / self._bw,
                                     2 * rows * c.head / tp / self._flops)

  def step_time(self, shapes: Sequence[StepShape]) -> StepCost:
    if not shapes:
      raise ValueError("step_time: give one StepShape per simulated rank")
    if len(shapes) > self.par.dp:
      raise ValueError(f"step_time: {len(shapes)} rank shapes for dp={self.par.dp}")
    ext = self.attn_imbalance if len(shapes) < self.par.dp else 1.0
    c, parts, work = self._c, {}, [0.0] * len(shapes)
    rows = [s.tokens for s in shapes]
    total = self._layer("dense", shapes, rows, False, parts, ext, c.dense_layers, work)
    total += self._layer("moe", shapes, rows, False, parts, ext, c.moe_layers, work)
    logit_rows = max(s.decode_seqs + s.draft_tokens + s.sampling_prefills for s in shapes)
    parts["head"] = self._head(logit_rows)
    total += parts["head"]
    K = max(s.mtp_k for s in shapes)
    if K and self.cfg.num_mtp_layers:
      # The engine's MTP step: module 1 over every row (its K/V stays in
      # step), then K chained draft passes over the sampling sequences,
      # each with the shared head.
      total += self._layer("mtp", shapes, rows, False, parts, ext, 1)
      drafting = [s.decode_seqs + s.sampling_prefills for s in shapes]
      total += self._layer("mtp", shapes, drafting, True, parts, ext, K)
      head = (K + 1) * self._head(max(drafting))
      parts["mtp"] += head
      total += head
    parts["overhead"] = self.step_overhead_s
    return StepCost(total + self.step_overhead_s, parts, tuple(work))


# ----------------------------------------------------------------- calibrated

FEATURES = {
    "const": lambda s: 1.0,
    "tokens": lambda s: s.tokens,
    "seqs": lambda s: s.seqs,
    "decode_seqs": lambda s: s.decode_seqs,
    "prefill_tokens": lambda s: s.prefill_tokens,
    "kv_read_tokens": lambda s: s.kv_read_tokens,
    "attn_pairs": lambda s: s.pairs_prefill + s.pairs_decode,
    "padded_tokens": lambda s: s.padded_tokens,
    "padded_seqs": lambda s: s.padded_seqs,
    # K/V positions the padded program attends over: seqs x pages x page size.
    "padded_kv": lambda s: s.padded_seqs * s.padded_pages * s.page_size,
}


def nnls(A, b) -> np.ndarray:
  """min |Ax - b| subject to x >= 0 (Lawson-Hanson active set)."""
  A, b = np.asarray(A, np.float64), np.asarray(b, np.float64)
  scale = np.linalg.norm(A, axis=0)
  scale[scale == 0] = 1.0
  A = A / scale  # equal column norms: the tolerances mean the same for every feature
  n = A.shape[1]
  x, passive = np.zeros(n), np.zeros(n, bool)
  tol = 1e-12 * max(1.0, np.abs(A).max()) * n
  for _ in range(3 * n + 10):
    w = A.T @ (b - A @ x)
    if passive.all() or w[~passive].max() <= tol:
      break
    passive[np.argmax(np.where(passive, -np.inf, w))] = True
    while True:
      z = np.zeros(n)
      z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
      if (z[passive] > tol).all():
        break
      neg = passive & (z <= tol)
      alpha = np.min(x[neg] / np.maximum(x[neg] - z[neg], 1e-300))
      x = x + alpha * (z - x)
      passive &= x > tol
    x = z
  return x / scale


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalibratedCost:
  """t = sum_i coef_i * feature_i(step), coefficients >= 0, fitted to
  measured steps. Several ranks: the slowest one's prediction."""
  features: tuple[str, ...]
  coef: tuple[float, ...]
  max_model_len: int | None = None
  transfer_s_per_token: float = 0.0  # disaggregated K/V copy (ASSUMED 0 on one host)

  def __post_init__(self):
    unknown = [f for f in self.features if f not in FEATURES]
    if unknown:
      raise ValueError(f"CalibratedCost: unknown features {unknown}; known: {sorted(FEATURES)}")
    if len(self.coef) != len(self.features) or any(not c >= 0 for c in self.coef):
      raise ValueError("CalibratedCost: need one coefficient >= 0 per feature")

  @classmethod
  def fit(cls, samples, features=("const", "tokens", "seqs", "padded_kv"), **kw):
    """samples: (StepShape, seconds) pairs -> the non-negative least-squares fit."""
    samples = list(samples)
    if len(samples) < len(features):
      raise ValueError(f"CalibratedCost.fit: {len(samples)} samples for {len(features)} features")
    if any(not t > 0 for _, t in samples):
      raise ValueError("CalibratedCost.fit: every measured step time must be > 0")
    A = np.array([[FEATURES[f](s) for f in features] for s, _ in samples], np.float64)
    b = np.array([t for _, t in samples], np.float64)
    return cls(features=tuple(features), coef=tuple(float(c) for c in nnls(A, b)), **kw)

  def predict(self, shape: StepShape) -> float:
    return sum(c * FEATURES[f](shape) for f, c in zip(self.features, self.coef))

  def step_time(self, shapes: Sequence[StepShape]) -> StepCost:
    if not shapes:
      raise ValueError("step_time: give one StepShape per simulated rank")
    per_rank = [self.predict(s) for s in shapes]
    worst = shapes[int(np.argmax(per_rank))]
    parts = {f: c * FEATURES[f](worst) for f, c in zip(self.features, self.coef)}
    return StepCost(sum(parts.values()), parts, tuple(per_rank))

  def kv_transfer_s(self, tokens: int) -> float:
    return tokens * self.transfer_s_per_token

  def kv_pages(self, page_size: int) -> int:
    raise ValueError("CalibratedCost: give EngineConfig.num_pages (no memory model)")


def cost_per_million_tokens(*, price_per_gpu_hour: float, gpus: float,
                            tokens_per_s: float) -> float:
  """Dollars per million output tokens at a GPU-hour price."""
  if not price_per_gpu_hour >= 0 or not gpus > 0:
    raise ValueError(f"price_per_gpu_hour must be >= 0 and gpus > 0, got "
                     f"{price_per_gpu_hour}, {gpus}")
  if not tokens_per_s > 0:
    return math.inf
  return price_per_gpu_hour * gpus / 3600 / tokens_per_s * 1e6
