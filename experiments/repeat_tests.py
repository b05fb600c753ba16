"""Runs a set of test files again and again (`python -m pytest -n 2`, the
README's way) and records every run, to show the multi-device and serving
tests pass run after run with no crash and no rerun (the suite has none).

  python experiments/repeat_tests.py --runs=20
  python experiments/repeat_tests.py --runs=3 --tests=tests/sharding/test_sharding.py

Appends one JSON line per run to --out (default
experiments/results/repeat_tests.jsonl): the commit, when it started, its
seconds, pytest's passed / failed / error counts, whether an xdist worker
crashed, and the exit status. Stops at the first run that does not pass
unless --keep_going; --until_s stops starting new runs after that many
seconds.
"""

import datetime
import json
import os
import re
import subprocess
import sys
import time

from absl import flags

from benchlib import cli, flag_config

MULTI_DEVICE_AND_SERVING = [
    "tests/sharding/test_sharding.py", "tests/sharding/test_spec_mesh.py", "tests/sharding/test_tp_kernel_sharding.py",
    "tests/sharding/test_multihost.py", "tests/engine/test_eplb.py", "tests/gpu/test_ep_bytes.py",
    "tests/sharding/test_sharding_report.py", "tests/serving/test_serving.py", "tests/serving/test_serving_router.py",
    "tests/serving/test_serving_workloads.py", "tests/serving/test_serving_ray.py", "tests/serving/test_http_server.py",
    "tests/serving/test_http_ray.py", "tests/serving/test_soak.py",
]

_RUNS = flags.DEFINE_integer("runs", 20, "runs at most")
_TESTS = flags.DEFINE_list("tests", MULTI_DEVICE_AND_SERVING, "test files or ids")
_WORKERS = flags.DEFINE_integer("workers", 2, "pytest -n")
_UNTIL_S = flags.DEFINE_integer("until_s", 0, "start no run after this many seconds (0: no limit)")
_KEEP_GOING = flags.DEFINE_bool("keep_going", False, "go on after a run that did not pass")
_OUT = flags.DEFINE_string("out", None, "JSON lines (default experiments/results/repeat_tests.jsonl)")
_CONFIG = flag_config.define_config(__file__)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def counts(output: str) -> dict:
  """pytest's summary line -> {passed, failed, errors, ...}."""
  summary = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed)", line)]
  found = re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary[-1] if summary else "")
  return {("errors" if kind.startswith("error") else kind): int(n) for n, kind in found}


def run_once(tests, workers) -> dict:
  start = time.time()
  proc = subprocess.run([sys.executable, "-m", "pytest", "-n", str(workers), "-p", "no:cacheprovider",
                         "-o", "addopts=-q", *tests], cwd=ROOT, capture_output=True, text=True)
  out = proc.stdout + proc.stderr
  c = counts(out)
  return dict(started=datetime.datetime.fromtimestamp(start, datetime.timezone.utc).isoformat(
      timespec="seconds"), seconds=round(time.time() - start, 1), returncode=proc.returncode,
              passed=c.get("passed", 0), failed=c.get("failed", 0), errors=c.get("errors", 0),
              skipped=c.get("skipped", 0),
              worker_crashed=bool(re.search(r"node down|worker '?gw\d+'? crashed", out)),
              failures=re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M))


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
  dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip())
  path = _OUT.value or os.path.join(ROOT, "experiments", "results", "repeat_tests.jsonl")
  t0 = time.time()
  for i in range(_RUNS.value):
    if _UNTIL_S.value and time.time() - t0 > _UNTIL_S.value:
      break
    row = dict(run=i + 1, commit=commit, dirty=dirty, tests=_TESTS.value, workers=_WORKERS.value,
               **run_once(_TESTS.value, _WORKERS.value))
    with open(path, "a") as f:
      f.write(json.dumps(row) + "\n")
    ok = row["returncode"] == 0 and not row["worker_crashed"]
    print(f"run {i + 1}: {'pass' if ok else 'FAIL'} {row['passed']} passed, {row['failed']} failed, "
          f"{row['errors']} errors, {row['seconds']:.0f} s {row['failures']}", flush=True)
    if not ok and not _KEEP_GOING.value:
      sys.exit(1)


if __name__ == "__main__":
  cli.run(main)
