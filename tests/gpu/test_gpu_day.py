"""experiments/gpu_day.py --dry_run end to end on CPU (every part, tiny shapes,
Pallas interpreted), so the script the lent GPU runs cannot rot; and its
pieces: the pytest log parser, the time boxes, no install step."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import subprocess_env
from benchlib import gpu_day

ROOT = pathlib.Path(__file__).parents[2]


@pytest.mark.newest_jax  # the lent GPU machine's jax 0.11: CI's Python 3.12 job runs it
def test_dry_run_writes_every_part(tmp_path):
  env = subprocess_env(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "experiments/gpu_day.py", "--dry_run",
                         f"--out_dir={tmp_path}", "--budget_s=900"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stderr[-3000:]
  [path] = [p for p in tmp_path.glob("gpu_day_cpu_*.json")
            if re.fullmatch(r"gpu_day_cpu_\d{4}-\d\d-\d\d\.json", p.name)]
  run = json.loads(path.read_text())
  assert run["meta"]["dry_run"] and run["meta"]["platform"] == "cpu"
  assert [t["part"] for t in run["timeline"]] == list(gpu_day.PARTS)
  assert all(t["process"] == "ok" and t["part_status"] == "ok" for t in run["timeline"]), \
      run["timeline"]

  tests = run["tests"]
  assert tests["counts"] == {"passed": tests["ran"]} and tests["ran"] >= 3, tests
  assert not tests["failed"] and pathlib.Path(run["files"]["tests_log"]).exists()

  kernels = run["kernels"]
  assert kernels["roofline"]["hbm_gbps"] > 0 and not kernels.get("skipped")
  for name, entries in kernels["results"].items():
    assert entries, name
    for e in entries:
      assert e["impls"]["ours"]["status"] == "ok" and e["impls"]["ours"]["numerics_ok"], e
  assert len(kernels["winners"]["rows"]) == sum(map(len, kernels["results"].values()))

  assert run["engine"]["status"] == "ok"
  assert list(gpu_day.engine_points(run["engine"])), "no engine roofline fraction recorded"
  assert pathlib.Path(run["files"]["plot"]).stat().st_size > 10_000
  for part in gpu_day.PARTS:  # each part's own JSON, as written while it ran
    assert json.loads(pathlib.Path(run["files"][part]).read_text())
  assert "gpu_day cpu" in proc.stdout


def test_pytest_log_parser_reads_plain_xdist_and_streamed_failures():
  text = "\n".join([
      "tests/test_a.py::TestX::test_one PASSED                                [ 10%]",
      "[gw1] [ 20%] FAILED tests/test_a.py::TestXGpu::test_two[case-1]",
      "[gw0] [ 30%] PASSED tests/test_b.py::test_three[Gpu-5]",
      "tests/test_b.py::test_four ",  # cut short mid-line: not counted
      "FAILED tests/test_a.py::TestXGpu::test_two[case-1] - AssertionError: 0.1 <= 1e-05"])
  streamed = json.dumps(dict(test="tests/test_c.py::test_five", error="E   ValueError: x")) + "\n"
  streamed += "not json\n"
  r = gpu_day.parse_pytest_log(text, streamed)
  assert r["counts"] == {"passed": 2, "failed": 1} and r["ran"] == 3
  assert r["failed"] == [dict(test="tests/test_a.py::TestXGpu::test_two[case-1]",
                              error="AssertionError: 0.1 <= 1e-05")]
  assert r["passed"] == ["tests/test_a.py::TestX::test_one", "tests/test_b.py::test_three[Gpu-5]"]


def test_the_kernels_part_orders_every_kernel():
  """Its default order (least measured first) names each kernel once."""
  from benchlib import kernels
  assert sorted(gpu_day.KERNEL_ORDER) == sorted(kernels.KERNELS)


def test_part_deadlines_pass_unused_time_on():
  parts = list(gpu_day.PARTS)
  ends = [gpu_day.part_deadline(p, parts=parts, start=100.0, budget_s=410.0) for p in parts]
  assert ends == sorted(ends) and ends[-1] == 100.0 + 410.0 - gpu_day._PLOT_RESERVE_S
  assert abs((ends[0] - 100.0) - gpu_day.SHARES[parts[0]] * 400) < 1e-6  # its share of the usable time
  # A part run alone gets the whole budget.
  assert gpu_day.part_deadline("kernels", parts=["kernels"], start=0.0, budget_s=110.0) == 100.0


def test_the_gpu_machine_script_never_installs():
  for path in ("experiments/gpu_day.py", "experiments/benchlib/gpu_day.py",
               "experiments/benchlib/gpu_engine.py", "experiments/benchlib/kernels.py"):
    source = (ROOT / path).read_text()
    assert not re.search(r"\bpip\b|ensurepip|install_requires", source), path
