"""configs/ is the one configuration system of the experiments: every
`experiments/*.py` script takes a config with `--config=` (by default one in
configs/ that changes none of the flags' defaults, so a script behaves the
same with and without it), every config in configs/ loads and names its
script, and that script's own flag parsing consumes every field (`--config=` +
`benchlib.flag_config`, without the experiment: the scripts parsed in one
subprocess, each script's flags removed before the next defines its own). A
default is written once, in its flag: no config field restates it, and every
flag is a field all the same (`--config.<field>=`)."""

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
SCRIPTS = sorted(f"experiments/{p.name}" for p in (ROOT / "experiments").glob("*.py"))
# Parameterised configs: file -> the arguments (`--config=file.py:arg`) to check.
ARGS = {"bench_decode.py": ["", "bench_moe"], "serving_topologies.py": ["", "tp2", "dp_ep2"]}

# Imports the script as a module (its flags, no `app.run`), then for each argv
# (a JSON list of lists) parses it as the script would, applies the config and
# prints the result. `--config.<field>=` overrides are defined from sys.argv
# when the script defines --config, so they may appear in one argv only.
_PARSE = """
import importlib.util, json, sys, traceback
from absl import flags
from benchlib import flag_config
FLAGS = flags.FLAGS

def parse(path, argvs):
  sys.argv = [path, *argvs[0]]
  spec = importlib.util.spec_from_file_location("script_under_test", path)
  sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)  # absl: flags' module
  spec.loader.exec_module(module)
  names = [f.name for f in FLAGS.get_flags_for_module("script_under_test") if f.name != "config"]
  out = []
  for argv in argvs:
    FLAGS.unparse_flags()
    FLAGS([path, *argv])
    applied = flag_config.apply_config(FLAGS["config"].value, FLAGS, path)
    out.append(dict(applied=applied, values={n: FLAGS[n].value for n in names},
                    defaults={n: FLAGS[n].default for n in names}))
  return dict(rounds=out, config_default=FLAGS["config"].default_as_str,
              config_module=FLAGS.find_module_defining_flag("config"))

def forget():
  # The script's flags (and any --config.<field> overrides) leave FLAGS, so
  # the next script in this process defines its own flags of the same names.
  FLAGS.unparse_flags()
  for name in [f.name for f in FLAGS.get_flags_for_module("script_under_test")]:
    delattr(FLAGS, name)
  for name in [n for n in FLAGS if n.startswith("config.")]:
    delattr(FLAGS, name)
  sys.modules.pop("script_under_test", None)

if sys.argv[1] == "--each":  # {script: argvs} -> {script: result or the error's traceback}
  results = {}
  for path, argvs in json.loads(sys.argv[2]).items():
    try:
      results[path] = parse(path, argvs)
    except BaseException:  # noqa: BLE001 (a script's SystemExit too: its test reports it)
      results[path] = dict(error=traceback.format_exc())
    forget()
  print(json.dumps(results, default=str))
else:
  print(json.dumps(parse(sys.argv[1], json.loads(sys.argv[2])), default=str))
"""


def _load(name, arg=""):
  """get_config() of configs/<name>, as `--config=configs/<name>[:arg]` calls it."""
  spec = importlib.util.spec_from_file_location(f"config_{name[:-3]}", ROOT / "configs" / name)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(*([arg] if arg else []))


def _run_parse(*args, prelude="") -> subprocess.CompletedProcess:
  """`_PARSE` in a subprocess (after `prelude`) with `args` as its argv."""
  return subprocess.run([sys.executable, "-c", prelude + _PARSE, *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=600,
                        env={"JAX_PLATFORMS": "cpu", **os.environ, "PYTHONPATH": _PYTHONPATH})


def _last_json(proc: subprocess.CompletedProcess):
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _parse_rounds(script, *argvs, prelude=""):
  return _last_json(_run_parse(str(ROOT / script), json.dumps(argvs), prelude=prelude))


def _parse(script, *argv):
  return _parse_rounds(script, list(argv))["rounds"][0]


def _parse_each(argvs: dict) -> dict:
  """{script: [argv, ...]} -> {script: `_PARSE`'s result}, every script in one subprocess."""
  results = _last_json(_run_parse("--each", json.dumps({str(ROOT / k): v
                                                        for k, v in argvs.items()})))
  return {script: results[str(ROOT / script)] for script in argvs}


def _configs_of(script):
  """(spec, ConfigDict) of every config in configs/ whose `script` is `script`."""
  for name in CONFIGS:
    for arg in ARGS.get(name, [""]):
      cfg = _load(name, arg)
      if cfg.script == script:
        yield f"configs/{name}" + (f":{arg}" if arg else ""), cfg


def test_every_config_names_a_script():
  for name in CONFIGS:
    cfg = _load(name)
    assert cfg.script in SCRIPTS, (name, cfg.script)


def test_every_script_has_a_config():
  # configs/ is the one configuration system: no experiment without a config.
  assert len(SCRIPTS) >= 27
  named = {_load(name).script for name in CONFIGS}
  assert set(SCRIPTS) <= named, sorted(set(SCRIPTS) - named)


@pytest.fixture(scope="module")
def every_script_parsed():
  """Each script's `_PARSE` result for no --config and for each of its configs,
  all parsed in one subprocess (one import of jax for the 30-odd scripts;
  each script's flags are removed before the next one defines its own)."""
  return _parse_each({script: [[], *([f"--config={spec}"] for spec, _ in _configs_of(script))]
                      for script in SCRIPTS})


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_takes_its_configs(script, every_script_parsed):
  configs = list(_configs_of(script))
  assert configs, f"{script}: no config in configs/"
  out = every_script_parsed[script]
  assert "error" not in out, out.get("error")
  # --config is the script's flag, by default a config of configs/ for this script.
  assert out["config_module"] == "script_under_test", out["config_module"]
  default = pathlib.Path(out["config_default"].strip("'\""))
  assert default.parent == ROOT / "configs" and default.exists(), default
  assert _load(default.name).script == script
  # No --config: the default config, which changes no flag.
  first = out["rounds"][0]
  assert first["applied"] == {} and first["values"] == first["defaults"], script
  # Each config: the script's flags consume every field and hold its value.
  for (spec, cfg), got in zip(configs, out["rounds"][1:]):
    fields = {k: v for k, v in cfg.items() if k != "script"}
    # A default lives in its flag only: a field in a config file changes it.
    assert None not in fields.values(), (spec, "a None field: the flag's default, restated")
    restated = [k for k, v in fields.items() if _same(v, got["defaults"][k])]
    assert not restated, (spec, "fields that restate their flag's default", restated)
    assert set(got["applied"]) == set(fields), spec
    for k, v in fields.items():  # the flag holds the field (list flags: strings)
      want = [str(x) for x in v] if isinstance(v, tuple) else v
      assert got["values"][k] == want, (spec, k)


def test_one_process_parses_each_script_as_its_own_process_would(every_script_parsed):
  # The last script parsed after all the others: the same flags, values and
  # defaults as a process of its own (no flag of an earlier script left over).
  script = SCRIPTS[-1]
  alone = _parse_rounds(script, [], *([f"--config={spec}"] for spec, _ in _configs_of(script)))
  assert every_script_parsed[script] == alone


def _same(field, default) -> bool:
  """A config field's value equals a flag's default (as the flag would hold it)."""
  if isinstance(field, bool) != isinstance(default, bool):
    return False
  if isinstance(field, tuple):
    field = [str(x) for x in field]
  return field == default or (isinstance(default, float) and not isinstance(field, bool)
                              and isinstance(field, (int, float)) and float(field) == default)


def test_same_sees_a_restated_default():
  assert _same((1, 8, 32), ["1", "8", "32"]) and _same(450, 450.0) and _same("tp", "tp")
  assert not _same(3, 0) and not _same(True, 1.0) and not _same(("1",), ["1", "8"])


@pytest.mark.parametrize("script", ["experiments/gpu_day.py", "experiments/mosaic_tune.py"])
def test_gpu_scripts_run_without_ml_collections(script):
  # The lent GPU machine's image has no ml_collections and nothing can be
  # installed there: the script parses, and runs on its flags' defaults.
  out = _parse_rounds(script, [], prelude="import sys; sys.modules['ml_collections'] = None\n")
  assert out["rounds"][0]["applied"] == {}
  assert out["rounds"][0]["values"] == out["rounds"][0]["defaults"]


def test_every_flag_is_a_field_but_internal_deprecated_and_secret_ones():
  # Filled in from the flags: a field no config file writes is overridable.
  out = _parse("experiments/kv_quant.py", "--config.max_tokens=8", "--config.teacher=False")
  assert out["values"]["max_tokens"] == 8 and out["values"]["teacher"] is False
  assert out["applied"] == {"max_tokens": 8, "teacher": False}
  for script, field in [("experiments/gpu_day.py", "part"), ("experiments/serve.py", "api_key"),
                        ("experiments/kv_quant.py", "model_dir")]:
    proc = _run_parse(str(ROOT / script), json.dumps([[f"--config.{field}=x"]]))
    assert proc.returncode != 0, (script, field)


def test_mlperf_configs_run_the_bundled_model():
  # Each is named for what it runs: the bundled model (no checkpoint), and the
  # limits or serving its name adds to mlperf_default_model.py.
  for name in CONFIGS:
    if name.startswith("mlperf_"):
      assert name.startswith("mlperf_default_model"), name
      cfg = _load(name)
      # model: the flag's default, "default" (the bundled model), never restated
      assert "model" not in cfg and "hf_dir" not in cfg and "model_dir" not in cfg, name
  assert _load("mlperf_default_model_405b_limits.py").limits == "llama3.1-405b"
  assert _load("mlperf_default_model_gpt_oss_limits.py").limits == "gpt-oss-120b"
  assert _load("mlperf_default_model_mtp.py").speculative == 3


def test_overrides_and_precedence():
  out = {k: v["rounds"][0] for k, v in _parse_each({
      "experiments/mlperf_harness.py": [["--config=configs/mlperf_default_model_gpt_oss_limits.py",
                                         "--config.scenarios=Server", "--config.server_qps=2",
                                         "--max_tokens=4"]],
      "experiments/bench_decode.py": [["--config=configs/bench_decode.py:bench_moe",
                                       "--config.batches=1,8", "--config.threads=2"]],
      "experiments/gpu_day.py": [["--config.budget_s=300", "--config.out_dir=/tmp/g"]],
      "experiments/repeat_tests.py": [["--config.tests=tests/a.py,tests/b.py"]],
      "experiments/generate.py": [["--config.prompt=def f(a, b):"]]}).items()}
  v, applied = (out["experiments/mlperf_harness.py"][k] for k in ("values", "applied"))
  assert v["scenarios"] == ["Server"] and v["server_qps"] == 2.0 and v["limits"] == "gpt-oss-120b"
  # The command line wins.
  assert v["max_tokens"] == 4 and "max_tokens" not in applied
  v = out["experiments/bench_decode.py"]["values"]
  assert v["model"] == "bench_moe" and v["batches"] == ["1", "8"] and v["threads"] == 2
  # A default config: overridden without naming it; a None field set from the command line.
  v = out["experiments/gpu_day.py"]["values"]
  assert v["budget_s"] == 300.0 and v["out_dir"] == "/tmp/g"
  # A None field of a list flag takes a comma-separated string, as the flag does.
  assert out["experiments/repeat_tests.py"]["values"]["tests"] == ["tests/a.py", "tests/b.py"]
  # a multi flag
  assert out["experiments/generate.py"]["values"]["prompt"] == ["def f(a, b):"]


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
