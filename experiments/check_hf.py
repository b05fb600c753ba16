"""Load HF checkpoints with `checkpoint.load_hf` and check the logits against transformers.

  pip install -e ".[hf]"                                   # torch + transformers
  python experiments/check_hf.py                           # tiny random Llama and DeepSeek-V3
  python experiments/check_hf.py --archs=llama --seq_len=32
  python experiments/check_hf.py --hf_dir=path/to/hf_checkpoint   # a checkpoint of your own

Without --hf_dir, builds each architecture as a tiny random transformers model,
saves it as safetensors to a temporary directory, loads that directory with
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

from jaxinfer import checkpoint, models

_HF_DIR = flags.DEFINE_string("hf_dir", None, "an HF checkpoint directory (config.json + "
                              "*.safetensors) to check instead of the tiny random models")
_ARCHS = flags.DEFINE_list("archs", ["llama", "deepseek_v3"], "tiny random architectures to "
                           "build: llama, deepseek_v3")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 16, "tokens per sequence")
_BATCH = flags.DEFINE_integer("batch", 2, "sequences")
_SEED = flags.DEFINE_integer("seed", 0, "weights and tokens seed")
_TOLERANCE = flags.DEFINE_float("tolerance", 1e-4, "largest relative error accepted "
                                "(float32 parity measures ~1e-6)")

# Tiny configs (vocab 256, hidden 64): a few MB, built in seconds.
TINY = {
    "llama": ("LlamaConfig", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=32))),
    "deepseek_v3": ("DeepseekV3Config", dict(
        vocab_size=256, hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        max_position_embeddings=128, rope_interleave=True, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=1.0))),
}


def _transformers():
  try:
    import torch
    import transformers
  except ImportError as e:
    raise SystemExit(f"check_hf needs torch and transformers ({e}): pip install -e '.[hf]'")
  transformers.utils.logging.disable_progress_bar()
  return torch, transformers


def _load_hf_model(torch, transformers, path):
  kwargs = dict(dtype=torch.float32, attn_implementation="eager")
  try:  # MoE models: the reference per-expert loop, not a fused kernel
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, experts_implementation="eager", **kwargs).eval()
  except (TypeError, ValueError):
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def _save_tiny(torch, transformers, arch: str, path: str) -> None:
  """A tiny random HF model of `arch`, saved as safetensors in `path`."""
  cls_name, kwargs = TINY[arch]
  config = getattr(transformers, cls_name)(initializer_range=0.2, **kwargs)
  torch.manual_seed(_SEED.value)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  with torch.no_grad():  # non-trivial norms and router biases, so none can be silently dropped
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.1 * torch.randn_like(p))
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(0.1 * torch.randn_like(b))
  model.save_pretrained(path, safe_serialization=True)


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
  torch, transformers = _transformers()
  print(f"transformers {transformers.__version__}, torch {torch.__version__}")
  if _HF_DIR.value:
    rels = [check(_HF_DIR.value, "hf_dir", torch, transformers)]
  else:
    unknown = sorted(set(_ARCHS.value) - set(TINY))
    if unknown:
      raise app.UsageError(f"--archs: unknown {unknown}; choose from {sorted(TINY)}")
    rels = []
    for arch in _ARCHS.value:
      with tempfile.TemporaryDirectory() as d:
        _save_tiny(torch, transformers, arch, d)
        rels.append(check(d, arch, torch, transformers))
  if max(rels) > _TOLERANCE.value:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
