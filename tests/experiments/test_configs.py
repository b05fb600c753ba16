"""configs/*.py: every config loads, names its script, and that script's own
flag parsing consumes every field (`--config=` + `benchlib.flag_config`,
run in a subprocess without the experiment); default configs equal the
flags' defaults, so a script behaves the same with and without one."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_dict

from benchlib import flag_config

ROOT = pathlib.Path(__file__).parents[2]
# `python -c` children import benchlib (experiments/benchlib) as the scripts do.
_PYTHONPATH = os.pathsep.join(p for p in (str(ROOT / "experiments"), os.environ.get("PYTHONPATH"))
                              if p)
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.py"))
# Parameterised configs: file -> the arguments (`--config=file.py:arg`) to check.
ARGS = {"bench_decode.py": ["", "bench_moe"], "serving_topologies.py": ["", "tp2", "dp_ep2"]}

# Imports the script as a module (its flags, no `app.run`), parses argv like
# the script would, applies the config and prints the result.
_PARSE = """
import importlib.util, json, sys
from absl import flags
from benchlib import flag_config
path, argv = sys.argv[1], sys.argv[2:]
spec = importlib.util.spec_from_file_location("script_under_test", path)
sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)  # absl: flags' module
spec.loader.exec_module(module)
FLAGS = flags.FLAGS
FLAGS([path, *argv])
applied = flag_config.apply_config(FLAGS["config"].value, FLAGS, path)
names = [f.name for f in FLAGS.get_flags_for_module("script_under_test") if f.name != "config"]
print(json.dumps(dict(applied=applied, values={n: FLAGS[n].value for n in names},
                      defaults={n: FLAGS[n].default for n in names}), default=str))
"""


def _load(name, arg=""):
  """get_config() of configs/<name>, as `--config=configs/<name>[:arg]` calls it."""
  spec = importlib.util.spec_from_file_location(f"config_{name[:-3]}", ROOT / "configs" / name)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(*([arg] if arg else []))


def _parse(script, *argv):
  proc = subprocess.run([sys.executable, "-c", _PARSE, str(ROOT / script), *argv], cwd=ROOT,
                        capture_output=True, text=True, timeout=300,
                        env={"JAX_PLATFORMS": "cpu", **os.environ, "PYTHONPATH": _PYTHONPATH})
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _cases():
  for name in CONFIGS:
    for arg in ARGS.get(name, [""]):
      yield pytest.param(name, arg, id=f"{name}:{arg}" if arg else name)


def test_every_config_file_is_checked():
  assert set(CONFIGS) >= {"mlperf_default_model.py", "mlperf_deepseek_r1.py",
                          "mlperf_deepseek_r1_dp_ep.py",
                          "mlperf_llama3_1_405b.py", "mlperf_gpt_oss.py",
                          "serving_topologies.py", "bench_decode.py"}


@pytest.mark.parametrize("name,arg", list(_cases()))
def test_script_consumes_every_field(name, arg):
  cfg = _load(name, arg)
  assert (ROOT / cfg.script).exists(), cfg.script
  spec = f"configs/{name}" + (f":{arg}" if arg else "")
  out = _parse(cfg.script, f"--config={spec}")
  fields = {k: v for k, v in cfg.items() if k != "script" and v is not None}
  assert set(out["applied"]) == set(fields)
  for k, v in fields.items():  # the flag holds the field (list flags: strings)
    want = [str(x) for x in v] if isinstance(v, tuple) else v
    assert out["values"][k] == want, k


def test_default_configs_equal_the_flag_defaults():
  for name, script in (("mlperf_default_model.py", "experiments/mlperf_harness.py"),
                       ("bench_decode.py", "experiments/bench_decode.py")):
    out = _parse(script)  # no --config: the script's default config
    assert out["applied"], name
    assert {k: out["defaults"][k] for k in out["applied"]} == out["applied"], name
    assert out["values"] == out["defaults"], name


def test_mlperf_configs_set_the_same_fields():
  keys = [set(_load(n).keys()) for n in CONFIGS if n.startswith("mlperf_")]
  assert len(keys) == 5 and all(k == keys[0] for k in keys)


def test_overrides_and_precedence():
  out = _parse("experiments/mlperf_harness.py", "--config=configs/mlperf_gpt_oss.py",
               "--config.scenarios=Server", "--config.server_qps=2", "--max_tokens=4")
  v = out["values"]
  assert v["scenarios"] == ["Server"] and v["server_qps"] == 2.0 and v["limits"] == "gpt-oss-120b"
  assert v["max_tokens"] == 4 and "max_tokens" not in out["applied"]  # the command line wins
  out = _parse("experiments/bench_decode.py", "--config=configs/bench_decode.py:bench_moe",
               "--config.batches=1,8", "--config.threads=2")
  assert out["values"]["model"] == "bench_moe"
  assert out["values"]["batches"] == ["1", "8"] and out["values"]["threads"] == 2


def test_a_field_no_flag_consumes_is_an_error():
  fv = flags.FlagValues()
  flags.DEFINE_integer("repeats", 5, "", flag_values=fv)
  fv(["x.py"])
  cfg = config_dict.ConfigDict(dict(script="experiments/x.py", repeats=2, typo=1))
  with pytest.raises(ValueError, match=r"\['typo'\] are not flags"):
    flag_config.apply_config(cfg, fv, "experiments/x.py")
  with pytest.raises(ValueError, match="is for script"):
    flag_config.apply_config(cfg, fv, "experiments/other.py")
  cfg = config_dict.ConfigDict(dict(script="experiments/x.py", repeats=2))
  assert flag_config.apply_config(cfg, fv, "/repo/experiments/x.py") == {"repeats": 2}
  assert fv.repeats == 2
