"""WAN-2.2-T2V-A14B as one value: both experts' DiT config, the sampler, the VAE.

`a14b()` carries the real dimensions (shapes only: `wan_weights.param_specs`
/ `count_params`, nothing allocates); `tiny()` a random model of the same
structure small enough to sample on a CPU in a second (the VideoEngine and
LoadGen tests). The MLPerf settings are the sampler's defaults: 20 steps,
guidance 4.0 / 3.0, boundary 0.875, 720 x 1280, 81 frames at 16 fps.

flow_shift: the A14B scheduler_config.json's value is what to run
(`unipc.FlowUniPC.from_diffusers` reads it, `load_pipeline` does); 3.0 here
is diffusers' Wan scheduler default, not checked against the published file.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxinfer.diffusion import unipc, wan_vae, wan_weights
from jaxinfer.diffusion.wan_config import WanConfig, a14b_expert
from jaxinfer.diffusion.wan_pipeline import SamplerConfig
from jaxinfer.models.specs import is_spec

# The Wan 2.1 VAE's per-channel latent statistics (AutoencoderKLWan's defaults).
LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
               3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WanModel:
  dit: WanConfig  # both experts (transformer/, transformer_2/) share it
  sampler: SamplerConfig
  vae: wan_vae.VaeConfig
  height: int = 720
  width: int = 1280
  frames: int = 81
  fps: int = 16
  text_len: int = 512  # UMT5 tokens (prompt embeddings padded to this)

  def latent_shape(self, batch: int = 1) -> tuple[int, ...]:
    """The initial latent: [B, 16, (frames - 1) / 4 + 1, height / 8, width / 8]."""
    return (batch, self.dit.in_channels, (self.frames - 1) // 4 + 1, self.height // 8,
            self.width // 8)

  def tokens(self) -> int:
    """Video tokens of one DiT pass."""
    return self.dit.tokens(*self.latent_shape()[2:])


def a14b() -> WanModel:
  return WanModel(dit=a14b_expert(), sampler=SamplerConfig(solver=unipc.FlowUniPC(flow_shift=3.0)),
                  vae=wan_vae.VaeConfig(latents_mean=LATENTS_MEAN, latents_std=LATENTS_STD,
                                        dtype="bfloat16"))


def tiny() -> WanModel:
  """diffusers' tiny test dimensions (DiT 2 x 2 heads of 12, VAE base 3): 9
  frames of 16 x 16, 4 steps, float32."""
  return WanModel(dit=WanConfig(num_heads=2, head_dim=12, text_dim=32, ffn_dim=32, num_layers=2,
                                rope_max_seq_len=32),
                  sampler=SamplerConfig(num_steps=4, solver=unipc.FlowUniPC(flow_shift=3.0)),
                  vae=wan_vae.VaeConfig(base_dim=3, dim_mult=(1, 1, 1, 1), num_res_blocks=1,
                                        latents_mean=LATENTS_MEAN, latents_std=LATENTS_STD),
                  height=16, width=16, frames=9, text_len=8)


def count_params(model: WanModel) -> dict[str, int]:
  """Parameters from shapes alone: each expert, the VAE decoder, the total."""
  expert = wan_weights.count_params(model.dit)
  vae = sum(math.prod(s.shape)
            for s in jax.tree.leaves(wan_vae.param_specs(model.vae), is_leaf=is_spec))
  return dict(transformer=expert, transformer_2=expert, vae_decoder=vae,
              total=2 * expert + vae)
