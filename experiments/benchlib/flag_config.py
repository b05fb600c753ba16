"""Experiment configs over an absl script's flags.

A config is a `configs/*.py` module whose `get_config()` returns an
`ml_collections.ConfigDict`: a `script` field naming the experiment script it
is for, and fields named as that script's flags. Every `experiments/*.py`
script defines `--config` with `define_config` (its default config is
`configs/<script name>.py` unless it names another) and calls `apply_config`
first thing in `main`:

  python experiments/mlperf_harness.py --config=configs/mlperf_default_model_gpt_oss_limits.py
  python experiments/mlperf_harness.py --config=configs/mlperf_default_model_mtp.py --config.scenarios=Server
  python experiments/gpu_day.py --config.budget_s=300   # the default config, configs/gpu_day.py

Precedence, highest first: a flag given on the command line (`--scenarios=`),
the config (with its `--config.<field>=` overrides), the flag's default. So a
script keeps its flags, their help and their defaults; a config names a
setting once and a field no flag consumes is an error, not a silent no-op.
Tuples (what `--config.<field>=a,b` parses to) fill list flags; a None field
(`config_dict.placeholder(type)`, overridable from the command line) leaves
its flag's default.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

from absl import flags

try:
  from ml_collections import config_flags
except ImportError:  # the lent GPU machine's image: jax, absl, no ml_collections (no install step)
  config_flags = None

# Flags defined through `define_config` belong to the calling script (its --help).
flags.disclaim_key_flags()

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def define_config(script: str, default: str | None = None) -> flags.FlagHolder:
  """Defines the `--config` flag of the experiment script at `script` (its
  `__file__`): a `configs/*.py` file (`file.py:arg` passes `get_config` an
  argument), by default `configs/<default>`, or without one the config named as
  the script (`experiments/gpu_day.py` -> `configs/gpu_day.py`), whose fields
  are the flags' defaults so the script runs as it always did.

  Without ml_collections installed, `--config` is a plain flag that only its
  default (None: the flags' defaults, what the default config sets) passes:
  the GPU scripts still run where nothing can be installed."""
  name = default or os.path.basename(script)
  help_ = f"experiment config (configs/*.py[:arg]; default configs/{name})"
  if config_flags is None:
    return flags.DEFINE_string("config", None, help_ + "; needs ml_collections, not installed")
  return config_flags.DEFINE_config_file(
      "config", str(CONFIGS / name), help_ + "; override a field with --config.<field>=")


def apply_config(config, flag_values: flags.FlagValues, script: str) -> dict:
  """Sets each flag of `flag_values` named by a `config` field, unless it was
  given on the command line. `script`: the running script's path; it must
  end with the config's `script` field. Returns {field: value} as applied.

  Raises ValueError naming the field when no flag consumes it, the config is
  for another script, or a value does not parse as its flag's type."""
  if config is None:
    return {}
  if isinstance(config, str):  # define_config without ml_collections
    raise ValueError(f"--config={config}: configs need ml_collections (pip install ml_collections)")
  fields = dict(config.items())
  target = fields.pop("script", None)
  if target is None or not os.path.abspath(script).endswith(os.path.normpath(target)):
    raise ValueError(f"--config: the config is for script {target!r}, not {script!r} "
                     "(a config names its script in a `script` field)")
  unknown = sorted(k for k in fields if k not in flag_values or k == "config")
  if unknown:
    raise ValueError(f"--config: fields {unknown} are not flags of {target}")
  applied = {}
  for name, value in fields.items():
    flag = flag_values[name]
    if flag.present or value is None:
      continue  # the command line wins over the config; None: the flag's default
    flag.value = _parse(flag, name, value)
    applied[name] = flag.value
  return applied


def _parse(flag, name, value):
  """value -> what the flag itself would hold (a list flag holds strings; a
  multi flag, `--prompt=a --prompt=b`, a list of its parser's values)."""
  if isinstance(value, (tuple, list)):
    value = [str(v) for v in value]
  try:
    if isinstance(flag, flags.MultiFlag):
      return [flag.parser.parse(v) for v in (value if isinstance(value, list) else [value])]
    return flag.parser.parse(value)
  except (ValueError, TypeError) as e:
    raise ValueError(f"--config.{name}={value!r}: {e}") from None


def load_config(path: str | pathlib.Path, arg: str | None = None):
  """`get_config(arg)` (or `get_config()`) of the config file at `path`: how
  a config builds on another (config files are loaded by path, not imported
  as a package)."""
  path = pathlib.Path(path)
  spec = importlib.util.spec_from_file_location(f"_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config() if arg is None else module.get_config(arg)
