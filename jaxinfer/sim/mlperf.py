"""MLPerf Inference datacenter LLM scenarios over the simulator's step-cost
model (`sim/cost.py`'s `RooflineCost`): DeepSeek-R1 and Llama 3.1 405B,
Offline / Server / Interactive, predicted tokens/s per GPU for a searched
configuration, and the published GB300 NVL72 figures to hold them against.

The search is analytic (steady state): for one configuration (co-located or
disaggregated, TP / attention DP / EP, MTP depth, prefill chunk, decode batch
per rank) it prices a mean decode step and the prefill work each emitted
token brings with `RooflineCost.step_time`, and derives tokens/s per GPU,
TPOT and TTFT; `search` keeps the best configuration whose TPOT and TTFT
hold the scenario's limits. Server and Interactive: a rank holds at most
`batch` sequences and a Poisson-arriving request waits for a free slot
(an M/M/c queue over the pooled slots, `served_load`); the prediction is
the mean batch at the highest load whose p99 TTFT (prefill plus slot wait)
holds, and TPOT is judged with every slot busy. Techniques (`Techniques`) switch what the
search may use, so a "v5.1-like" and a "v6.0-like" system differ only in
them; `ablation` turns them on one at a time.

Every workload and hardware figure below says where it comes from; every
efficiency factor says whether it was measured (and where) or ASSUMED.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

from jaxinfer import presets
from jaxinfer.sim.cost import Parallelism, RooflineCost, StepShape, device
from jaxinfer.sim.engine import TRTLLM_R1_ACCEPTANCE

PAGE = 64


# ------------------------------------------------------------------ workloads

@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
  """One MLPerf benchmark's model and token lengths (means; p99 for TTFT)."""
  benchmark: str
  preset: str
  isl_mean: float
  isl_p99: float
  osl_mean: float
  # E[o^2] / (2 E[o]) over the samples' output lengths o: how far into its
  # output an in-flight decode token is on average (decode time is spent in
  # proportion to o, so long outputs weigh more than osl_mean / 2 says).
  osl_age_mean: float
  template_tokens: int  # tokens every prompt shares (what KV-aware routing can reuse)
  weight_dtype: str
  kv_dtype: str


# Token-length statistics: computed here from openshift-psap/performance-
# dashboard mlperf-data/summaries/{deepseek-r1,llama3-1-405b}.csv (commit
# 71007029fb5b; per-sample tok_input_len / tok_ref_output_len extracted by its
# mlperf-data/original/generate_dataset_summaries.py from MLCommons' datasets
# mlperf_deepseek_r1_dataset_4388_fp8_eval.pkl and
# mlperf_llama3.1_405b_dataset_8313_processed_fp16_eval.pkl). Checks against
# mlcommons/inference: the 405B file's mean output 684.7 equals the README's
# tokens_per_sample 684.68; the R1 file's outputs capped at 20,000 (the
# README's max-OSL 20K) average 3886.2, the README's mean-output-tok-len.
WORKLOADS = {
    # mlcommons/inference language/deepseek-r1: 4388 samples (loadgen/mlperf.conf
    # performance_sample_count_override); mean output 3886.2 tokens (README,
    # reference "mean-output-tok-len": 3886.2274); max template 4 tokens
    # (utils/backend_registry.py MAX_TEMPLATE_TOKS). From the dataset CSV:
    # input mean 803.8, p99 1432, max 3140 (MAX_ISL 3136); outputs capped at
    # 20,000: E[o^2] / (2 E[o]) = 4354 (output std 5065 uncapped: long-tailed).
    # Weights NVFP4 (NVIDIA's Blackwell R1 entries run nvidia/DeepSeek-R1-FP4);
    # K/V FP8: ASSUMED (TensorRT-LLM's FP8 KV cache).
    "deepseek-r1": Workload(benchmark="deepseek-r1", preset="deepseek_v3", isl_mean=803.8,
                            isl_p99=1432.0, osl_mean=3886.2, osl_age_mean=4354.0,
                            template_tokens=4, weight_dtype="fp4", kv_dtype="fp8"),
    # mlcommons/inference language/llama3.1-405b: 8313 samples (mlperf.conf);
    # mean output 684.68 tokens (README, reference "tokens_per_sample"). From
    # the dataset CSV: input mean 9428.6, p99 18956, max 19988; output
    # E[o^2] / (2 E[o]) = 392. Weights NVFP4 (NVIDIA's Blackwell 405B
    # entries); K/V FP8 ASSUMED.
    "llama3.1-405b": Workload(benchmark="llama3.1-405b", preset="llama3_1_405b",
                              isl_mean=9428.6, isl_p99=18956.0, osl_mean=684.68,
                              osl_age_mean=392.0, template_tokens=0, weight_dtype="fp4",
                              kv_dtype="fp8"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scenario:
  """LoadGen scenario: Offline (no latency bound) or Server-type with p99
  TTFT / TPOT limits (Poisson arrivals). The metric for all three is
  generated tokens per second (LoadGen's tokens/s: output tokens of
  completed samples / run time), here divided by the system's GPUs."""
  name: str
  ttft_ms: float | None = None
  tpot_ms: float | None = None


# loadgen/mlperf.conf (mlcommons/inference): deepseek-r1.Server ttft 2000 /
# tpot 80; deepseek-r1-interactive.Server ttft 1500 / tpot 15;
# llama3_1-405b.Server ttft 6000 / tpot 175 (ms, 99th percentile).
SCENARIOS = {
    ("deepseek-r1", "Offline"): Scenario(name="Offline"),
    ("deepseek-r1", "Server"): Scenario(name="Server", ttft_ms=2000.0, tpot_ms=80.0),
    ("deepseek-r1", "Interactive"): Scenario(name="Interactive", ttft_ms=1500.0, tpot_ms=15.0),
    ("llama3.1-405b", "Offline"): Scenario(name="Offline"),
    ("llama3.1-405b", "Server"): Scenario(name="Server", ttft_ms=6000.0, tpot_ms=175.0),
}

# NVIDIA's MLPerf Inference results on GB300 NVL72 (72 GPUs), closed division,
# tokens/s per GPU, as issue 74 quotes them: v6.0 and v5.1 rounds.
# Interactive (new in v6.0): 250,634 tokens/s for the system / 72 GPUs
# (ASSUMED: the system is one NVL72 rack).
PUBLISHED = [
    dict(benchmark="deepseek-r1", scenario="Server", round="v6.0", per_gpu=8064.0),
    dict(benchmark="deepseek-r1", scenario="Offline", round="v6.0", per_gpu=9821.0),
    dict(benchmark="deepseek-r1", scenario="Interactive", round="v6.0", per_gpu=250634.0 / 72),
    dict(benchmark="deepseek-r1", scenario="Server", round="v5.1", per_gpu=2907.0),
    dict(benchmark="deepseek-r1", scenario="Offline", round="v5.1", per_gpu=5842.0),
    dict(benchmark="llama3.1-405b", scenario="Server", round="v6.0", per_gpu=259.0),
    dict(benchmark="llama3.1-405b", scenario="Offline", round="v6.0", per_gpu=271.0),
    dict(benchmark="llama3.1-405b", scenario="Server", round="v5.1", per_gpu=170.0),
    dict(benchmark="llama3.1-405b", scenario="Offline", round="v5.1", per_gpu=224.0),
]
SYSTEM_GPUS = 72  # GB300 NVL72: one NVLink domain (cost.DEVICES["gb300"].nvlink_domain)

# Hardware: `cost.DEVICES` holds GB300, B200, H200, H100 with their datasheet
# figures and sources in comments (HBM bandwidth, bf16 / fp8 / fp4 peaks,
# NVLink and network bandwidth). Pages they come from:
HARDWARE_SOURCES = {
    "gb300": "nvidia.com/en-us/data-center/gb300-nvl72 (specifications table)",
    "b200": "nvidia.com/en-us/data-center/hgx (HGX B200 specifications)",
    "h200": "nvidia.com/en-us/data-center/h200 (H200 SXM datasheet)",
    "h100": "nvidia.com/en-us/data-center/h100 (H100 SXM datasheet)",
}


# ------------------------------------------------------------- efficiencies

@dataclasses.dataclass(frozen=True, kw_only=True)
class Efficiency:
  """Fractions of `RooflineCost`'s roofline (which already charges
  DeviceSpec.bw_eff / flop_eff, the copy and matmul fractions measured on
  H100 / H200) that a system's kernels reach, and scheduling constants."""
  # MEASURED: this repository's engine decoding the DeepSeek-V3 layers (MoE,
  # MLA) at batch 64 on one H200 reached 0.452 of its bandwidth roofline
  # (experiments/results/gpu/h200_2026-11-27_run7/
  # gpu_day_nvidia_h200_2026-11-27_engine.json, moe.decode.batch_64
  # fraction_of_roofline): an engine whose kernels are not fused or tuned.
  # ASSUMED mapping: it stands for the v5.1 software's kernels.
  unfused_kernels: float = 0.452
  # MEASURED inputs, ASSUMED rule: fused, tuned kernels (v6.0) reach what the
  # best kernel of each family measured on that H200 reached (any
  # implementation; gpu_day_nvidia_h200_2026-11-27_kernels.json roofline_frac):
  # paged decode attention 0.595, causal prefill attention 0.758 (torch
  # sdpa), grouped expert matmul 0.859 (median), quantized matmul 0.498
  # (bf16 weight dot); their geometric mean 0.663 scales the whole step.
  fused_kernels: float = 0.663
  # MEASURED (published): TensorRT-LLM's balanced attention DP keeps average
  # / max tokens per rank at 0.88 (sim_scale.TRTLLM_ATTN_BALANCE); charged to
  # every decode step's attention as max / mean = 1 / 0.88.
  attn_balance: float = 0.88
  # ASSUMED: Server-type scenarios queue a request for a decode slot (a
  # rank's batch is capped) with a router that pools the slots of every rank
  # of the system ("system"), or only of one instance's ranks ("instance").
  slot_pool: str = "system"
  # ASSUMED: the largest decode batch per attention-DP rank (CUDA graphs).
  max_batch: int = 512


@dataclasses.dataclass(frozen=True, kw_only=True)
class Techniques:
  """What the v5.1 -> v6.0 software added (issue 74), each on or off."""
  fused_kernels: bool = False  # faster, fused kernels
  adp_balance: bool = False  # attention-DP balancing of context requests
  disaggregated: bool = False  # separate prefill and decode GPUs
  wide_ep: bool = False  # EP beyond 8 GPUs (up to the NVL72 rack)
  mtp: bool = False  # MTP speculative decoding, up to 3 drafts
  kv_routing: bool = False  # KV-aware routing (prefix reuse)

  def with_(self, name: str) -> "Techniques":
    return dataclasses.replace(self, **{name: True})


TECHNIQUE_ORDER = ("fused_kernels", "adp_balance", "disaggregated", "wide_ep", "mtp",
                   "kv_routing")
TECHNIQUE_CAUSE = {
    "fused_kernels": "faster and fused kernels (the best measured kernels' fraction of the "
                     "roofline instead of the unfused engine's)",
    "adp_balance": "attention-DP balancing of context requests (prefill spread evenly over "
                   "ranks instead of whole chunks stalling every rank's step)",
    "disaggregated": "disaggregated prefill / decode (no prefill in decode steps)",
    "wide_ep": "wide EP (experts over up to 72 GPUs: fewer expert bytes per GPU)",
    "mtp": "MTP speculative decoding, up to 3 drafts (TensorRT-LLM R1 acceptance)",
    "kv_routing": "KV-aware routing (reuses only the shared chat template here)",
}
ROUND_TECHNIQUES = {"v5.1": Techniques(), "v6.0": Techniques(**{t: True for t in TECHNIQUE_ORDER})}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """One deployment on the system's GPUs."""
  mode: str  # "colocated" | "disaggregated"
  tp: int  # attention TP per rank
  ranks: int  # attention-DP ranks per decode instance
  ep: int  # decode instance's EP size (1: dense)
  mtp_k: int = 0
  chunk: int = 0  # co-located prefill chunk (token budget beyond the decode rows)
  batch: int = 1  # decode sequences per rank (the batch cap)
  prefill_gpus: int = 0  # disaggregated: GPUs of the system on prefill


# --------------------------------------------------------------- step costs

@functools.lru_cache(maxsize=None)
def _cost(preset: str, dev: str, tp: int, ranks: int, ep: int, weight_dtype: str,
          kv_dtype: str, kernel_eff: float, attn_balance: float) -> RooflineCost:
  return RooflineCost(cfg=presets.get(preset), device=device(dev),
                      par=Parallelism(tp=tp, dp=ranks, ep=ep), weight_dtype=weight_dtype,
                      kv_dtype=kv_dtype, slowdown=1.0 / kernel_eff,
                      attn_imbalance=1.0 / attn_balance)


def _shape(batch: float, context: float, k: int, prefill: float, prefill_start: float) -> StepShape:
  """One rank's step: `batch` decodes at `context` (K drafts each) plus
  `prefill` prompt tokens continuing from `prefill_start`."""
  b, rows, p = int(round(batch)), k + 1, int(round(prefill))
  s = int(prefill_start)
  return StepShape(decode_seqs=b, draft_tokens=b * k, mtp_k=k,
                   kv_read_tokens=int(b * (context + rows)) + (s + p if p else 0),
                   pairs_decode=int(b * (rows * (context + rows) - rows * (rows - 1) // 2)),
                   prefill_tokens=p, prefill_seqs=1 if p else 0, sampling_prefills=1 if p else 0,
                   pairs_prefill=p * s + p * (p + 1) // 2)


def tokens_per_row(k: int) -> float:
  """Tokens one decode row emits per step with K MTP drafts."""
  return 1.0 + sum(TRTLLM_R1_ACCEPTANCE[:k])


@dataclasses.dataclass(frozen=True)
class _Ctx:
  """What one evaluation holds fixed."""
  w: Workload
  sc: Scenario
  tech: Techniques
  eff: Efficiency
  dev: str

  def cost(self, tp: int, ranks: int, ep: int) -> RooflineCost:
    kern = self.eff.fused_kernels if self.tech.fused_kernels else self.eff.unfused_kernels
    return _cost(self.w.preset, self.dev, tp, ranks, ep, self.w.weight_dtype, self.w.kv_dtype,
                 kern, self.eff.attn_balance)

  @property
  def context(self) -> float:  # mean context an in-flight decode token attends
    return self.w.isl_mean + self.w.osl_age_mean

  @property
  def new_prompt(self) -> float:  # prompt tokens a request must prefill
    return self.w.isl_mean - (self.w.template_tokens if self.tech.kv_routing else 0)



def _fits(cost: RooflineCost, batch: float, ctx: _Ctx) -> bool:
  try:
    cap = cost.kv_pages(PAGE) * PAGE
  except ValueError:
    return False
  return batch * ctx.context <= cap  # the batch's mean in-flight tokens


def _queue_p99_s(rho: float, service_s: float) -> float:
  """99th percentile wait of an M/D/1 queue, approximated as ln(100) times
  its mean wait rho / (2 (1 - rho)) service (ASSUMED exponential tail)."""
  return math.log(100) * rho / (2 * (1 - rho)) * service_s


def _colocated_step(ctx: _Ctx, cost: RooflineCost, c: Config, batch: float):
  """Mean step seconds and prefill tokens per rank per step of a co-located
  rank decoding `batch` sequences; None when prefill cannot keep up."""
  k = c.mtp_k
  p = batch * tokens_per_row(k) * ctx.new_prompt / ctx.w.osl_mean
  if p > c.chunk:
    return None
  if ctx.tech.adp_balance:  # every rank takes its share of the prompts each step
    return cost.step_time([_shape(batch, ctx.context, k, p, ctx.w.isl_mean / 2)]).seconds, p
  # Unbalanced: prompts arrive as whole chunks on some ranks; a step with a
  # chunk on any of the instance's ranks waits for it.
  q = p / c.chunk
  f = 1 - (1 - q) ** c.ranks
  full = cost.step_time([_shape(batch, ctx.context, k, c.chunk, ctx.w.isl_mean / 2)]).seconds
  bare = cost.step_time([_shape(batch, ctx.context, k, 0, 0)]).seconds
  return f * full + (1 - f) * bare, p


def _erlang_c(slots: int, load: float) -> float:
  """Probability that a request waits for a slot in an M/M/c queue (c
  slots, offered load `load` busy slots on average): Halfin and Whitt's
  approximation 1 / (1 + beta Phi(beta) / phi(beta)), beta = (c - a) / sqrt(a)."""
  if load >= slots:
    return 1.0
  if load <= 0:
    return 0.0
  beta = (slots - load) / math.sqrt(load)
  phi = math.exp(-beta * beta / 2) / math.sqrt(2 * math.pi)
  if phi == 0.0:
    return 0.0
  big_phi = 0.5 * (1 + math.erf(beta / math.sqrt(2)))
  return min(1.0, 1.0 / (1.0 + beta * big_phi / phi))


def _slot_wait_p99(slots: int, load: float, life_s: float) -> float:
  """99th percentile wait for a slot: P(W > w) = C exp(-(c - a) w / L)."""
  cw = _erlang_c(slots, load)
  if cw <= 0.01:
    return 0.0
  return life_s / (slots - load) * math.log(cw / 0.01)


@functools.lru_cache(maxsize=None)
def served_load(slots: int, life_s: float, budget_s: float) -> float:
  """The most busy slots on average (Poisson arrivals, exponential holding
  times of mean `life_s`) whose p99 wait for a slot stays within `budget_s`."""
  lo, hi = 0.0, float(slots)
  for _ in range(40):
    mid = (lo + hi) / 2
    if _slot_wait_p99(slots, mid, life_s) <= budget_s:
      lo = mid
    else:
      hi = mid
  return lo


def _served(ctx: _Ctx, c: Config, ranks: int, full_step_s: float, ttft0_s: float):
  """Server-type scenarios: a rank holds at most `c.batch` sequences; a
  request waits for a free slot (M/M/c over the pooled slots; output lengths
  are long-tailed, std 1.3 x mean for DeepSeek-R1, so exponential holding
  times are a fair stand-in). Returns (mean batch per rank, p99 slot wait
  s) at the highest load whose TTFT stays within the limit; Offline: the
  full batch, no wait; None: no budget left."""
  if ctx.sc.ttft_ms is None:
    return float(c.batch), 0.0
  budget = ctx.sc.ttft_ms / 1e3 - ttft0_s
  if budget <= 0:
    return None
  pool = ranks if ctx.eff.slot_pool == "system" else c.ranks
  slots = pool * c.batch
  life = ctx.w.osl_mean / tokens_per_row(c.mtp_k) * full_step_s  # decode time at full batch
  load = served_load(slots, life, budget)
  if load < 1:
    return None
  return load / pool, _slot_wait_p99(slots, load, life)


def colocated(ctx: _Ctx, c: Config) -> dict | None:
  cost = ctx.cost(c.tp, c.ranks, c.ep)
  if not _fits(cost, c.batch, ctx):
    return None
  full = _colocated_step(ctx, cost, c, c.batch)  # every slot busy: TPOT's worst case
  if full is None:
    return None
  tpr = tokens_per_row(c.mtp_k)
  chunk_step = cost.step_time([_shape(c.batch, ctx.context, c.mtp_k, c.chunk,
                                      ctx.w.isl_mean / 2)]).seconds
  rho = min(full[1] / c.chunk, 0.999)
  ttft0 = _queue_p99_s(rho, chunk_step) + math.ceil(ctx.w.isl_p99 / c.chunk) * chunk_step
  served = _served(ctx, c, SYSTEM_GPUS // c.tp, full[0], ttft0)
  if served is None:
    return None
  batch, wait = served
  t = _colocated_step(ctx, cost, c, batch)[0]
  return dict(per_gpu=batch * tpr / t / c.tp, tpot_ms=full[0] / tpr * 1e3,
              ttft_ms=(ttft0 + wait) * 1e3, step_ms=t * 1e3, mean_batch=batch)


def _prefill_rank(ctx: _Ctx, tokens: int = 8192):
  """A prefill instance (MoE: DP8 attention + EP8; dense: the decode TP)
  and its tokens/s per GPU on `tokens`-token steps of whole prompts."""
  moe = presets.get(ctx.w.preset).is_moe
  tp, ranks, ep = (1, 8, 8) if moe else (8, 1, 1)
  cost = ctx.cost(tp, ranks, ep)
  n = max(1, round(tokens / ctx.new_prompt))
  L = int(ctx.new_prompt)
  s = StepShape(prefill_tokens=n * L, prefill_seqs=n, sampling_prefills=n,
                kv_read_tokens=n * L, pairs_prefill=n * (L * (L + 1) // 2))
  t = cost.step_time([s]).seconds
  return cost, t, n * L / t / tp


def disaggregated(ctx: _Ctx, c: Config) -> dict | None:
  decode_gpus = SYSTEM_GPUS - c.prefill_gpus
  if c.prefill_gpus < 1 or c.tp * c.ranks > decode_gpus:
    return None
  cost = ctx.cost(c.tp, c.ranks, c.ep)
  if not _fits(cost, c.batch, ctx):
    return None
  tpr = tokens_per_row(c.mtp_k)
  full = cost.step_time([_shape(c.batch, ctx.context, c.mtp_k, 0, 0)]).seconds
  pcost, pstep, prate = _prefill_rank(ctx)
  prompt_share = ctx.new_prompt / ctx.w.osl_mean / (c.prefill_gpus * prate)
  rho = decode_gpus * c.batch * tpr / full / c.tp * prompt_share  # at full batch
  if rho >= 1:
    return None
  ttft0 = (_queue_p99_s(rho, pstep) + pstep * max(1.0, ctx.w.isl_p99 / 8192)
           + pcost.kv_transfer_s(int(ctx.w.isl_p99)))
  served = _served(ctx, c, decode_gpus // c.tp, full, ttft0)
  if served is None:
    return None
  batch, wait = served
  t = cost.step_time([_shape(batch, ctx.context, c.mtp_k, 0, 0)]).seconds
  decode_rate = decode_gpus * batch * tpr / t / c.tp  # output tokens/s
  return dict(per_gpu=decode_rate / SYSTEM_GPUS, tpot_ms=full / tpr * 1e3,
              ttft_ms=(ttft0 + wait) * 1e3, step_ms=t * 1e3, mean_batch=batch,
              prefill_utilization=decode_rate * prompt_share)


BATCHES = (8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
CHUNKS = (512, 1024, 2048, 4096, 8192)


def _layouts(ctx: _Ctx) -> list[tuple[int, int, int]]:
  """(attention TP, attention-DP ranks, EP) of a decode instance."""
  if not presets.get(ctx.w.preset).is_moe:
    return [(4, 1, 1), (8, 1, 1)]
  sizes = (8, 16, 32, 64, 72) if ctx.tech.wide_ep else (8,)
  return [(8, 1, 8)] + [(1, n, n) for n in sizes]


def candidates(ctx: _Ctx):
  """Every configuration the techniques allow."""
  moe = presets.get(ctx.w.preset).is_moe
  ks = (0, 1, 2, 3) if ctx.tech.mtp and presets.get(ctx.w.preset).num_mtp_layers else (0,)
  batches = [b for b in BATCHES if b <= ctx.eff.max_batch]
  for (tp, ranks, ep), k, b in itertools.product(_layouts(ctx), ks, batches):
    for chunk in CHUNKS:
      yield Config(mode="colocated", tp=tp, ranks=ranks, ep=ep, mtp_k=k, chunk=chunk, batch=b)
    if ctx.tech.disaggregated:
      for p in range(8, SYSTEM_GPUS, 8 if moe else 4):
        if tp * ranks <= SYSTEM_GPUS - p:
          yield Config(mode="disaggregated", tp=tp, ranks=ranks, ep=ep, mtp_k=k, batch=b,
                       prefill_gpus=p)


def holds(sc: Scenario, r: dict) -> bool:
  return ((sc.tpot_ms is None or r["tpot_ms"] <= sc.tpot_ms)
          and (sc.ttft_ms is None or r["ttft_ms"] <= sc.ttft_ms))


def search(benchmark: str, scenario: str, tech: Techniques, *, eff: Efficiency = Efficiency(),
           dev: str = "gb300") -> dict | None:
  """The configuration of most tokens/s per GPU that holds the scenario's
  limits: {per_gpu, tpot_ms, ttft_ms, step_ms, config} (None: none holds)."""
  ctx = _Ctx(WORKLOADS[benchmark], SCENARIOS[(benchmark, scenario)], tech, eff, dev)
  best = None
  for c in candidates(ctx):
    r = colocated(ctx, c) if c.mode == "colocated" else disaggregated(ctx, c)
    if r is not None and holds(ctx.sc, r) and (best is None or r["per_gpu"] > best["per_gpu"]):
      best = dict(r, config=dataclasses.asdict(c))
  return best


def predict_table(*, eff: Efficiency = Efficiency(), dev: str = "gb300", log=None) -> list[dict]:
  """One row per `PUBLISHED` entry: the search under that round's techniques."""
  rows = []
  for pub in PUBLISHED:
    best = search(pub["benchmark"], pub["scenario"], ROUND_TECHNIQUES[pub["round"]], eff=eff,
                  dev=dev)
    pred = best["per_gpu"] if best else 0.0
    row = dict(benchmark=pub["benchmark"], scenario=pub["scenario"], round=pub["round"],
               published_per_gpu=pub["per_gpu"], predicted_per_gpu=pred,
               ratio=pred / pub["per_gpu"], config=best["config"] if best else None,
               tpot_ms=best["tpot_ms"] if best else None,
               ttft_ms=best["ttft_ms"] if best else None,
               mean_batch=best["mean_batch"] if best else None)
    rows.append(row)
    if log:
      log(row)
  return rows


def ablation(benchmark: str, scenario: str, *, eff: Efficiency = Efficiency(),
             dev: str = "gb300") -> dict:
  """From the v5.1 techniques to v6.0's, one at a time (TECHNIQUE_ORDER),
  each step re-searching the best configuration: the factors multiply to
  predicted v6.0 / v5.1 exactly."""
  tech = ROUND_TECHNIQUES["v5.1"]
  prev = search(benchmark, scenario, tech, eff=eff, dev=dev)
  start, steps = prev["per_gpu"], []
  for name in TECHNIQUE_ORDER:
    tech = tech.with_(name)
    cur = search(benchmark, scenario, tech, eff=eff, dev=dev)
    steps.append(dict(technique=name, cause=TECHNIQUE_CAUSE[name],
                      factor=cur["per_gpu"] / prev["per_gpu"], per_gpu=cur["per_gpu"],
                      config=cur["config"]))
    prev = cur
  return dict(benchmark=benchmark, scenario=scenario, v51_per_gpu=start,
              v60_per_gpu=prev["per_gpu"], predicted_ratio=prev["per_gpu"] / start,
              product=math.prod(s["factor"] for s in steps), steps=steps)
