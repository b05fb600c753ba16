"""Tiny random Wan 2.2 A14B pieces built with diffusers (nothing downloaded).

The DiT is diffusers' own test config (2 layers, 2 heads of 12, FFN 32, text
dim 32, rope_max_seq_len 32); the two experts differ by seed. Biases and
norm weights are redrawn (diffusers zero- / one-initialises them, which
would hide a bias or norm read from the wrong tensor). The tokenizer is a
tiny Unigram tokenizer.json of google/umt5-xxl's shape (<pad> 0, </s> 1,
<unk> 2, Metaspace pieces, a closing </s>), the text encoder a tiny
UMT5EncoderModel of d_model 32 (the DiT's text_dim)."""

import json

import diffusers
import pytest
import tokenizers
import torch
import transformers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

TINY_DIT = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                in_channels=16, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32,
                num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                rope_max_seq_len=32)


def randomize(module, seed: int):
  """Every parameter redrawn: weights ~ N(0, 1/fan_in), the rest ~ N(0, 0.1) (+1 for norm
  weights), so no tensor is a constant that a wrong mapping would still match."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      if p.ndim >= 2 and "scale_shift_table" not in name:
        fan_in = p[0].numel()
        p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
      else:
        base = 1.0 if ("norm" in name and name.endswith("weight")) else 0.0
        p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
  return module


# Wan2.2-T2V-A14B-Diffusers scheduler_config.json fields the sampler reads.
SCHEDULER = dict(num_train_timesteps=1000, solver_order=2, prediction_type="flow_prediction",
                 use_flow_sigmas=True, flow_shift=3.0, predict_x0=True, solver_type="bh2",
                 lower_order_final=True, final_sigmas_type="zero", timestep_spacing="linspace")
TINY_UMT5 = dict(vocab_size=64, d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2,
                 feed_forward_proj="gated-gelu", dropout_rate=0.0)
WORDS = ("a", "cat", "dog", "on", "the", "moon", "surfing", "wave", "in", "red", "blue", "sky")


def write_tokenizer(directory) -> None:
  """tokenizer.json and tokenizer_config.json of a tiny UMT5-shaped tokenizer
  (words, then single characters for the rest; what is left is <unk>)."""
  chars = sorted(set("abcdefghijklmnopqrstuvwxyzACT&,.'"))
  vocab = ([(t, 0.0) for t in ("<pad>", "</s>", "<unk>")] + [(f"\u2581{w}", -1.0) for w in WORDS]
           + [("\u2581", -3.0)] + [(c, -3.0) for c in chars])
  tok = tokenizers.Tokenizer(models.Unigram(vocab, unk_id=2))
  tok.normalizer = normalizers.Replace(tokenizers.Regex(" {2,}"), " ")
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
  tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
  tok.post_processor = processors.TemplateProcessing(
      single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True)
                          for t in ("<pad>", "</s>", "<unk>")])
  directory.mkdir(parents=True, exist_ok=True)
  tok.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(dict(
      tokenizer_class="T5Tokenizer", pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
      extra_ids=0)))


def tiny_text_encoder(seed: int):
  """A tiny UMT5EncoderModel with its relative-bias tables and norms redrawn."""
  torch.manual_seed(seed)
  model = transformers.UMT5EncoderModel(transformers.UMT5Config(**TINY_UMT5)).eval()
  with torch.no_grad():
    for blk in model.encoder.block:
      blk.layer[0].SelfAttention.relative_attention_bias.weight.normal_(0, 1.0)
      blk.layer[0].layer_norm.weight.normal_(1.0, 0.1)
  return model


def tiny_dit(seed: int):
  torch.manual_seed(seed)
  return randomize(diffusers.WanTransformer3DModel(**TINY_DIT), seed).eval()


def tiny_vae_model(seed: int):
  """diffusers' tiny test VAE: base_dim 3, dim_mult 1111, one res block."""
  torch.manual_seed(seed)
  vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1],
                                   num_res_blocks=1, temperal_downsample=[False, True, True])
  return randomize(vae, seed).eval()


# Fixtures built once a run (scope="session"): test modules import them by name
# (a conftest.py under tests/ would shadow tests/conftest.py for
# `from conftest import ...`).
@pytest.fixture(scope="session")
def dit_dirs(tmp_path_factory):
  """transformer/ and transformer_2/ of a tiny A14B, saved by diffusers."""
  root = tmp_path_factory.mktemp("wan_tiny")
  models = {}
  for name, seed in (("transformer", 0), ("transformer_2", 1)):
    models[name] = tiny_dit(seed)
    models[name].save_pretrained(root / name)
  return root, models


@pytest.fixture(scope="session")
def tiny_vae(tmp_path_factory):
  """diffusers' tiny test VAE (base_dim 3) and its saved vae/ directory."""
  vae = tiny_vae_model(7)
  path = tmp_path_factory.mktemp("wan_vae") / "vae"
  vae.save_pretrained(path)
  return vae, path


@pytest.fixture(scope="session")
def wan_pipeline_dir(dit_dirs, tiny_vae, tmp_path_factory):
  """A whole tiny WanPipeline (tokenizer/, text_encoder/, both experts, vae/,
  scheduler/) saved by diffusers, and the pipeline."""
  root = tmp_path_factory.mktemp("wan_pipeline")
  write_tokenizer(root / "tokenizer_src")
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(root / "tokenizer_src"))
  models = dit_dirs[1]
  pipe = diffusers.WanPipeline(tokenizer=tokenizer, text_encoder=tiny_text_encoder(3),
                               vae=tiny_vae[0],
                               scheduler=diffusers.UniPCMultistepScheduler(**SCHEDULER),
                               transformer=models["transformer"],
                               transformer_2=models["transformer_2"], boundary_ratio=0.875)
  pipe.save_pretrained(root / "pipeline")
  return root / "pipeline", pipe
