"""A quantized KV cache (`EngineConfig(kv_cache_dtype=...)`) against the
full-precision one on one model: greedy agreement of the generated tokens
and the cache bytes per token (so tokens per byte budget).

Agreement, per quantized cache against the full-precision cache's outputs:
  teacher_forced_match  (optional) next-token agreement at every position
                of the full-precision output (`teacher_forced`)
  prefix_match  mean over prompts of (tokens before the first divergence) /
                (tokens generated): after a divergence the two continue
                different texts, so later positions say little
  token_match   fraction of positions whose tokens are equal
  identical     fraction of prompts generated identically
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import time

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.engine.engine import Engine, EngineConfig
from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.kv import cache as kv_cache

# Stdlib modules the prompts are cut from (the default model is trained
# byte-level on the Python standard library).
PROMPT_MODULES = ("json.decoder", "textwrap", "string", "fractions", "shlex", "colorsys",
                  "heapq", "bisect", "fnmatch", "glob", "getopt", "calendar", "difflib",
                  "ipaddress", "statistics", "argparse")


def stdlib_prompts(encode, num: int = 32, length: int = 96, seed: int = 0) -> list[list[int]]:
  """num prompts of `length` characters cut at seeded offsets from the
  sources of PROMPT_MODULES (cycled), encoded with `encode`."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(num):
    src = inspect.getsource(importlib.import_module(PROMPT_MODULES[i % len(PROMPT_MODULES)]))
    start = int(rng.integers(0, max(1, len(src) - length)))
    out.append(encode(src[start:start + length]))
  return out


def agreement(ref: list[list[int]], out: list[list[int]]) -> dict:
  """prefix_match, token_match and identical of `out` against `ref` (module docstring)."""
  prefix, equal, total = [], 0, 0
  for r, o in zip(ref, out):
    n = min(len(r), len(o))
    same = [a == b for a, b in zip(r[:n], o[:n])]
    first = same.index(False) if False in same else n
    prefix.append(first / max(len(r), 1))
    equal += sum(same)
    total += max(len(r), len(o))
  return dict(prefix_match=float(np.mean(prefix)), token_match=equal / max(total, 1),
              identical=float(np.mean([r == o for r, o in zip(ref, out)])))


def teacher_forced(eng: Engine, prompts: list[list[int]], ref: list[list[int]]) -> float:
  """Fraction of positions i where `eng`'s greedy next token after
  prompt + ref[:i] is ref[i]: per-step agreement on the reference's own
  text, free of the compounding that follows a first divergence."""
  contexts = [p + r[:i] for p, r in zip(prompts, ref) for i in range(len(r))]
  want = [t for r in ref for t in r]
  got = eng.generate(contexts, SamplingParams(max_tokens=1, temperature=0.0))
  return float(np.mean([o.token_ids[0] == t for o, t in zip(got, want)]))


def _scale_range(eng: Engine) -> list[float] | None:
  if eng.kv_scales is None:
    return None
  values = np.concatenate([a for seg in eng.kv_scales for a in seg.values()])
  return [float(values.min()), float(values.max())]


def kv_quant_agreement(cfg: ModelConfig, params, prompts: list[list[int]], *, max_tokens: int,
                       kinds=("fp8", "int8"), config: EngineConfig | None = None,
                       teacher: bool = False) -> dict:
  """Greedy `max_tokens` per prompt with the full-precision cache and each
  kv_cache_dtype of `kinds` (same engine settings otherwise). -> {rows: one
  per cache (kv_cache_dtype, page dtype, bytes per token, scale source and
  range, seconds, agreement with the full-precision outputs and, with
  teacher, `teacher_forced` agreement), outputs}."""
  config = config or EngineConfig(page_size=16, num_pages=128, max_num_seqs=len(prompts))
  sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
  rows, outputs, ref = [], {}, None
  for kind in (None, *kinds):
    t0 = time.perf_counter()
    eng = Engine(cfg, params, dataclasses.replace(config, kv_cache_dtype=kind))
    out = [o.token_ids for o in eng.generate(prompts, sampling)]
    seconds = time.perf_counter() - t0
    ref = out if kind is None else ref
    name = kind or "full"
    outputs[name] = out
    forced = teacher_forced(eng, prompts, ref) if teacher and kind is not None else 1.0
    rows.append(dict(kv_cache_dtype=name, page_dtype=eng.kv_dtype.name,
                     bytes_per_token=kv_cache.page_bytes(cfg, 1, eng.kv_dtype),
                     scales=eng.kv_scales_source, scale_range=_scale_range(eng),
                     seconds=round(seconds, 2), **agreement(ref, out),
                     teacher_forced_match=forced if teacher else None))
  return dict(rows=rows, outputs=outputs, prompts=len(prompts), max_tokens=max_tokens)
