"""MLPerf Inference datacenter LLM scenarios over the simulator's step-cost
model (`sim/cost.py`'s `RooflineCost`): DeepSeek-R1 and Llama 3.1 405B,
Offline / Server / Interactive, predicted tokens/s per GPU for a searched
configuration, and the published GB300 NVL72 figures to hold them against.

Each published figure comes with the submission that produced it
(`Record`: its system's GPUs, deployment, batch cap, token budget, MTP
depth), read from the MLCommons results repositories: the search runs on
that system's GPUs, within that record's batch cap, over the layouts the
round's software could use, and also at the record's own deployment
(`at_record`), which separates the step-cost model's error from the
search's.

The search is analytic (steady state): for one configuration (co-located or
disaggregated, TP / attention DP / EP, MTP depth, prefill chunk, decode batch
per rank) it prices a mean decode step and the prefill work each emitted
token brings with `RooflineCost.step_time`, and derives tokens/s per GPU,
TPOT and TTFT; `search` keeps the best configuration whose TPOT and TTFT
hold the scenario's limits. Server and Interactive: a rank holds at most
`batch` sequences and a Poisson-arriving request waits for a free slot
(an M/M/c queue over the pooled slots, `served_load`); the prediction is
the mean batch at the highest load whose p99 TTFT (prefill plus slot wait)
holds, and TPOT is judged with every slot busy. A co-located rank's
prompts also queue for its chunk budget (M/G/1 over the datasets'
input-length bins, `prefill_ttft_p99`); a disaggregated one for a prefill
instance (M/M/c), then its own steps and K/V transfer (`_p99_of_sum`).
Offline fills every slot.
What a round's software could do (`Techniques`, `ROUND_TECHNIQUES`) and
its batch caps and system (`Record`) are all the rounds differ in;
`ablation` changes them one at a time.

Every workload and hardware figure below says where it comes from; every
efficiency factor says whether it was measured (and where) or ASSUMED.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from statistics import NormalDist

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
  # The input lengths as (share of samples, their mean length) bins, shortest
  # first: deciles, then 90-95, 95-98, 98-99, 99-99.5 and 99.5-100%.
  isl_bins: tuple


ISL_BIN_SHARES = (0.1,) * 9 + (0.05, 0.03, 0.01, 0.005, 0.005)


def _bins(*lengths: float) -> tuple:
  return tuple(zip(ISL_BIN_SHARES, lengths, strict=True))


# Token-length statistics: computed here from openshift-psap/performance-
# dashboard mlperf-data/summaries/{deepseek-r1,llama3-1-405b}.csv (commit
# 71007029fb5b; per-sample tok_input_len / tok_ref_output_len extracted by its
# mlperf-data/original/generate_dataset_summaries.py from MLCommons' datasets
# mlperf_deepseek_r1_dataset_4388_fp8_eval.pkl and
# mlperf_llama3.1_405b_dataset_8313_processed_fp16_eval.pkl). Checks against
# mlcommons/inference: the 405B file's mean output 684.7 equals the README's
# tokens_per_sample 684.68; the R1 file's outputs capped at 20,000 (the
# README's max-OSL 20K) average 3886.2, the README's mean-output-tok-len.
# isl_bins: the same files' tok_input_len sorted and cut at the shares named
# in `Workload` (each bin's mean length; the bins' mean is the input mean).
WORKLOADS = {
    # mlcommons/inference language/deepseek-r1: 4388 samples (loadgen/mlperf.conf
    # performance_sample_count_override); mean output 3886.2 tokens (README,
    # reference "mean-output-tok-len": 3886.2274); max template 4 tokens
    # (utils/backend_registry.py MAX_TEMPLATE_TOKS). From the dataset CSV:
    # input mean 803.8, p99 1432, max 3140 (MAX_ISL 3136); outputs capped at
    # 20,000: E[o^2] / (2 E[o]) = 4354 (output std 5065 uncapped: long-tailed).
    # Weights NVFP4 and K/V FP8: every record below (precision 'fp4',
    # kv_cache_dtype 'fp8').
    "deepseek-r1": Workload(benchmark="deepseek-r1", preset="deepseek_v3", isl_mean=803.8,
                            isl_p99=1432.0, osl_mean=3886.2, osl_age_mean=4354.0,
                            template_tokens=4, weight_dtype="fp4", kv_dtype="fp8",
                            isl_bins=_bins(98, 162, 497, 837, 883, 924, 992, 1088, 1215, 1295,
                                           1329, 1391, 1453, 1665)),
    # mlcommons/inference language/llama3.1-405b: 8313 samples (mlperf.conf);
    # mean output 684.68 tokens (README, reference "tokens_per_sample"). From
    # the dataset CSV: input mean 9428.6, p99 18956, max 19988; output
    # E[o^2] / (2 E[o]) = 392. NVFP4 weights, FP8 K/V (the records' configs).
    "llama3.1-405b": Workload(benchmark="llama3.1-405b", preset="llama3_1_405b",
                              isl_mean=9428.6, isl_p99=18956.0, osl_mean=684.68,
                              osl_age_mean=392.0, template_tokens=0, weight_dtype="fp4",
                              kv_dtype="fp8",
                              isl_bins=_bins(2646, 4389, 6016, 7925, 9472, 10548, 11374, 12262,
                                             13373, 14898, 16803, 18454, 19199, 19709)),
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


# mlcommons/inference loadgen/mlperf.conf (commit b66003e10e2d): lines 148-150
# deepseek-r1.Server ttft_latency 2000 / tpot_latency 80; lines 153-155
# deepseek-r1-interactive.Server 1500 / 15; lines 129-131 llama3_1-405b.Server
# 6000 / 175 (ms); line 83 *.Server.target_latency_percentile = 99.
SCENARIOS = {
    ("deepseek-r1", "Offline"): Scenario(name="Offline"),
    ("deepseek-r1", "Server"): Scenario(name="Server", ttft_ms=2000.0, tpot_ms=80.0),
    ("deepseek-r1", "Interactive"): Scenario(name="Interactive", ttft_ms=1500.0, tpot_ms=15.0),
    ("llama3.1-405b", "Offline"): Scenario(name="Offline"),
    ("llama3.1-405b", "Server"): Scenario(name="Server", ttft_ms=6000.0, tpot_ms=175.0),
}


# ------------------------------------------------------------------- records

@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """One deployment on the system's GPUs."""
  mode: str  # "colocated" | "disaggregated"
  tp: int  # attention TP per rank
  ranks: int  # attention-DP ranks per decode instance
  ep: int  # decode instance's EP size (1: dense)
  mtp_k: int = 0
  chunk: int = 0  # co-located prefill token budget per step (beyond the decode rows)
  batch: int = 1  # decode sequences per rank (the batch cap)
  prefill_gpus: int = 0  # disaggregated: GPUs of the system on prefill


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
  """The submission a published figure comes from and how it was deployed
  (its config files): the search runs on `system_gpus` within `config.batch`
  (the record's per-rank batch cap), and `at_record` evaluates `config`."""
  submitter: str
  system_gpus: int
  # The log's "Tokens per second" (Offline) or "Completed tokens per second".
  system_tokens_per_s: float
  config: Config
  deployment: str  # the record's deployment in words
  source: str  # result and config files
  # Server-type logs' operating point, from the same mlperf_log_summary.txt:
  # sequences decoding per decode rank (an attention-DP rank or a TP
  # instance; Little's law: completed samples/s x (mean latency - mean TTFT)
  # / ranks), mean and p99 TPOT, p99 TTFT (ms).
  log: dict | None = None


# The published rows: per GPU = the log's tokens/s over the system's GPUs.
# v6.0: mlcommons/inference_results_v6.0 at commit ab33b2144a9f ("Publishing
# Results"; read from its mirror gbeezybez/inference_results_v6.0), v5.1:
# mlcommons/inference_results_v5.1 (read from its mirror
# ykamiset/inference_results_v5.1 at e9ccad4d681a); each file under closed/.
# The DeepSeek-R1 v6.0 Server and Offline figures of issue 74 (8,064 and
# 9,821 per GPU) are the best GB300 results per GPU of that round, from
# partners' 8-GPU systems (Nebius, CoreWeave), not NVIDIA's 72-GPU entry
# (5,562 and 8,987: `OTHER_GB300_V60`).
_V60, _V51 = "mlcommons/inference_results_v6.0 closed/", "mlcommons/inference_results_v5.1 closed/"
_DEP8 = dict(mode="colocated", tp=1, ranks=8, ep=8)  # tensor_parallelism 8 + enable_attention_dp
_TP2 = dict(mode="colocated", tp=2, ranks=1, ep=1)
PUBLISHED = [
    dict(benchmark="deepseek-r1", scenario="Server", round="v6.0", per_gpu=64509.99 / 8,
         record=Record(
             submitter="Nebius", system_gpus=8, system_tokens_per_s=64509.99,
             config=Config(**_DEP8, chunk=4608, batch=640),
             deployment="1 x DEP8 (attention DP 8 + EP 8), gpu_batch_size 640, max_num_tokens "
                        "4608 (whole prompts), ADP balance, no MTP, stream_interval 100",
             source=_V60 + "Nebius/results/GB300-NVL72_GB300-288GB_aarch64x8_TRT/deepseek-r1/"
                    "Server/performance/run_1/mlperf_log_summary.txt; Nebius/configs/"
                    "GB300-NVL72_GB300-288GB_aarch64x8/Server/deepseek-r1.py",
             log=dict(in_flight_per_rank=17.18 * (270.92 - 0.63) / 8, tpot_mean_ms=72.4, tpot_p99_ms=77.7,
                      ttft_p99_ms=1427.7))),
    dict(benchmark="deepseek-r1", scenario="Offline", round="v6.0", per_gpu=78564.0 / 8,
         record=Record(
             submitter="CoreWeave", system_gpus=8, system_tokens_per_s=78564.0,
             config=Config(**_DEP8, chunk=6144, batch=1024),
             deployment="1 x DEP8, gpu_batch_size 1024, max_num_tokens 6144, ADP balance, no MTP",
             source=_V60 + "CoreWeave/results/GB300-NVL72_GB300-288GB_aarch64x8_TRT/deepseek-r1/"
                    "Offline/performance/run_1/mlperf_log_summary.txt; CoreWeave/configs/"
                    "GB300-NVL72_GB300-288GB_aarch64x8/Offline/deepseek-r1.py")),
    dict(benchmark="deepseek-r1", scenario="Interactive", round="v6.0", per_gpu=250633.67 / 72,
         record=Record(
             submitter="NVIDIA", system_gpus=72, system_tokens_per_s=250633.67,
             config=Config(mode="disaggregated", tp=1, ranks=16, ep=16, mtp_k=3, batch=128,
                           prefill_gpus=8),
             deployment="disaggregated: 4 prefill x DEP2 (8 GPUs) + 4 decode x DEP16 (64 GPUs), "
                        "max_batch_size 128, MTP 3, KV-aware router (Dynamo)",
             source=_V60 + "NVIDIA/results/GB300-NVL72_GB300-288GB_aarch64x72_TRT/deepseek-r1/"
                    "Interactive/performance/run_1/mlperf_log_summary.txt; NVIDIA/configs/"
                    "GB300-NVL72_GB300-288GB_aarch64x72/Interactive/deepseek-r1.py, .../"
                    "aarch64x16/Interactive/disagg_decode/deepseek-r1.yml, .../aarch64x2/"
                    "Interactive/disagg_prefill/deepseek-r1.yml",
             log=dict(in_flight_per_rank=66.90 * (42.16 - 0.42) / 64, tpot_mean_ms=11.54, tpot_p99_ms=13.87,
                      ttft_p99_ms=491.6))),
    dict(benchmark="deepseek-r1", scenario="Server", round="v5.1", per_gpu=209327.68 / 72,
         record=Record(
             submitter="NVIDIA", system_gpus=72, system_tokens_per_s=209327.68,
             config=Config(**_DEP8, chunk=3456, batch=512),
             deployment="9 x DEP8, gpu_batch_size 512, max_num_tokens 3456, ADP balance, no MTP",
             source=_V51 + "NVIDIA/results/GB300-NVL72_GB300-288GB_aarch64x72_TRT/deepseek-r1/"
                    "Server/performance/run_1/mlperf_log_summary.txt; NVIDIA/configs/"
                    "GB300-NVL72_GB300-288GB_aarch64x72_TRT/Server/deepseek-r1.py",
             log=dict(in_flight_per_rank=56.95 * (233.10 - 0.78) / 72, tpot_mean_ms=63.7, tpot_p99_ms=70.8,
                      ttft_p99_ms=1939.7))),
    dict(benchmark="deepseek-r1", scenario="Offline", round="v5.1", per_gpu=420659.0 / 72,
         record=Record(
             submitter="NVIDIA", system_gpus=72, system_tokens_per_s=420659.0,
             config=Config(**_DEP8, chunk=6656, batch=1536),
             deployment="9 x DEP8, gpu_batch_size 1536 (K/V memory holds fewer), max_num_tokens "
                        "6656, ADP balance, no MTP",
             source=_V51 + "NVIDIA/results/GB300-NVL72_GB300-288GB_aarch64x72_TRT/deepseek-r1/"
                    "Offline/performance/run_1/mlperf_log_summary.txt; NVIDIA/configs/"
                    "GB300-NVL72_GB300-288GB_aarch64x72_TRT/Offline/deepseek-r1.py")),
    dict(benchmark="llama3.1-405b", scenario="Server", round="v6.0", per_gpu=18627.63 / 72,
         record=Record(
             submitter="NVIDIA", system_gpus=72, system_tokens_per_s=18627.63,
             config=Config(mode="disaggregated", tp=4, ranks=1, ep=1, batch=256,
                           prefill_gpus=52),
             deployment="disaggregated: 26 prefill x TP2 (52 GPUs) + 5 decode x TP4 (20 GPUs), "
                        "decode max_batch_size 256, KV-aware router (Dynamo)",
             source=_V60 + "NVIDIA/results/GB300-NVL72_GB300-288GB_aarch64x72_TRT/llama3.1-405b/"
                    "Server/performance/run_1/mlperf_log_summary.txt and user.conf (target_qps "
                    "29.4: the dynamo_cluster config); NVIDIA/configs/GB300-NVL72_GB300-288GB_"
                    "aarch64x72/Server/llama3_1-405b.py, .../aarch64x4/Server/disagg_decode/"
                    "llama3_1-405b.yaml",
             log=dict(in_flight_per_rank=29.01 * (39.62 - 2.09) / 5, tpot_mean_ms=58.7, tpot_p99_ms=60.2,
                      ttft_p99_ms=4577.4))),
    dict(benchmark="llama3.1-405b", scenario="Offline", round="v6.0", per_gpu=19511.7 / 72,
         record=Record(
             submitter="NVIDIA", system_gpus=72, system_tokens_per_s=19511.7,
             config=Config(**_TP2, chunk=1536, batch=2048),
             deployment="36 x TP2, gpu_batch_size 2048 (K/V memory holds fewer), chunked "
                        "context, max_num_tokens 1536",
             source=_V60 + "NVIDIA/results/GB300-NVL72_GB300-288GB_aarch64x72_TRT/llama3.1-405b/"
                    "Offline/performance/run_1/mlperf_log_summary.txt; NVIDIA/configs/"
                    "GB300-NVL72_GB300-288GB_aarch64x2/Offline/llama3_1-405b.py")),
    dict(benchmark="llama3.1-405b", scenario="Server", round="v5.1", per_gpu=12248.42 / 72,
         record=Record(
             submitter="NVIDIA", system_gpus=72, system_tokens_per_s=12248.42,
             config=Config(**_TP2, chunk=1536, batch=2048),
             deployment="36 x TP2, gpu_batch_size 2048, chunked context, max_num_tokens 1536",
             source=_V51 + "NVIDIA/results/GB300-NVL72_GB300-288GB_aarch64x72_TRT/llama3.1-405b/"
                    "Server/performance/run_1/mlperf_log_summary.txt; NVIDIA/configs/"
                    "GB300-NVL72_GB300-288GB_aarch64x72_TRT/Server/llama3_1-405b.py",
             log=dict(in_flight_per_rank=19.46 * (49.27 - 1.78) / 36, tpot_mean_ms=75.7, tpot_p99_ms=100.1,
                      ttft_p99_ms=4745.8))),
    dict(benchmark="llama3.1-405b", scenario="Offline", round="v5.1", per_gpu=16104.1 / 72,
         record=Record(
             submitter="NVIDIA", system_gpus=72, system_tokens_per_s=16104.1,
             config=Config(**_TP2, chunk=1536, batch=2048),
             deployment="36 x TP2, gpu_batch_size 2048, chunked context, max_num_tokens 1536",
             source=_V51 + "NVIDIA/results/GB300-NVL72_GB300-288GB_aarch64x72_TRT/llama3.1-405b/"
                    "Offline/performance/run_1/mlperf_log_summary.txt; NVIDIA/configs/"
                    "GB300-NVL72_GB300-288GB_aarch64x72_TRT/Offline/llama3_1-405b.py")),
]

# The other GB300 DeepSeek-R1 v6.0 results of the same software (TensorRT-LLM,
# DEP8 instances), tokens/s per GPU from each log under _V60 + <submitter>/
# results/<system>/deepseek-r1/<scenario>/performance/run_1: how far apart
# submitters land on one hardware and software (Server 5,562 to 8,064).
OTHER_GB300_V60 = [
    dict(submitter="NVIDIA", system="GB300-NVL72_GB300-288GB_aarch64x72_TRT", scenario="Server",
         per_gpu=400436.77 / 72),
    dict(submitter="NVIDIA", system="GB300-NVL72_GB300-288GB_aarch64x72_TRT", scenario="Offline",
         per_gpu=647076.0 / 72),
    dict(submitter="Nebius", system="GB300-NVL72_GB300-288GB_aarch64x72_TRT", scenario="Server",
         per_gpu=575579.74 / 72),
    dict(submitter="Nebius", system="GB300-NVL72_GB300-288GB_aarch64x8_TRT", scenario="Offline",
         per_gpu=76346.6 / 8),
    dict(submitter="CoreWeave", system="GB300-NVL72_GB300-288GB_aarch64x8_TRT", scenario="Server",
         per_gpu=44589.69 / 8),
]

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
  H100 / H200) that a round's kernels reach, per part of the step, and
  scheduling constants. Attention is charged against the same matmul
  fraction (flop_eff) as the kernel measurements below, not the device's
  attn_flop_eff: that one is itself an attention kernel's fraction
  (FlashAttention-3's), which the attention factor here replaces."""
  # MEASURED: this repository's engine decoding the DeepSeek-V3 layers (MoE,
  # MLA) at batch 64 on one H200 reached 0.452 of its bandwidth roofline
  # (experiments/results/gpu/h200_2026-11-27_run7/
  # gpu_day_nvidia_h200_2026-11-27_engine.json, moe.decode.batch_64
  # fraction_of_roofline): an engine whose kernels are not fused or tuned.
  # ASSUMED mapping: it stands for the v5.1 software's kernels, every part.
  unfused_kernels: float = 0.452
  # MEASURED, per family: the best implementation's roofline_frac in
  # gpu_day_nvidia_h200_2026-11-27_kernels.json (same folder); v6.0's kernels
  # are ASSUMED to reach them. Attention: paged decode attention 0.595 (B8
  # S8192, Q1; prefill attention reached 0.758, charged 0.595 too, decode
  # dominates); dense (projections, dense MLP, shared experts, head): the
  # quantized matmul 0.498; experts: the grouped matmul's median 0.859.
  attention_kernels: float = 0.595
  dense_kernels: float = 0.498
  expert_kernels: float = 0.859
  # ASSUMED: collectives (TP all-reduce, EP all-to-all) reach the kernels'
  # geometric mean 0.663 (no collective was measured on the GPU day).
  comm_kernels: float = 0.663
  # MEASURED (published): TensorRT-LLM's balanced attention DP keeps average
  # / max tokens per rank at 0.877 (NVIDIA/TensorRT-LLM docs/source/blogs/
  # tech_blog/blog10_ADP_Balance_Strategy.md, "Avg Balance Ratio 87.70%", 8
  # GB200, DeepSeek-V3, DP8 + EP8); charged to every decode step's attention
  # as max / mean = 1 / 0.88.
  attn_balance: float = 0.88
  # MEASURED (published): expert load imbalance (max - mean) / mean over the
  # GPUs of EP32 with no redundant experts, DeepSeek-V3 / R1 traffic: 1.56
  # (0.11 with EPLB's 32 redundant slots; serving_facts.md). The records run
  # no EPLB (no redundant slots in any moe_config). ASSUMED: the experts'
  # loads independent, so a GPU's load over E / ep experts varies as
  # sqrt(ep / E) and the busiest of ep GPUs sits z(ep) (the expected maximum
  # of ep standard normals) above the mean: `expert_imbalance`.
  expert_imbalance_ep32: float = 1.56
  # ASSUMED: Server-type scenarios queue a request for a decode slot (a
  # rank's batch is capped) with a router that pools the slots of every rank
  # of the system ("system"), or only of one instance's ranks ("instance").
  slot_pool: str = "system"

  def expert_imbalance(self, ep: int) -> float:
    """(max - mean) / mean expert load over `ep` GPUs without EPLB."""
    z = lambda n: NormalDist().inv_cdf((n - 0.375) / (n + 0.25))  # Blom's approximation
    return self.expert_imbalance_ep32 * z(ep) / z(32) * math.sqrt(ep / 32) if ep > 1 else 0.0

  def parts(self, fused: bool) -> tuple:
    """(part, slowdown) pairs for `RooflineCost.part_slowdown`."""
    if not fused:
      return tuple((p, 1.0 / self.unfused_kernels) for p in ("attention", "dense", "experts",
                                                               "comm"))
    return (("attention", 1.0 / self.attention_kernels), ("dense", 1.0 / self.dense_kernels),
            ("experts", 1.0 / self.expert_kernels), ("comm", 1.0 / self.comm_kernels))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Techniques:
  """What a round's software could use, each on or off."""
  fused_kernels: bool = False  # v6.0's faster, fused kernels
  adp_balance: bool = False  # attention-DP balancing of context requests
  disaggregated: bool = False  # separate prefill and decode GPUs
  wide_ep: bool = False  # EP beyond 8 GPUs (up to the NVL72 rack)
  mtp: bool = False  # MTP speculative decoding, up to 3 drafts
  kv_routing: bool = False  # KV-aware routing (prefix reuse)

  def with_(self, name: str) -> "Techniques":
    return dataclasses.replace(self, **{name: True})


TECHNIQUE_ORDER = ("fused_kernels", "adp_balance", "disaggregated", "wide_ep", "mtp",
                   "kv_routing")
# v5.1: the records already balance attention-DP context requests
# (adp_balancing_enable True in both v5.1 DeepSeek-R1 configs above); v6.0's
# records add the rest (Interactive: disaggregated, EP16, MTP 3, KV router).
ROUND_TECHNIQUES = {"v5.1": Techniques(adp_balance=True),
                    "v6.0": Techniques(**{t: True for t in TECHNIQUE_ORDER})}


# --------------------------------------------------------------- step costs

@functools.lru_cache(maxsize=None)
def _cost(preset: str, dev: str, tp: int, ranks: int, ep: int, weight_dtype: str,
          kv_dtype: str, parts: tuple, attn_balance: float,
          moe_imbalance: float) -> RooflineCost:
  """The step-cost model of one instance. Attention at the matmul fraction
  (see `Efficiency`). ASSUMED: RooflineCost's per-layer latency
  (layer_floor_s, 100 us, itself ASSUMED from the batch-1 B200 anchor, which
  this keeps: 109 tokens/s/user against TensorRT-LLM's published 111) is
  added to every layer's roofline work (floor_adds) instead of hidden under
  it: a layer's small kernels and collective latencies sit on the critical
  path at any batch. The records' logs show such a fixed part: at DEP8 the
  step is ~38 ms plus a part that grows with the batch (v6.0: 307 in flight
  per rank at 56.2 ms mean TPOT in NVIDIA's 72-GPU Server log, 582 at 72.4
  ms in Nebius's; v5.1: 184 at 63.7 ms), where the roofline alone puts ~14
  ms of weight and expert reads."""
  d = device(dev)
  return RooflineCost(cfg=presets.get(preset), device=dataclasses.replace(
      d, attn_flop_eff=d.flop_eff), par=Parallelism(tp=tp, dp=ranks, ep=ep),
      weight_dtype=weight_dtype, kv_dtype=kv_dtype, part_slowdown=parts,
      attn_imbalance=1.0 / attn_balance, moe_imbalance=moe_imbalance, floor_adds=True)


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
  system_gpus: int = 72
  batch_cap: int = 512

  def cost(self, tp: int, ranks: int, ep: int) -> RooflineCost:
    return _cost(self.w.preset, self.dev, tp, ranks, ep, self.w.weight_dtype, self.w.kv_dtype,
                 self.eff.parts(self.tech.fused_kernels), self.eff.attn_balance,
                 self.eff.expert_imbalance(ep))

  @property
  def context(self) -> float:  # mean context an in-flight decode token attends
    return self.w.isl_mean + self.w.osl_age_mean

  @property
  def new_prompt(self) -> float:  # prompt tokens a request must prefill
    return self.w.isl_mean - self._reused

  @property
  def prompt_bins(self) -> tuple:  # isl_bins less what the prefix cache holds
    return tuple((m, length - self._reused) for m, length in self.w.isl_bins)

  @property
  def _reused(self) -> int:
    return self.w.template_tokens if self.tech.kv_routing else 0


def max_batch(cost: RooflineCost, ctx: _Ctx) -> int:
  """The most sequences one rank's K/V memory holds at the mean context."""
  try:
    cap = cost.kv_pages(PAGE) * PAGE
  except ValueError:
    return 0
  return int(cap // ctx.context)


def _bisect(below, lo: float, hi: float, rel: float) -> tuple[float, float]:
  """Halve [lo, hi] around where `below` turns False (True at lo, False at
  hi) until it is narrower than `rel` times its first width."""
  tol = rel * (hi - lo)
  while hi - lo > tol:
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if below(mid) else (lo, mid)
  return lo, hi


def _wait_tail(x: list, rho: float) -> tuple[float, float]:
  """(C, theta) of an M/G/1 queue's waiting-time tail P(W > w) ~ C exp(-theta
  w) (Cramer-Lundberg: theta solves lam (E[exp(theta X)] - 1) = theta, C =
  (1 - rho) / (lam E[X exp(theta X)] - 1)); service X as (share, seconds)
  pairs, lam = rho / E[X]."""
  lam = rho / sum(m * v for m, v in x)
  f = lambda th: lam * (sum(m * math.exp(th * v) for m, v in x) - 1) - th
  hi = 1.0 / max(v for _, v in x)
  while f(hi) < 0:
    hi *= 2
  theta = _bisect(lambda th: f(th) < 0, 0.0, hi, 1e-9)[1]
  return (1 - rho) / (lam * sum(m * v * math.exp(theta * v) for m, v in x) - 1), theta


def _p99_of_sum(own: list, waits: float, c: float, theta: float) -> float:
  """99th percentile of W + S: S as (share, seconds) pairs, W independent of
  it with tail P(W > w) = min(waits, c exp(-theta w)) (waits: P(W > 0))."""
  def tail(t: float) -> float:  # P(W + S > t)
    return sum(m * (1.0 if t < s else min(waits, c * math.exp(-theta * (t - s))))
               for m, s in own)

  hi = max(s for _, s in own) + max(0.0, math.log(max(c, 1e-12) / 0.01)) / theta
  return _bisect(lambda t: tail(t) > 0.01, 0.0, hi, 1e-6)[1]


def prefill_ttft_p99(bins: tuple, chunk: int, chunk_step_s: float, rho: float) -> float:
  """99th percentile of a co-located prompt's time to its first token: its
  wait W for the rank's chunk budget plus its own ceil(L / chunk) chunk
  steps, over the input-length `bins` ((share, length) pairs).

  The queue is M/G/1 over chunk-step time: a prompt of L tokens brings
  L / chunk chunk steps of work (`rho`: the share of time in chunk steps).
  W's tail is the Cramer-Lundberg asymptote (`_wait_tail`), capped at rho.
  The p99 of the sum, not a sum of p99s."""
  own = [(m, math.ceil(length / chunk) * chunk_step_s) for m, length in bins]
  if rho <= 0:
    return _p99_of_sum(own, 0.0, 0.0, 1.0)
  c, theta = _wait_tail([(m, n / chunk * chunk_step_s) for m, n in bins], rho)
  return _p99_of_sum(own, rho, c, theta)


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
  return _bisect(lambda a: _slot_wait_p99(slots, a, life_s) <= budget_s, 0.0, float(slots),
                 1e-12)[0]


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
  if c.tp * c.ranks > ctx.system_gpus or c.batch > max_batch(cost, ctx):
    return None
  full = _colocated_step(ctx, cost, c, c.batch)  # every slot busy: TPOT's worst case
  if full is None:
    return None
  tpr = tokens_per_row(c.mtp_k)
  chunk_step = cost.step_time([_shape(c.batch, ctx.context, c.mtp_k, c.chunk,
                                      ctx.w.isl_mean / 2)]).seconds
  # A rank's prompts queue for its chunk budget (M/G/1, `prefill_ttft_p99`).
  # Busy, the queue moves a chunk per chunk step (chunk / chunk_step tokens a
  # second); prompts arrive at p tokens per mean step: its utilization is the
  # fraction of time spent in chunk steps, not of the chunk budget per step.
  rho = min(full[1] / c.chunk * chunk_step / full[0], 0.999)
  ttft0 = prefill_ttft_p99(ctx.prompt_bins, c.chunk, chunk_step, rho)
  instances = ctx.system_gpus // (c.tp * c.ranks)  # whole instances; GPUs left over idle
  served = _served(ctx, c, instances * c.ranks, full[0], ttft0)
  if served is None:
    return None
  batch, wait = served
  t = _colocated_step(ctx, cost, c, batch)[0]
  used = instances * c.tp * c.ranks / ctx.system_gpus
  return dict(per_gpu=batch * tpr / t / c.tp * used, tpot_ms=full[0] / tpr * 1e3,
              ttft_ms=(ttft0 + wait) * 1e3, step_ms=t * 1e3, mean_batch=batch)


def _prefill_rank(ctx: _Ctx, tokens: int = 8192):
  """A prefill instance as the records deploy it (DeepSeek-R1: DEP2, attention
  DP 2 + EP 2; Llama 3.1 405B: TP2): (cost, seconds of a step of `tokens`
  tokens of whole prompts, tokens/s per GPU, prompts per step, GPUs)."""
  moe = presets.get(ctx.w.preset).is_moe
  tp, ranks, ep = (1, 2, 2) if moe else (2, 1, 1)
  cost = ctx.cost(tp, ranks, ep)
  n = max(1, round(tokens / ctx.new_prompt))
  L = int(ctx.new_prompt)
  s = StepShape(prefill_tokens=n * L, prefill_seqs=n, sampling_prefills=n,
                kv_read_tokens=n * L, pairs_prefill=n * (L * (L + 1) // 2))
  t = cost.step_time([s]).seconds
  return cost, t, n * L / t / (tp * ranks), n, tp * ranks


def disaggregated(ctx: _Ctx, c: Config) -> dict | None:
  decode_gpus = ctx.system_gpus - c.prefill_gpus
  if c.prefill_gpus < 1 or c.tp * c.ranks > decode_gpus:
    return None
  cost = ctx.cost(c.tp, c.ranks, c.ep)
  if c.batch > max_batch(cost, ctx):
    return None
  decode_gpus = decode_gpus // (c.tp * c.ranks) * c.tp * c.ranks  # whole instances
  tpr = tokens_per_row(c.mtp_k)
  full = cost.step_time([_shape(c.batch, ctx.context, c.mtp_k, 0, 0)]).seconds
  pcost, pstep, prate, n, pgpus = _prefill_rank(ctx)
  prompt_share = ctx.new_prompt / ctx.w.osl_mean / (c.prefill_gpus * prate)
  rho = decode_gpus * c.batch * tpr / full / c.tp * prompt_share  # at full batch
  servers = c.prefill_gpus // pgpus  # prefill instances, each serving n prompts a step
  if rho >= 1 or servers < 1:
    return None
  # A prompt waits for one of the instances' n prompt slots (M/M/c, each
  # held a step), then takes its own steps and its K/V's transfer: the p99
  # of the sum over the input-length bins.
  slots, load = servers * n, rho * servers * n
  waits = _erlang_c(slots, load)
  own = [(m, pstep * max(1.0, length / 8192) + pcost.kv_transfer_s(int(length)))
         for m, length in ctx.prompt_bins]
  ttft0 = _p99_of_sum(own, waits, waits, (slots - load) / pstep)
  served = _served(ctx, c, decode_gpus // c.tp, full, ttft0)
  if served is None:
    return None
  batch, wait = served
  t = cost.step_time([_shape(batch, ctx.context, c.mtp_k, 0, 0)]).seconds
  decode_rate = decode_gpus * batch * tpr / t / c.tp  # output tokens/s
  return dict(per_gpu=decode_rate / ctx.system_gpus, tpot_ms=full / tpr * 1e3,
              ttft_ms=(ttft0 + wait) * 1e3, step_ms=t * 1e3, mean_batch=batch,
              prefill_utilization=decode_rate * prompt_share)


BATCHES = (8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 640, 768, 1024, 1280, 1536, 2048)
CHUNKS = (512, 1024, 2048, 4096, 8192)


def _layouts(ctx: _Ctx) -> list[tuple[int, int, int]]:
  """(attention TP, attention-DP ranks, EP) of a decode instance that fits
  the system: dense TP2 / TP4 / TP8 (the 405B records run TP2 and TP4);
  MoE TP8 + EP8 or DEP8, and with wide EP DEP16 .. DEP64."""
  if not presets.get(ctx.w.preset).is_moe:
    out = [(2, 1, 1), (4, 1, 1), (8, 1, 1)]
  else:
    # EP sizes divide the 256 experts: the records run no EPLB (no redundant
    # expert slots in any moe_config), which an EP72 needs.
    sizes = (8, 16, 32, 64) if ctx.tech.wide_ep else (8,)
    out = [(8, 1, 8)] + [(1, n, n) for n in sizes]
  return [lay for lay in out if lay[0] * lay[1] <= ctx.system_gpus]


def _batches(ctx: _Ctx, lay: tuple[int, int, int]) -> list[int]:
  """The batch grid up to the record's cap, plus the largest batch the
  layout's K/V memory holds (under the cap)."""
  fit = min(ctx.batch_cap, max_batch(ctx.cost(*lay), ctx))
  return sorted({b for b in BATCHES if b <= fit} | ({fit} if fit >= 1 else set()))


def candidates(ctx: _Ctx):
  """Every configuration the techniques, the system and the batch cap allow."""
  moe = presets.get(ctx.w.preset).is_moe
  ks = (0, 1, 2, 3) if ctx.tech.mtp and presets.get(ctx.w.preset).num_mtp_layers else (0,)
  for (tp, ranks, ep), k in itertools.product(_layouts(ctx), ks):
    for b in _batches(ctx, (tp, ranks, ep)):
      for chunk in CHUNKS:
        yield Config(mode="colocated", tp=tp, ranks=ranks, ep=ep, mtp_k=k, chunk=chunk, batch=b)
      if ctx.tech.disaggregated:
        for p in range(8, ctx.system_gpus, 8 if moe else 4):
          if tp * ranks <= ctx.system_gpus - p:
            yield Config(mode="disaggregated", tp=tp, ranks=ranks, ep=ep, mtp_k=k, batch=b,
                         prefill_gpus=p)


def _record_candidates(ctx: _Ctx, record: Config):
  """The record's deployment at every batch cap up to its own."""
  for b in _batches(ctx, (record.tp, record.ranks, record.ep)):
    yield dataclasses.replace(record, batch=b)


def holds(sc: Scenario, r: dict) -> bool:
  return ((sc.tpot_ms is None or r["tpot_ms"] <= sc.tpot_ms)
          and (sc.ttft_ms is None or r["ttft_ms"] <= sc.ttft_ms))


def search(benchmark: str, scenario: str, tech: Techniques, *, eff: Efficiency = Efficiency(),
           dev: str = "gb300", system_gpus: int = 72, batch_cap: int = 512,
           record: Config | None = None) -> dict | None:
  """The configuration of most tokens/s per GPU that holds the scenario's
  limits: {per_gpu, tpot_ms, ttft_ms, step_ms, config} (None: none holds).
  With `record`, only that deployment (its batch cap searched)."""
  ctx = _Ctx(WORKLOADS[benchmark], SCENARIOS[(benchmark, scenario)], tech, eff, dev,
             system_gpus, batch_cap)
  best = None
  for c in candidates(ctx) if record is None else _record_candidates(ctx, record):
    r = colocated(ctx, c) if c.mode == "colocated" else disaggregated(ctx, c)
    if r is not None and holds(ctx.sc, r) and (best is None or r["per_gpu"] > best["per_gpu"]):
      best = dict(r, config=dataclasses.asdict(c))
  return best


def search_row(pub: dict, *, eff: Efficiency = Efficiency(), dev: str = "gb300",
               tech: Techniques | None = None, at_record: bool = False) -> dict | None:
  """`search` for one `PUBLISHED` row: its round's techniques (or `tech`),
  its record's system and batch cap; `at_record`: the record's deployment."""
  rec = pub["record"]
  return search(pub["benchmark"], pub["scenario"], tech or ROUND_TECHNIQUES[pub["round"]],
                eff=eff, dev=dev, system_gpus=rec.system_gpus, batch_cap=rec.config.batch,
                record=rec.config if at_record else None)


def _row(pub: dict, best: dict | None, at_rec: dict | None) -> dict:
  rec, pred = pub["record"], best["per_gpu"] if best else 0.0
  return dict(benchmark=pub["benchmark"], scenario=pub["scenario"], round=pub["round"],
              published_per_gpu=pub["per_gpu"], predicted_per_gpu=pred,
              ratio=pred / pub["per_gpu"], config=best["config"] if best else None,
              tpot_ms=best["tpot_ms"] if best else None,
              ttft_ms=best["ttft_ms"] if best else None,
              mean_batch=best["mean_batch"] if best else None,
              system_gpus=rec.system_gpus, submitter=rec.submitter,
              record_deployment=rec.deployment, record_source=rec.source,
              at_record_per_gpu=at_rec["per_gpu"] if at_rec else 0.0,
              at_record_ratio=(at_rec["per_gpu"] if at_rec else 0.0) / pub["per_gpu"],
              at_record_config=at_rec["config"] if at_rec else None, record_log=rec.log)


def predict_table(*, eff: Efficiency = Efficiency(), dev: str = "gb300", log=None,
                  at_record: bool = True) -> list[dict]:
  """One row per `PUBLISHED` entry: the search under that round's techniques
  on the record's system and batch cap, and (`at_record`) the record's own
  deployment."""
  rows = []
  for pub in PUBLISHED:
    best = search_row(pub, eff=eff, dev=dev)
    at_rec = search_row(pub, eff=eff, dev=dev, at_record=True) if at_record else None
    rows.append(_row(pub, best, at_rec))
    if log:
      log(rows[-1])
  return rows


# ------------------------------------------------------------------- ablation

ABLATION_CAUSE = {
    "fused_kernels": "faster, fused kernels: each part at its kernel family's measured fraction "
                     "(attention 0.595, dense 0.498, experts 0.859, comm 0.663) instead of the "
                     "unfused engine's 0.452",
    "batch_cap": "the v6.0 record's batch cap per rank instead of the v5.1 record's",
    "system": "the v6.0 record's system (GPUs) instead of the v5.1 record's: fewer slots to "
              "pool for Server, no EP beyond the system",
    "disaggregated": "disaggregated prefill / decode (no prefill in decode steps)",
    "wide_ep": "wide EP (experts over up to 72 GPUs: fewer expert bytes per GPU)",
    "mtp": "MTP speculative decoding, up to 3 drafts (TensorRT-LLM R1 acceptance)",
    "kv_routing": "KV-aware routing (reuses only the shared chat template here)",
}
ABLATION_ORDER = ("fused_kernels", "batch_cap", "system", "disaggregated", "wide_ep", "mtp",
                  "kv_routing")


def _published(benchmark: str, scenario: str, rnd: str) -> dict:
  return next(p for p in PUBLISHED if (p["benchmark"], p["scenario"], p["round"])
              == (benchmark, scenario, rnd))


def ablation(benchmark: str, scenario: str, *, eff: Efficiency = Efficiency(),
             dev: str = "gb300") -> dict:
  """From the v5.1 row's setup (techniques, batch cap, system) to the v6.0
  row's, one change at a time (ABLATION_ORDER; adp_balance is on in both),
  each step re-searching the best configuration: the factors multiply to
  predicted v6.0 / v5.1 exactly."""
  old, new = _published(benchmark, scenario, "v5.1"), _published(benchmark, scenario, "v6.0")
  setup = dict(tech=ROUND_TECHNIQUES["v5.1"], batch_cap=old["record"].config.batch,
               system_gpus=old["record"].system_gpus)
  run = lambda s: search(benchmark, scenario, s["tech"], eff=eff, dev=dev,
                         system_gpus=s["system_gpus"], batch_cap=s["batch_cap"])
  prev = run(setup)
  start, steps = prev["per_gpu"], []
  for name in ABLATION_ORDER:
    if name == "batch_cap":
      setup["batch_cap"] = new["record"].config.batch
    elif name == "system":
      setup["system_gpus"] = new["record"].system_gpus
    else:
      setup["tech"] = setup["tech"].with_(name)
    cur = run(setup)
    steps.append(dict(technique=name, cause=ABLATION_CAUSE[name],
                      factor=cur["per_gpu"] / prev["per_gpu"], per_gpu=cur["per_gpu"],
                      config=cur["config"]))
    prev = cur
  return dict(benchmark=benchmark, scenario=scenario, v51_per_gpu=start,
              v60_per_gpu=prev["per_gpu"], predicted_ratio=prev["per_gpu"] / start,
              product=math.prod(s["factor"] for s in steps), steps=steps)
