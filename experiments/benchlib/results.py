"""Writing an experiment's results: JSON (with the device it ran on) and an
optional plot, under one output prefix."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from typing import Callable

import jax


def write(prefix: str, rows: list[dict], plot: Callable[[list, str], None] | None = None,
          **meta) -> dict:
  """Writes prefix.json ({device, platform, jax, **meta, rows}) and, with
  `plot(rows, path)`, prefix.png. -> the JSON object."""
  device = jax.devices()[0]
  out = dict(device=str(device.device_kind), platform=device.platform, jax=jax.__version__,
             **meta, rows=rows)
  os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
  with open(prefix + ".json", "w") as f:
    json.dump(out, f, indent=1)
  if plot is not None:
    plot(rows, prefix + ".png")
  print(f"\nwrote {prefix}.json" + (" and .png" if plot is not None else ""))
  return out


def write_report(report: dict, path: str) -> None:
  """A report dict as JSON at `path` (its folder made if missing)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(report, f, indent=1)
    f.write("\n")
  print(f"\nwrote {path}")


def spread(samples: list[float]) -> dict:
  """Timed tokens/s samples -> their median, min, max and the samples."""
  return dict(tokens_per_s=statistics.median(samples), tokens_per_s_min=min(samples),
              tokens_per_s_max=max(samples), samples=samples)


def machine_info() -> dict:
  """The machine a benchmark ran on: CPU model and count, versions."""
  cpu = platform.processor()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
  except OSError:
    pass
  out = dict(cpu=cpu, cpu_count=os.cpu_count(), python=platform.python_version(),
             jax=jax.__version__, backend=jax.default_backend())
  for name in ("torch", "transformers"):
    mod = sys.modules.get(name)
    out[name] = getattr(mod, "__version__", None)
  return out
