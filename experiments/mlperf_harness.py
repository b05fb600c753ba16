"""MLPerf LoadGen harness: Offline, Server and Interactive runs of an Engine
on the default model, with LoadGen's own summary beside the harness's
measurements, the compliance check, accuracy against greedy references, and
a Server QPS search.

  python experiments/mlperf_harness.py                                # all three scenarios
  python experiments/mlperf_harness.py --scenarios=Server --search    # highest valid Server QPS
  python experiments/mlperf_harness.py --mode=accuracy
  python experiments/mlperf_harness.py --config=configs/mlperf_default_model_mtp.py --config.scenarios=Server
  python experiments/serve.py --fixed_step_shapes --max_num_seqs=8 --max_num_batched_tokens=64 &
  python experiments/mlperf_harness.py --scenarios=Server --server_url=http://127.0.0.1:8000
      # over HTTP: each sample a streaming /v1/completions request (`serving.mlperf_http`)

A config (`configs/mlperf_*.py`, default `configs/mlperf_default_model.py`:
these flags' defaults) sets the flags it names; a flag given on the command
line wins over it (`benchlib.flag_config`).

Latency limits are a model's published Server / Interactive TTFT and TPOT
99th-percentile limits (`--limits`: `LIMITS`, as MLPerf Inference's
mlperf.conf sets them), times `--latency_scale` to map them
to a small model on a small machine. The dataset is `--num_samples`
held-out stdlib prompts (never trained on) or a JSONL file of
{"tokens": [...]} or {"text": "..."} rows (`--dataset`), with "images":
[paths] for a vision model (`--hf_dir`, e.g. Qwen3-VL; one image
placeholder id in "tokens", or "<image>" in "text", per image:
`serving.workloads.read_prompts`).
"""

from __future__ import annotations

import json
import os
import shutil

from absl import flags
import jax

from benchlib import cli, flag_config, model_flags, results
from benchlib.sharding_report import parse_mesh
from jaxinfer import (Engine, EngineConfig, MTPConfig, SamplingParams, sharding,
                      training, vision_inputs)
from jaxinfer.serving import mlperf, mlperf_http, workloads

# (TTFT ms, TPOT ms) 99th-percentile limits: Server, Interactive.
LIMITS = {"llama2-70b": ((2000, 200), (450, 40)), "llama3.1-405b": ((6000, 175), (4500, 80)),
          "deepseek-r1": ((2000, 80), (1500, 15)), "gpt-oss-120b": ((3000, 80), (2000, 15))}

FLAGS = flags.FLAGS
flags.DEFINE_list("scenarios", ["Offline", "Server", "Interactive"], "LoadGen scenarios")
flags.DEFINE_enum("mode", "performance", ["performance", "accuracy"], "LoadGen mode")
flags.DEFINE_string("dataset", "", "JSONL of prompts ({'tokens': [...]} or {'text': ...}); "
                    "default: held-out stdlib prompts")
_MODEL = model_flags.define()  # a vision model (--hf_dir) takes a --dataset with images
flags.DEFINE_string("processor_json", "", "vision models: ProcessorConfig fields as JSON "
                    "(default: the vision tower's patch sizes, HF's pixel bounds)")
flags.DEFINE_integer("num_samples", 32, "held-out prompts in the default dataset")
flags.DEFINE_integer("prompt_bytes", 96, "bytes of each held-out prompt")
flags.DEFINE_integer("max_tokens", 32, "tokens generated per sample")
flags.DEFINE_enum("limits", "deepseek-r1", sorted(LIMITS), "whose latency limits")
flags.DEFINE_float("latency_scale", 2.0, "multiplies the TTFT / TPOT limits")
flags.DEFINE_float("server_qps", 6.0, "Server target QPS (without --search)")
flags.DEFINE_float("interactive_qps", 4.0, "Interactive target QPS")
flags.DEFINE_float("offline_qps", 15.0, "Offline expected QPS (sizes the one query)")
flags.DEFINE_integer("min_duration_ms", 20_000, "LoadGen min_duration per run")
flags.DEFINE_integer("min_query_count", 500, "LoadGen min_query_count per run (runs of tens of "
                     "queries failed its early-stopping test of the 99th percentiles here)")
flags.DEFINE_bool("search", False, "binary-search the highest valid Server QPS")
flags.DEFINE_float("search_lo", 4.0, "search: a QPS expected valid")
flags.DEFINE_float("search_hi", 32.0, "search: a QPS expected invalid")
flags.DEFINE_integer("search_steps", 4, "search: bisection steps")
flags.DEFINE_integer("search_min_duration_ms", 20_000, "search: min_duration of each probe "
                     "(short probes pass QPS that full runs fail near saturation)")
flags.DEFINE_integer("max_num_seqs", 8, "engine: sequences per step")
flags.DEFINE_integer("max_num_batched_tokens", 64, "engine: token budget per step")
flags.DEFINE_integer("speculative", 0, "MTP draft tokens (0: plain decoding)")
flags.DEFINE_string("mesh", "", "engine: shard it on a mesh of all devices, e.g. data=2,expert=4 "
                    "('': one device)")
flags.DEFINE_enum("layout", "dp_attn_ep", list(sharding.LAYOUTS), "engine: layout (with --mesh)")
flags.DEFINE_integer("cpu_devices", 0, "simulate this many CPU devices for --mesh")
flags.DEFINE_string("server_url", "", "drive an OpenAI-compatible server at this URL "
                    "(experiments/serve.py) instead of an in-process engine")
flags.DEFINE_string("server_model", "default", "with --server_url: the model id it serves")
flags.DEFINE_integer("http_concurrency", 64, "with --server_url: requests in flight at most")
flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results", "mlperf"),
                    "output directory (LoadGen logs per run, results.json)")
_CONFIG = flag_config.define_config(__file__, "mlperf_default_model.py")  # or configs/mlperf_*.py


def _dataset(cfg, tokenizer):
  """-> (prompts, images per prompt or None)."""
  if not FLAGS.dataset:
    return training.held_out_prompts([FLAGS.prompt_bytes] * FLAGS.num_samples), None
  encode = tokenizer.encode if tokenizer is not None else None
  prompts, images = workloads.read_prompts(FLAGS.dataset, encode=encode, vision=cfg.vision)
  return prompts, images if any(i is not None for i in images) else None


def _engine(cfg, params):
  spec = MTPConfig(num_draft_tokens=FLAGS.speculative) if FLAGS.speculative else None
  # Fixed step shapes: the warm-up compiles every program a run needs, so no
  # LoadGen query waits on a compile.
  mesh = sharding.make_mesh(parse_mesh(FLAGS.mesh)) if FLAGS.mesh else None
  proc = None
  if FLAGS.processor_json:
    with open(FLAGS.processor_json) as f:
      proc = vision_inputs.ProcessorConfig(**{k: v for k, v in json.load(f).items()
                                              if k in vision_inputs.ProcessorConfig.__annotations__})
  return Engine(cfg, params, EngineConfig(page_size=16, max_num_seqs=FLAGS.max_num_seqs,
                                          image_processor=proc,
                                          max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                                          kv_cache_bytes=256 << 20, speculative=spec,
                                          fixed_step_shapes=True),
                mesh=mesh, layout=FLAGS.layout if mesh is not None else None)


def _limits(scenario):
  server, interactive = LIMITS[FLAGS.limits]
  ttft, tpot = interactive if scenario == "Interactive" else server
  return ttft * FLAGS.latency_scale, tpot * FLAGS.latency_scale


def _ms(summary, key):
  v = summary.get(key)
  return None if v is None else v / 1e6


def _sut(cfg, params, prompts, scenario, images=None):
  first_token_events = scenario != "Offline"
  if FLAGS.server_url:  # the server compiled its programs on its own warm-up
    if images is not None:
      raise ValueError("--server_url: datasets with images run on the in-process Engine only")
    return mlperf_http.HttpSUT(FLAGS.server_url, FLAGS.server_model, prompts,
                               max_tokens=FLAGS.max_tokens, first_token_events=first_token_events,
                               concurrency=FLAGS.http_concurrency)
  engine = _engine(cfg, params)
  sampling = SamplingParams(max_tokens=FLAGS.max_tokens)
  engine.generate(prompts, sampling, images=images)  # compiles the programs before timing
  return mlperf.EngineSUT(engine, prompts, sampling, first_token_events=first_token_events,
                          images=images)


def one_run(cfg, params, prompts, scenario, qps, *, min_duration_ms, tag, images=None):
  sampling = SamplingParams(max_tokens=FLAGS.max_tokens)
  sut = _sut(cfg, params, prompts, scenario, images)
  ttft, tpot = _limits(scenario)
  outdir = os.path.join(FLAGS.out, tag)
  shutil.rmtree(outdir, ignore_errors=True)
  s = mlperf.run_loadgen(sut, scenario=scenario, outdir=outdir, mode=FLAGS.mode, target_qps=qps,
                         ttft_ms=ttft, tpot_ms=tpot, min_duration_ms=min_duration_ms,
                         min_query_count=FLAGS.min_query_count)
  mine = sut.measured()
  comp = sut.compliance()
  row = dict(scenario=scenario, tag=tag, mode=FLAGS.mode, target_qps=qps, ttft_limit_ms=ttft,
             tpot_limit_ms=tpot, valid=s["valid"],
             loadgen=dict(
                 tokens_per_s=s.get("Completed tokens per second", s.get("Tokens per second")),
                 samples_per_s=s.get("Completed samples per second", s.get("Samples per second")),
                 ttft_ms={q: _ms(s, f"{q}.00 percentile first token latency (ns)")
                          for q in (50, 90, 99)},
                 tpot_ms={q: _ms(s, f"{q}.00 percentile time to output token (ns)")
                          for q in (50, 90, 99)},
                 latency_ms={q: _ms(s, f"{q}.00 percentile latency (ns)") for q in (50, 90, 99)}),
             harness=mine, compliance=comp,
             first_tokens_match=not comp["first_token_mismatches"])
  if FLAGS.mode == "accuracy":
    ref = _engine(cfg, params).generate(prompts, sampling, images=images)
    got = mlperf.parse_accuracy_log(os.path.join(outdir, "mlperf_log_accuracy.json"))
    row["accuracy_samples_logged"] = len(got)
    row["accuracy_exact_match"] = sum(got.get(i) == r.token_ids for i, r in enumerate(ref)) / len(ref)
  _print(row)
  return row


def _print(r):
  lgs, me = r["loadgen"], r["harness"]
  t, p = lgs["ttft_ms"], lgs["tpot_ms"]
  fmt = lambda d: "/".join("-" if d.get(q) is None else f"{d[q]:.1f}" for q in (50, 90, 99))
  # Accuracy mode: LoadGen computes no performance result (its summary has no
  # "Result is" line), so the row reports the accuracy check instead.
  verdict = ("accuracy" if r["mode"] == "accuracy" else "VALID" if r["valid"] else "INVALID")
  print(f"{r['tag']:22s} {verdict:8s} qps {r['target_qps']:6.2f}  "
        f"tokens/s loadgen {lgs['tokens_per_s'] or 0:7.1f} harness {me.get('tokens_per_s', 0):7.1f}"
        f"  TTFT p50/90/99 ms loadgen {fmt(t)} harness "
        f"{fmt({int(k[1:]): v for k, v in me.get('ttft_ms', {}).items() if k != 'mean'})}"
        f"  TPOT loadgen {fmt(p)} harness "
        f"{fmt({int(k[1:]): v for k, v in me.get('tpot_ms', {}).items() if k != 'mean'})}"
        f"  first tokens match {r['first_tokens_match']}"
        + (f"  exact {r['accuracy_exact_match']:.2f}" if "accuracy_exact_match" in r else ""),
        flush=True)


def search(cfg, params, prompts):
  """Bisection on Server QPS between a valid lo and an invalid hi."""
  lo, hi, rows = FLAGS.search_lo, FLAGS.search_hi, []
  for k in range(FLAGS.search_steps):
    mid = (lo * hi) ** 0.5  # geometric: QPS spans orders of magnitude
    r = one_run(cfg, params, prompts, "Server", mid, tag=f"search{k}_qps{mid:.2f}",
                min_duration_ms=FLAGS.search_min_duration_ms)
    rows.append(r)
    lo, hi = (mid, hi) if r["valid"] else (lo, mid)
  best = max((r for r in rows if r["valid"]), key=lambda r: r["target_qps"], default=None)
  if best is None:
    print(f"search: no valid QPS found in [{FLAGS.search_lo}, {FLAGS.search_hi}]")
    return rows, None
  check = one_run(cfg, params, prompts, "Server", 1.5 * best["target_qps"],
                  tag=f"check_qps{1.5 * best['target_qps']:.2f}",
                  min_duration_ms=FLAGS.min_duration_ms)
  confirm = one_run(cfg, params, prompts, "Server", best["target_qps"],
                    tag=f"confirm_qps{best['target_qps']:.2f}",
                    min_duration_ms=FLAGS.min_duration_ms)
  rows += [check, confirm]
  print(f"search: highest valid Server QPS {best['target_qps']:.2f} (confirmed "
        f"{'VALID' if confirm['valid'] else 'INVALID'} at full duration); at 1.5x "
        f"({check['target_qps']:.2f}) the run is {'VALID' if check['valid'] else 'INVALID'}")
  return rows, dict(max_valid_qps=best["target_qps"], confirmed=confirm["valid"],
                    at_1_5x_valid=check["valid"])


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, FLAGS, __file__)
  if FLAGS.cpu_devices:  # before anything initialises JAX's backends
    jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices)
  model = _MODEL.load()
  cfg, params = model.cfg, model.params
  prompts, images = _dataset(cfg, model.tokenizer)
  rows, found = [], None
  if FLAGS.search and images is not None:
    raise ValueError("--search: datasets with images run the scenarios only")
  if FLAGS.search:
    rows, found = search(cfg, params, prompts)
  else:
    qps = dict(Offline=FLAGS.offline_qps, Server=FLAGS.server_qps,
               Interactive=FLAGS.interactive_qps)
    for scenario in FLAGS.scenarios:
      if scenario not in qps:
        raise ValueError(f"--scenarios: unknown {scenario!r}; use {sorted(qps)}")
      rows.append(one_run(cfg, params, prompts, scenario, qps[scenario],
                          min_duration_ms=FLAGS.min_duration_ms, tag=f"{scenario}_{FLAGS.mode}",
                          images=images))
  name = "search" if FLAGS.search else f"scenarios_{FLAGS.mode}"
  results.write(os.path.join(FLAGS.out, name), rows, None, search=found, limits=FLAGS.limits,
                latency_scale=FLAGS.latency_scale, max_tokens=FLAGS.max_tokens,
                num_samples=len(prompts), model=model.name,
                images=images is not None,
                mesh=FLAGS.mesh or None, layout=FLAGS.layout if FLAGS.mesh else None,
                speculative=FLAGS.speculative, server_url=FLAGS.server_url or None)


if __name__ == "__main__":
  cli.run(main)
