"""Tiny random Wan 2.2 A14B pieces built with diffusers (nothing downloaded).

The DiT is diffusers' own test config (2 layers, 2 heads of 12, FFN 32, text
dim 32, rope_max_seq_len 32); the two experts differ by seed. Biases and
norm weights are redrawn (diffusers zero- / one-initialises them, which
would hide a bias or norm read from the wrong tensor)."""

import diffusers
import pytest
import torch

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


def tiny_dit(seed: int):
  torch.manual_seed(seed)
  return randomize(diffusers.WanTransformer3DModel(**TINY_DIT), seed).eval()


def tiny_vae_model(seed: int):
  """diffusers' tiny test VAE: base_dim 3, dim_mult 1111, one res block."""
  torch.manual_seed(seed)
  vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1],
                                   num_res_blocks=1, temperal_downsample=[False, True, True])
  return randomize(vae, seed).eval()


# Session fixtures: test modules import them by name (a conftest.py under tests/
# would shadow tests/conftest.py for `from conftest import ...`).
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
