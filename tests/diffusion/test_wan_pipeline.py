"""Sampling against diffusers' WanPipeline (two experts, CFG, UniPC flow) from
the same initial latent and prompt embeddings, and the scheduler's table."""

import diffusers
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer.diffusion import loading, unipc, wan_parallel, wan_pipeline, wan_weights
from wan_tiny import SCHEDULER, dit_dirs, tiny_vae  # noqa: F401 (fixtures built once a run)


def _rel(ours, ref):
  return float(np.max(np.abs(np.asarray(ours) - ref)) / np.max(np.abs(ref)))


def test_schedule_matches_diffusers_timesteps_and_sigmas():
  ref = diffusers.UniPCMultistepScheduler(**SCHEDULER)
  ref.set_timesteps(20)
  ours = unipc.schedule(unipc.FlowUniPC.from_diffusers(SCHEDULER), 20)
  np.testing.assert_array_equal(ours.timesteps, ref.timesteps.numpy())
  np.testing.assert_allclose(ours.sigmas, ref.sigmas.numpy(), rtol=1e-6)
  sampler = wan_pipeline.SamplerConfig()
  boundary = 0.875 * 1000
  assert sampler.high_noise_steps() == int((ref.timesteps >= boundary).sum())
  with pytest.raises(ValueError, match="use_karras_sigmas"):
    unipc.FlowUniPC.from_diffusers({**SCHEDULER, "use_karras_sigmas": True})


def test_unipc_steps_match_diffusers_on_a_linear_model():
  """The coefficient table against scheduler.step on v = x * a + b (all orders,
  the corrector, the final sigma-0 step)."""
  ref = diffusers.UniPCMultistepScheduler(**SCHEDULER)
  ref.set_timesteps(7)
  s = unipc.schedule(unipc.FlowUniPC.from_diffusers(SCHEDULER), 7)
  rng = np.random.default_rng(0)
  x0 = rng.standard_normal((2, 3)).astype(np.float32)
  xt, state = torch.from_numpy(x0), unipc.init_state(jnp.asarray(x0))
  for i, t in enumerate(ref.timesteps):
    vel = lambda x: np.sin(3 * np.asarray(x)) - 0.5 * np.asarray(x) + i
    xt = ref.step(torch.from_numpy(vel(xt).astype(np.float32)), t, xt, return_dict=False)[0]
    state = unipc.step(state, jnp.asarray(vel(state[0])), s.sigmas[i], s.corrector[i],
                       s.predictor[i])
  assert _rel(state[0], xt.numpy()) < 1e-5


def _inputs():
  g = torch.Generator().manual_seed(5)
  latents = torch.randn(1, 16, 3, 4, 6, generator=g)  # 9 frames of 32 x 48
  return latents, torch.randn(1, 9, 32, generator=g), torch.randn(1, 9, 32, generator=g)


def _pipeline(models, vae):
  return diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=vae,
                               scheduler=diffusers.UniPCMultistepScheduler(**SCHEDULER),
                               transformer=models["transformer"],
                               transformer_2=models["transformer_2"], boundary_ratio=0.875)


def _run(pipe, output_type):
  latents, text, neg = _inputs()
  with torch.no_grad():
    out = pipe(prompt_embeds=text, negative_prompt_embeds=neg, latents=latents.clone(),
               height=32, width=48, num_frames=9, num_inference_steps=6, guidance_scale=4.0,
               guidance_scale_2=3.0, output_type=output_type).frames
  return np.asarray(out)


SAMPLER = wan_pipeline.SamplerConfig(num_steps=6, guidance_high=4.0, guidance_low=3.0,
                                     solver=unipc.FlowUniPC.from_diffusers(SCHEDULER))


def test_pipeline_matches_diffusers(dit_dirs):
  root, models = dit_dirs
  assert 0 < SAMPLER.high_noise_steps() < 6  # both experts run
  ref = _run(_pipeline(models, None), "latent")
  cfg, high = wan_weights.load_transformer(str(root / "transformer"))
  _, low = wan_weights.load_transformer(str(root / "transformer_2"))
  latents, text, neg = (jnp.asarray(a.numpy()) for a in _inputs())
  ours = wan_pipeline.denoise(cfg, SAMPLER, high, low, latents, text, neg)
  err = _rel(ours, ref)
  print(f"denoised latents: max|ours - diffusers| / max|diffusers| = {err:.2e}")
  assert err < 1e-4
  # The experts matter: swapping them changes the result.
  swapped = wan_pipeline.denoise(cfg, SAMPLER, low, high, latents, text, neg)
  assert _rel(swapped, ref) > 1e-2


def test_generate_frames_match_diffusers(dit_dirs, tiny_vae, tmp_path):
  root, models = dit_dirs
  pipe = _pipeline(models, tiny_vae[0])
  pipe.save_pretrained(tmp_path)  # the whole directory, loaded as one below
  ref = _run(pipe, "np")  # [B, F, H, W, 3] in [0, 1]
  model, params = loading.load_pipeline(str(tmp_path), num_steps=6, height=32, width=48,
                                        frames=9)
  assert model.sampler == SAMPLER and model.latent_shape() == (1, 16, 3, 4, 6)
  latents, text, neg = (jnp.asarray(a.numpy()) for a in _inputs())
  frames = wan_pipeline.generate(model.dit, model.sampler, params.high, params.low, model.vae,
                                 params.vae, latents, text, neg)
  assert frames.shape == ref.shape == (1, 9, 32, 48, 3)
  err = float(np.max(np.abs(np.asarray(frames) - ref)))
  print(f"frames: max|ours - diffusers| = {err:.2e} (frames in [0, 1])")
  assert err < 1e-3
  assert np.std(ref) > 1e-2
  # Loaded onto a CFG 2 x TP 2 mesh (each device reads its slice of the heads
  # and FFN columns), sampled CFG- and tensor-parallel: diffusers' latents still.
  mesh = wan_parallel.make_mesh(cfg=2, tensor=2)
  _, sharded = loading.load_pipeline(str(tmp_path), mesh=mesh, num_steps=6, height=32,
                                     width=48, frames=9)
  wq = sharded.high["blocks"]["self"]["wq"]
  assert wq.addressable_shards[0].data.shape[2] == model.dit.num_heads // 2
  z = wan_pipeline.denoise(model.dit, model.sampler, sharded.high, sharded.low, latents, text,
                           neg, mesh=mesh)
  err = _rel(z, _run(pipe, "latent"))
  print(f"latents, CFG 2 x TP 2: max|ours - diffusers| / max|diffusers| = {err:.2e}")
  assert err < 1e-4


def test_pipeline_input_errors(dit_dirs):
  cfg, p = wan_weights.load_transformer(str(dit_dirs[0] / "transformer"))
  sampler = wan_pipeline.SamplerConfig(num_steps=2)
  x = jnp.zeros((1, 16, 1, 2, 2))
  with pytest.raises(ValueError, match="neg_text"):
    wan_pipeline.denoise(cfg, sampler, p, p, x, jnp.zeros((1, 4, 32)), jnp.zeros((1, 5, 32)))
  with pytest.raises(ValueError, match="latents must be"):
    wan_pipeline.denoise(cfg, sampler, p, p, x[:, :8], jnp.zeros((1, 4, 32)),
                         jnp.zeros((1, 4, 32)))
  with pytest.raises(ValueError, match="num_steps"):
    wan_pipeline.SamplerConfig(num_steps=0)
