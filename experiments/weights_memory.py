"""Host memory of an Engine's weights on CPU: resident set size (RSS) against
the weight bytes, for a preset with random weights and the unrolled step
layout (the CPU default for models of 64 MiB of layer weights or more).

  python experiments/weights_memory.py                      # bench_dense and bench_moe
  python experiments/weights_memory.py --models=bench_dense

Per model, in a fresh process each (so one model's allocations do not blur
the next): RSS before, with the params built, with the Engine built as well
(both held), after the caller drops its params (the Engine's copy alone), and
the peak (VmHWM), and the bytes of jax's live arrays. The KV pool is
subtracted. Freed heap pages are handed back (malloc_trim) before the last
RSS reading. Writes
experiments/results/weights_memory.json.
"""

import ctypes
import gc
import json
import os
import subprocess
import sys

from absl import flags

from benchlib import cli, flag_config

_MODELS = flags.DEFINE_list("models", ["bench_dense", "bench_moe"], "presets (jaxinfer.presets)")
_OUT = flags.DEFINE_string("out", None, "output JSON (default experiments/results/weights_memory.json)")
_ONE = flags.DEFINE_string("one", None, "internal: measure this preset in this process, print JSON")
_CONFIG = flag_config.define_config(__file__)


def _status(key: str) -> int:
  """A /proc/self/status size in bytes (VmRSS, VmHWM)."""
  with open("/proc/self/status") as f:
    line = next(line for line in f if line.startswith(key + ":"))
  return int(line.split()[1]) * 1024


def measure(model: str) -> dict:
  import jax
  from jaxinfer import Engine, EngineConfig, models, presets
  from jaxinfer.engine import inspect as engine_inspect
  cfg = presets.get(model)
  rss = {"start": _status("VmRSS")}
  params = models.init_params(cfg, jax.random.key(0))
  jax.block_until_ready(params)
  weight_bytes = sum(w.nbytes for w in jax.tree.leaves(params))
  rss["params"] = _status("VmRSS")
  engine = Engine(cfg, params, EngineConfig(num_pages=64, page_size=16, unroll_layers=True))
  jax.block_until_ready(engine_inspect.step_params(engine))
  rss["params_and_engine"] = _status("VmRSS")
  del params
  gc.collect()
  ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back, so RSS shows what is held
  rss["engine"] = _status("VmRSS")
  pool_bytes = sum(a.nbytes for a in jax.tree.leaves(engine.pool))
  live_bytes = sum(a.nbytes for a in jax.live_arrays())
  held = lambda key: (rss[key] - rss["start"] - (pool_bytes if "engine" in key else 0)) / weight_bytes
  return dict(model=model, weight_bytes=weight_bytes, pool_bytes=pool_bytes, rss_bytes=rss,
              live_array_bytes_over_weights=round((live_bytes - pool_bytes) / weight_bytes, 3),
              peak_bytes=_status("VmHWM"),
              engine_alone_over_weights=round(held("engine"), 3),
              params_and_engine_over_weights=round(held("params_and_engine"), 3),
              peak_over_weights=round((_status("VmHWM") - rss["start"] - pool_bytes)
                                      / weight_bytes, 3))


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  if _ONE.value:
    print(json.dumps(measure(_ONE.value)))
    return
  rows = []
  for model in _MODELS.value:
    out = subprocess.run([sys.executable, __file__, f"--one={model}"], check=True,
                         capture_output=True, text=True).stdout
    rows.append(json.loads(out.strip().splitlines()[-1]))
    r = rows[-1]
    print(f"{model}: weights {r['weight_bytes'] / 2**20:.0f} MiB; RSS over the weights: "
          f"engine alone {r['engine_alone_over_weights']:.2f}x (live arrays "
          f"{r['live_array_bytes_over_weights']:.2f}x), with the caller's params "
          f"{r['params_and_engine_over_weights']:.2f}x, peak {r['peak_over_weights']:.2f}x")
  path = _OUT.value or os.path.join(os.path.dirname(__file__), "results", "weights_memory.json")
  with open(path, "w") as f:
    json.dump({"rows": rows}, f, indent=1)
  print("wrote", path)


if __name__ == "__main__":
  cli.run(main)
