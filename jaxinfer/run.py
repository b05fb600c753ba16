"""Library entry points the experiment scripts and notebooks call.

  load_default_model() -> (cfg, params, tokenizer)   the bundled trained tiny model
  load_model(preset=..., hf_dir=..., checkpoint_dir=...) -> (cfg, params)
  run_engine(cfg, params, prompts=..., sampling=..., engine_config=...) -> EngineRun
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from jaxinfer import checkpoint, presets
from jaxinfer.config import ModelConfig
from jaxinfer.engine.engine import Engine, EngineConfig, RequestOutput
from jaxinfer.models import init_params
from jaxinfer.tokenizer import ByteTokenizer

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(__file__), "default_model")


def load_default_model(dtype=None):
  """The bundled default model: `tiny_moe` (MLA + MoE + one MTP module)
  trained byte-level on the Python standard library by
  `experiments/train_tiny.py`. -> (cfg, params, tokenizer) with
  `tokenizer.encode(str) -> list[int]` and `decode(list[int]) -> str`."""
  if not os.path.isdir(os.path.join(DEFAULT_MODEL_DIR, "params")):
    raise FileNotFoundError(f"the default model checkpoint is missing from {DEFAULT_MODEL_DIR}; "
                            "recreate it with `python experiments/train_tiny.py`")
  # Weights ship in bfloat16; they are cast on read to the compute dtype.
  cfg, params = checkpoint.restore(DEFAULT_MODEL_DIR)
  cfg = dataclasses.replace(cfg, dtype=jnp.dtype(dtype).name) if dtype is not None else cfg
  params = jax.tree.map(lambda a: a.astype(cfg.compute_dtype()), params)
  return cfg, params, ByteTokenizer()


def load_model(*, preset: str | None = None, hf_dir: str | None = None,
               checkpoint_dir: str | None = None, seed: int = 0, dtype=None):
  """Exactly one source: a preset (random weights), an HF directory, or an
  orbax checkpoint written by `checkpoint.save`."""
  given = [s for s in (preset, hf_dir, checkpoint_dir) if s]
  if len(given) != 1:
    raise ValueError("load_model: pass exactly one of preset, hf_dir, checkpoint_dir")
  if hf_dir:
    return checkpoint.load_hf(hf_dir, dtype=dtype)
  if checkpoint_dir:
    return checkpoint.restore(checkpoint_dir, dtype=dtype)
  cfg = presets.get(preset)
  if dtype is not None:
    cfg = dataclasses.replace(cfg, dtype=jnp.dtype(dtype).name)
  return cfg, init_params(cfg, jax.random.key(seed))


@dataclasses.dataclass
class EngineRun:
  outputs: list[RequestOutput]
  summary: dict  # wall_s, tokens_per_s, ttft/tpot percentiles, cache hits, compiles, ...


def run_engine(cfg: ModelConfig, params, *, prompts, sampling, engine_config: EngineConfig,
               warmup: bool = True, progress: bool = True, mesh=None,
               layout: str | None = None) -> EngineRun:
  """Runs prompts through a fresh Engine and summarises the run.

  With warmup, an identical run on a throwaway engine first compiles the step
  programs, so the timed run measures serving, not compilation. mesh and
  layout (together, or neither) shard the engine as `Engine` does. progress:
  a bar of finished requests on stderr, shown only when stderr is a terminal.
  """
  def engine():
    return Engine(cfg, params, engine_config, mesh=mesh, layout=layout)

  if warmup:
    engine().generate(prompts, sampling)
  eng = engine()
  # A bar only on a terminal (disable=None: off when stderr is piped or redirected).
  bar = tqdm.tqdm(total=len(prompts), desc="requests", disable=None if progress else True,
                  leave=False)
  t0 = time.perf_counter()
  outs = eng.generate(prompts, sampling, progress=lambda n: bar.update(1))
  wall = time.perf_counter() - t0
  bar.close()
  stats = eng.stats()
  ttft = np.array([o.metrics.ttft_s for o in outs])
  tpot = np.array([o.metrics.tpot_s for o in outs if o.metrics.tpot_s is not None])
  generated = sum(o.metrics.generated_tokens for o in outs)
  pct = lambda a, q: float(np.percentile(a, q)) if len(a) else float("nan")
  summary = dict(
      requests=len(outs), wall_s=wall, generated_tokens=generated,
      tokens_per_s=generated / wall, ttft_p50_s=pct(ttft, 50), ttft_p90_s=pct(ttft, 90),
      tpot_p50_s=pct(tpot, 50), tpot_p90_s=pct(tpot, 90),
      prompt_tokens=stats["prompt_tokens"], cached_prompt_tokens=stats["cached_prompt_tokens"],
      steps=stats["steps"], tokens_per_step=stats["tokens_per_step"],
      compiles=stats["compiles"], preemptions=stats["preemptions"],
      dp_ranks=stats["dp_ranks"], requests_per_rank=stats["requests_per_rank"],
      **{k: v for k, v in stats.items() if k.startswith("spec_")})
  return EngineRun(outputs=outs, summary=summary)
