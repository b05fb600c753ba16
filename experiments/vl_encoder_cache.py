"""The vision encoder cache on image requests with repeated images
(`benchlib.vl_encoder`): hit rate and tokens/s with and without it.
Writes <out>.json.

  python experiments/vl_encoder_cache.py
  python experiments/vl_encoder_cache.py --hf_dir=path/to/Qwen3-VL --num_requests=64
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
from absl import flags

from benchlib import cli, flag_config, model_flags, results, vl_encoder
from jaxinfer import EngineConfig, vision_inputs

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FIXTURE = os.path.join(_ROOT, "tests", "fixtures", "hf_vl")
# A Qwen3-VL HF checkpoint (--hf_dir; default: the tiny random test fixture).
_MODEL = model_flags.define(hf_dir=os.path.join(_FIXTURE, "qwen3_vl"))
_PROCESSOR = flags.DEFINE_string("processor_json", os.path.join(_FIXTURE, "processor.json"),
                                 "ProcessorConfig fields as JSON (None: the model's defaults)")
_MAX_PIXELS = flags.DEFINE_integer("max_pixels", 4096, "resized image area bound")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 32, "image requests")
_NUM_IMAGES = flags.DEFINE_integer("num_images", 4, "distinct images they draw from")
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 64, "image side in pixels")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "text tokens per prompt")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 8, "greedy tokens per request")
_OUT = flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results",
                                               "vl_encoder_cache"), "output prefix (.json)")
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  model = _MODEL.load(dtype=jnp.float32)
  cfg, params = model.cfg, model.params
  proc = None
  if _PROCESSOR.value:
    with open(_PROCESSOR.value) as f:
      fields = {k: v for k, v in json.load(f).items() if k != "images"}
    proc = vision_inputs.ProcessorConfig(**dict(fields, max_pixels=_MAX_PIXELS.value))
  config = EngineConfig(page_size=16, num_pages=1024, max_num_seqs=16, max_num_batched_tokens=256,
                        image_processor=proc)
  out = vl_encoder.encoder_cache_bench(
      cfg, params, config, num_requests=_NUM_REQUESTS.value, num_images=_NUM_IMAGES.value,
      image_size=_IMAGE_SIZE.value, prompt_len=_PROMPT_LEN.value, max_tokens=_MAX_TOKENS.value)
  print("| setting | encoder calls | hit rate | tokens/s (prompt+output) | output tokens/s |")
  print("|---|---|---|---|---|")
  for r in out["rows"]:
    print(f"| {r['setting']} | {r['encoder_calls']} | {r['encoder_cache_hit_rate']:.3f} | "
          f"{r['total_tokens_per_s']:.1f} | {r['output_tokens_per_s']:.1f} |")
  print(f"cache / no cache tokens/s: {out['speedup']:.2f}x; same tokens: {out['same_tokens']}")
  rows = out.pop("rows")
  results.write(_OUT.value, rows, None, model=os.path.basename(model.source["hf_dir"].rstrip("/")),
                **out)


if __name__ == "__main__":
  cli.run(main)
