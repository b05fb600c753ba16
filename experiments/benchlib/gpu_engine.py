"""The Engine on one GPU at real widths, random bf16 weights (issue 37, 4c).

`run_engine_bench(record, save, deadline=..., dry_run=...)` fills `record`
in place, calling `save()` after every measurement, in priority order:

  dense  llama3_8b: decode at batch 1 / 8 / 64 against the HBM roofline,
         prefill of 2k-token prompts against the bf16 matmul roofline, and
         Pallas against XLA attention (greedy tokens) at batch 8, and decode
         on the Mosaic GPU paged kernel (Backend attention "mosaic") at batch
         1 / 8 / 64 against the Pallas (Triton) runs of the same prompts
  moe    a DeepSeek-V3 slice at full width (MLA, 1 dense + 1 MoE layer of
         256 sigmoid-routed experts, 1 MTP module): decode at batch 1 / 8 /
         64 against the HBM roofline, MTP speculation with K = 1, 2, 3
         drafts, Pallas against XLA at batch 8, and decode on the Mosaic
         GPU MLA kernel at batch 1 / 8 / 64 against the Pallas runs

Decode runs the Engine's default form (on a GPU: per-layer weights, q, k and
v fused); at some batches the same decode over the stacked layers, scanned
(`EngineConfig(unroll_layers=False)`), measures what that form gains.

Each model's decode at one batch (8) also traces ten decode steps of its
warm engine under jax's profiler and records the top kernels by device time
(`benchlib.trace_top`; on CPU the host's XLA op events). After the dense
model's measurements, its peer: transformers' `generate` on the same config
with random weights, a static cache and torch.compile, at batch 1 and 8, in
the same process (`benchlib.torch_peer`), with our decode tokens/s over the
peer's at each batch.

Each measurement runs on a fresh `Engine` (the jitted steps are shared by
engines of one config): an untimed run on other random prompts compiles its
programs, then a timed run with the same shapes. Decode is timed from the
moment every request has its first token (the whole batch is prefilled in
one step) to the end: no prefill inside. Every sub-measurement is time-boxed
against `deadline` (skipped when its estimate does not fit) and records its
own error instead of raising. `dry_run` runs the same code on CPU at tiny
shapes (tiny_dense, tiny_moe; float32; Pallas interpreted).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import platform
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchlib import torch_peer, trace_top
from benchlib.decode import count_xla_compiles
from benchlib.decode_roofline import decode_bytes_per_step, expected_experts
from benchlib.kernel_timing import measure_roofline, short_error
from jaxinfer import hf_config, models, ops, presets
from jaxinfer.backend import Backend
from jaxinfer.config import ModelConfig
from jaxinfer.engine import Engine, EngineConfig, SamplingParams
from jaxinfer.engine.speculative import MTPConfig
from jaxinfer.models.specs import is_spec

CONVENTIONS = {
    "decode tokens_per_s": "tokens emitted after every request of the batch had its first token "
                           "/ wall time from that moment to the last token (host loop of "
                           "Engine.step, async scheduling; prefill excluded)",
    "step_s": "that window / the engine steps finishing in it (steps dispatched after the "
              "moment + the one in flight then)",
    "tpot_s": "mean over the requests of RequestMetrics.tpot_s (bench.decode's convention)",
    "bytes_per_step": "benchlib.decode_roofline.decode_bytes_per_step in the weight dtype: every weight but "
                      "the embedding (batch rows of it), MTP modules excluded; routed experts "
                      "counted as the distinct experts the batch's tokens touch on average, "
                      "E(1 - (1 - k/E)^batch) per MoE layer; KV of the mean context "
                      "(prompt + new / 2)",
    "roofline_tokens_per_s": "batch * roofline.hbm_gbps * 1e9 / bytes_per_step.total",
    "fraction_of_roofline": "tokens_per_s / roofline_tokens_per_s",
    "prefill tokens_per_s": "batch * prompt_len / (submit -> every first token known), the "
                            "batch in one step, median of the timed runs",
    "prefill flops": "2 * tokens * (matmul weights but the embedding and the head, routed "
                     "experts scaled by k/E) + 2 * batch * head + per layer 2 * N * (D_qk + "
                     "D_v) * T(T+1)/2 per sequence (causal attention)",
    "prefill fraction_of_roofline": "flops / time / (roofline.matmul_tflops * 1e12)",
    "first_call_s": "wall time of the untimed run (compiles included)",
    "xla_compiles": "XLA backend compiles in the untimed run (_warm) and in the timed run "
                    "(_timed, 0 when each program compiled once); _retimed > 0: the first "
                    "timed run compiled (a lazily defined jax config changed the tracing "
                    "context) and the timed run was repeated",
    "pallas_vs_xla": "the timed prompts run greedy under Backend attention xla; identical: every "
                     "token equal; match_fraction: equal tokens at equal positions / all; "
                     "first_divergence: the earliest position any request differs (None: none)",
    "mtp": "speculative decoding with the model's MTP module, K drafts every step, same prompts "
           "as decode at that batch; mean_accepted_length: tokens per sequence per verify step "
           "(Engine.stats, over the untimed and the timed run); same_tokens_as_plain: "
           "match_fraction against plain greedy decoding of the same prompts",
    "scanned": "decode with EngineConfig(unroll_layers=False): the stacked layers scanned, "
               "same prompts as decode at that batch, whose Engine holds its default form (on "
               "a GPU per-layer weights, read in place; the scanned step copies each layer's "
               "weights out of the stack: gpu_plan --weights); decode_over_scanned: decode's "
               "tokens_per_s / this run's; identical / match_fraction: greedy tokens against "
               "decode's",
    "mosaic": "decode under Backend(attention='mosaic', grouped_matmul='mosaic') (the "
              "Mosaic GPU kernels on GQA steps and MLA decode steps, jax's ragged_dot_mgpu "
              "for unquantized experts, Pallas / XLA elsewhere), same prompts as decode at "
              "that batch; kernel: "
              "'mosaic' where ops.mosaic_kernel picks a Mosaic kernel for the "
              "step's shapes, else why not (the step then ran Pallas); speedup_vs_pallas: "
              "tokens_per_s / decode's; identical / match_fraction: greedy tokens against "
              "decode's",
    "trace": "decode at Shapes.trace_batch: after the timed run, other prompts of the same "
             "shapes run to min(trace_steps, new_tokens - 1) + 1 tokens; once every request "
             "has its first token, the engine steps to the end under jax.profiler.trace "
             "(decode_steps: Engine.step calls traced; with async scheduling the first decode "
             "step was dispatched just before and the last call only collects tokens); "
             "top: the trace_top.TOP_K names with the most time among the "
             "device plane's stream events (source 'device'), or on CPU the host's innermost "
             "XLA op events (source 'host'): count, total_ms, share = total / traced_ms (every "
             "selected event's time added up); xla_compiles: XLA compiles while traced (0: "
             "the warm programs); status 'unavailable' | 'error' with why, never raised",
    "torch_peer": "transformers' generate on the dense config (hf_config.to_hf) with random "
                  "weights, greedy, static cache; GPU: bfloat16 and generate's torch.compile "
                  "of the decode step (mode reduce-overhead, fullgraph); CPU dry run: float32, "
                  "eager, one thread; same prompt_len / new_tokens as decode; per batch: "
                  "tokens_per_s = batch * (new_tokens - 1) / (the fastest generate of "
                  "new_tokens - the fastest of 1 token); ours_over_peer: decode's tokens_per_s "
                  "at that batch / the peer's (benchlib.torch_peer)",
}

# every run's kernels, Mosaic and XLA entries aside (explicit: a Hopper's default is Mosaic)
_PALLAS = Backend(attention="pallas", grouped_matmul="xla")
_MIN_COMPILE_LEFT_S = 20.0  # never start a compile-heavy step with less left (real run)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shapes:
  """One model's measurements: decode batches, prompt and new tokens per request."""
  batches: tuple[int, ...]
  prompt_len: int
  new_tokens: int
  page_size: int
  identity_batch: int
  prefill_batch: int = 0  # 0: no prefill measurement
  prefill_len: int = 0
  mtp_ks: tuple[int, ...] = ()
  mtp_batch: int = 1
  mosaic_batches: tuple[int, ...] = ()  # decode under Backend attention "mosaic"
  scanned_batches: tuple[int, ...] = ()  # decode over the stacked layers, scanned
  trace_batch: int = 0  # the decode batch traced under jax's profiler (0: none)
  trace_steps: int = 10  # decode steps traced (at most new_tokens - 1)
  peer_batches: tuple[int, ...] = ()  # transformers' generate at these batches (torch_peer)
  max_batched_tokens: int = 1 << 30  # cap on the prefill step (chunks beyond it)


def plan(dry_run: bool) -> list[tuple[str, ModelConfig, Shapes]]:
  """The models and shapes of a run: [(role, config, shapes)].

  Real: page sizes and lengths keep every decode in one page bucket (llama:
  200 + 56 tokens, pages 13..16; DeepSeek: 8 + 24 tokens in one 64-token
  page, up to K more with MTP), so each batch compiles one prefill and one
  decode program. DeepSeek's prompts are short because on GPU `ragged_dot`
  may expand its rows over all 256 experts (XLA's RaggedDotRewriter): the
  prefill step's temp then grows as E x tokens x k x D; on a device too
  small for that beside two routed-expert blocks, the MTP block is made
  dense (`fit_memory`, noted in the record)."""
  if dry_run:  # two layers each (MoE: 1 dense + 1 MoE + MTP, as the slice); CI time: MoE at
    # batch 8 only, MTP with 1 and 3 drafts
    dense = presets.get("tiny_dense", dtype="float32", backend=_PALLAS, num_layers=2)
    moe = presets.get("tiny_moe", dtype="float32", backend=_PALLAS, num_layers=2,
                      dense_layers=(0,))
    return [("dense", dense, Shapes(batches=(1, 8), prompt_len=6, new_tokens=4, page_size=16,
                                    identity_batch=8, prefill_batch=2, prefill_len=32,
                                    mosaic_batches=(8,), scanned_batches=(8,), trace_batch=8,
                                    peer_batches=(1, 8))),
            ("moe", moe, Shapes(batches=(8,), prompt_len=6, new_tokens=4, page_size=16,
                                identity_batch=8, mtp_ks=(1, 3), mtp_batch=8,
                                max_batched_tokens=48, trace_batch=8))]
  dense = presets.get("llama3_8b", dtype="bfloat16", backend=_PALLAS)
  moe = presets.get("deepseek_v3", dtype="bfloat16", backend=_PALLAS, num_layers=2,
                    dense_layers=(0,))
  return [("dense", dense, Shapes(batches=(1, 8, 64), prompt_len=200, new_tokens=56, page_size=16,
                                  identity_batch=8, prefill_batch=4, prefill_len=2048,
                                  mosaic_batches=(1, 8, 64), scanned_batches=(1, 64),
                                  trace_batch=8, peer_batches=(1, 8))),
          ("moe", moe, Shapes(batches=(1, 8, 64), prompt_len=8, new_tokens=24, page_size=64,
                              identity_batch=8, mtp_ks=(1, 2, 3), mtp_batch=1,
                              max_batched_tokens=512, mosaic_batches=(1, 8, 64),
                              scanned_batches=(64,), trace_batch=8))]


# ----------------------------------------------------------------------------- time box


def _json_safe(x):
  """NaN / inf (an acceptance with nothing drafted) -> None, so the JSON is strict."""
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, dict):
    return {k: _json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_json_safe(v) for v in x]
  return x


class _Box:
  """Runs sub-measurements against the deadline: each gets an estimate (a
  default per kind, then the last wall time of that kind), is skipped when it
  does not fit, records its error instead of raising, and is saved."""

  def __init__(self, deadline: float, save: Callable[[], None], dry_run: bool):
    self.deadline, self.save = deadline, save
    self.min_left = 1.0 if dry_run else _MIN_COMPILE_LEFT_S
    self.scale = 0.05 if dry_run else 1.0  # the defaults are GPU guesses
    self.walls: dict[str, float] = {}

  def left(self) -> float:
    return self.deadline - time.monotonic()

  def estimate(self, kind: str, default_s: float) -> float:
    return self.walls.get(kind, default_s * self.scale)

  def run(self, into: dict, key: str, kind: str, default_s: float, fn: Callable[[], dict], *,
          then: tuple[str, float] | None = None) -> dict:
    """into[key] = fn()'s entry with status ok / error, or skipped when its
    estimate (plus that of `then`, (kind, default_s): what must fit after it
    to be of use) exceeds the time left. -> the entry."""
    est = self.estimate(kind, default_s) + (self.estimate(*then) if then else 0.0)
    if self.left() < max(est, self.min_left):
      entry = dict(status="skipped", reason="time box", estimate_s=round(est, 1),
                   left_s=round(self.left(), 1))
    else:
      t0 = time.monotonic()
      try:
        entry = _json_safe({"status": "ok", **fn()})  # fn may say "skipped" itself
      except Exception as e:  # noqa: BLE001  (recorded; the next measurement runs)
        entry = dict(status="error", error=short_error(e))
      entry["wall_s"] = self.walls[kind] = time.monotonic() - t0
      print(f"[engine bench] {key}: {entry['status']} ({entry['wall_s']:.1f}s)"
            + (f" {entry['error']}" if "error" in entry else ""), flush=True)
    into[key] = entry
    self.save()
    return entry


# ----------------------------------------------------------------------------- accounting


def param_bytes(cfg: ModelConfig) -> int:
  specs = models.param_specs(cfg)
  return sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize
             for s in jax.tree.leaves(specs, is_leaf=is_spec))


def prefill_flops(cfg: ModelConfig, batch: int, prompt_len: int) -> float:
  """Matmul FLOPs of prefilling `batch` prompts of `prompt_len` (CONVENTIONS)."""
  specs = models.param_specs(cfg)
  k_over_e = cfg.num_experts_per_tok / cfg.num_experts if cfg.is_moe else 0.0
  per_token = 0.0
  for path, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
    top = path[0].key
    dims = [a for a in s.logical_axes if a not in ("layers",)]
    if top in ("embed", "lm_head", "mtp") or len(dims) < 2:
      continue  # gathers, the head (per sequence, below), norms and biases
    n = math.prod(s.shape)
    per_token += 2 * n * (k_over_e if "expert" in s.logical_axes else 1.0)
  tokens = batch * prompt_len
  head = 2.0 * cfg.d_model * cfg.vocab_size * batch
  pairs = prompt_len * (prompt_len + 1) / 2
  attn = cfg.num_layers * batch * 2.0 * cfg.num_heads * (cfg.qk_head_dim + cfg.attn_v_head_dim) * pairs
  return per_token * tokens + head + attn


def _decode_roofline(cfg: ModelConfig, batch: int, prompt_len: int, new_tokens: int,
                     gbps: float, tokens_per_s: float) -> dict:
  item = cfg.compute_dtype().itemsize
  b = decode_bytes_per_step(cfg, batch, prompt_len + new_tokens // 2, item)
  roof = batch * gbps * 1e9 / b["total"]
  out = dict(bytes_per_step=b, roofline_tokens_per_s=roof,
             fraction_of_roofline=tokens_per_s / roof,
             ideal_step_s=b["total"] / (gbps * 1e9))
  if cfg.is_moe:  # and what it reads when every expert is read (a dense ragged_dot)
    touched = expected_experts(cfg.num_experts, cfg.num_experts_per_tok, batch)
    out.update(experts_touched_per_layer=touched,
               bytes_per_step_all_experts=b["total"] + b["experts"] * (cfg.num_experts / touched - 1))
  return out


# ----------------------------------------------------------------------------- serving


def _prompts(cfg: ModelConfig, batch: int, length: int, seed: int) -> list[list[int]]:
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, length)).tolist()


def _engine(cfg, params, s: Shapes, batch: int, prompt_len: int, new_tokens: int,
            spec_k: int | None = None, unroll: bool | None = None) -> Engine:
  extra = spec_k + 1 if spec_k else 0  # MTP reserves pages for the most a step may accept
  per_seq = -(-(prompt_len + new_tokens + extra) // s.page_size)
  return Engine(cfg, params, EngineConfig(
      page_size=s.page_size, num_pages=batch * per_seq + 1, max_num_seqs=batch,
      max_num_batched_tokens=max(min(batch * prompt_len, s.max_batched_tokens), batch * (extra + 1)),
      max_model_len=prompt_len + new_tokens + extra + s.page_size, enable_prefix_caching=False,
      ignore_eos=True, unroll_layers=unroll,
      speculative=MTPConfig(num_draft_tokens=spec_k, batch_schedule=()) if spec_k else None))


def _serve(engine: Engine, prompts, new_tokens: int) -> dict:
  """Runs prompts through engine.step; times the prefill (submit -> every
  first token) and the decode window after it. -> timings and token ids."""
  sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0)
  t0 = time.perf_counter()
  ids = [engine.submit(p, sampling) for p in prompts]
  waiting, t_first, steps_first, tokens_after = set(ids), None, 0, 0
  while engine.has_unfinished():
    events = engine.step()
    if t_first is not None:
      tokens_after += sum(len(t) for _, t, _ in events)
      continue
    waiting -= {rid for rid, t, _ in events if t}
    if not waiting:
      t_first, steps_first = time.perf_counter(), engine.stats()["steps"]
      tokens_after = sum(len(engine.output(i).token_ids) for i in ids) - len(ids)
  t_end = time.perf_counter()
  outs = [engine.output(i) for i in ids]
  assert all(len(o.token_ids) == new_tokens for o in outs), "a request stopped early"
  in_flight = 1 if engine.config.async_scheduling and engine.stats()["steps"] > steps_first else 0
  steps = engine.stats()["steps"] - steps_first + in_flight
  window = t_end - t_first
  tpots = [o.metrics.tpot_s for o in outs if o.metrics.tpot_s is not None]
  return dict(prefill_s=t_first - t0, decode_s=window, decode_steps=steps,
              decode_tokens=tokens_after, tokens=[o.token_ids for o in outs],
              tpot_s=statistics.mean(tpots) if tpots else None)


def _trace_decode(engine: Engine, prompts, steps: int) -> dict:
  """`steps` decode steps of the warm engine under jax's profiler: prompts
  submitted for steps + 1 tokens, stepped untraced until every request has
  its first token, then traced to the end -> trace_top's record (CONVENTIONS
  "trace") with decode_steps and xla_compiles."""
  sampling = SamplingParams(max_tokens=steps + 1, temperature=0.0)
  waiting = {engine.submit(p, sampling) for p in prompts}
  while waiting and engine.has_unfinished():
    waiting -= {rid for rid, t, _ in engine.step() if t}
  ran = [0]

  def decode():
    while engine.has_unfinished():
      engine.step()
      ran[0] += 1

  with count_xla_compiles() as xla:
    out = trace_top.trace_top(decode)
  decode()  # what a failed trace left unfinished
  if out["status"] == "ok" and jax.default_backend() == "gpu" and out["source"] != "device":
    out["note"] = "no device events in the trace (is CUPTI available?): host op times"
  return dict(out, batch=len(prompts), decode_steps=ran[0], xla_compiles=xla[0])


def _measure(cfg, params, s: Shapes, batch: int, prompt_len: int, new_tokens: int, *,
             spec_k: int | None = None, timed_runs: int = 1, unroll: bool | None = None,
             trace_steps: int = 0) -> tuple[dict, list]:
  """A fresh engine: an untimed run (compiles), then `timed_runs` on other
  prompts (the last run's prompts: seed 2), then (trace_steps > 0) that
  many decode steps traced (`_trace_decode`, prompts of seed 3).
  -> (entry, the last run's tokens)."""
  engine = _engine(cfg, params, s, batch, prompt_len, new_tokens, spec_k, unroll)
  timed = lambda: [_serve(engine, _prompts(cfg, batch, prompt_len, seed=2), new_tokens)
                   for _ in range(timed_runs)]
  try:
    with count_xla_compiles() as xla:
      t0 = time.perf_counter()
      _serve(engine, _prompts(cfg, batch, prompt_len, seed=1), new_tokens)
      first_call_s = time.perf_counter() - t0
      compiles_warm, xla_warm = engine.stats()["compiles"], xla[0]
      runs = timed()
      # A jax module imported lazily by the first kernel lowering can add a
      # config to the tracing context (jax 0.11: Pallas interpret mode), so the
      # first program compiles again on its next call: then time again.
      xla_retimed, xla_mark = xla[0] - xla_warm, xla[0]
      if xla_retimed:
        runs = timed()
    stats = engine.stats()
    trace = (_trace_decode(engine, _prompts(cfg, batch, prompt_len, seed=3), trace_steps)
             if trace_steps else None)
  finally:
    engine.release()
  run = runs[-1]
  entry = dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
               first_call_s=first_call_s, compiles_warm=compiles_warm,
               compiles_after=stats["compiles"], xla_compiles_warm=xla_warm,
               xla_compiles_retimed=xla_retimed,
               xla_compiles_timed=xla[0] - xla_mark if xla_retimed else xla_retimed,
               host_ms_per_step=stats["host_ms_per_step"],
               prefill_s=statistics.median(r["prefill_s"] for r in runs),
               prefill_tokens_per_s=statistics.median(batch * prompt_len / r["prefill_s"]
                                                       for r in runs))
  if new_tokens > 1:
    entry.update(tokens_per_s=run["decode_tokens"] / run["decode_s"],
                 step_s=run["decode_s"] / max(run["decode_steps"], 1),
                 decode_steps=run["decode_steps"], tpot_s=run["tpot_s"])
  if spec_k:
    entry.update(K=spec_k, mean_accepted_length=stats["spec_mean_accepted_length"],
                 acceptance_per_position=stats["spec_acceptance_per_position"])
  if trace:
    entry["trace"] = trace
  return entry, run["tokens"]


def _compare(ours: list[list[int]], ref: list[list[int]]) -> dict:
  equal = total = 0
  first = None
  for a, b in zip(ours, ref):
    total += max(len(a), len(b))
    for i, (x, y) in enumerate(zip(a, b)):
      equal += x == y
      if x != y and (first is None or i < first):
        first = i
    if len(a) != len(b) and first is None:
      first = min(len(a), len(b))
  return dict(identical=ours == ref, match_fraction=equal / max(total, 1), first_divergence=first,
              identical_requests=sum(a == b for a, b in zip(ours, ref)), requests=len(ref))


# ----------------------------------------------------------------------------- one model


def config_summary(cfg: ModelConfig) -> dict:
  keys = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
          "ffn_dim", "attention", "kv_lora_rank", "q_lora_rank", "num_experts",
          "num_experts_per_tok", "moe_ffn_dim", "num_shared_experts", "router", "dense_layers",
          "num_mtp_layers", "dtype")
  out = {k: getattr(cfg, k) for k in keys}
  out["backend"] = dataclasses.asdict(cfg.backend)
  out["dense_layers"] = list(cfg.dense_layers)
  out.update(params=models.count_params(cfg), param_bytes=param_bytes(cfg))
  return out


def fit_memory(cfg: ModelConfig, s: Shapes, limit: int | None) -> tuple[ModelConfig, str]:
  """cfg, with a routed-expert MTP block made dense when it would leave too
  little of the device's `limit` bytes for the steps' temps (`plan`: a dense
  ragged_dot's E x rows x D expansion at the largest prefill step). -> (cfg, note)."""
  if not cfg.is_moe or not cfg.num_mtp_layers or limit is None:
    return cfg, ""
  rows = min(max(s.batches) * s.prompt_len, s.max_batched_tokens) * cfg.num_experts_per_tok
  temp = cfg.num_experts * rows * cfg.d_model * cfg.compute_dtype().itemsize
  need = param_bytes(cfg) + temp + (4 << 30)
  if need <= limit:
    return cfg, f"fits: ~{need / 2**30:.1f} GiB needed of {limit / 2**30:.1f} GiB"
  lite = dataclasses.replace(cfg, dense_layers=(*cfg.dense_layers, cfg.num_layers))
  return lite, (f"MTP block made dense: with routed experts it needs ~{need / 2**30:.1f} GiB "
                f"of {limit / 2**30:.1f} GiB")


class _Model:
  """One model's measurements over its params; `tokens` keeps each batch's
  timed greedy tokens (Pallas) for the identity and MTP comparisons."""

  def __init__(self, out: dict, cfg: ModelConfig, params, s: Shapes, roof: dict):
    self.out, self.cfg, self.params, self.s, self.roof = out, cfg, params, s, roof
    self.tokens: dict[int, list] = {}

  def decode(self, b: int) -> dict:
    s = self.s
    steps = min(s.trace_steps, s.new_tokens - 1) if b == s.trace_batch else 0
    entry, self.tokens[b] = _measure(self.cfg, self.params, s, b, s.prompt_len, s.new_tokens,
                                     trace_steps=steps)
    entry.update(_decode_roofline(self.cfg, b, s.prompt_len, s.new_tokens,
                                  self.roof["hbm_gbps"], entry["tokens_per_s"]))
    return entry

  def prefill(self) -> dict:
    s = self.s
    entry, _ = _measure(self.cfg, self.params, s, s.prefill_batch, s.prefill_len, 1, timed_runs=2)
    flops = prefill_flops(self.cfg, s.prefill_batch, s.prefill_len)
    achieved = flops * entry["prefill_tokens_per_s"] / (s.prefill_batch * s.prefill_len)
    entry.update(flops=flops, tflops=achieved / 1e12,
                 fraction_of_roofline=achieved / (self.roof["matmul_tflops"] * 1e12))
    return entry

  def mtp(self, k: int) -> dict:
    s = self.s
    entry, got = _measure(self.cfg, self.params, s, s.mtp_batch, s.prompt_len, s.new_tokens,
                          spec_k=k)
    plain = self.out["decode"].get(f"batch_{s.mtp_batch}", {})
    if plain.get("status") == "ok":
      entry["speedup_vs_plain"] = entry["tokens_per_s"] / plain["tokens_per_s"]
      entry["same_tokens_as_plain"] = _compare(got, self.tokens[s.mtp_batch])["match_fraction"]
    return entry

  def identity(self) -> dict:
    s, b = self.s, self.s.identity_batch
    if b not in self.tokens:  # the Pallas run of this batch did not happen: run it now
      _, self.tokens[b] = _measure(self.cfg, self.params, s, b, s.prompt_len, s.new_tokens)
    xla = dataclasses.replace(self.cfg, backend=dataclasses.replace(self.cfg.backend,
                                                                    attention="xla"))
    entry, got = _measure(xla, self.params, s, b, s.prompt_len, s.new_tokens)
    keep = ("first_call_s", "tokens_per_s", "step_s", "compiles_after", "xla_compiles_timed")
    return dict(batch=b, prompt_len=s.prompt_len, new_tokens=s.new_tokens,
                **_compare(self.tokens[b], got), xla={k: entry[k] for k in keep},
                pallas_tokens_per_s=self.out["decode"].get(f"batch_{b}", {}).get("tokens_per_s"))

  def scanned(self, b: int) -> dict:
    """Decode at batch b over the stacked layers, scanned
    (`EngineConfig(unroll_layers=False)`), against decode's run in the
    Engine's default form."""
    s = self.s
    entry, got = _measure(self.cfg, self.params, s, b, s.prompt_len, s.new_tokens, unroll=False)
    entry.update(_decode_roofline(self.cfg, b, s.prompt_len, s.new_tokens,
                                  self.roof["hbm_gbps"], entry["tokens_per_s"]))
    plain = self.out["decode"].get(f"batch_{b}", {})
    if plain.get("status") == "ok":
      entry.update(decode_over_scanned=plain["tokens_per_s"] / entry["tokens_per_s"],
                   **_compare(got, self.tokens[b]))
    return entry

  def mosaic(self, b: int) -> dict:
    """Decode at batch b under Backend attention "mosaic", against decode's run."""
    s = self.s
    cfg = dataclasses.replace(self.cfg, backend=dataclasses.replace(
        self.cfg.backend, attention="mosaic", grouped_matmul="mosaic"))
    entry, got = _measure(cfg, self.params, s, b, s.prompt_len, s.new_tokens)
    entry.update(kernel=mosaic_kernel(cfg, s, b))
    plain = self.out["decode"].get(f"batch_{b}", {})
    if plain.get("status") == "ok":
      entry.update(speedup_vs_pallas=entry["tokens_per_s"] / plain["tokens_per_s"],
                   **_compare(got, self.tokens[b]))
    return entry


def mosaic_kernel(cfg: ModelConfig, s: Shapes, batch: int) -> str:
  """'mosaic' when a decode step of this config runs a Mosaic GPU kernel,
  else why not: `ops.mosaic_kernel` asked with the step's shapes,
  as `ops.ragged_paged_attention` asks it."""
  window = 0 if cfg.window_choices() == (0,) else max(cfg.window_choices())
  if cfg.attention.latent:  # one latent pool: the keys, the values its first R columns
    K, H, kw = 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dict(latent_dim=cfg.kv_lora_rank)
  else:
    K, H, kw = cfg.num_kv_heads, cfg.head_dim, dict(values_dim=cfg.head_dim)
  kernel, why = ops.mosaic_kernel((batch, cfg.num_heads, H), cfg.compute_dtype(),
                                  (K, batch, s.page_size, H), window=window,
                                  sinks=cfg.attention_sinks, **kw)
  return "mosaic" if kernel else f"pallas ({why})"


def torch_peer_entry(cfg: ModelConfig, s: Shapes, decode: dict, deadline: float) -> dict:
  """transformers' generate on cfg at s.peer_batches (`torch_peer.measure_generate`,
  same prompt and new tokens as our decode), each batch with our decode's
  tokens/s (`decode`: the model's decode record) and ours / the peer's."""
  peer = torch_peer.measure_generate(hf_config.to_hf(cfg), batches=s.peer_batches,
                                     prompt_len=s.prompt_len, new_tokens=s.new_tokens,
                                     gpu=jax.default_backend() == "gpu", deadline=deadline)
  if "params" in peer:
    peer["same_params_as_ours"] = peer["params"] == models.count_params(cfg)
  for key, e in peer.get("batches", {}).items():
    ours = decode.get(key, {})
    if ours.get("status") == "ok" and e.get("tokens_per_s"):
      e.update(ours_tokens_per_s=ours["tokens_per_s"],
               ours_over_peer=ours["tokens_per_s"] / e["tokens_per_s"])
  return peer


def _init(cfg: ModelConfig, holder: dict) -> dict:
  """Random params made on the device by one jitted program (so each leaf's
  float32 draw fuses into its cast instead of living whole) -> holder."""
  t0 = time.perf_counter()
  holder["params"] = jax.block_until_ready(
      jax.jit(lambda key: models.init_params(cfg, key))(jax.random.key(0)))
  return dict(init_s=time.perf_counter() - t0,
              device=str(jax.tree.leaves(holder["params"])[0].devices()))


def _run_model(out: dict, box: _Box, role: str, cfg: ModelConfig, s: Shapes, roof: dict) -> None:
  """Init, then decode per batch, scanned decode, prefill, MTP per K,
  Pallas vs XLA, Mosaic decode and the torch peer, in that order, each
  time-boxed (init only when a decode fits after it)."""
  cfg, note = fit_memory(cfg, s, (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit"))
  out.update(config=config_summary(cfg), memory_note=note, decode={},
             **({"mtp": {}} if s.mtp_ks else {}))
  holder = {}
  init = box.run(out, "init", f"{role}_init", 20, lambda: _init(cfg, holder),
                 then=(f"{role}_decode", 45))
  if "params" not in holder:  # every measurement of the model needs its weights
    why = dict(status="skipped", reason=f"init {init['status']}")
    out["decode"].update({f"batch_{b}": dict(why) for b in s.batches})
    out.get("mtp", {}).update({f"k_{k}": dict(why) for k in s.mtp_ks})
    out.update({"pallas_vs_xla": dict(why), **({"prefill": dict(why)} if s.prefill_batch else {})})
    if s.mosaic_batches:
      out["mosaic"] = {f"batch_{b}": dict(why) for b in s.mosaic_batches}
    if s.scanned_batches:
      out["scanned"] = {f"batch_{b}": dict(why) for b in s.scanned_batches}
    if s.peer_batches:
      out["torch_peer"] = dict(why)
    box.save()
    return
  m = _Model(out, cfg, holder.pop("params"), s, roof)
  for b in s.batches:
    box.run(out["decode"], f"batch_{b}", f"{role}_decode", 45, lambda b=b: m.decode(b))
  for b in s.scanned_batches:
    box.run(out.setdefault("scanned", {}), f"batch_{b}", f"{role}_scanned", 60,
            lambda b=b: m.scanned(b))
  if s.prefill_batch:
    box.run(out, "prefill", f"{role}_prefill", 30, m.prefill)
  for k in s.mtp_ks:
    box.run(out["mtp"], f"k_{k}", f"{role}_mtp", 45, lambda k=k: m.mtp(k))
  box.run(out, "pallas_vs_xla", f"{role}_identity", 45, m.identity)
  for b in s.mosaic_batches:
    box.run(out.setdefault("mosaic", {}), f"batch_{b}", f"{role}_mosaic", 45,
            lambda b=b: m.mosaic(b))
  del m
  gc.collect()
  if s.peer_batches:  # compiles a model of its own: after ours, before the next model
    box.run(out, "torch_peer", f"{role}_torch_peer", 120,
            lambda: torch_peer_entry(cfg, s, out["decode"], box.deadline))


# ----------------------------------------------------------------------------- the run


def _meta(dry_run: bool) -> dict:
  dev = jax.local_devices()[0]
  stats = dev.memory_stats() or {}
  return dict(device_kind=dev.device_kind, platform=dev.platform, jax=jax.__version__,
              jaxlib=_jaxlib_version(),
              python=platform.python_version(), dry_run=dry_run,
              bytes_limit=stats.get("bytes_limit"), conventions=CONVENTIONS)


def _jaxlib_version():
  try:
    import jaxlib  # noqa: PLC0415
    return jaxlib.__version__
  except Exception:  # noqa: BLE001
    return None


def run_engine_bench(record: dict, save: Callable[[], None], *, deadline: float,
                     dry_run: bool, roofline: dict | None = None) -> None:
  """Fills `record` (JSON values only) in priority order, saving after each
  measurement: meta, roofline, then per model ("dense", "moe") its config,
  init, decode {batch_B} (the trace batch's with its trace), scanned
  {batch_B}, prefill, mtp {k_K}, pallas_vs_xla, mosaic {batch_B}, and
  torch_peer (the dense model's). deadline: a
  `time.monotonic()` value; roofline: {"hbm_gbps", "matmul_tflops"} measured
  earlier in the run, else measured here (`benchlib.kernel_timing.measure_roofline`)."""
  t0 = time.monotonic()
  record["meta"] = _meta(dry_run)
  save()
  box = _Box(deadline, save, dry_run)
  gpu = jax.default_backend() == "gpu"
  if roofline is None:
    box.run(record, "roofline", "roofline", 15, lambda: dict(
        source="measured here", **measure_roofline(gpu=gpu, dtype="bfloat16" if gpu else "float32",
                                                   warmup=2, repeats=5)))
  else:
    record["roofline"] = dict(status="ok", source="given", **roofline)
    save()
  roof = record["roofline"]
  for role, cfg, shapes in plan(dry_run):
    record[role] = out = dict(model=cfg.model_type, shapes=dataclasses.asdict(shapes))
    if roof.get("status") != "ok":
      out.update(status="skipped", reason="no roofline")
      continue
    _run_model(out, box, role, cfg, shapes, roof)
    gc.collect()
  record["meta"]["wall_s"] = time.monotonic() - t0
  save()
