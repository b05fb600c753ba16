"""The shipped default model and the README's run command."""

import os
import re
import subprocess
import sys

import jaxinfer
from conftest import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# An INFO line: absl's Python format (I1127 07:12:44.123 ...), XLA's C++ one
# (I0000 00:00:...), or a plain logging one.
INFO = re.compile(r"^(I\d{4} \d\d:\d\d|INFO[: ])")
# What jaxlib's CUDA extensions log from C++ when `import jax` loads them on a
# machine without a GPU, before any script code runs (nothing configures it):
# CI's venv has them (the gpu-compile extra); a plain `pip install -e .` has
# no CUDA plugin and prints neither line (benchlib/cli.py).
JAXLIB_IMPORT = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\)|"
                           r"I0000 00:00:\S+ +\d+ cudart_stub\.cc:\d+\] Could not find cuda)")


def test_default_model_loads_with_mtp_and_a_tokenizer():
  cfg, params, tok = jaxinfer.load_default_model()
  assert cfg.num_mtp_layers == 1 and cfg.is_moe and cfg.attention.latent
  assert "mtp" in params
  text = "def f(x):\n    return x  # é"
  assert tok.decode(tok.encode(text)) == text


def test_readme_first_command_reads_clean():
  # The README's first command, `python experiments/generate.py`, as a user
  # runs it with its output piped (`> out.txt 2> err.txt`): stdout holds the
  # completions and the metrics table in plain text, stderr no INFO logs.
  env = subprocess_env(drop=("XLA_FLAGS", "JAX_PLATFORMS", "NO_COLOR"))
  out = subprocess.run([sys.executable, "experiments/generate.py"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  for needle in ("prompt + completion", "TTFT", "TPOT", "tokens/s", "mean accepted length",
                 "acceptance per position", "def read_lines(path):"):
    assert needle in out.stdout, (needle, out.stdout[-2000:])
  assert "\x1b" not in out.stdout and "\x1b" not in out.stderr, out.stdout[-2000:]
  info = [l for l in out.stderr.splitlines() if INFO.match(l) and not JAXLIB_IMPORT.match(l)]
  assert not info and "Traceback" not in out.stderr, out.stderr[-3000:]


def test_verbosity_flag_shows_info_logs():
  # -v=0 brings back jax's and orbax's INFO lines on stderr.
  out = subprocess.run([sys.executable, "experiments/generate.py", "-v=0", "--max_tokens=2",
                        "--num_draft_tokens=0"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=subprocess_env())
  assert out.returncode == 0, out.stderr[-3000:]
  assert any(INFO.match(line) for line in out.stderr.splitlines()), out.stderr[-3000:]
  assert "prompt + completion" in out.stdout and "prompt + completion" not in out.stderr
