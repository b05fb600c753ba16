"""The shipped default model and the README's run command."""

import os
import subprocess
import sys

import jaxinfer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_default_model_loads_with_mtp_and_a_tokenizer():
  cfg, params, tok = jaxinfer.load_default_model()
  assert cfg.num_mtp_layers == 1 and cfg.is_moe and cfg.attention == "mla"
  assert "mtp" in params
  text = "def f(x):\n    return x  # é"
  assert tok.decode(tok.encode(text)) == text


def test_readme_run_command_prints_text_and_metrics():
  # The README's first command runs experiments/generate.py with no flags;
  # here with fewer tokens.
  out = subprocess.run([sys.executable, "experiments/generate.py", "--max_tokens=24"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  for needle in ("prompt + completion", "TTFT", "TPOT", "tokens/s", "mean accepted length",
                 "acceptance per position"):
    assert needle in out.stdout, (needle, out.stdout[-2000:])
