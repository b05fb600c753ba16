"""WAN-2.2-T2V-A14B sampling: two experts, classifier-free guidance, UniPC.

diffusers' `WanPipeline.__call__` from prompt embeddings and a fixed initial
latent: at each of the scheduler's timesteps t, the high-noise expert
(`transformer`) runs while t >= boundary_ratio * num_train_timesteps, the
low-noise one (`transformer_2`) after, each with its own guidance scale;
the conditional and unconditional passes are one batched DiT call
([cond; uncond] along the batch), and v = v_u + g (v_c - v_u) feeds the
UniPC step (`unipc`). Timesteps fall monotonically, so the experts' steps
are a prefix and a suffix: two `lax.scan`s in one jitted program, each over
its expert's params. The denoiser is `wan_dit.forward`, or with a mesh the
CFG-, sequence- and tensor-parallel pass of `wan_parallel`. `generate` decodes the
result with the VAE (`wan_vae`) into frames in [0, 1], as output_type="np".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.diffusion import unipc, wan_dit, wan_parallel, wan_vae
from jaxinfer.diffusion.wan_config import WanConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerConfig:
  """The MLPerf WAN-2.2-T2V-A14B settings by default: 20 steps, guidance 4.0
  (high-noise expert) and 3.0 (low-noise), boundary 0.875."""
  num_steps: int = 20
  guidance_high: float = 4.0
  guidance_low: float = 3.0
  boundary_ratio: float = 0.875
  solver: unipc.FlowUniPC = unipc.FlowUniPC()

  def __post_init__(self):
    if self.num_steps < 1:
      raise ValueError(f"SamplerConfig.num_steps must be >= 1, got {self.num_steps}")
    if not 0.0 <= self.boundary_ratio <= 1.0:
      raise ValueError(f"SamplerConfig.boundary_ratio must be in [0, 1], got "
                       f"{self.boundary_ratio}")

  def schedule(self) -> unipc.Schedule:
    return unipc.schedule(self.solver, self.num_steps)

  def high_noise_steps(self) -> int:
    """Steps of the high-noise expert: timesteps >= boundary_ratio * T."""
    boundary = self.boundary_ratio * self.solver.num_train_timesteps
    return int(np.sum(self.schedule().timesteps >= boundary))


def check_inputs(cfg: WanConfig, latents, text, neg_text) -> None:
  """ValueError naming the argument, before any device work."""
  if latents.ndim != 5 or latents.shape[1] != cfg.in_channels:
    raise ValueError(f"latents must be [B, {cfg.in_channels}, F, H, W], got {latents.shape}")
  if text.shape != neg_text.shape:
    raise ValueError(f"text ({text.shape}) and neg_text ({neg_text.shape}) embeddings must "
                     "have one shape (pad both to the text length)")
  wan_dit.check_inputs(cfg, latents, jnp.zeros(latents.shape[0]), text)


def _guided(cfg: WanConfig, params, x, t, text2, guidance: float, mesh):
  """v = v_u + g (v_c - v_u), both passes in one DiT call of batch 2B."""
  B = x.shape[0]
  x2 = jnp.concatenate([x, x]).astype(cfg.compute_dtype())
  t2 = jnp.full((2 * B,), t, jnp.float32)
  if mesh is None:
    v2 = wan_dit.forward(cfg, params, x2, t2, text2)
  else:
    v2 = wan_parallel.forward(cfg, params, x2, t2, text2, mesh)
  cond, uncond = v2[:B].astype(jnp.float32), v2[B:].astype(jnp.float32)
  return uncond + guidance * (cond - uncond)


def denoise_step(cfg: WanConfig, params, state, text2, row, *, guidance: float, mesh=None):
  """One sampling step: the guided velocity at state's sample (one DiT call
  on [cond; uncond], text2 = [text; neg_text]) and the UniPC update. row:
  (timestep, sigma, corrector [5], predictor [3]), one step of the Schedule;
  state: `unipc.init_state`'s (x, last, m_prev, m_prev2)."""
  t, sigma, corr, pred = row
  v = _guided(cfg, params, state[0], t, text2, guidance, mesh)
  return unipc.step(state, v, sigma, corr, pred)


def _run(cfg: WanConfig, params, state, text2, guidance: float, rows, mesh):
  """A run of UniPC steps of one expert, scanned over the schedule's rows."""
  def body(state, row):
    return denoise_step(cfg, params, state, text2, row, guidance=guidance, mesh=mesh), None
  if rows[0].shape[0] == 0:
    return state
  return jax.lax.scan(body, state, rows)[0]


@functools.partial(jax.jit, static_argnames=("cfg", "sampler", "mesh"))
def _denoise(cfg: WanConfig, sampler: SamplerConfig, params_high, params_low, latents, text,
             neg_text, mesh=None):
  s = sampler.schedule()
  k = sampler.high_noise_steps()
  rows = (s.timesteps.astype(np.float32), s.sigmas[:-1], s.corrector, s.predictor)
  high = tuple(jnp.asarray(r[:k]) for r in rows)
  low = tuple(jnp.asarray(r[k:]) for r in rows)
  text2 = jnp.concatenate([text, neg_text])
  state = unipc.init_state(latents.astype(jnp.float32))
  state = _run(cfg, params_high, state, text2, sampler.guidance_high, high, mesh)
  state = _run(cfg, params_low, state, text2, sampler.guidance_low, low, mesh)
  return state[0]


def denoise(cfg: WanConfig, sampler: SamplerConfig, params_high, params_low, latents, text,
            neg_text, *, mesh=None):
  """The denoised latents [B, C, F, H, W] float32 from the initial latents
  (float32 noise), prompt embeddings text [B, L, Dt] and negative-prompt
  embeddings neg_text [B, L, Dt]; one jitted program for all steps. mesh:
  a `wan_parallel.make_mesh` mesh runs each DiT pass CFG-, sequence- and
  tensor-parallel over its axes (params placed by `wan_parallel.param_shardings`)."""
  check_inputs(cfg, latents, text, neg_text)
  if mesh is not None:
    wan_parallel.check_mesh(cfg, mesh, latents.shape, batch=2 * latents.shape[0])
  return _denoise(cfg, sampler, params_high, params_low, latents, text, neg_text, mesh)


def to_frames(video):
  """VAE output [B, 3, F, H, W] in [-1, 1] -> frames [B, F, H, W, 3] in [0, 1]
  (diffusers' VideoProcessor.postprocess_video, output_type="np")."""
  return jnp.clip(video / 2 + 0.5, 0.0, 1.0).transpose(0, 2, 3, 4, 1)


def generate(cfg: WanConfig, sampler: SamplerConfig, params_high, params_low,
             vae_cfg: wan_vae.VaeConfig, vae_params, latents, text, neg_text, *, mesh=None):
  """Frames [B, 1 + 4 (F - 1), 8H, 8W, 3] float32 in [0, 1]: `denoise`, the
  latents de-normalised by the VAE's mean / std, decoded (`wan_vae.decode`)."""
  z = denoise(cfg, sampler, params_high, params_low, latents, text, neg_text, mesh=mesh)
  return to_frames(wan_vae.decode(vae_cfg, vae_params, wan_vae.denormalize(vae_cfg, z)))
