"""One set of model flags across the experiment scripts
(`benchlib.model_flags`), and their command-line manners (`benchlib.cli`):
colour only on a terminal and never with NO_COLOR."""

import io
import pathlib
import re
import subprocess
import sys

import pytest

from benchlib import cli, model_flags
from conftest import subprocess_env

ROOT = pathlib.Path(__file__).parents[2]
SCRIPTS = sorted((ROOT / "experiments").glob("*.py"))
# Loading weights: the bundled model, a checkpoint, or a preset by name.
LOADS = re.compile(r"load_default_model|run\.load_model|checkpoint\.(load_hf|restore)\(|"
                   r"presets\.get\(|run_\w+\(model=")
SHARED = set(model_flags.HELP)  # model, hf_dir, checkpoint_dir, model_dir, preset
# check_hf.py checks HF checkpoints against transformers, which loads only
# those: its --hf_dir (the shared flag's name and meaning) is its one model flag.
HF_ONLY = {"check_hf.py": {"hf_dir"}}
# Scripts that build models but do not take one: why.
EXEMPT = {"weights_memory.py": "sweeps a list of presets (--models)",
          "train_tiny.py": "trains tiny_moe from random weights, or on from --init_from (its "
                           "own earlier run)"}


def _text(script):
  return script.read_text()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_define_no_model_flag_of_their_own(script):
  own = set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", _text(script))) & SHARED
  assert own == HF_ONLY.get(script.name, set()), (script.name, own)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_script_that_loads_a_model_takes_the_shared_flags(script):
  text = _text(script)
  if not LOADS.search(text) or script.name in HF_ONLY or script.name in EXEMPT:
    return
  assert "model_flags.define(" in text or "model_flags.define_preset(" in text, script.name


def test_the_model_loading_scripts():
  # The scripts that load weights take --model / --hf_dir / --checkpoint_dir.
  loaders = {p.name for p in SCRIPTS if "model_flags.define(" in _text(p)}
  assert loaders >= {"generate.py", "serve.py", "mlperf_harness.py", "bench_speculative.py",
                     "serve_bench.py", "simulate_cluster.py", "kv_transfer_bench.py",
                     "kv_quant.py", "soak.py", "dp_balance.py", "vl_encoder_cache.py"}


class _Tty(io.StringIO):
  def isatty(self):
    return True


def test_bold_only_on_a_terminal_without_no_color(monkeypatch):
  monkeypatch.delenv("NO_COLOR", raising=False)
  assert cli.bold("x", _Tty()) == "\033[1mx\033[0m"
  assert cli.bold("x", io.StringIO()) == "x"  # piped or redirected
  monkeypatch.setenv("NO_COLOR", "1")
  assert cli.bold("x", _Tty()) == "x"
  monkeypatch.setenv("NO_COLOR", "")  # no-color.org: set and empty means colour
  assert cli.bold("x", _Tty()) == "\033[1mx\033[0m"


def test_old_spellings_still_work_with_a_warning():
  # --model_dir (serve.py's and mlperf_harness.py's old flag) is --hf_dir.
  env = subprocess_env(drop=("XLA_FLAGS",))
  out = subprocess.run([sys.executable, "experiments/generate.py",
                        f"--model_dir={ROOT / 'tests/fixtures/hf/llama'}", "--prompt_ids=1,2,3",
                        "--max_tokens=2", "--num_draft_tokens=0", "--num_pages=16"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "--model_dir is deprecated: use --hf_dir=" in out.stderr
  assert "model: hf_dir=" in out.stdout and "llama" in out.stdout
