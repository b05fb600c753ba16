"""Cluster studies at DeepSeek-R1 scale with the simulator (`jaxinfer/sim/`).

`scale_study(...)` runs, on roofline step times (`sim.cost.RooflineCost`):

  anchors  batch-1 decode of DeepSeek-R1 on 8 B200 (TP8, FP4) against
           TensorRT-LLM's published 111 tokens/s/user (253 with MTP3): how
           far the roofline's latency terms are from a real system.
  ep       one instance of N GPUs (attention DP = EP = N) per device and N:
           whether the weights fit, K/V capacity, and the decode step at a
           few batches split into weights / experts / attention / all-to-all.
  pareto   closed-loop concurrency sweeps of co-located vs disaggregated
           serving, MTP off and K = 1..3: tokens/s/GPU against p99 TPOT, the
           best point under each TPOT limit (and its TTFT limit), $/M tokens.
  routing  KV-aware vs round-robin routing of multi-turn conversations over
           8-GPU instances: prefix hits, TTFT, tokens/s/GPU.
  balance  attention-DP rank choice (the engine's: pending tokens + K/V held;
           vs round-robin by request count) on one explicitly simulated
           8-rank instance with prompts of very different lengths.

Scale is reached by simulating a few ranks of an instance: a simulated rank
stands for one GPU, and the instance's other attention-DP ranks are
bootstrapped from the simulated ranks' recent steps (`WorkerSpec.
instance_ranks`), so a prefill chunk on any of the 72 ranks holds up the
whole step, as it does in a real attention-DP + EP step. Per-GPU figures are
then the same for any number of such instances; the cluster size enters
through the EP size, the NVLink domain and the disaggregated split.
Workload (ASSUMED, flags): prompts and outputs uniform in [x/2, 3x/2] around
ISL = OSL = 1024 (the common "1k/1k" benchmark point; MLPerf's DeepSeek-R1
set has longer outputs), closed-loop concurrency per decode rank.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxinfer import presets
from jaxinfer.engine.engine import EngineConfig
from jaxinfer.engine.speculative import MTPConfig
from jaxinfer.serving import workloads
from jaxinfer.serving.disagg import DisaggConfig
from jaxinfer.sim.cost import (Parallelism, RooflineCost, StepShape, cost_per_million_tokens,
                               device)
from jaxinfer.sim.engine import TRTLLM_R1_ACCEPTANCE, WorkerSpec, check_acceptance
from jaxinfer.sim.simulator import Simulator

PAGE = 64  # FlashMLA's page size
# TensorRT-LLM's balanced attention DP reports average / max tokens per rank
# 0.88 (serving_facts.md). The `ep` study no longer charges that constant: it
# charges the imbalance of the engine's own scheduling, simulated on all 8
# ranks of an instance (`balance`, `simulated_attn_imbalance`).
TRTLLM_ATTN_BALANCE = 0.88
# Published anchor: DeepSeek-R1 on 8 B200, TP8, FP4 weights, batch 1
# (TensorRT-LLM blog): 111 tokens/s/user, 253 with 3 MTP drafts.
ANCHOR = dict(device="b200", tp=8, weight_dtype="fp4", no_mtp=111.0, mtp3=253.0)


def _decode_shape(batch: int, context: int, k: int = 0) -> StepShape:
  rows = k + 1
  return StepShape(decode_seqs=batch, draft_tokens=batch * k, mtp_k=k,
                   kv_read_tokens=batch * (context + rows),
                   pairs_decode=batch * (rows * (context + rows) - rows * (rows - 1) // 2))


def anchors(*, model: str, context: int, acceptance) -> list[dict]:
  cfg = presets.get(model)
  cost = RooflineCost(cfg=cfg, device=device(ANCHOR["device"]),
                      par=Parallelism(tp=ANCHOR["tp"], ep=ANCHOR["tp"]),
                      weight_dtype=ANCHOR["weight_dtype"])
  rows = []
  for k, published in ((0, ANCHOR["no_mtp"]), (3, ANCHOR["mtp3"])):
    c = cost.step_time([_decode_shape(1, context, k)])
    per_step = 1 + sum(acceptance[:k])
    rows.append(dict(experiment="anchor", mtp_k=k, step_ms=c.seconds * 1e3,
                     tokens_per_step=per_step, tokens_per_s_user=per_step / c.seconds,
                     published=published, ratio=per_step / c.seconds / published,
                     parts_ms={n: v * 1e3 for n, v in c.parts.items()}))
  return rows


def ep_table(*, model: str, devices, gpus, weight_dtype: str, kv_dtype: str, context: int,
             attn_imbalance: float, batches=(32, 128)) -> list[dict]:
  """Decode at `context` on one instance of n GPUs (attention DP = EP = n),
  one rank simulated; attn_imbalance (max / mean rank work, from
  `simulated_attn_imbalance`) charged to the others."""
  cfg = presets.get(model)
  rows = []
  for dev in devices:
    for n in gpus:
      cost = RooflineCost(cfg=cfg, device=device(dev), par=Parallelism(dp=n, ep=n),
                          weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                          attn_imbalance=attn_imbalance)
      row = dict(experiment="ep", device=dev, gpus=n, ep=n,
                 weights_gb_per_gpu=cost.weight_bytes_per_gpu() / 1e9,
                 network_all_to_all=n > cost.device.nvlink_domain)
      try:
        row["kv_tokens_per_gpu"] = cost.kv_pages(PAGE) * PAGE
      except ValueError as e:
        rows.append(dict(row, fits=False, error=str(e)))
        continue
      row["fits"] = True
      for b in batches:
        c = cost.step_time([_decode_shape(b, context)])
        row[f"b{b}"] = dict(step_ms=c.seconds * 1e3, tokens_per_s_per_gpu=b / c.seconds,
                            parts_ms={k: v * 1e3 for k, v in c.parts.items()})
      rows.append(row)
  return rows


def _items(n: int, *, isl: int, osl: int, seed: int, vocab: int = 100_000) -> list:
  """Prompt and output lengths uniform in [x/2, 3x/2] (varied lengths keep a
  closed loop from running in lockstep)."""
  rng = np.random.default_rng([seed, 5])
  return [workloads.Item(0.0, tuple(rng.integers(0, vocab, int(rng.integers(isl // 2,
                                                                            3 * isl // 2 + 1)))),
                         int(rng.integers(osl // 2, 3 * osl // 2 + 1))) for _ in range(n)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Setup:
  """What one pareto curve holds fixed."""
  mode: str  # "colocated" | "disaggregated"
  mtp_k: int
  split: tuple[int, int] = (0, 1)  # simulated (prefill, decode) ranks
  acceptance_name: str = "trtllm"
  budget: int = 2048  # co-located: token budget per step (the prefill chunk)

  @property
  def label(self) -> str:
    mtp = f"MTP{self.mtp_k}" if self.mtp_k else "no MTP"
    acc = "" if self.acceptance_name == "trtllm" or not self.mtp_k else f" ({self.acceptance_name})"
    if self.mode == "colocated":
      return f"co-located, chunk {self.budget}, {mtp}{acc}"
    return f"disagg {self.split[0]}P:{self.split[1]}D, {mtp}{acc}"


def _specs(setup: _Setup, *, cfg, dev, gpus, concurrency, weight_dtype, kv_dtype,
           prefill_ep, acceptance, slowdown=1.0) -> list[WorkerSpec]:
  spec = MTPConfig(num_draft_tokens=setup.mtp_k, batch_schedule=()) if setup.mtp_k else None
  acc = acceptance if setup.mtp_k else ()
  common = dict(weight_dtype=weight_dtype, kv_dtype=kv_dtype, slowdown=slowdown)
  p, d = setup.split
  d_gpus = gpus * d // (p + d)
  link = "nvlink" if gpus <= dev.nvlink_domain else "network"
  dec = RooflineCost(cfg=cfg, device=dev, par=Parallelism(dp=d_gpus, ep=d_gpus), kv_link=link,
                     **common)
  if setup.mode == "colocated":
    config = EngineConfig(page_size=PAGE, max_num_seqs=concurrency,
                          max_num_batched_tokens=setup.budget, speculative=spec)
    return [WorkerSpec(cost=dec, config=config, ranks=d, instance_ranks=d_gpus, acceptance=acc,
                       name="mixed")]
  pre = RooflineCost(cfg=cfg, device=dev, par=Parallelism(dp=prefill_ep, ep=prefill_ep),
                     kv_link=link, **common)
  # Prefill ranks take whole prompts (8k-token steps, compute-bound); decode
  # ranks only decode, so their budget only bounds the rows of MTP blocks.
  pconf = EngineConfig(page_size=PAGE, max_num_seqs=64, max_num_batched_tokens=8192,
                       speculative=spec)
  dconf = EngineConfig(page_size=PAGE, max_num_seqs=concurrency,
                       max_num_batched_tokens=concurrency * (setup.mtp_k + 1), speculative=spec)
  return [WorkerSpec(cost=pre, config=pconf, role="prefill", ranks=p, instance_ranks=prefill_ep,
                     acceptance=acc, name="prefill"),
          WorkerSpec(cost=dec, config=dconf, role="decode", ranks=d, instance_ranks=d_gpus,
                     acceptance=acc, name="decode")]


def _point(setup, specs, items, concurrency, price, seed) -> dict:
  sim = Simulator(specs, router="round_robin", disagg=DisaggConfig(mode="always"), seed=seed)
  res = sim.run(items, concurrency=concurrency)
  s = res.summary(price_per_gpu_hour=price)
  serving = "mixed" if setup.mode == "colocated" else "decode"
  why = s["why"]
  w = why[serving]
  kinds = w["kinds"]
  return dict(
      experiment="pareto", curve=setup.label, mode=setup.mode, mtp_k=setup.mtp_k,
      split=list(setup.split), acceptance=setup.acceptance_name,
      concurrency_per_decode_rank=concurrency // setup.split[1],
      tokens_per_s_per_gpu=s["tokens_per_s_per_gpu"], usd_per_million=s["usd_per_million_tokens"],
      tpot_ms=s["tpot_ms"], ttft_ms=s["ttft_ms"], latency_requests=s["latency_requests"],
      decode_batch=w["decode_seqs_per_rank"], tokens_per_decode_row=w["tokens_per_decode_row"],
      decode_step_ms=kinds.get("decode", {}).get("step_ms", math.nan),
      mixed_step_ms=kinds.get("mixed", {}).get("step_ms", math.nan),
      mixed_share=kinds.get("mixed", {}).get("share", 0.0),
      prefill_tokens_per_mixed_step=kinds.get("mixed", {}).get("prefill_tokens_per_rank", 0.0),
      parts_ms=w["parts_ms_per_step"], mean_step_ms=w["mean_step_ms"],
      prefill_busy=(why["prefill"]["busy_s"] / max(s["duration_s"], 1e-9) / setup.split[0]
                    if "prefill" in why else None),
      mean_transfer_ms=s["mean_transfer_ms"])


def pareto(*, model, dev_name, gpus, isl, osl, weight_dtype, kv_dtype, concurrencies, mtp_ks,
           disagg_splits, disagg_mtp_ks, acceptance, extra_acceptance, colo_budget, prefill_ep,
           price, rounds, seed, slowdown=1.0, log=print) -> list[dict]:
  cfg, dev = presets.get(model), device(dev_name)
  setups = [_Setup(mode="colocated", mtp_k=k, budget=colo_budget) for k in mtp_ks]
  setups += [_Setup(mode="colocated", mtp_k=max(mtp_ks), acceptance_name=name,
                    budget=colo_budget) for name in extra_acceptance if max(mtp_ks, default=0)]
  setups += [_Setup(mode="disaggregated", mtp_k=k, split=tuple(sp))
             for sp in disagg_splits for k in disagg_mtp_ks]
  rows = []
  for setup in setups:
    acc = extra_acceptance.get(setup.acceptance_name, acceptance)
    for c in concurrencies:
      total = c * setup.split[1]
      items = _items(int(rounds * total) + 8, isl=isl, osl=osl, seed=seed)
      specs = _specs(setup, cfg=cfg, dev=dev, gpus=gpus, concurrency=c,
                     weight_dtype=weight_dtype, kv_dtype=kv_dtype, prefill_ep=prefill_ep,
                     acceptance=acc, slowdown=slowdown)
      row = _point(setup, specs, items, total, price, seed)
      row.update(device=dev_name, gpus=gpus, isl=isl, osl=osl, slowdown=slowdown,
                 colo_budget=setup.budget if setup.mode == "colocated" else None)
      rows.append(row)
      log(format_point(row))
  return rows


def best_under(rows, *, tpot_ms: float, ttft_ms: float) -> dict:
  """Per curve, the point of most tokens/s/GPU whose p99 TPOT and p99 TTFT
  hold the limits (None when no point does)."""
  out = {}
  for r in rows:
    ok = r["tpot_ms"]["p99"] <= tpot_ms and r["ttft_ms"]["p99"] <= ttft_ms
    best = out.get(r["curve"])
    if ok and (best is None or r["tokens_per_s_per_gpu"] > best["tokens_per_s_per_gpu"]):
      out[r["curve"]] = r
    else:
      out.setdefault(r["curve"], None)
  return out


def routing(*, model, dev_name, gpus, weight_dtype, kv_dtype, seed, price) -> list[dict]:
  """Multi-turn conversations (each turn's prompt extends the last) over
  gpus / 8 instances of TP8 attention + EP8, one scheduler each."""
  cfg, dev = presets.get(model), device(dev_name)
  n = max(2, gpus // 8)
  cost = RooflineCost(cfg=cfg, device=dev, par=Parallelism(tp=8, ep=8),
                      weight_dtype=weight_dtype, kv_dtype=kv_dtype)
  config = EngineConfig(page_size=PAGE, max_num_seqs=128, max_num_batched_tokens=8192)
  # Prefill-heavy agentic-style traffic: long shared histories, short
  # answers, conversations starting in a rush (64 per instance per second)
  # so that prefill queues form. 32 n + 3 conversations: a count that is
  # not a multiple of n, so round-robin does not bring a conversation back
  # to the same instance every turn by accident of the fixed think time.
  items = workloads.multi_turn(32 * n + 3, 8, 64.0 * n, vocab_size=100_000, system_len=2048,
                               user_len=512, reply_len=512, think_s=2.0, max_tokens=32,
                               seed=seed)
  rows = []
  for policy in ("kv", "round_robin"):
    specs = [WorkerSpec(cost=cost, config=config, gpus_per_rank=8, name=f"i{i}")
             for i in range(n)]
    s = Simulator(specs, router=policy, seed=seed).run(items).summary(
        window=None, price_per_gpu_hour=price)
    rows.append(dict(experiment="routing", router=policy, device=dev_name, gpus=8 * n,
                     instances=n, prefix_hit_rate=s["prefix_hit_rate"],
                     ttft_ms=s["ttft_ms"], tpot_ms=s["tpot_ms"],
                     tokens_per_s_per_gpu=s["tokens_per_s_per_gpu"],
                     mean_step_ms=s["why"]["mixed"]["mean_step_ms"],
                     mixed_share=s["why"]["mixed"]["kinds"].get("mixed", {}).get("share", 0.0),
                     **workloads.summary(items)))
  return rows


def balance(*, model, dev_name, weight_dtype, kv_dtype, osl, seed, price,
            concurrency_per_rank=32) -> list[dict]:
  """One 8-GPU instance (DP8 attention, EP8), all 8 ranks simulated:
  prompts of 256 or 8192 tokens (one in eight long)."""
  cfg, dev = presets.get(model), device(dev_name)
  cost = RooflineCost(cfg=cfg, device=dev, par=Parallelism(dp=8, ep=8),
                      weight_dtype=weight_dtype, kv_dtype=kv_dtype)
  rng = np.random.default_rng([seed, 7])
  total = 8 * concurrency_per_rank
  items = [workloads.Item(0.0, tuple(rng.integers(0, 100_000, 8192 if rng.random() < 0.125
                                                  else 256)),
                          int(rng.integers(osl // 2, 3 * osl // 2 + 1)))
           for _ in range(int(2.5 * total))]
  rows = []
  for policy, dp_balance in (("tokens", "none"), ("tokens", "split"), ("round_robin", "none")):
    config = EngineConfig(page_size=PAGE, max_num_seqs=concurrency_per_rank * 2,
                          max_num_batched_tokens=2048, dp_balance=dp_balance)
    spec = WorkerSpec(cost=cost, config=config, ranks=8, rank_policy=policy)
    s = Simulator([spec], seed=seed).run(items, concurrency=total).summary(
        price_per_gpu_hour=price)
    w = s["why"]["mixed"]
    rows.append(dict(experiment="balance", rank_policy=policy, dp_balance=dp_balance,
                     device=dev_name, gpus=8,
                     attn_dp_balance=w["attn_dp_balance"], mean_step_ms=w["mean_step_ms"],
                     decode_only_balance=w["kinds"].get("decode", {}).get("attn_dp_balance"),
                     decode_only_share=w["kinds"].get("decode", {}).get("share", 0.0),
                     tokens_per_s_per_gpu=s["tokens_per_s_per_gpu"], tpot_ms=s["tpot_ms"],
                     ttft_ms=s["ttft_ms"]))
  return rows


def simulated_attn_imbalance(balance_rows: list[dict]) -> float:
  """max / mean rank work of decode steps under the engine's default
  scheduling (token-balanced rank choice, `EngineConfig().dp_balance`), from
  `balance`'s all-ranks simulation."""
  default = EngineConfig().dp_balance
  row = next(r for r in balance_rows
             if r["rank_policy"] == "tokens" and r["dp_balance"] == default)
  b = row["decode_only_balance"] or row["attn_dp_balance"]
  return 1.0 / b


def format_point(r: dict) -> str:
  t, f = r["tpot_ms"], r["ttft_ms"]
  return (f"  {r['curve']:<34s} conc/rank {r['concurrency_per_decode_rank']:4d}  "
          f"TPOT p50 {t['p50']:6.1f} p99 {t['p99']:6.1f} ms  TTFT p99 {f['p99']:7.0f} ms  "
          f"{r['tokens_per_s_per_gpu']:7.0f} tok/s/GPU  batch {r['decode_batch']:5.1f}  "
          f"decode step {r['decode_step_ms']:5.1f} ms, with prefill {r['mixed_step_ms']:6.1f} ms "
          f"({100 * r['mixed_share']:3.0f}% of steps)  tok/row {r['tokens_per_decode_row']:.2f}")


def check_inputs(*, price_per_gpu_hour, isl, osl, rounds, concurrencies, mtp_ks,
                 disagg_splits, acceptance) -> None:
  if not price_per_gpu_hour >= 0:
    raise ValueError(f"price_per_gpu_hour must be >= 0, got {price_per_gpu_hour}")
  if isl < 2 or osl < 2:
    raise ValueError(f"isl and osl must be >= 2, got {isl}, {osl}")
  if not rounds >= 1:
    raise ValueError(f"rounds must be >= 1, got {rounds}")
  if not concurrencies or min(concurrencies) < 1:
    raise ValueError(f"concurrencies must be >= 1, got {concurrencies}")
  for k in mtp_ks:
    if not isinstance(k, int) or not 0 <= k <= 8:
      raise ValueError(f"MTP draft tokens must be ints in [0, 8], got {k!r}")
  for sp in disagg_splits:
    if len(sp) != 2 or min(sp) < 1:
      raise ValueError(f"disagg splits are (prefill ranks >= 1, decode ranks >= 1), got {sp}")
  check_acceptance(acceptance, max(mtp_ks, default=0))


def cost_table(best: dict, *, price: float) -> dict:
  return {curve: None if r is None else dict(
      tokens_per_s_per_gpu=r["tokens_per_s_per_gpu"],
      usd_per_million=cost_per_million_tokens(price_per_gpu_hour=price, gpus=1,
                                              tokens_per_s=r["tokens_per_s_per_gpu"]),
      concurrency_per_decode_rank=r["concurrency_per_decode_rank"],
      tpot_p99_ms=r["tpot_ms"]["p99"], ttft_p99_ms=r["ttft_ms"]["p99"])
      for curve, r in best.items()}


def weight_dtype_for(dev_name: str, weight_dtype: str) -> str:
  """"auto": FP4 (NVFP4) on Blackwell, whose MLPerf DeepSeek-R1 entries
  run FP4 weights; FP8 (DeepSeek's released format) on Hopper."""
  if weight_dtype != "auto":
    return weight_dtype
  return "fp4" if device(dev_name).fp4_flops else "fp8"


def _study_anchors(model, isl, acceptance, log) -> list[dict]:
  log("\n== anchors: batch-1 decode, DeepSeek-R1 on 8 B200 (TP8, FP4) ==")
  rows = anchors(model=model, context=isl, acceptance=acceptance)
  for r in rows:
    log(f"  MTP{r['mtp_k']}: model {r['tokens_per_s_user']:6.1f} tokens/s/user "
        f"(step {r['step_ms']:.2f} ms x {r['tokens_per_step']:.2f} tokens) vs published "
        f"{r['published']:.0f}: x{r['ratio']:.2f}; latency floor "
        f"{r['parts_ms']['latency_floor']:.2f} ms, comm {r['parts_ms']['comm']:.2f} ms")
  return rows


def _study_ep(model, devices, gpus, weight_dtype, kv_dtype, context, attn_imbalance,
              log) -> list[dict]:
  log(f"\n== ep: one instance, attention DP = EP = N, decode at context {context}; the "
      f"unsimulated ranks charged max/mean attention work {attn_imbalance:.3f} (simulated "
      f"scheduling; TensorRT-LLM reports {1 / TRTLLM_ATTN_BALANCE:.3f}) ==")
  rows = []
  for dev in devices:
    wd = weight_dtype_for(dev, weight_dtype)
    for r in ep_table(model=model, devices=(dev,), gpus=gpus, weight_dtype=wd,
                      kv_dtype=kv_dtype, context=context, attn_imbalance=attn_imbalance):
      r["weight_dtype"], r["attn_imbalance"] = wd, attn_imbalance
      rows.append(r)
      log(format_ep(r))
  return rows


def _study_pareto(*, colo_budgets, mtp_ks, disagg_splits, extra_acceptance, **kw) -> list[dict]:
  """Co-located curves per step budget (every MTP depth at the first, none
  and the deepest at the others), then disaggregated splits."""
  curves = []
  for budget in colo_budgets:
    ks = mtp_ks if budget == colo_budgets[0] else tuple(sorted({0, max(mtp_ks, default=0)}))
    curves.append(dict(colo_budget=budget, mtp_ks=tuple(ks), disagg_splits=()))
  curves.append(dict(colo_budget=colo_budgets[0], mtp_ks=(), disagg_splits=disagg_splits))
  return [r for c in curves
          for r in pareto(**kw, **c, extra_acceptance=extra_acceptance if c is curves[0] else {})]


def _study_routing(model, dev_name, gpus, wd, kv_dtype, seed, price, log) -> list[dict]:
  log(f"\n== routing: multi-turn conversations over {gpus // 8} instances of 8 "
      f"{dev_name} (TP8 attention, EP8) ==")
  rows = routing(model=model, dev_name=dev_name, gpus=gpus, weight_dtype=wd, kv_dtype=kv_dtype,
                 seed=seed, price=price)
  for r in rows:
    log(f"  {r['router']:<12s} prefix hits {100 * r['prefix_hit_rate']:5.1f}%  TTFT mean "
        f"{r['ttft_ms']['mean']:7.0f} p99 {r['ttft_ms']['p99']:7.0f} ms  TPOT p50 "
        f"{r['tpot_ms']['p50']:5.1f} ms  {r['tokens_per_s_per_gpu']:7.0f} tok/s/GPU  "
        f"steps with prefill {100 * r['mixed_share']:3.0f}%  (shareable prefix "
        f"{100 * r['shared_prefix_fraction']:.0f}% of prompt tokens)")
  return rows


def _study_balance(model, dev_name, wd, kv_dtype, osl, seed, price, log) -> list[dict]:
  log(f"\n== balance: one DP8/EP8 instance of {dev_name}, all 8 ranks simulated, "
      f"1 prompt in 8 of 8192 tokens, the rest 256 ==")
  rows = balance(model=model, dev_name=dev_name, weight_dtype=wd, kv_dtype=kv_dtype, osl=osl,
                 seed=seed, price=price)
  for r in rows:
    dec = r["decode_only_balance"]
    dec = "-" if dec is None else f"{dec:.2f}"
    log(f"  rank choice {r['rank_policy']:<12s} dp_balance {r['dp_balance']:<5s} balance "
        f"(mean/max rank work) "
        f"{r['attn_dp_balance']:.2f} over all steps, {dec} over the "
        f"{100 * r['decode_only_share']:.0f}% without prefill;  step "
        f"{r['mean_step_ms']:5.1f} ms  TPOT p50 "
        f"{r['tpot_ms']['p50']:5.1f} ms  {r['tokens_per_s_per_gpu']:7.0f} tok/s/GPU")
  return rows


def scale_study(*, model: str = "deepseek_v3", devices=("gb300", "b200", "h200", "h100"),
                gpus=(8, 16, 32, 72, 144, 288), pareto_device: str = "gb300",
                pareto_gpus: int = 72, isl: int = 1024, osl: int = 1024,
                weight_dtype: str = "auto", kv_dtype: str = "bf16",
                concurrencies=(8, 16, 32, 64, 128, 192, 256), mtp_ks=(0, 1, 2, 3),
                colo_budgets=(512, 2048), disagg_splits=((1, 1), (1, 2)),
                disagg_mtp_ks=(0, 3), acceptance=TRTLLM_R1_ACCEPTANCE,
                extra_acceptance: dict | None = None, prefill_ep: int = 8,
                price_per_gpu_hour: float = 3.0, limits=((15.0, 1500.0), (80.0, 2000.0)),
                rounds: float = 2.0, routing_gpus: int = 64, slowdown: float = 1.0,
                experiments=("anchors", "ep", "pareto", "routing", "balance"), seed: int = 0,
                log=print) -> dict:
  """The studies of the module docstring. limits: (TPOT, TTFT) p99 ms pairs
  (DeepSeek-R1 Interactive and Server). -> {"rows": [...], "best": ...}."""
  extra_acceptance = dict(extra_acceptance or {})
  check_inputs(price_per_gpu_hour=price_per_gpu_hour, isl=isl, osl=osl, rounds=rounds,
               concurrencies=concurrencies, mtp_ks=tuple(mtp_ks) + tuple(disagg_mtp_ks),
               disagg_splits=disagg_splits, acceptance=acceptance)
  for name, acc in extra_acceptance.items():
    check_acceptance(acc, max(mtp_ks, default=0))
  for dev in (*devices, pareto_device):
    device(dev)
  context = isl + osl // 2
  rows, best = [], {}
  if "anchors" in experiments:
    rows += _study_anchors(model, isl, acceptance, log)
  wd = weight_dtype_for(pareto_device, weight_dtype)
  balance_rows = []
  if "balance" in experiments or "ep" in experiments:
    balance_rows = _study_balance(model, pareto_device, wd, kv_dtype, osl, seed,
                                  price_per_gpu_hour, log)
  if "ep" in experiments:
    rows += _study_ep(model, devices, gpus, weight_dtype, kv_dtype, context,
                      simulated_attn_imbalance(balance_rows), log)
  if "pareto" in experiments:
    wd = weight_dtype_for(pareto_device, weight_dtype)
    log(f"\n== pareto: {model} on {pareto_gpus} {pareto_device} ({wd} weights, {kv_dtype} K/V), "
        f"ISL {isl} / OSL {osl} (+-50%), closed loop, roofline slowdown {slowdown:g} ==")
    pareto_rows = _study_pareto(
        model=model, dev_name=pareto_device, gpus=pareto_gpus, isl=isl, osl=osl,
        weight_dtype=wd, kv_dtype=kv_dtype, concurrencies=concurrencies, mtp_ks=mtp_ks,
        colo_budgets=colo_budgets, disagg_splits=disagg_splits, disagg_mtp_ks=disagg_mtp_ks,
        acceptance=acceptance, extra_acceptance=extra_acceptance, prefill_ep=prefill_ep,
        price=price_per_gpu_hour, rounds=rounds, seed=seed, slowdown=slowdown, log=log)
    rows += pareto_rows
    for tpot, ttft in limits:
      b = best_under(pareto_rows, tpot_ms=tpot, ttft_ms=ttft)
      best[f"tpot{tpot:g}ms_ttft{ttft:g}ms"] = cost_table(b, price=price_per_gpu_hour)
      log(format_best(b, tpot=tpot, ttft=ttft, price=price_per_gpu_hour))
  if "routing" in experiments:
    rows += _study_routing(model, pareto_device, routing_gpus, wd, kv_dtype, seed,
                           price_per_gpu_hour, log)
  if "balance" in experiments:
    rows += balance_rows
  return dict(rows=rows, best=best)


def format_ep(r: dict) -> str:
  head = (f"  {r['device']:<6s} {r['gpus']:4d} GPUs ({r['weight_dtype']}): weights "
          f"{r['weights_gb_per_gpu']:6.1f} GB/GPU")
  if not r["fits"]:
    return head + "  DOES NOT FIT"
  out = head + f", K/V room {r['kv_tokens_per_gpu'] / 1e6:5.2f}M tokens/GPU" + \
      (" (all-to-all over the network)" if r["network_all_to_all"] else "")
  for key in ("b32", "b128"):
    b = r[key]
    p = b["parts_ms"]
    out += (f"\n      batch {key[1:]:>3s}/GPU: step {b['step_ms']:5.1f} ms = dense "
            f"{p['dense']:4.1f} + experts {p['experts']:4.1f} + attention {p['attention']:4.1f}"
            f" + comm {p['comm']:5.1f} + floor {p['latency_floor']:4.1f} + other "
            f"{p['head'] + p['overhead']:3.1f}  -> {b['tokens_per_s_per_gpu']:6.0f} tok/s/GPU")
  return out


def format_best(best: dict, *, tpot: float, ttft: float, price: float) -> str:
  lines = [f"\n  best under p99 TPOT <= {tpot:g} ms and p99 TTFT <= {ttft:g} ms "
           f"(${price:.2f}/GPU-hour):"]
  for curve, r in sorted(best.items(), key=lambda kv: -(kv[1] or {}).get(
      "tokens_per_s_per_gpu", -1)):
    if r is None:
      lines.append(f"    {curve:<44s} no point meets the limits")
      continue
    usd = cost_per_million_tokens(price_per_gpu_hour=price, gpus=1,
                                  tokens_per_s=r["tokens_per_s_per_gpu"])
    why = (f"pure decode steps {r['decode_step_ms']:.1f} ms" if r["mode"] == "disaggregated"
           else f"{100 * r['mixed_share']:.0f}% of steps carry prefill on some rank "
                f"({r['mixed_step_ms']:.1f} ms vs {r['decode_step_ms']:.1f} ms pure decode)")
    lines.append(f"    {curve:<44s} {r['tokens_per_s_per_gpu']:7.0f} tok/s/GPU  ${usd:6.3f}/M  "
                 f"conc/rank {r['concurrency_per_decode_rank']:3d}, batch "
                 f"{r['decode_batch']:5.1f}, TPOT p99 {r['tpot_ms']['p99']:5.1f} ms, "
                 f"{r['tokens_per_decode_row']:.2f} tok/step; {why}")
  return "\n".join(lines)
