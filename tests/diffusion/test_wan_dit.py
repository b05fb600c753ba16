"""The Wan DiT against diffusers' WanTransformer3DModel, loaded from its own
save_pretrained output (both A14B experts), and its input / checkpoint errors."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch

from jaxinfer.checkpoint import CheckpointError
from jaxinfer.diffusion import wan_dit, wan_weights
from wan_tiny import dit_dirs  # noqa: F401 (fixtures built once a run)


def _rel(ours, ref):
  return float(np.max(np.abs(np.asarray(ours) - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("name", ["transformer", "transformer_2"])
def test_dit_matches_diffusers(dit_dirs, name):
  root, models = dit_dirs
  cfg, params = wan_weights.load_transformer(str(root / name))
  g = torch.Generator().manual_seed(3)
  latents = torch.randn(2, 16, 3, 8, 12, generator=g)  # 3 x 4 x 6 patches: every rope axis
  text = torch.randn(2, 7, 32, generator=g)
  t = torch.tensor([999.0, 437.0])
  with torch.no_grad():
    ref = models[name](latents, t, text, return_dict=False)[0].numpy()
  ours = wan_dit.forward(cfg, params, jnp.asarray(latents.numpy()), jnp.asarray(t.numpy()),
                         jnp.asarray(text.numpy()))
  assert ours.shape == ref.shape
  err = _rel(ours, ref)
  print(f"{name}: max|ours - diffusers| / max|diffusers| = {err:.2e}")
  assert err < 1e-4


def test_dit_bfloat16_within_design_tolerance(dit_dirs):
  """bfloat16 weights and activations (norms, modulation, residuals in float32),
  as the A14B runs, against diffusers in float32: docs/design.md's 2e-2."""
  root, models = dit_dirs
  cfg, params = wan_weights.load_transformer(str(root / "transformer"), "bfloat16")
  assert params["blocks"]["self"]["wq"].dtype == jnp.bfloat16
  g = torch.Generator().manual_seed(4)
  latents, text = torch.randn(1, 16, 2, 4, 4, generator=g), torch.randn(1, 6, 32, generator=g)
  with torch.no_grad():
    ref = models["transformer"](latents, torch.tensor([500.0]), text, return_dict=False)[0]
  ours = wan_dit.forward(cfg, params, jnp.asarray(latents.numpy()), 500.0,
                         jnp.asarray(text.numpy()))
  assert ours.dtype == jnp.bfloat16
  err = _rel(np.asarray(ours, np.float32), ref.numpy())
  print(f"bfloat16: max|ours - diffusers f32| / max|diffusers| = {err:.2e}")
  assert err < 2e-2


def test_dit_input_errors(dit_dirs):
  root, _ = dit_dirs
  cfg, params = wan_weights.load_transformer(str(root / "transformer"))
  text = jnp.zeros((1, 4, 32))
  with pytest.raises(ValueError, match="latents must be"):
    wan_dit.forward(cfg, params, jnp.zeros((1, 15, 2, 4, 4)), 1.0, text)
  with pytest.raises(ValueError, match="height"):
    wan_dit.forward(cfg, params, jnp.zeros((1, 16, 2, 5, 4)), 1.0, text)
  with pytest.raises(ValueError, match="text embeddings"):
    wan_dit.forward(cfg, params, jnp.zeros((1, 16, 2, 4, 4)), 1.0, jnp.zeros((1, 4, 31)))


def _rewrite(src, dst, edit):
  dst.mkdir()
  (dst / "config.json").write_text((src / "config.json").read_text())
  tensors = safetensors.numpy.load_file(str(src / "diffusion_pytorch_model.safetensors"))
  edit(tensors)
  safetensors.numpy.save_file(tensors, str(dst / "diffusion_pytorch_model.safetensors"))


def test_checkpoint_errors_name_the_tensor(dit_dirs, tmp_path):
  src = dit_dirs[0] / "transformer"
  name = "blocks.1.attn1.to_q.weight"
  _rewrite(src, tmp_path / "missing", lambda t: t.pop(name))
  with pytest.raises(CheckpointError, match="missing tensor 'blocks.1.attn1.to_q.weight'"):
    wan_weights.load_transformer(str(tmp_path / "missing"))

  def misshape(t):
    t[name] = t[name][:, :-1].copy()
  _rewrite(src, tmp_path / "shape", misshape)
  with pytest.raises(CheckpointError, match="blocks.1.attn1.to_q.weight.*shape"):
    wan_weights.load_transformer(str(tmp_path / "shape"))

  def extra(t):
    t["blocks.0.attn2.add_k_proj.weight"] = np.zeros((24, 24), np.float32)
  _rewrite(src, tmp_path / "extra", extra)
  with pytest.raises(CheckpointError, match="unexpected tensors.*add_k_proj"):
    wan_weights.load_transformer(str(tmp_path / "extra"))

  (tmp_path / "i2v").mkdir()
  config = json.loads((src / "config.json").read_text())
  (tmp_path / "i2v" / "config.json").write_text(json.dumps({**config, "image_dim": 1280}))
  with pytest.raises(ValueError, match="image_dim"):
    wan_weights.load_transformer(str(tmp_path / "i2v"))
