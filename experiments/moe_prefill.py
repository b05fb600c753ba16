"""MoE prefill variants on CPU (`benchlib.moe_prefill`): one bench_moe
layer's routed experts over a prefill's tokens, the Engine's split-expert
loop against other chunk sizes, unfused gate/up, static capacity blocks,
the grouped ragged_dot and the dense reference; each checked against the
dense reference and timed in one run, interleaved.

  python experiments/moe_prefill.py                 # 512 tokens
  python experiments/moe_prefill.py --tokens=128,512,2048

Writes experiments/results/moe_prefill.json.
"""

from absl import flags

from benchlib import cli, flag_config, model_flags, moe_prefill, results
from benchlib.results import machine_info

_MODEL = model_flags.define_preset("bench_moe")  # a preset with MoE layers
_TOKENS = flags.DEFINE_list("tokens", ["512"], "prefill tokens per call")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed calls per variant (median)")
_OUT = flags.DEFINE_string("out", "experiments/results/moe_prefill", "output prefix (.json)")
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  rows = []
  for t in map(int, _TOKENS.value):
    for r in moe_prefill.run(_MODEL.value, t, _REPEATS.value):
      rows.append(dict(tokens=t, **r))
      print(f"{t:5d} tokens  {r['variant']:28s} {r['ms']:9.2f} ms  {r['vs_default']:5.2f}x of "
            f"the default  max |err| {r['max_abs_err']:.2e}")
  results.write(_OUT.value, rows, None, model=_MODEL.value, repeats=_REPEATS.value,
                machine=machine_info(),
                note="one MoE layer's routed experts (routing outside), median ms per call; "
                     "vs_default: the Engine's default ms / this variant's; max_abs_err: "
                     "against the dense reference (ref_max_abs: its largest |value|)")


if __name__ == "__main__":
  cli.run(main)
