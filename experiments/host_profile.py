"""Host time of an Engine decode step on CPU, part by part, in the engine and
alone (`benchlib.host_profile`).

  python experiments/host_profile.py                  # bench_moe, batch 8
  python experiments/host_profile.py --model=bench_dense --batch=32
  python experiments/host_profile.py --decode_steps=8  # multi-step decode

Writes experiments/results/host_profile_<model>[_decode_steps<n>].json.
"""

from absl import flags

from benchlib import cli, flag_config, host_profile, model_flags, results
from benchlib.results import machine_info

_MODEL = model_flags.define_preset("bench_moe")
_BATCH = flags.DEFINE_integer("batch", 8, "decoding sequences")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", 1, "EngineConfig.decode_steps")
_OUT = flags.DEFINE_string("out", None, "output prefix (default experiments/results/host_profile_<model>)")
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  n = _DECODE_STEPS.value
  r = host_profile.run(_MODEL.value, _BATCH.value, decode_steps=n)
  for part, v in r["in_engine"].items():
    print(f"in the engine  {part:12s} wall {v['wall_ms']:.3f} ms, cpu {v['cpu_ms']:.3f} ms")
  for part, ms in r["alone"].items():
    print(f"alone          {part:34s} {ms:.3f} ms")
  print("weight arrays", r["param_leaves"])
  per_step = r["in_engine"]["dispatch"]["wall_ms"] / n
  print(f"dispatch per model step: {per_step:.3f} ms ({n} per dispatch)")
  suffix = f"_decode_steps{n}" if n > 1 else ""
  results.write(_OUT.value or f"experiments/results/host_profile_{_MODEL.value}{suffix}",
                [dict(where="in_engine", part=k, **v) for k, v in r["in_engine"].items()]
                + [dict(where="alone", part=k, wall_ms=v) for k, v in r["alone"].items()],
                None, model=_MODEL.value, batch=_BATCH.value, param_leaves=r["param_leaves"],
                decode_steps=n, dispatch_ms_per_model_step=per_step,
                machine=machine_info(),
                note="medians: in_engine over the second run's decode dispatches (thread CPU "
                     "time too; a dispatch runs decode_steps model steps); "
                     "alone over repeated calls with no step computing, except the step call "
                     "'behind a running step'")


if __name__ == "__main__":
  cli.run(main)
