"""Decode and prefill tokens/s of a preset with random weights through the
Engine, against HF transformers + PyTorch and the memory roofline, all
measured in this run on this machine (`experiments/benchlib/decode.py`).

  python experiments/bench_decode.py                       # bench_dense, batch 1, 8, 32, HF peer
  python experiments/bench_decode.py --model=bench_moe
  python experiments/bench_decode.py --batches=1 --repeats=1 --new_tokens=16 --peer=none
  python experiments/bench_decode.py --config=configs/bench_decode.py:bench_moe --config.batches=1,8

A config (`configs/bench_decode.py`, the default: these flags' defaults; its
argument picks the preset) sets the flags it names; a flag given on the
command line wins over it (`benchlib.flag_config`).

Writes experiments/results/bench_decode_<model>.json and .png: per (side,
batch) the median (min, max) tokens/s over --repeats runs, ours / HF, the
roofline (batch x measured bandwidth / bytes read per step) and the fraction
of it reached; prefill tokens/s at --prefill_len (batch 1) with ours / HF.
"""

import importlib.util
import os

from absl import flags

from benchlib import cli, flag_config, model_flags
from benchlib.decode import run_decode_bench

_HAVE_HF = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))

_MODEL = model_flags.define_preset("bench_dense")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32"], "decode batch sizes")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "prompt tokens before decoding")
_PREFILL_LEN = flags.DEFINE_integer("prefill_len", 512, "prompt tokens of the prefill rows")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "tokens generated per request")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed runs per cell (median, min, max)")
_PEER = flags.DEFINE_enum("peer", "hf" if _HAVE_HF else "none", ["hf", "none"],
                          "hf: also time transformers + PyTorch (default when installed)")
_THREADS = flags.DEFINE_integer("threads", None, "torch threads (default: os.cpu_count())")
_BANDWIDTH_BYTES = flags.DEFINE_integer("bandwidth_bytes", 1 << 30,
                                        "array size of the bandwidth measurement")
_SEED = flags.DEFINE_integer("seed", 0, "weights and prompts")
_QUANT = flags.DEFINE_list("quant", [], "weight-only methods also run (int8, fp8, int4, ...)")
_LAYOUT = flags.DEFINE_enum("weight_layout", "auto",
                            ["auto", "in_out", "out_in", "out_major", "panels"],
                            "the Engine's cpu_weight_layout")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", 1, "the Engine's decode_steps (multi-step decode)")
_OUT = flags.DEFINE_string("out", None, "output prefix (.json, .png); default "
                           "experiments/results/bench_decode_<model>")
_CONFIG = flag_config.define_config(__file__)  # configs/bench_decode.py[:preset]


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  out = _OUT.value or os.path.join(os.path.dirname(__file__), "results",
                                   f"bench_decode_{_MODEL.value}")
  run_decode_bench(model=_MODEL.value, batches=[int(b) for b in _BATCHES.value],
                   prompt_len=_PROMPT_LEN.value, prefill_len=_PREFILL_LEN.value,
                   new_tokens=_NEW_TOKENS.value, repeats=_REPEATS.value, peer=_PEER.value,
                   threads=_THREADS.value, bandwidth_bytes=_BANDWIDTH_BYTES.value,
                   seed=_SEED.value, quant=tuple(_QUANT.value),
                   weight_layout=_LAYOUT.value, decode_steps=_DECODE_STEPS.value, out=out)


if __name__ == "__main__":
  cli.run(main)
