"""The chunked VAE decoder against diffusers' AutoencoderKLWan.decode (diffusers'
own tiny test config), loaded from its save_pretrained output."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer.diffusion import wan_vae
from wan_tiny import tiny_vae  # noqa: F401 (fixtures built once a run)


def test_vae_decode_matches_diffusers(tiny_vae):
  vae, path = tiny_vae
  cfg, params = wan_vae.load_vae(str(path))
  z = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(1))  # 9 x 32 x 32 px
  with torch.no_grad():
    ref = vae.decode(z, return_dict=False)[0].numpy()
  ours = np.asarray(wan_vae.decode(cfg, params, jnp.asarray(z.numpy())))
  assert ours.shape == ref.shape == (1, 3, 9, 32, 32)
  err = float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))
  print(f"VAE decode: max|ours - diffusers| / max|diffusers| = {err:.2e}")
  assert err < 1e-4
  assert np.std(ref[:, :, 1:]) > 1e-3  # frames after the first are not constant


def test_vae_errors(tiny_vae):
  _, path = tiny_vae
  cfg, params = wan_vae.load_vae(str(path))
  with pytest.raises(ValueError, match="VAE latents must be"):
    wan_vae.decode(cfg, params, jnp.zeros((1, 8, 2, 4, 4)))
  with pytest.raises(ValueError, match="is_residual"):
    wan_vae.VaeConfig.from_diffusers({"is_residual": True})
