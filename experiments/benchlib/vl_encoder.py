"""The vision encoder cache on image requests with repeated images: the
cache's hit rate and the engine's tokens/s with it and without it
(`EngineConfig.encoder_cache_tokens`, 0: every image encoded per request).

The workload: num_requests prompts, each text + one image drawn (seeded)
from num_images distinct random images, the text also drawn per request
so the prefix cache does not serve whole prompts (only the first page's
text before the image could match). Each setting runs the workload once
untimed (compiles: the step programs and the vision tower), then timed on
a fresh engine.
"""

from __future__ import annotations

import dataclasses
import io
import time

import numpy as np
from PIL import Image

from jaxinfer.engine import Engine, EngineConfig, SamplingParams


def random_png(size: int, seed: int) -> bytes:
  arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
  buf = io.BytesIO()
  Image.fromarray(arr).save(buf, format="PNG")
  return buf.getvalue()


def workload(cfg, *, num_requests: int, num_images: int, image_size: int, prompt_len: int,
             seed: int = 0):
  """-> (prompts with one image placeholder each, their images)."""
  rng = np.random.default_rng(seed)
  pool = [random_png(image_size, seed * 1000 + i) for i in range(num_images)]
  vc = cfg.vision  # text ids below every vision special token
  vocab = min(cfg.vocab_size, vc.image_token_id, vc.video_token_id, vc.vision_start_token_id,
              vc.vision_end_token_id)
  prompts, images = [], []
  for _ in range(num_requests):
    text = rng.integers(1, vocab, prompt_len).tolist()
    cut = int(rng.integers(1, prompt_len))
    prompts.append(text[:cut] + [cfg.vision.image_token_id] + text[cut:])
    images.append([pool[int(rng.integers(num_images))]])
  return prompts, images


def _run(cfg, params, config: EngineConfig, prompts, images, max_tokens: int) -> dict:
  eng = Engine(cfg, params, config)
  sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
  t0 = time.perf_counter()
  outs = eng.generate(prompts, sampling, images=images)
  wall = time.perf_counter() - t0
  stats = eng.stats()
  gen = sum(len(o.token_ids) for o in outs)
  prompt = sum(o.metrics.prompt_tokens for o in outs)
  return dict(wall_s=wall, generated_tokens=gen, prompt_tokens=prompt,
              output_tokens_per_s=gen / wall, total_tokens_per_s=(gen + prompt) / wall,
              encoder_calls=stats["encoder_calls"],
              encoder_cache_hit_rate=stats.get("encoder_cache_hit_rate", 0.0),
              outputs=[o.token_ids for o in outs])


def encoder_cache_bench(cfg, params, config: EngineConfig, *, num_requests: int, num_images: int,
                        image_size: int, prompt_len: int, max_tokens: int,
                        cache_tokens: int = 1 << 16, seed: int = 0) -> dict:
  """-> {rows: one per setting ("cache", "no_cache"), speedup, same_tokens}."""
  prompts, images = workload(cfg, num_requests=num_requests, num_images=num_images,
                             image_size=image_size, prompt_len=prompt_len, seed=seed)
  rows = []
  for name, tokens in (("cache", cache_tokens), ("no_cache", 0)):
    c = _with(config, encoder_cache_tokens=tokens)
    _run(cfg, params, c, prompts, images, max_tokens)  # compiles
    row = _run(cfg, params, c, prompts, images, max_tokens)
    rows.append(dict(setting=name, encoder_cache_tokens=tokens, **row))
  same = rows[0].pop("outputs") == rows[1].pop("outputs")
  return dict(rows=rows, same_tokens=same,
              speedup=rows[0]["total_tokens_per_s"] / rows[1]["total_tokens_per_s"],
              num_requests=num_requests, num_images=num_images, image_size=image_size,
              prompt_len=prompt_len, max_tokens=max_tokens)


def _with(config: EngineConfig, **kw) -> EngineConfig:
  return dataclasses.replace(config, **kw)
