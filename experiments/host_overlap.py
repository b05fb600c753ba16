"""The Engine's host work per decode step against its device step
(`benchlib.host_overlap`): on a model of 32 narrow layers (random weights,
float32), at batch 1, 64 and 256, the host's own CPU time, its busy time,
the step's wall time and the device time per decode step, the blocking
reads per step and whether step N + 1 is dispatched before step N's tokens
are read; then the same with the device part made slow on purpose, where
the wall time must be within the tolerance of max(host, device).

  python experiments/host_overlap.py                        # batch 1, 64, 256
  python experiments/host_overlap.py --batches=64 --slow_factor=3
  python experiments/host_overlap.py --noasync_scheduling   # the serial loop, for contrast

Writes experiments/results/host_overlap_<machine>_<date>.json.
"""

import datetime
import os

from absl import flags

from benchlib import cli, flag_config, host_overlap, results
from benchlib.results import machine_info

_BATCHES = flags.DEFINE_list("batches", ["1", "64", "256"], "decoding sequences, one run each")
_LAYERS = flags.DEFINE_integer("num_layers", 32, "the model's layers")
_D_MODEL = flags.DEFINE_integer("d_model", 64, "the model's width")
_VOCAB = flags.DEFINE_integer("vocab_size", 256, "the model's vocabulary")
_PROMPT = flags.DEFINE_integer("prompt_len", 16, "tokens per prompt")
_NEW = flags.DEFINE_integer("new_tokens", 32, "tokens generated per sequence")
_UNROLL = flags.DEFINE_bool("unroll_layers", True,
                            "EngineConfig.unroll_layers: per-layer weight arrays, as a GPU "
                            "engine holds them")
_ASYNC = flags.DEFINE_bool("async_scheduling", True, "EngineConfig.async_scheduling")
_FACTOR = flags.DEFINE_float("slow_factor", 2.0,
                             "slow mode: the added device time, in multiples of the host's "
                             "busy time per step")
_SLOW_MS = flags.DEFINE_float("slow_ms", None, "slow mode: the added device time in ms "
                              "(overrides --slow_factor)")
_REPEATS = flags.DEFINE_integer("repeats", 10,
                                "runs of the last decode program alone (device time)")
_TOLERANCE = flags.DEFINE_float("tolerance", 0.1, "overlap check: wall <= (1 + tolerance) x "
                                "max(host, device)")
_MACHINE = flags.DEFINE_string("machine", "epyc2c", "short machine name for the output file")
_OUT = flags.DEFINE_string("out", None, "output prefix (default "
                           "experiments/results/host_overlap_<machine>_<date>)")
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  load_before = os.getloadavg()
  r = host_overlap.run(tuple(map(int, _BATCHES.value)), num_layers=_LAYERS.value,
                       d_model=_D_MODEL.value, vocab_size=_VOCAB.value,
                       prompt_len=_PROMPT.value, new_tokens=_NEW.value,
                       unroll_layers=_UNROLL.value, async_scheduling=_ASYNC.value,
                       slow_factor=_FACTOR.value, slow_ms=_SLOW_MS.value,
                       repeats=_REPEATS.value, tolerance=_TOLERANCE.value)
  print("| batch | mode | host CPU ms | host busy ms | device ms | wall ms | wall / max | "
        "serial / max | blocking reads | N+1 before N read | device idle |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for row in r["rows"]:
    for mode in ("normal", "slow"):
      m = row[mode]
      o = m["overlap"]
      print(f"| {row['batch']} | {mode} | {m['host_cpu_ms']:.3f} | {m['host_ms']:.3f} | "
            f"{m['device_ms']:.3f} | {m['wall_ms']:.3f} | {o['ratio']:.3f}"
            f"{'' if o['ok'] else ' (over)'} | {o['serial_ratio']:.3f} | "
            f"{m['blocking_reads_per_step']} | {m['dispatched_before_read']} | "
            f"{m['device_idle']} |")
  today = datetime.date.today().isoformat()
  results.write(_OUT.value or f"experiments/results/host_overlap_{_MACHINE.value}_{today}",
                r["rows"], None, model=r["model"], iters_per_ms=r["iters_per_ms"],
                async_scheduling=_ASYNC.value, machine=machine_info(),
                load_average=dict(before=load_before, after=os.getloadavg()),
                note="medians over the steady decode steps (one decode step dispatched and "
                     "one read per Engine.step); host CPU: thread CPU time of the driving "
                     "thread; host busy: wall less the time blocked in reads of device "
                     "values; device: the last decode program alone, dispatched back to back "
                     "on its own outputs, per call; slow: each step followed by a loop of "
                     "slow_factor x the host busy time (spin_ms); load_average: the "
                     "1/5/15-minute load before and after")


if __name__ == "__main__":
  cli.run(main)
