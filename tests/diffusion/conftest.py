"""The tiny random A14B experts and VAE (`wan_tiny`), saved with save_pretrained
once per session."""

import pytest

from wan_tiny import tiny_dit, tiny_vae_model


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
