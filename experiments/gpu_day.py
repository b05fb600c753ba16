"""The GPU day: check and measure the GPU path in one time-boxed run, with the
jax the machine already has. No install step: from the repository root,

  PYTHONPATH=. python3 experiments/gpu_day.py --out_dir=/tmp/gpu_day
  PYTHONPATH=. python3 experiments/gpu_day.py --dry_run --out_dir=/tmp/dry  # CPU, tiny shapes

Parts (benchlib.gpu_day): the kernel tests' GPU subclasses, the kernels
against their peers and the measured roofline, the Engine at real widths.
Each runs in a process of its own within its share of --budget_s; every part
rewrites its JSON as it goes and the run's JSON after each part, so a run
cut short keeps what it measured. Files, in --out_dir:
gpu_day_<device>_<date>.json (all parts), .png (the plot), _tests.log (pytest's
output), _<part>.json (each part as it ran).
"""

import os

# Before jax starts: a part shares the GPU with torch (flash's peer) and with
# the other processes of the run, so no process takes 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import datetime  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402

from benchlib import cli, flag_config, gpu_day, kernels  # noqa: E402

_OUT_DIR = flags.DEFINE_string("out_dir", os.path.join(os.path.dirname(__file__), "results", "gpu"),
                               "where the JSON, plot and logs go")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "CPU, tiny shapes, Pallas interpreted")
_BUDGET_S = flags.DEFINE_float("budget_s", 450.0, "the whole run's time box, seconds")
_PARTS = flags.DEFINE_list("parts", list(gpu_day.PARTS), f"subset of {','.join(gpu_day.PARTS)}")
_KERNELS = flags.DEFINE_list("kernels", list(gpu_day.KERNEL_ORDER),
                             "the kernels part's kernels, in this order (first measured first)")
# Set by the run for the process of one part; not for users.
_PART = flags.DEFINE_enum("part", None, list(gpu_day.PARTS), "internal: run this part only")
_PART_JSON = flags.DEFINE_string("part_json", None, "internal: the part's JSON file")
_DEADLINE_IN_S = flags.DEFINE_float("deadline_in_s", None, "internal: the part's time box")
_ROOFLINE_JSON = flags.DEFINE_string("roofline_json", None,
                                     "internal: the kernels part's JSON (its measured roofline)")
_CONFIG = flag_config.define_config(__file__)

EXPERIMENTS = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(EXPERIMENTS)


def run_part():
  """This process is one part: run it into its JSON file."""
  deadline = time.monotonic() + _DEADLINE_IN_S.value
  record = {}
  save = lambda: gpu_day.write_json(_PART_JSON.value, record)
  if _PART.value == "kernels":
    gpu_day.run_kernels_part(record, save, deadline=deadline, dry_run=_DRY_RUN.value,
                             which=_KERNELS.value)
  else:
    kernels = gpu_day.read_json(_ROOFLINE_JSON.value) if _ROOFLINE_JSON.value else None
    gpu_day.run_engine_part(record, save, deadline=deadline, dry_run=_DRY_RUN.value,
                            roofline=(kernels or {}).get("roofline"))


def _spawn(part, part_json, deadline, roofline_json):
  """The part in a child process, killed past its deadline -> (status, returncode)."""
  cmd = [sys.executable, os.path.abspath(__file__), f"--part={part}", f"--part_json={part_json}",
         f"--deadline_in_s={max(deadline - time.monotonic(), 1.0):.1f}",
         f"--dry_run={_DRY_RUN.value}", f"--kernels={','.join(_KERNELS.value)}"]
  if roofline_json:
    cmd.append(f"--roofline_json={roofline_json}")
  # jaxinfer from this checkout, benchlib for the part and its pytest child.
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      p for p in (REPO_ROOT, EXPERIMENTS, os.environ.get("PYTHONPATH")) if p))
  if part == "engine":  # alone on the GPU by then: the DeepSeek slice wants ~55 GB
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
  proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env)
  try:
    rc = proc.wait(timeout=max(deadline - time.monotonic(), 1.0) + gpu_day.GRACE_S)
    return ("ok" if rc == 0 else "crashed"), rc
  except subprocess.TimeoutExpired:
    proc.kill()
    return "killed past its time box", proc.wait()


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  if _PART.value:
    return run_part()
  start = time.monotonic()
  unknown = set(_PARTS.value) - set(gpu_day.PARTS)
  if unknown:
    raise app.UsageError(f"--parts: unknown {sorted(unknown)}; choose from {gpu_day.PARTS}")
  unknown = set(_KERNELS.value) - set(kernels.KERNELS)
  if unknown:
    raise app.UsageError(f"--kernels: unknown {sorted(unknown)}; choose from {kernels.KERNELS}")
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  env = gpu_day.environment()
  if not _DRY_RUN.value and env["platform"] != "gpu":
    raise app.UsageError(f"no GPU visible to jax (platform {env['platform']!r}); "
                         "use --dry_run to run on CPU")
  base = gpu_day.file_base(_OUT_DIR.value, env["device_kind"], datetime.date.today())
  run = dict(meta=dict(env, dry_run=_DRY_RUN.value, budget_s=_BUDGET_S.value,
                       parts=_PARTS.value, started=datetime.datetime.now().isoformat("T", "seconds")),
             timeline=[], files=dict(json=base + ".json"))
  save = lambda: gpu_day.write_json(base + ".json", run)
  save()
  print(f"gpu_day: {env['device_kind']}, jax {env['jax']}, budget {_BUDGET_S.value:.0f} s -> "
        f"{base}.*", flush=True)
  for part in gpu_day.PARTS:
    if part not in _PARTS.value:
      continue
    deadline = gpu_day.part_deadline(part, parts=_PARTS.value, start=start,
                                     budget_s=_BUDGET_S.value)
    part_json = f"{base}_{part}.json"
    t0 = time.monotonic()
    print(f"--- {part}: {deadline - t0:.0f} s", flush=True)
    if part == "tests":
      run["tests"] = record = {}
      status, rc = "ok", 0
      gpu_day.run_tests_part(record, lambda: gpu_day.write_json(part_json, record),
                             deadline=deadline, dry_run=_DRY_RUN.value, repo_root=REPO_ROOT,
                             log_path=base + "_tests.log")
      run["files"]["tests_log"] = base + "_tests.log"
    else:
      roofline = f"{base}_kernels.json" if part == "engine" else None
      status, rc = _spawn(part, part_json, deadline, roofline)
      run[part] = gpu_day.read_json(part_json) or {"status": "no output"}
    run["files"][part] = part_json
    run["timeline"].append(dict(part=part, process=status, returncode=rc,
                                wall_s=round(time.monotonic() - t0, 1),
                                part_status=run[part].get("status")))
    save()
    print(f"--- {part}: {status}, part status {run[part].get('status')}, "
          f"{time.monotonic() - t0:.0f} s", flush=True)
  run["meta"]["wall_s"] = round(time.monotonic() - start, 1)
  run["files"]["plot"], why = gpu_day.plot(run, base + ".png")
  if not run["files"]["plot"]:
    run["files"]["plot_missing"] = why
  save()
  print(gpu_day.summary(run))


if __name__ == "__main__":
  cli.run(main)
