"""End-to-end decode and prefill throughput: jaxinfer's `Engine` against HF
transformers + PyTorch and the memory roofline, all measured in one run.

What is measured, and why:

  bandwidth  `measure_bandwidth`: a jitted `jnp.sum` streaming over a float32
             array (1 GiB by default), median GB/s. Decode is memory bound, so
             this is the ceiling the roofline divides by. Measured in the same
             run because a shared machine's bandwidth moves with its load.
  bytes      `decode_bytes_per_step`: what one decode step must read at least:
             every weight but the embedding table (only `batch` rows of it), the
             routed experts a batch touches on average, and the KV cache.
  ours       `bench_engine`: requests through `jaxinfer.Engine`, the path users
             run (scheduler, paged cache, sampling, host overhead included);
             compiles are excluded by an identical warm-up on the same engine.
  peer       `bench_hf`: `AutoModelForCausalLM.from_config` + greedy `generate`
             on the same machine, same model shapes (random weights on both
             sides; the weights are not copied over: only speed is compared),
             timed per token from inside the call, like the Engine's TTFT/TPOT.

Roofline: tokens/s <= batch * bandwidth / bytes per step (perf_facts.md).
`run_decode_bench` runs everything and writes JSON + PNG via `results.write`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchlib import results
from benchlib.decode_roofline import decode_bytes_per_step, measure_bandwidth
from benchlib.hf_peer import bench_hf, hf_model, hf_param_count
from benchlib.results import machine_info
from jaxinfer import hf_config as hf_config_lib
from jaxinfer import models, presets
from jaxinfer.config import ModelConfig, QuantConfig
from jaxinfer.engine import Engine, EngineConfig, SamplingParams
from jaxinfer.engine import inspect as engine_inspect
from jaxinfer.engine import weight_layout as layout_probe

CONVENTIONS = {
    "decode tokens_per_s": "ours: batch / mean TPOT over the batch's requests (every prompt is "
                           "prefilled in one step, so TPOT spans decode steps only); hf: "
                           "batch * (new_tokens - 1) / (time of the last token - time of the "
                           "first) inside one generate call (a StoppingCriteria stamps each step)",
    "prefill tokens_per_s": "ours: batch * prompt_len / max TTFT of max_tokens=1 requests; hf: "
                            "batch * prompt_len / (generate call start -> first token), "
                            "max_new_tokens=1",
    "median/min/max": "over `repeats` timed runs, after one untimed warm-up run",
    "bytes_per_step": "weights but the embedding table + batch embedding rows + (MoE) routed "
                      "experts E(1 - (1 - k/E)^batch) per layer + KV of the mean decode context "
                      "(prompt_len + new_tokens / 2); MTP modules excluded (plain decoding)",
    "roofline_tokens_per_s": "batch * bandwidth.gbps * 1e9 / bytes_per_step.total; "
                             "bandwidth.gbps: the higher of the jnp.sum read bandwidth "
                             "measured before and after the timed cells",
    "fraction_of_roofline": "tokens_per_s / roofline_tokens_per_s",
    "ratio_vs_hf": "ours tokens_per_s / hf tokens_per_s (medians), same phase and batch",
}




_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_xla_compiles():
  """Counts XLA backend compiles inside the block (-> a one-element list)."""
  count = [0]

  def listener(event, duration_secs, **kwargs):
    del duration_secs, kwargs
    count[0] += event == _COMPILE_EVENT

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield count
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def bench_engine(cfg: ModelConfig, params, *, batch: int, prompt_len: int, new_tokens: int,
                 repeats: int, seed: int = 0, engine_options: dict | None = None) -> dict:
  """`batch` random prompts of `prompt_len` tokens, submitted together through
  one `Engine`, greedy, each run to exactly `new_tokens` (ignore_eos).

  The token budget fits every prompt in one prefill step, so TTFT is that step
  and TPOT spans pure decode steps. Prefix caching is off and every repeat
  draws fresh prompts (nothing is served from cache). One untimed warm-up run
  compiles the programs: the engine's program count (`stats()["compiles"]`)
  before and after the timed runs should be equal, and `xla_compiles_timed`
  (XLA backend compiles while timed) 0.
  -> {prefill: spread, decode: spread | None, compiles_warm, compiles_after,
      xla_compiles_timed, host_ms_per_step (`Engine.stats`), param_leaves
      (arrays the step takes as weights)}. engine_options: more `EngineConfig`
  fields (cpu_weight_layout, decode_steps, ...).
  """
  ps = 16
  per_seq = -(-(prompt_len + new_tokens) // ps)
  ec = EngineConfig(page_size=ps, num_pages=batch * per_seq + 1,  # + the reserved null page
                    max_num_seqs=batch,
                    max_num_batched_tokens=batch * prompt_len, enable_prefix_caching=False,
                    ignore_eos=True, **(engine_options or {}))
  engine = Engine(cfg, params, ec)
  rng = np.random.default_rng(seed)
  sampling = SamplingParams(max_tokens=new_tokens)

  def once():
    prompts = rng.integers(0, cfg.vocab_size, (batch, prompt_len)).tolist()
    outs = engine.generate(prompts, sampling)
    assert all(len(o.token_ids) == new_tokens for o in outs), "a request stopped early"
    m = [o.metrics for o in outs]
    prefill = batch * prompt_len / max(x.ttft_s for x in m)
    decode = batch / statistics.mean(x.tpot_s for x in m) if new_tokens > 1 else None
    return prefill, decode

  once()
  warm = engine.stats()["compiles"]
  with count_xla_compiles() as xla_compiles:
    runs = [once() for _ in range(repeats)]
  stats = engine.stats()
  return dict(prefill=results.spread([p for p, _ in runs]),
              decode=results.spread([d for _, d in runs]) if new_tokens > 1 else None,
              compiles_warm=warm, compiles_after=stats["compiles"],
              xla_compiles_timed=xla_compiles[0], host_ms_per_step=stats["host_ms_per_step"],
              param_leaves=len(jax.tree.leaves(engine_inspect.step_params(engine))))



# ----------------------------------------------------------------------------- the run


def format_table(rows: list[dict]) -> str:
  lines = ["| phase | side | batch | prompt | tokens/s median (min-max) | ours/HF (quantized: "
           "/float) | roofline tok/s | fraction of roofline |", "|---|---|---|---|---|---|---|---|"]
  fmt = lambda x, f: "-" if x is None else format(x, f)
  for r in rows:
    lines.append(
        f"| {r['phase']} | {r['side']} | {r['batch']} | {r['prompt_len']} | "
        f"{r['tokens_per_s']:.1f} ({r['tokens_per_s_min']:.1f}-{r['tokens_per_s_max']:.1f}) | "
        f"{fmt(r.get('ratio_vs_hf', r.get('ratio_vs_float')), '.2f')} | "
        f"{fmt(r.get('roofline_tokens_per_s'), '.1f')} | "
        f"{fmt(r.get('fraction_of_roofline'), '.2f')} |")
  return "\n".join(lines)


def _plot(rows: list[dict], path: str) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  dec = [r for r in rows if r["phase"] == "decode"]
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  sides = ["jaxinfer", "hf"] + sorted({r["side"] for r in dec} - {"jaxinfer", "hf"})
  for side, style in zip(sides, ("o-", "s-", "^-", "v-", "d-", "p-")):
    sel = sorted((r for r in dec if r["side"] == side), key=lambda r: r["batch"])
    if not sel:
      continue
    b = [r["batch"] for r in sel]
    axes[0].errorbar(b, [r["tokens_per_s"] for r in sel], fmt=style, capsize=3, label=side,
                     yerr=[[r["tokens_per_s"] - r["tokens_per_s_min"] for r in sel],
                           [r["tokens_per_s_max"] - r["tokens_per_s"] for r in sel]])
    axes[1].plot(b, [r["fraction_of_roofline"] for r in sel], style, label=side)
  roof = sorted({(r["batch"], r["roofline_tokens_per_s"]) for r in dec if r["side"] == "jaxinfer"})
  axes[0].plot([b for b, _ in roof], [t for _, t in roof], "kx--", label="memory roofline (float)")
  axes[0].set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens / s",
              title="decode throughput")
  axes[1].set(xscale="log", xlabel="batch", ylabel="fraction of the roofline",
              title="decode vs memory roofline")
  for ax in axes:
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _bandwidth(nbytes: int, when: str) -> dict:
  bw = measure_bandwidth(nbytes)
  print(f"bandwidth ({when}): {bw['gbps']:.1f} GB/s (jnp.sum); numpy copy "
        f"{bw['numpy_copy_gbps']:.1f} GB/s (read + write)", flush=True)
  return bw


_COMPILE_KEYS = ("compiles_warm", "compiles_after", "xla_compiles_timed", "host_ms_per_step",
                 "param_leaves")


def _row(phase, side, batch, prompt_len, new_tokens, spread, **extra) -> dict:
  return dict(phase=phase, side=side, batch=batch, prompt_len=prompt_len,
              new_tokens=new_tokens, **spread, **extra)


def quantized(cfg: ModelConfig, params, method: str):
  """cfg and params with every projection weight-only quantized (`models.quant`),
  per output channel (int4: groups of 32 inputs)."""
  block = {"int4": (1, 32), "mxfp4": (1, 32), "nvfp4": (1, 16)}.get(method, (1, 0))
  qcfg = dataclasses.replace(cfg, quant=QuantConfig(method=method, block=block))
  return qcfg, models.specs.quantize_params(qcfg, params)


def _measure(cfg, params, hf, *, batches, prompt_len, prefill_len, new_tokens, repeats,
             seed, quant=(), engine_options=None) -> list:
  """Ours (and HF's, when hf is not None; ours with weights quantized by each
  `quant` method) decode per batch, then prefill at batch 1.
  -> [(phase, side, batch, prompt_len, new_tokens, result, cfg)]."""
  cells = []
  qmodels = {m: quantized(cfg, params, m) for m in quant}

  def cell(phase, side, b, plen, n, res, c=cfg):
    cells.append((phase, side, b, plen, n, res, c))
    print(f"{phase} batch {b} {side}: {res[phase]['tokens_per_s']:.1f} tok/s", flush=True)

  for b in batches:
    cell("decode", "jaxinfer", b, prompt_len, new_tokens,
         bench_engine(cfg, params, batch=b, prompt_len=prompt_len, new_tokens=new_tokens,
                      repeats=repeats, seed=seed, engine_options=engine_options))
    for m, (qcfg, qparams) in qmodels.items():
      cell("decode", f"jaxinfer {m}", b, prompt_len, new_tokens,
           bench_engine(qcfg, qparams, batch=b, prompt_len=prompt_len, new_tokens=new_tokens,
                        repeats=repeats, seed=seed, engine_options=engine_options), qcfg)
    if hf is not None:
      cell("decode", "hf", b, prompt_len, new_tokens,
           bench_hf(hf, batch=b, prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats,
                    seed=seed))
  cell("prefill", "jaxinfer", 1, prefill_len, 1,
       bench_engine(cfg, params, batch=1, prompt_len=prefill_len, new_tokens=1, repeats=repeats,
                    seed=seed, engine_options=engine_options))
  if hf is not None:
    cell("prefill", "hf", 1, prefill_len, 1,
         bench_hf(hf, batch=1, prompt_len=prefill_len, new_tokens=1, repeats=repeats, seed=seed))
  return cells


def _rows(cfg, cells, gbps: float, itemsize: int) -> list[dict]:
  """Result rows: decode against the roofline at `gbps`, ours against HF's."""
  rows = []
  for phase, side, b, plen, n, res, c in cells:
    extra = {k: res[k] for k in _COMPILE_KEYS if k in res}
    if phase == "decode":
      bytes_ = decode_bytes_per_step(c, b, plen + n // 2, itemsize)
      roof = b * gbps * 1e9 / bytes_["total"]
      extra.update(bytes_per_step=bytes_, roofline_tokens_per_s=roof,
                   fraction_of_roofline=res["decode"]["tokens_per_s"] / roof)
    rows.append(_row(phase, side, b, plen, n, res[phase], **extra))
  for r in rows:
    if r["side"] == "jaxinfer":
      peer_row = next((p for p in rows if p["side"] == "hf" and p["phase"] == r["phase"]
                       and p["batch"] == r["batch"]), None)
      r["ratio_vs_hf"] = peer_row and r["tokens_per_s"] / peer_row["tokens_per_s"]
    elif r["side"].startswith("jaxinfer "):  # quantized weights: against our float run
      base = next(p for p in rows if p["side"] == "jaxinfer" and p["phase"] == r["phase"]
                  and p["batch"] == r["batch"])
      r["ratio_vs_float"] = r["tokens_per_s"] / base["tokens_per_s"]
  return rows


def run_decode_bench(*, model: str = "bench_dense", batches=(1, 8, 32), prompt_len: int = 128,
                     prefill_len: int = 512, new_tokens: int = 64, repeats: int = 5,
                     peer: str = "hf", threads: int | None = None,
                     bandwidth_bytes: int = 1 << 30, seed: int = 0, quant=(),
                     weight_layout: str = "auto", decode_steps: int = 1, out: str | None = None,
                     command: str | None = None) -> dict:
  """Bandwidth, then per batch ours and HF's decode, then prefill at
  `prefill_len` (batch 1), then bandwidth again (the roofline takes the
  higher); prints a table and writes out.json / out.png.
  -> the written JSON object. peer: "hf" or "none"; quant: weight-only
  methods ("int8", "fp8", ...) whose decode runs beside ours in float;
  weight_layout, decode_steps: the Engine's `cpu_weight_layout`, `decode_steps`."""
  engine_options = dict(cpu_weight_layout=weight_layout, decode_steps=decode_steps)
  if peer not in ("hf", "none"):
    raise ValueError(f"peer must be 'hf' or 'none', got {peer!r}")
  if new_tokens < 2 or repeats < 1 or min(batches) < 1:
    raise ValueError("need new_tokens >= 2, repeats >= 1 and batches >= 1")
  # Plain decoding never runs the MTP modules: leave them out of the weights.
  cfg = dataclasses.replace(presets.get(model), num_mtp_layers=0)
  threads = threads or os.cpu_count()
  bw_start = _bandwidth(bandwidth_bytes, "start")
  params = models.init_params(cfg, jax.random.key(seed))
  if weight_layout == "auto" and jax.default_backend() == "cpu":
    layout_probe.probe(cfg)  # the Engine reads "auto" off this machine's probe, timing nothing
  dtype = jnp.dtype(cfg.compute_dtype())
  meta = dict(model=model, params=models.count_params(cfg), dtype=dtype.name,
              batches=list(batches), prompt_len=prompt_len, prefill_len=prefill_len,
              new_tokens=new_tokens, repeats=repeats, peer=peer, torch_threads=threads,
              quant=list(quant), weight_layout=weight_layout, decode_steps=decode_steps,
              seed=seed, conventions=CONVENTIONS)
  hf = None
  if peer == "hf":
    hf = hf_model(hf_config_lib.to_hf(cfg), threads=threads)
    meta.update(hf_params=hf_param_count(hf), hf_attn_implementation=hf.config._attn_implementation)
    if meta["hf_params"] != meta["params"]:
      raise AssertionError(f"HF model has {meta['hf_params']} params, ours {meta['params']}")
  meta.update(machine=machine_info(), command=command or " ".join(map(shlex.quote, sys.argv)))

  cells = _measure(cfg, params, hf, batches=batches, prompt_len=prompt_len,
                   prefill_len=prefill_len, new_tokens=new_tokens, repeats=repeats, seed=seed,
                   quant=tuple(quant), engine_options=engine_options)
  del params, hf
  bw_end = _bandwidth(bandwidth_bytes, "end")
  # The roofline is a ceiling: the higher of the two measurements (a shared
  # machine's load moves the bandwidth during the run).
  gbps = max(bw_start["gbps"], bw_end["gbps"])
  meta["bandwidth"] = dict(gbps=gbps, start=bw_start, end=bw_end)

  rows = _rows(cfg, cells, gbps, dtype.itemsize)
  grew = [r for r in rows if r.get("compiles_after", 0) != r.get("compiles_warm", 0)
          or r.get("xla_compiles_timed", 0)]
  if grew:
    where = [(r["phase"], r["batch"]) for r in grew]
    print(f"WARNING: programs compiled during the timed runs of {where}")
  print("\n" + format_table(rows))
  out = out or os.path.join("experiments", "results", f"bench_decode_{model}")
  return results.write(out, rows, _plot, **meta)
