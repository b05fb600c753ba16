"""The README's newcomer path, command by command, with short settings: an HF
checkpoint checked against transformers (experiments/check_hf.py), generation
sharded over simulated devices (experiments/generate.py --mesh), and a LoadGen
run (experiments/mlperf_harness.py). Generation with the default model is
tests/models/test_default_model.py."""

import json
import os
import subprocess
import sys
from conftest import subprocess_env


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args, timeout=600):
  # A fresh process: no inherited simulated-device flags, the script sets its own.
  env = subprocess_env(drop=("XLA_FLAGS", "JAX_PLATFORMS"))
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout, env=env)


def test_check_hf_matches_transformers():
  out = _run(["experiments/check_hf.py", "--seq_len=8"])
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  lines = [l for l in out.stdout.splitlines() if "max|ours - hf|" in l]
  assert len(lines) == 2 and all(l.endswith(")") and " OK " in l for l in lines), out.stdout


def test_check_hf_fails_above_tolerance():
  out = _run(["experiments/check_hf.py", "--archs=llama", "--seq_len=4", "--tolerance=1e-12"])
  assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
  assert "FAIL" in out.stdout


def test_generate_sharded_on_simulated_devices():
  out = _run(["experiments/generate.py", "--cpu_devices=8", "--mesh=data=2,expert=4",
              "--layout=dp_attn_ep", "--max_tokens=8", "--num_pages=32", "--max_num_seqs=4"])
  assert out.returncode == 0, out.stderr[-3000:]
  assert "over 8 cpu devices, layout dp_attn_ep, 8 attention-DP ranks" in out.stdout, out.stdout
  for needle in ("prompt + completion", "TTFT", "tokens/s", "MTP drafts per step (K)"):
    assert needle in out.stdout, (needle, out.stdout[-2000:])


def test_mlperf_harness_short_run(tmp_path):
  out = _run(["experiments/mlperf_harness.py", "--scenarios=Server", "--num_samples=4",
              "--max_tokens=4", "--min_duration_ms=1000", "--min_query_count=8",
              "--server_qps=4", f"--out={tmp_path}"])
  assert out.returncode == 0, out.stderr[-3000:]
  assert "first tokens match True" in out.stdout, out.stdout[-2000:]
  assert (tmp_path / "scenarios_performance.json").exists()
  assert (tmp_path / "Server_performance" / "mlperf_log_summary.txt").exists()


def test_mlperf_harness_deepseek_r1_dp_ep_mtp(tmp_path):
  # The R1-style config: attention DP + wide EP on 8 simulated devices, MTP K = 3.
  out = _run(["experiments/mlperf_harness.py", "--config=configs/mlperf_default_model_mtp_dp_ep.py",
              "--scenarios=Offline", "--num_samples=8", "--max_tokens=8",
              "--min_duration_ms=500", "--min_query_count=8", f"--out={tmp_path}"])
  assert out.returncode == 0, out.stderr[-3000:]
  assert "first tokens match True" in out.stdout, out.stdout[-2000:]
  rows = json.loads((tmp_path / "scenarios_performance.json").read_text())
  assert rows["mesh"] == "data=2,expert=4" and rows["speculative"] == 3
