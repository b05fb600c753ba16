"""The GPU day: one time-boxed run that checks and measures the GPU path on a
lent GPU, with the jax that machine has (no install step).

Parts, in order, each in a process of its own (a crash or hang in one part
cannot take the others with it) and each with its share of the time budget
(what a part leaves unused passes to the next):

  tests    the kernel tests' GPU subclasses (compiled kernels against their
           references, every kernel and dtype) under pytest
  kernels  `kernels.sweep` at the "gpu_day" shapes: every kernel against its
           peers and the roofline (copy bandwidth, matmul rate) measured in
           the same run, and the winner table (`kernel_winners`: per case the
           fastest candidate that matched its reference)
  engine   `gpu_engine.run_engine_bench`: the Engine at real widths with
           random weights

Each part writes its own JSON after every measurement, and the run's JSON
(all parts so far) is rewritten after every part, so a run cut short keeps
what it measured. At the end: one plot. `dry_run` runs the same code on CPU
at tiny shapes, interpreted (tests/gpu/test_gpu_day.py runs it in CI).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time

from benchlib import gpu_engine, kernel_winners, kernels

PARTS = ("tests", "kernels", "engine")
SHARES = {"tests": 0.30, "kernels": 0.36, "engine": 0.34}  # of the budget, before carry-over
# The kernels part's default order, least measured first (its time box cuts the tail):
# MLA (the Mosaic kernel without spills, 4 slots), mixed steps (DeepSeek's on the items),
# GQA decode, the MoE matmul, prefill, quantized matmuls.
KERNEL_ORDER = ("mla", "ragged", "paged", "gmm", "flash", "qmatmul")
GRACE_S = 25.0  # a part's process past its deadline by this much is killed
_PLOT_RESERVE_S = 10.0

# pytest selections: on a GPU the GPU subclasses of every kernel test file;
# the dry run takes a few interpret-mode cases of the same files.
TEST_FILES = (  # the kernels a GPU has checked least first: a time box cuts the tail
    "tests/kernels/test_kernels_mosaic_mla_ragged.py",
    "tests/kernels/test_kernels_mosaic_experts.py", "tests/kernels/test_kernels_hstu.py",
    "tests/kernels/test_kernels_mosaic_ragged.py",
    "tests/kernels/test_grouped_matmul.py", "tests/kernels/test_kernels_mosaic.py",
    "tests/kernels/test_kernels_flash.py", "tests/kernels/test_kernels_paged.py",
    "tests/kernels/test_kernels_quantized_matmul.py")
GPU_SELECTION = "Gpu"
DRY_SELECTION = "not Gpu and (bf16_causal_window or lengths_edge_cases or test_bf16_activations)"
_RESULT_LINE = re.compile(r"^(tests/\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
# pytest-xdist's -v lines: "[gw0] [ 12%] PASSED tests/...::name"
_XDIST_LINE = re.compile(r"^\[gw\d+\]\s+\[\s*\d+%\]\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
                         r"\s+(tests/\S+::\S+)")
GPU_WORKERS = 4  # pytest-xdist processes sharing the GPU: compiling kernels is CPU-bound
_SUMMARY_LINE = re.compile(r"^(FAILED|ERROR) (tests/\S+::\S+?)(?: - (.*))?$")


def file_base(out_dir: str, device_kind: str, day: datetime.date) -> str:
  """<out_dir>/gpu_day_<device>_<YYYY-MM-DD>: the run's files share this stem."""
  return os.path.join(out_dir, f"gpu_day_{kernels.device_slug(device_kind)}_{day:%Y-%m-%d}")


def write_json(path: str, data) -> None:
  """Written whole to a temporary file, then renamed: a reader (or a kill) never
  sees half a file."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(data, f, indent=1)
  os.replace(tmp, path)


def read_json(path: str):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


# ----------------------------------------------------------------------------- tests part


def parse_pytest_log(text: str, failure_log: str = "") -> dict:
  """Counts and failures from `pytest -v -rfE` output (with or without xdist),
  complete or cut short; `failure_log`: the JSON lines tests/conftest.py
  writes for each failure as it happens (JAXINFER_FAILURE_LOG)."""
  outcomes, failures = {}, {}
  for line in text.splitlines():
    line = line.strip()
    m, x = _RESULT_LINE.match(line), _XDIST_LINE.match(line)
    if m:
      outcomes[m.group(1)] = m.group(2).lower()
    elif x:
      outcomes[x.group(2)] = x.group(1).lower()
    s = _SUMMARY_LINE.match(line)
    if s:
      failures[s.group(2)] = (s.group(3) or "")[:300]
  for line in failure_log.splitlines():
    try:
      f = json.loads(line)
    except ValueError:
      continue
    failures.setdefault(f["test"], f.get("error", ""))
  counts = {}
  for status in outcomes.values():
    counts[status] = counts.get(status, 0) + 1
  failed = sorted(t for t, s in outcomes.items() if s in ("failed", "error"))
  return dict(counts=counts, ran=len(outcomes),
              failed=[dict(test=t, error=failures.get(t, "")) for t in failed],
              passed=sorted(t for t, s in outcomes.items() if s == "passed"))


def run_tests_part(record: dict, save, *, deadline: float, dry_run: bool, repo_root: str,
                   log_path: str) -> None:
  """pytest over the kernel test files (GPU subclasses, or the dry run's
  interpret-mode selection), its output streamed to `log_path`, killed at
  `deadline` (time.monotonic()); `record` gets the counts and failures."""
  selection = DRY_SELECTION if dry_run else GPU_SELECTION
  cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-v", "-rfE", "--tb=short",
         "-p", "no:cacheprovider", "-k", selection, *TEST_FILES]
  if not dry_run:
    cmd[3:3] = ["-n", str(GPU_WORKERS)]
  failure_log = log_path + ".failures"
  if os.path.exists(failure_log):
    os.remove(failure_log)
  env = dict(os.environ, JAX_PLATFORMS="cpu" if dry_run else "cuda",
             JAXINFER_FAILURE_LOG=failure_log)
  record.update(command=" ".join(cmd), selection=selection, status="running")
  save()
  t0 = time.monotonic()
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, cwd=repo_root, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
      rc = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
      timed_out = False
    except subprocess.TimeoutExpired:
      proc.kill()
      rc, timed_out = proc.wait(), True
  with open(log_path) as f:
    text = f.read()
  failures = ""
  if os.path.exists(failure_log):
    with open(failure_log) as f:
      failures = f.read()
  parsed = parse_pytest_log(text, failures)
  record.update(parsed, returncode=rc, timed_out=timed_out, wall_s=time.monotonic() - t0)
  if timed_out:
    record["status"] = "time box"
  elif parsed["ran"] == 0:
    record["status"] = "error"
    record["error"] = f"pytest ran no test (exit {rc}): is a GPU visible to jax? see {log_path}"
  else:
    record["status"] = "ok" if rc == 0 else "failed"
  save()


# ----------------------------------------------------------------------------- kernels part


def run_kernels_part(record: dict, save, *, deadline: float, dry_run: bool,
                     which=kernels.KERNELS) -> None:
  """The kernel sweep of `which` kernels, in that order, into `record`
  (kernels.sweep's result layout)."""
  env, dev = kernels.bench_env()
  shapes, repeats, warmup = ("tiny", 2, 1) if dry_run else ("gpu_day", 10, 2)
  record.update(kernels.new_result(env, dev, kernels=tuple(which), shapes=shapes,
                                   repeats=repeats, warmup=warmup))
  kernels.sweep(record, env, shapes=shapes, repeats=repeats, warmup=warmup, save=save,
                deadline=deadline)
  record["table"] = kernels.format_table(record).splitlines()
  # Per case, the fastest candidate that matched its reference (`kernel_winners`).
  record["winners"] = kernel_winners.winner_table(record)
  record["status"] = "ok"
  save()


def run_engine_part(record: dict, save, *, deadline: float, dry_run: bool,
                    roofline: dict | None) -> None:
  gpu_engine.run_engine_bench(record, save, deadline=deadline, dry_run=dry_run,
                              roofline=roofline or None)
  record.setdefault("status", "ok")
  save()


# ----------------------------------------------------------------------------- the run


def part_deadline(part: str, *, parts, start: float, budget_s: float) -> float:
  """The time (on start's clock) by which `part` must end: the budget's end
  less the shares of the parts of `parts` after it (shares renormalised over
  `parts`). Parts run in order, so what one leaves unused passes to the next,
  and the last part gets all that is left."""
  parts = [p for p in PARTS if p in parts]
  later = parts[parts.index(part) + 1:]
  total = sum(SHARES[p] for p in parts)
  usable = budget_s - _PLOT_RESERVE_S
  return start + usable - sum(SHARES[p] for p in later) / total * usable


def environment() -> dict:
  """What ran: python, jax and jaxlib, the device, torch when importable."""
  import jax  # noqa: PLC0415
  dev = jax.devices()[0]
  env = dict(python=platform.python_version(), jax=jax.__version__,
             jaxlib=getattr(jax.lib, "__version__", None) or _version("jaxlib"),
             platform=dev.platform, device_kind=dev.device_kind, device_count=jax.device_count(),
             host=platform.node(), cpu_count=os.cpu_count())
  for name in ("jax_cuda13_plugin", "jax_cuda12_plugin", "torch", "triton"):
    v = _version(name.replace("_", "-"))
    if v:
      env[name] = v
  return env


def _version(dist: str) -> str | None:
  from importlib import metadata  # noqa: PLC0415
  try:
    return metadata.version(dist)
  except metadata.PackageNotFoundError:
    return None


# ----------------------------------------------------------------------------- plot, summary


FRACTION_KEYS = ("fraction_of_roofline", "roofline_frac")


def engine_points(record, path=()):
  """(label, fraction of the roofline) for every engine measurement that has
  one, wherever run_engine_bench put it in its record."""
  if isinstance(record, dict):
    frac = next((record[k] for k in FRACTION_KEYS if isinstance(record.get(k), (int, float))),
                None)
    if frac is not None:
      yield " / ".join(map(str, path)), frac
    for k, v in record.items():
      yield from engine_points(v, path + (k,))
  elif isinstance(record, list):
    for i, v in enumerate(record):
      yield from engine_points(v, path + (i,))


def plot(run: dict, path: str):
  """One figure: a panel per kernel measured, one for the engine's roofline
  fractions -> (path or None, why there is none)."""
  try:
    import matplotlib  # noqa: PLC0415  (optional dependency)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError as e:
    return None, f"not importable: {e}"
  try:
    kres = run.get("kernels") or {}
    panels = [k for k, v in (kres.get("results") or {}).items() if v and kres.get("roofline")]
    points = list(engine_points(run.get("engine") or {}))
    n = len(panels) + (1 if points else 0)
    if not n:
      return None, "nothing measured to plot"
    cols = min(3, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 5 * rows), squeeze=False)
    for ax in axes.flat[n:]:
      ax.set_visible(False)
    for ax, kernel in zip(axes.flat, panels):
      kernels.plot_panel(ax, kres, kernel)
    if points:
      ax = axes.flat[len(panels)]
      ax.barh([p[0] for p in points], [p[1] for p in points])
      ax.set_xlabel("fraction of the roofline measured in this run")
      ax.set_title("engine")
      ax.tick_params(axis="y", labelsize=6)
    meta = run["meta"]
    fig.suptitle(f"{meta['device_kind']}, jax {meta['jax']}, {meta['started'][:10]}"
                 + (" (dry run, CPU)" if meta.get("dry_run") else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, ""
  except Exception as e:  # noqa: BLE001  (the plot is optional; the JSON is already written)
    return None, f"plotting failed: {kernels.short_error(e)}"


def summary(run: dict) -> str:
  """The run in a few lines: tests, the kernel table, engine roofline fractions."""
  meta = run["meta"]
  lines = [f"gpu_day {meta['device_kind']} jax {meta['jax']} wall {meta.get('wall_s')} s"]
  for t in run["timeline"]:
    lines.append(f"  {t['part']:<8} {t['process']:<26} status {t['part_status']}  {t['wall_s']} s")
  tests = run.get("tests")
  if tests:
    lines.append(f"tests: {tests.get('counts')} ({tests.get('status')})")
    lines += [f"  FAILED {f['test']}: {f['error']}" for f in tests.get("failed", [])[:20]]
  lines += (run.get("kernels") or {}).get("table", [])
  for label, frac in engine_points(run.get("engine") or {}):
    lines.append(f"engine {label}: {frac:.1%} of the roofline")
  lines.append(f"files: {run['files']}")
  return "\n".join(lines)
