"""Quantized KV cache (fp8 e4m3, int8) against the full-precision cache on the
default model: greedy agreement and bytes per cached token
(`benchlib.kv_quant`). Writes <out>.json.

  python experiments/kv_quant.py
  python experiments/kv_quant.py --max_tokens=32 --impl=pallas   # Pallas kernels (interpret on CPU)
"""

from __future__ import annotations

import dataclasses
import os

from absl import flags

from benchlib import cli, flag_config, kv_quant, model_flags, results
from jaxinfer import Backend, EngineConfig

_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "greedy tokens per prompt")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 32, "prompts cut from stdlib sources")
_TEACHER = flags.DEFINE_bool("teacher", True, "also next-token agreement on the reference text")
_IMPL = flags.DEFINE_enum("impl", "xla", ["xla", "pallas"], "attention implementation")
_OUT = flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results", "kv_quant"),
                           "output prefix (.json)")
_MODEL = model_flags.define()
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  model = _MODEL.load()
  cfg, params, tokenizer = model.cfg, model.params, model.need_tokenizer()
  cfg = dataclasses.replace(cfg, backend=Backend(attention=_IMPL.value))
  prompts = kv_quant.stdlib_prompts(tokenizer.encode, _NUM_PROMPTS.value)
  config = EngineConfig(page_size=16, num_pages=2048, max_num_seqs=32)
  out = kv_quant.kv_quant_agreement(cfg, params, prompts, max_tokens=_MAX_TOKENS.value,
                                    config=config, teacher=_TEACHER.value)
  print("| kv cache | page dtype | bytes/token | teacher-forced | prefix match | token match | "
        "identical | scales |")
  print("|---|---|---|---|---|---|---|---|")
  for r in out["rows"]:
    print(f"| {r['kv_cache_dtype']} | {r['page_dtype']} | {r['bytes_per_token']} | "
          f"{r['teacher_forced_match']} | {r['prefix_match']:.3f} | {r['token_match']:.3f} | "
          f"{r['identical']:.3f} | {r['scales']} |")
  rows = out.pop("rows")
  out.pop("outputs")
  results.write(_OUT.value, rows, None, model="default (tiny_moe trained, MLA + MTP)",
                impl=_IMPL.value, **out)


if __name__ == "__main__":
  cli.run(main)
