"""Serve a model over an OpenAI-compatible HTTP API (`jaxinfer.serving.http_server`).

  python experiments/serve.py                               # the bundled default model on :8000
  python experiments/serve.py --port=8001 --api_key=secret --max_queue=32
  python experiments/serve.py --hf_dir=path/to/hf          # tokenizer.json + chat template from it
  python experiments/serve.py --model=tiny_moe              # a preset, random weights (byte tokens)
  python experiments/serve.py --backend=ray --workers=2     # a Ray cluster: a process per worker
  python experiments/serve.py --backend=ray --workers=1 --worker_processes=2 --worker_cpu_devices=2
      # one worker over 2 processes (a jax.distributed group, one 4-device tp mesh)

  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"model": "default", "prompt": "def add(a, b):", "max_tokens": 32, "temperature": 0}'

The server opens its port at once and serves with what is compiled: a
request's step programs compile when it first needs them, and while no
request is unfinished the engine's thread compiles every other step program
plain requests can need (--warmup: `Engine.warmup`'s list, prompt steps in
fixed shapes: --fixed_prefill_shapes; shortest contexts first), one between
looks at the queue, so a request waits for at most the one being compiled;
/health says "warming" until they are done (--warmup_before_serving: all of
them before the port opens, as a speculative or Ray server always does).
The programs go to jax's persistent compilation cache
(--compilation_cache_dir), from which a second start reads them. /metrics
serves Prometheus text.
--backend=ray serves a `Cluster(backend="ray")` of --workers mixed workers,
each a Ray actor in its own process with the same engine flags (a local
Ray is started unless --ray_address names one); /metrics then sums the
workers' engines. --worker_processes > 1 makes each worker a group of
processes sharing one tensor-parallel mesh (`serving.ray_group`).
"""

from __future__ import annotations

import os
import sys
import time

from absl import flags
import jax
import jax.monitoring
import jax.numpy as jnp
import uvicorn

from benchlib import cli, flag_config, model_flags
from jaxinfer import Engine, EngineConfig, MTPConfig, SamplingParams
from jaxinfer.engine import warmup
from jaxinfer.engine.engine import prefill_chunk
from jaxinfer.serving import openai_protocol
from jaxinfer.serving.cluster import Cluster
from jaxinfer.serving.http_server import make_app

_HOST = flags.DEFINE_string("host", "127.0.0.1", "address to listen on")
_PORT = flags.DEFINE_integer("port", 8000, "port to listen on")
_MODEL = model_flags.define()  # --model, --hf_dir (tokenizer.json, tokenizer_config.json), ...
_MODEL_NAME = flags.DEFINE_string("model_name", None, "the model id clients send (default: "
                                  "'default', the preset, or the checkpoint directory's name)")
_API_KEY = flags.DEFINE_string("api_key", os.environ.get("JAXINFER_API_KEY"),
                               "require 'Authorization: Bearer <key>' on every /v1 path, "
                               "as vLLM's --api-key (default: $JAXINFER_API_KEY; unset: no key)")
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 256, "requests held at once (queued or "
                                  "generating); beyond it a request gets 429")
_MAX_BODY = flags.DEFINE_integer("max_body_bytes", 1 << 20, "largest request body")
_MAX_TOKENS_CAP = flags.DEFINE_integer("max_tokens_cap", None, "most tokens one request may "
                                       "ask for (default: the context)")
_MAX_SEQS = flags.DEFINE_integer("max_num_seqs", 32, "engine: sequences per step")
_TOKEN_BUDGET = flags.DEFINE_integer("max_num_batched_tokens", 520, "engine: tokens per step "
                                     "(prompt steps pad to it or to a quarter of it; the "
                                     "default: 512 prompt tokens beside 8 decode rows)")
_GATHER_MS = flags.DEFINE_float("gather_ms", 15.0, "a request waking an idle engine waits for "
                                 "those that follow it, each within this many ms of the one "
                                 "before (at most 4 windows), so a burst prefills in one step "
                                 "(0: step at once)")
_KV_MB = flags.DEFINE_integer("kv_cache_mb", None, "engine: KV cache size in MiB (default: "
                              "EngineConfig.kv_cache_memory_fraction of the free device "
                              "memory, host memory on CPU)")
_DRAFT = flags.DEFINE_integer("num_draft_tokens", 0, "MTP speculative drafts per step (0: off)")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", 1, "engine: decode steps per dispatch when "
                                     "not speculating (EngineConfig.decode_steps)")
_FIXED_SHAPES = flags.DEFINE_bool("fixed_step_shapes", False, "engine: pad every step to the "
                                   "budgets (decode steps too)")
_FIXED_PREFILL = flags.DEFINE_bool("fixed_prefill_shapes", True, "engine: pad steps with a prompt "
                                   "chunk to the budgets, so the warm-up can compile every "
                                   "program plain traffic needs (EngineConfig)")
_WARMUP_TOP_K = flags.DEFINE_bool("warmup_top_k", False, "the warm-up also compiles the top-k "
                                  "sampler of each top_k bucket (7 more per shape)")
_CACHE_DIR = flags.DEFINE_string("compilation_cache_dir",
                                 os.path.expanduser("~/.cache/jaxinfer/xla"),
                                 "jax's persistent compilation cache: a second start reads the "
                                 "warm-up's programs back ('': off)")
_IMAGE_ROOT = flags.DEFINE_string("image_root", None, "vision models: the directory chat image "
                                  "file paths may be read from (None: base64 data URLs only)")
_WARMUP = flags.DEFINE_bool("warmup", True, "compile the step programs plain requests can "
                            "need: in the background while idle (/health says warming until "
                            "done), or before serving with --warmup_before_serving")
_WARMUP_FIRST = flags.DEFINE_bool("warmup_before_serving", False, "--warmup compiles every "
                                  "program before the port opens (a speculative or Ray server "
                                  "always does)")
_BACKEND = flags.DEFINE_enum("backend", "engine", ["engine", "ray"], "engine: one Engine in "
                             "this process; ray: a Cluster of Ray worker processes")
_WORKERS = flags.DEFINE_integer("workers", 2, "--backend=ray: worker processes")
_WORKER_CPUS = flags.DEFINE_float("worker_cpus", 1.0, "--backend=ray: Ray CPUs per worker")
_WORKER_PROCESSES = flags.DEFINE_integer("worker_processes", 1, "--backend=ray: processes per "
                                         "worker (> 1: a jax.distributed group, one tp mesh)")
_WORKER_CPU_DEVICES = flags.DEFINE_integer("worker_cpu_devices", None, "--backend=ray on CPU: "
                                           "devices per worker process (default: XLA's)")
_RAY_ADDRESS = flags.DEFINE_string("ray_address", None, "--backend=ray: a running Ray cluster "
                                   "(default: start one on this host)")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "the weights' and compute "
                           "dtype (default: the model's; presets and checkpoints: float32 on "
                           "CPU, bfloat16 on GPUs)")
_CONFIG = flag_config.define_config(__file__)


def load():
  """-> (model_flags.Model, chat template, model name) from the model flags."""
  model = _MODEL.load(dtype=None if _DTYPE.value is None else jnp.dtype(_DTYPE.value))
  hf_dir = model.source.get("hf_dir")
  template = openai_protocol.ChatTemplate(*(openai_protocol.load_chat_template(hf_dir) if hf_dir
                                            else (openai_protocol.BUILTIN_CHAT_TEMPLATE,)))
  where = next(iter(model.source.values()), "default")  # the preset or directory
  return model, template, os.path.basename(os.path.normpath(where))


def ray_cluster(config: EngineConfig):
  """A Cluster of --workers Ray worker processes, each loading the model itself."""
  import ray  # noqa: PLC0415 - only --backend=ray needs it
  from jaxinfer.serving.ray_worker import WorkerSpec  # noqa: PLC0415
  if not ray.is_initialized():
    ray.init(address=_RAY_ADDRESS.value, include_dashboard=False)
  env = ({} if _WORKER_CPU_DEVICES.value is None else
         {"XLA_FLAGS": f"--xla_force_host_platform_device_count={_WORKER_CPU_DEVICES.value}"})
  source = _MODEL.source()
  if "checkpoint_dir" in source:
    raise ValueError("--backend=ray serves the bundled model, a preset or an --hf_dir, "
                     "not a --checkpoint_dir")
  specs = [WorkerSpec(model=source.get("preset", "default"), checkpoint=source.get("hf_dir"),
                      config=config,
                      name=f"worker{k}", num_cpus=_WORKER_CPUS.value, env=env,
                      num_processes=_WORKER_PROCESSES.value, layout="tp")
           for k in range(_WORKERS.value)]
  return Cluster(specs, backend="ray", router="kv")


def compilation_cache() -> dict:
  """Turns on jax's persistent compilation cache (--compilation_cache_dir);
  -> its hit and miss counts, updated as programs compile."""
  counts = dict(hits=0, misses=0)
  if not _CACHE_DIR.value:
    return counts
  jax.config.update("jax_compilation_cache_dir", _CACHE_DIR.value)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  def count(event, **_):
    for key in counts:
      if event == f"/jax/compilation_cache/cache_{key}":
        counts[key] += 1
  jax.monitoring.register_event_listener(count)
  return counts


def background_warmup() -> bool:
  """Whether --warmup runs in the background: one Engine, plain decoding,
  prompt steps in fixed shapes (a finite list of programs)."""
  return (_WARMUP.value and not _WARMUP_FIRST.value and _BACKEND.value == "engine"
          and not _DRAFT.value and (_FIXED_PREFILL.value or _FIXED_SHAPES.value))


def warm_up(backend, cache: dict) -> None:
  """Compiles before serving: every plain program (`Engine.warmup`) when the
  shapes are bounded, else (speculation, bucketed prompt steps, a Ray
  cluster) the programs of a few requests of assorted lengths. cache: the
  persistent cache's counts (`compilation_cache`)."""
  start = time.perf_counter()
  bounded = (_BACKEND.value == "engine" and not _DRAFT.value
             and (_FIXED_PREFILL.value or _FIXED_SHAPES.value))
  if bounded:
    report = backend.warmup(top_k=_WARMUP_TOP_K.value)
    what = f"{report['programs']} step programs"
    if report["left_out"]:
      what += (f" ({report['left_out']} more left to compile when traffic needs them: the "
               "warm-up's share of vm.max_map_count memory maps is used; "
               "docs/known_issues.md)")
  else:
    copies = _WORKERS.value if _BACKEND.value == "ray" else 1  # distinct: every worker gets some
    backend.generate([[1 + k] * n for k in range(copies) for n in (8, 100, 400)],
                     SamplingParams(max_tokens=16))
    what = "the programs of a few requests"
  print(f"warm-up: compiled {what} in {time.perf_counter() - start:.1f} s (persistent cache "
        f"{_CACHE_DIR.value or 'off'}: {cache['hits']} hits, {cache['misses']} misses)",
        file=sys.stderr, flush=True)


def step_prompt_tokens(config: EngineConfig) -> int:
  """The prompt tokens a step holds beside a decode row for every sequence:
  a gathered burst is a step's worth once its prompts reach it."""
  return max(1, min(prefill_chunk(config), config.max_num_batched_tokens - config.max_num_seqs))


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  cache = compilation_cache()  # before anything compiles, warm-up or not
  model, template, name = load()
  cfg, params, tok = model.cfg, model.params, model.need_tokenizer()
  spec = MTPConfig(num_draft_tokens=_DRAFT.value) if _DRAFT.value else None
  config = EngineConfig(max_num_seqs=_MAX_SEQS.value, max_num_batched_tokens=_TOKEN_BUDGET.value,
                        kv_cache_bytes=None if _KV_MB.value is None else _KV_MB.value << 20,
                        speculative=spec,
                        fixed_step_shapes=_FIXED_SHAPES.value,
                        fixed_prefill_shapes=_FIXED_PREFILL.value,
                        decode_steps=1 if spec else _DECODE_STEPS.value)
  if _BACKEND.value == "ray":
    del params  # each worker process loads its own
    backend = ray_cluster(config)
  else:
    backend = Engine(cfg, params, config)
  if _WARMUP.value and not background_warmup():
    warm_up(backend, cache)
  app_ = make_app(backend, tok, _MODEL_NAME.value or name, max_queue=_MAX_QUEUE.value,
                  max_body_bytes=_MAX_BODY.value, max_tokens_cap=_MAX_TOKENS_CAP.value,
                  api_key=_API_KEY.value or None, chat_template=template,
                  image_root=_IMAGE_ROOT.value, gather_s=_GATHER_MS.value / 1e3,
                  gather_tokens=step_prompt_tokens(config))
  if background_warmup():
    programs = warmup.programs(backend, top_k=_WARMUP_TOP_K.value)
    app_.state.engine_loop.warm_in_background(programs)
    print(f"warm-up: {len(programs)} step programs to compile in the background "
          f"(/health says warming until done; persistent cache {_CACHE_DIR.value or 'off'})",
          file=sys.stderr, flush=True)
  print(f"serving {_MODEL_NAME.value or name!r} on http://{_HOST.value}:{_PORT.value}/v1 "
        f"(context {app_.state.engine_loop.max_model_len} tokens, backend {_BACKEND.value})",
        flush=True)
  try:
    uvicorn.run(app_, host=_HOST.value, port=_PORT.value, log_level="warning")
  finally:
    if _BACKEND.value == "ray":
      backend.shutdown()


if __name__ == "__main__":
  cli.run(main)
