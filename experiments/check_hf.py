"""Load HF checkpoints with `checkpoint.load_hf` and check the logits against transformers.

  pip install -e ".[hf]"                                   # torch + transformers
  python experiments/check_hf.py                           # tiny random Llama and DeepSeek-V3
  python experiments/check_hf.py --archs=llama --seq_len=32
  python experiments/check_hf.py --hf_dir=path/to/hf_checkpoint   # a checkpoint of your own

Without --hf_dir, builds each of --archs (any name in
`checkpoint.hf_build.BASE_CONFIGS`, the configs of the test fixtures) as a
tiny random transformers model with `hf_build.save_tiny`, which saves it as
safetensors to a temporary directory, loads that directory with
`jaxinfer.checkpoint.load_hf` (float32) and compares `models.logits` with the
transformers model's logits on random tokens. Prints max|ours - hf| and the
relative error max|ours - hf| / max|hf|; exits non-zero when the relative error
is above --tolerance.
"""

from __future__ import annotations

import sys
import tempfile

from absl import app, flags
import jax.numpy as jnp
import numpy as np

from benchlib import cli, flag_config
from jaxinfer import checkpoint, models
from jaxinfer.checkpoint import hf_build

_HF_DIR = flags.DEFINE_string("hf_dir", None, "an HF checkpoint directory (config.json + "
                              "*.safetensors) to check instead of the tiny random models")
_ARCHS = flags.DEFINE_list("archs", ["llama", "deepseek_v3"], "tiny random models to build: "
                           "names in checkpoint.hf_build.BASE_CONFIGS ("
                           + ", ".join(sorted(hf_build.BASE_CONFIGS)) + ")")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 16, "tokens per sequence")
_BATCH = flags.DEFINE_integer("batch", 2, "sequences")
_SEED = flags.DEFINE_integer("seed", 0, "weights and tokens seed")
_TOLERANCE = flags.DEFINE_float("tolerance", 1e-4, "largest relative error accepted "
                                "(float32 parity measures ~1e-6)")
_CONFIG = flag_config.define_config(__file__)

def _transformers():
  try:
    torch, transformers = hf_build.import_torch_transformers()
  except ImportError as e:
    raise SystemExit(f"check_hf: {e}")
  transformers.utils.logging.disable_progress_bar()
  return torch, transformers


def _load_hf_model(torch, transformers, path):
  kwargs = dict(dtype=torch.float32, attn_implementation="eager")
  try:  # MoE models: the reference per-expert loop, not a fused kernel
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, experts_implementation="eager", **kwargs).eval()
  except (TypeError, ValueError):
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def check(path: str, name: str, torch, transformers) -> float:
  """Loads `path` with jaxinfer and transformers, compares the logits -> relative error."""
  cfg, params = checkpoint.load_hf(path, dtype=jnp.float32)
  tokens = np.random.default_rng(_SEED.value).integers(
      0, cfg.vocab_size, (_BATCH.value, _SEQ_LEN.value)).astype(np.int32)
  ours = np.asarray(models.logits(cfg, params, tokens))
  with torch.no_grad():
    hf = _load_hf_model(torch, transformers, path)(
        input_ids=torch.from_numpy(tokens).long()).logits.float().numpy()
  diff = float(np.abs(ours - hf).max())
  rel = diff / float(np.abs(hf).max())
  ok = rel <= _TOLERANCE.value
  print(f"{name:12s} {cfg.model_type:12s} logits {tuple(ours.shape)}  max|ours - hf| = {diff:.2e}  "
        f"relative {rel:.2e}  {'OK' if ok else 'FAIL'} (tolerance {_TOLERANCE.value:g})",
        flush=True)
  return rel


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  torch, transformers = _transformers()
  print(f"transformers {transformers.__version__}, torch {torch.__version__}")
  if _HF_DIR.value:
    rels = [check(_HF_DIR.value, "hf_dir", torch, transformers)]
  else:
    unknown = sorted(set(_ARCHS.value) - set(hf_build.BASE_CONFIGS))
    if unknown:
      raise app.UsageError(f"--archs: unknown {unknown}; choose from "
                           f"{sorted(hf_build.BASE_CONFIGS)} (checkpoint.hf_build.BASE_CONFIGS)")
    rels = []
    for arch in _ARCHS.value:
      with tempfile.TemporaryDirectory() as d:
        hf_build.save_tiny(arch, d, seed=_SEED.value)
        rels.append(check(d, arch, torch, transformers))
  if max(rels) > _TOLERANCE.value:
    sys.exit(1)


if __name__ == "__main__":
  cli.run(main)
