"""XLA:CPU's two ways to multiply a few rows by a projection weight, a dot
and a multiply-reduce fusion, for float32 and weight-only quantized weights,
at 1 to 512 rows (`benchlib.linear_forms`); with --xla_flags, the same
again under each XLA_FLAGS setting (one process each), so the CPU flags of
this jax are measured on the same program.

  python experiments/linear_forms.py
  python experiments/linear_forms.py --xla_flags="--xla_cpu_use_onednn=true;--xla_cpu_use_xnnpack=false"
  python experiments/linear_forms.py --engine_batches=1,8,16,32   # also the Engine's decode step
  python experiments/linear_forms.py --rows=1 --weights=float32 --engine_batches=1,8,32 \
      --engine_xla_flags="--xla_cpu_use_onednn=true;--xla_cpu_use_xnnpack=false"

With --engine_batches, an unrolled Engine on bench_dense decodes at each
batch with the dot, the reduce (up to 64 rows) and the default
(`layers.ROW_REDUCE_ROWS`), each in its own process, rounds interleaved:
the programs of a whole step, where XLA's fusion choices differ from the
isolated MLPs above.

Writes experiments/results/linear_forms.json: one row per (flags, weights,
rows, form), with median ms, weight GB/s and the float32 dot's time over
each; `reduce_wins` lists the row counts where the reduce was faster
(`layers.ROW_REDUCE_ROWS` comes from it).
"""

import json
import os
import subprocess
import sys

from absl import flags

from benchlib import cli, flag_config

_KINDS = flags.DEFINE_list("weights", ["float32", "int8", "fp8", "int4"], "float32 and quant methods")
_ROWS = flags.DEFINE_list("rows", ["1", "2", "4", "8", "16", "32", "64", "128", "512"], "row counts")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed runs per cell (median)")
_XLA_FLAGS = flags.DEFINE_string("xla_flags", "", "';'-separated XLA_FLAGS settings also measured")
_OUT = flags.DEFINE_string("out", None, "output JSON (default experiments/results/linear_forms.json)")
_ENGINE = flags.DEFINE_list("engine_batches", [], "Engine decode batches to measure (bench_dense)")
_ENGINE_WEIGHTS = flags.DEFINE_list("engine_weights", ["float32", "int8"], "weights for --engine_batches")
_ENGINE_FLAGS = flags.DEFINE_string("engine_xla_flags", "", "';'-separated XLA_FLAGS settings under "
                                     "which the Engine cells also run (the default setting only)")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "interleaved rounds of the engine processes")
_CHILD = flags.DEFINE_bool("child", False, "internal: measure in this process, print JSON rows")
_ENGINE_CELL = flags.DEFINE_string("engine_cell", None, "internal: weights,batch,setting")
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  if _ENGINE_CELL.value:
    from benchlib import linear_forms
    weights, batch, setting = _ENGINE_CELL.value.split(",")
    print("MS " + json.dumps(linear_forms.engine_decode_ms(weights, int(batch), setting)))
    return
  if _CHILD.value:
    from benchlib import linear_forms
    rows = linear_forms.measure(tuple(_KINDS.value), tuple(int(r) for r in _ROWS.value),
                                _REPEATS.value)
    print("ROWS " + json.dumps(rows))
    return
  from benchlib import linear_forms, results
  from benchlib.results import machine_info
  base = os.environ.get("XLA_FLAGS", "")
  settings = [""] + [s.strip() for s in _XLA_FLAGS.value.split(";") if s.strip()]
  rows, wins = [], {}
  for setting in settings:
    env = dict(os.environ, XLA_FLAGS=f"{base} {setting}".strip())
    print(f"== XLA_FLAGS={env['XLA_FLAGS']!r}", flush=True)
    proc = subprocess.run([sys.executable, __file__, "--child", f"--weights={','.join(_KINDS.value)}",
                           f"--rows={','.join(_ROWS.value)}", f"--repeats={_REPEATS.value}"],
                          env=env, capture_output=True, text=True)
    found = [l for l in proc.stdout.splitlines() if l.startswith("ROWS ")]
    if proc.returncode or not found:
      raise RuntimeError(f"linear_forms under XLA_FLAGS={setting!r} failed:\n{proc.stderr[-3000:]}")
    print("\n".join(l for l in proc.stdout.splitlines() if not l.startswith("ROWS ")))
    part = [dict(r, xla_flags=setting) for r in json.loads(found[-1][5:])]
    rows += part
    wins[setting or "default"] = linear_forms.best_ranges(part)
  engine_rows = []
  cells = [(w, b, setting, "") for w in _ENGINE_WEIGHTS.value for b in _ENGINE.value
           for setting in ("dot", "reduce", "default")]
  cells += [(w, b, "default", f) for f in _ENGINE_FLAGS.value.split(";") if f.strip()
            for w in _ENGINE_WEIGHTS.value for b in _ENGINE.value]
  for _ in range(_ROUNDS.value if _ENGINE.value else 0):
    for weights, batch, setting, flag in cells:
      env = dict(os.environ, XLA_FLAGS=f"{base} {flag}".strip())
      proc = subprocess.run([sys.executable, __file__, f"--engine_cell={weights},{batch},{setting}"],
                            capture_output=True, text=True, env=env)
      found = [l for l in proc.stdout.splitlines() if l.startswith("MS ")]
      if proc.returncode or not found:
        raise RuntimeError(f"engine cell {weights},{batch},{setting},{flag} failed:\n"
                           f"{proc.stderr[-3000:]}")
      engine_rows.append(dict(weights=weights, batch=int(batch), setting=setting,
                              xla_flags=flag.strip(), decode_ms=json.loads(found[-1][3:])))
      print(engine_rows[-1], flush=True)
  out = _OUT.value or os.path.join(os.path.dirname(__file__), "results", "linear_forms")
  results.write(out.removesuffix(".json"), rows, machine=machine_info(),
                command="experiments/linear_forms.py " + " ".join(sys.argv[1:]),
                shapes=dict(d_model=linear_forms.D, ffn=linear_forms.F, layers=linear_forms.LAYERS),
                reduce_wins=wins, engine_decode=engine_rows)


if __name__ == "__main__":
  cli.run(main)
