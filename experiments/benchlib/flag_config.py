"""Experiment configs over an absl script's flags.

A config is a `configs/*.py` module whose `get_config()` returns an
`ml_collections.ConfigDict`: a `script` field naming the experiment script it
is for, and fields named as that script's flags. Every `experiments/*.py`
script defines `--config` with `define_config`, after its flags (its default
config is `configs/<script name>.py` unless it names another), and calls
`apply_config` first thing in `main`:

  python experiments/mlperf_harness.py --config=configs/mlperf_default_model_gpt_oss_limits.py
  python experiments/mlperf_harness.py --config=configs/mlperf_default_model_mtp.py --config.scenarios=Server
  python experiments/gpu_day.py --config.budget_s=300   # the default config, configs/gpu_day.py

A default lives in one place, the flag: a config file writes only what it
changes (a script's default config, often nothing but its `script`), and
loading it fills every other flag of the script in as a field holding the
flag's default, so `--config.<field>=` overrides any flag. Not filled in:
internal flags (help "internal: ...", passed to a script's own child
processes), deprecated spellings (help "deprecated: ...") and secrets
(`SECRETS`).

Precedence, highest first: a flag given on the command line (`--scenarios=`),
the config (with its `--config.<field>=` overrides), the flag's default. A
field no flag consumes is an error, not a silent no-op. Tuples (what
`--config.<field>=a,b` parses to) fill list flags; a None field
(`config_dict.placeholder(type)`) leaves its flag's default.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import pathlib
import sys

from absl import flags

try:
  from ml_collections import config_dict, config_flags
  from ml_collections.config_flags import config_flags as config_flags_impl
except ImportError:  # the lent GPU machine's image: jax, absl, no ml_collections (no install step)
  config_dict = config_flags = config_flags_impl = None

# Flags defined through `define_config` belong to the calling script (its --help).
flags.disclaim_key_flags()

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
# Flags that are never config fields (secrets do not go in files).
SECRETS = frozenset({"api_key"})


def define_config(script: str, default: str | None = None) -> flags.FlagHolder:
  """Defines the `--config` flag of the experiment script at `script` (its
  `__file__`), after the script's other flags: a `configs/*.py` file
  (`file.py:arg` passes `get_config` an argument), by default
  `configs/<default>`, or without one the config named as the script
  (`experiments/gpu_day.py` -> `configs/gpu_day.py`). A loaded config gets
  every flag of the calling script it does not set, as a field holding the
  flag's default (`config_fields`), so the script runs as it always did.

  Without ml_collections installed, `--config` is a plain flag that only its
  default (None: the flags' defaults) passes: the GPU scripts still run
  where nothing can be installed."""
  name = default or os.path.basename(script)
  help_ = f"experiment config (configs/*.py[:arg]; default configs/{name})"
  if config_flags is None:
    return flags.DEFINE_string("config", None, help_ + "; needs ml_collections, not installed")
  module = inspect.currentframe().f_back.f_globals.get("__name__")
  module = sys.argv[0] if module == "__main__" else module  # how absl names a script's flags
  parser = _DefaultsFilled(module, flags.FLAGS)
  # DEFINE_config_file's flag, with a parser that fills the flags in.
  return flags.DEFINE_flag(config_flags_impl._ConfigFlag(
      parser=parser, serializer=flags.ArgumentSerializer(), name="config",
      default=str(CONFIGS / name), help_string=help_ + "; override a field with --config.<field>=",
      flag_values=flags.FLAGS), flags.FLAGS)


def config_fields(flag_values: flags.FlagValues, module: str) -> dict:
  """{flag name: its default as a config field} for the flags `module`
  defines, less `config`, internal flags, deprecated spellings and SECRETS.
  A list default becomes a tuple; a None default a placeholder of the flag's
  type (str for a list flag: the comma-separated string it parses); a multi
  flag (`--prompt=a --prompt=b`) a str placeholder (None: its default)."""
  out = {}
  for flag in flag_values.get_flags_for_module(module):
    help_ = (flag.help or "").lower()
    if (flag.name == "config" or flag.name in SECRETS or help_.startswith("internal")
        or help_.startswith("deprecated")):
      continue
    value = flag.default
    if isinstance(flag, flags.MultiFlag):  # `--prompt=a --prompt=b`: one value from a config
      value = config_dict.placeholder(str)
    elif value is None:
      kind = {"int": int, "float": float, "bool": bool}.get(flag.flag_type(), str)
      value = config_dict.placeholder(kind)
    elif isinstance(value, list):
      value = tuple(value)
    out[flag.name] = value
  return out


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
    value = _parse(flag, name, value)
    if value != flag.default:  # a field filled in from the flag changes nothing
      flag.value = applied[name] = value
  return applied


def _parse(flag, name, value):
  """value -> what the flag itself would hold (a list flag holds strings; a
  multi flag, `--prompt=a --prompt=b`, a list of its parser's values)."""
  if isinstance(value, (tuple, list)):
    value = [str(v) for v in value]
    if not isinstance(flag, flags.MultiFlag):  # a list flag parses "a,b" (a tuple field may
      value = ",".join(value)                  # hold "a,b" whole: --config.tests=a.py,b.py)
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


if config_flags is not None:

  class _DefaultsFilled(config_flags_impl.ConfigFileFlagParser):
    """Loads a config file as `DEFINE_config_file` does, then fills in every
    flag of the script that it does not set (`config_fields`)."""

    def __init__(self, module: str, flag_values: flags.FlagValues):
      super().__init__(name="config")
      self.module, self.flag_values = module, flag_values

    def parse(self, path):
      config = super().parse(path)
      with config.unlocked():
        for name, value in config_fields(self.flag_values, self.module).items():
          if name not in config:
            config[name] = value
      return config

    def flag_type(self):
      return "config object"
