"""The model flags every experiment script that loads a model shares,
defined here once:

  --model=default        the bundled trained tiny_moe (`jaxinfer.load_default_model`)
  --model=tiny_dense     a preset of `jaxinfer.presets`, random weights
  --hf_dir=path/to/hf    an HF checkpoint directory (overrides --model)
  --checkpoint_dir=DIR   an orbax checkpoint written by `checkpoint.save` (overrides --model)

A script calls `define()` at module level (its flags, its `--help`; a
script's own default model as `define(default="tiny_dense")`) and
`ModelFlags.load()` in `main`. The old spelling of `--hf_dir`, `--model_dir`,
is kept as a deprecated alias: it still works, with a warning on stderr.

Scripts that study a preset's shapes rather than load weights (benchmarks on
random weights, compile-only plans) name it the same way, `--model=<preset>`,
with `define_preset(default)`; their old `--preset` is a deprecated alias.
"""

from __future__ import annotations

import dataclasses

from absl import flags, logging

from jaxinfer import run
from jaxinfer.tokenizer import load_tokenizer

# Flags defined through `define` belong to the calling script (its --help).
flags.disclaim_key_flags()

DEFAULT = "default"
HELP = {
    "model": "'default' (the bundled trained tiny_moe) or a preset name of jaxinfer.presets "
             "(random weights)",
    "hf_dir": "an HF checkpoint directory: config.json, *.safetensors, tokenizer.json "
              "(overrides --model)",
    "checkpoint_dir": "an orbax checkpoint written by jaxinfer.checkpoint.save (overrides --model)",
    "model_dir": "deprecated: use --hf_dir",
    "preset": "deprecated: use --model",
}
PRESET_HELP = "a preset name of jaxinfer.presets (its shapes; random weights where run)"


def _spelled(name: str, value, old: str, old_value):
  """--name's value, or its deprecated spelling --old's when given (with a
  warning; both given and different: an error naming them)."""
  if not old_value:
    return value
  logging.log_first_n(logging.WARNING, f"--{old} is deprecated: use --{name}=%s", 1, old_value)
  if flags.FLAGS[name].present and value != old_value:
    raise ValueError(f"--{name}={value} and --{old}={old_value} disagree: give --{name} only")
  return old_value


@dataclasses.dataclass(frozen=True)
class Model:
  """A loaded model: `name` says where it came from (for reports)."""
  name: str
  cfg: object
  params: object
  tokenizer: object  # None where the model has none (a preset's vocabulary past bytes)
  source: dict  # {} (the bundled model), or load_model's one keyword: preset / hf_dir / checkpoint_dir

  def need_tokenizer(self):
    """The tokenizer; ValueError for a model without one."""
    if self.tokenizer is None:
      raise ValueError(f"{self.name}: no tokenizer for a vocabulary of {self.cfg.vocab_size} "
                       "tokens; give an --hf_dir with tokenizer.json, or a byte-level model")
    return self.tokenizer


@dataclasses.dataclass(frozen=True)
class ModelFlags:
  """The holders of the shared model flags of one script."""
  model: flags.FlagHolder
  hf_dir: flags.FlagHolder
  checkpoint_dir: flags.FlagHolder
  model_dir: flags.FlagHolder  # deprecated alias of hf_dir

  def hf_path(self) -> str | None:
    """--hf_dir, or its deprecated spelling --model_dir (with a warning)."""
    return _spelled("hf_dir", self.hf_dir.value, "model_dir", self.model_dir.value)

  def source(self) -> dict:
    """{} for the bundled model, else `run.load_model`'s one keyword."""
    hf_dir = self.hf_path()
    if hf_dir and self.checkpoint_dir.value:
      raise ValueError("--hf_dir and --checkpoint_dir: give one checkpoint")
    if hf_dir:
      return dict(hf_dir=hf_dir)
    if self.checkpoint_dir.value:
      return dict(checkpoint_dir=self.checkpoint_dir.value)
    return {} if self.model.value == DEFAULT else dict(preset=self.model.value)

  def load(self, *, dtype=None) -> Model:
    """Loads the model the flags name. `dtype` applies to presets and
    checkpoints; the bundled model computes in its own dtype."""
    source = self.source()
    if not source:
      cfg, params, tok = run.load_default_model()
      return Model("default: tiny_moe trained on the Python stdlib", cfg, params, tok, source)
    cfg, params = run.load_model(**source, dtype=dtype)
    [(kind, where)] = source.items()
    return Model(f"{kind}={where}", cfg, params, _tokenizer(cfg, source.get("hf_dir")), source)


def _tokenizer(cfg, hf_dir):
  """tokenizer.json from hf_dir, bytes for a vocab-256 model, else None."""
  try:
    return load_tokenizer(cfg, hf_dir)
  except ValueError:
    return None


def define(default: str = DEFAULT, hf_dir: str | None = None) -> ModelFlags:
  """Defines --model (default `default`), --hf_dir (default none), --checkpoint_dir
  and the deprecated --model_dir in the calling script."""
  return ModelFlags(
      model=flags.DEFINE_string("model", default, HELP["model"]),
      hf_dir=flags.DEFINE_string("hf_dir", hf_dir, HELP["hf_dir"]),
      checkpoint_dir=flags.DEFINE_string("checkpoint_dir", None, HELP["checkpoint_dir"]),
      model_dir=flags.DEFINE_string("model_dir", None, HELP["model_dir"]))


@dataclasses.dataclass(frozen=True)
class PresetFlags:
  """--model=<preset> of a script that studies a preset's shapes."""
  model: flags.FlagHolder
  preset: flags.FlagHolder  # deprecated alias of model

  @property
  def value(self) -> str:
    """The preset: --model, or its deprecated spelling --preset (with a warning)."""
    return _spelled("model", self.model.value, "preset", self.preset.value)


def define_preset(default: str) -> PresetFlags:
  """Defines --model (a preset name; `default` is the script's) and the
  deprecated --preset in the calling script."""
  return PresetFlags(model=flags.DEFINE_string("model", default, PRESET_HELP),
                     preset=flags.DEFINE_string("preset", None, HELP["preset"]))
