"""`VideoEngine`: text-to-video requests through WAN-2.2-T2V-A14B sampling.

The video counterpart of the LLM `Engine`: it owns the device state (both
experts' params and the VAE decoder's), takes requests that carry what the
MLPerf benchmark fixes per sample (the prompt and negative-prompt
embeddings and the initial latent), and runs them in batches of a fixed
size (a short batch is padded with copies of its first request, whose
outputs are dropped), so a serving run compiles one sampling program and
one decode program. Everything a request holds is checked before any
device work; outputs are uint8 frames [F, H, W, 3].

  engine = VideoEngine(presets.tiny(), high, low, vae, max_batch=2)
  videos = engine.generate([VideoRequest(text, neg_text, latents), ...])
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxinfer.diffusion import wan_pipeline
from jaxinfer.diffusion.presets import WanModel


@dataclasses.dataclass(frozen=True)
class VideoRequest:
  text: np.ndarray  # [L, Dt] prompt embeddings (UMT5 output, padded to L)
  neg_text: np.ndarray  # [L, Dt] negative-prompt embeddings
  latents: np.ndarray  # [C, F, h, w] the initial latent (float32 noise)


class VideoEngine:
  def __init__(self, model: WanModel, params_high, params_low, vae_params, *,
               max_batch: int = 1, mesh=None):
    if not isinstance(max_batch, int) or max_batch < 1:
      raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    self.model, self.max_batch, self.mesh = model, max_batch, mesh
    self.params_high, self.params_low, self.vae_params = params_high, params_low, vae_params
    self._stats = dict(batches=0, videos=0, padded=0)

  def check_request(self, req: VideoRequest) -> None:
    """ValueError naming the field whose shape the model cannot take."""
    m = self.model
    text_shape = (m.text_len, m.dit.text_dim)
    for name in ("text", "neg_text"):
      if np.shape(getattr(req, name)) != text_shape:
        raise ValueError(f"VideoRequest.{name} must be {list(text_shape)}, got "
                         f"{list(np.shape(getattr(req, name)))}")
    latent = m.latent_shape()[1:]
    if np.shape(req.latents) != latent:
      raise ValueError(f"VideoRequest.latents must be {list(latent)} (the model's "
                       f"{m.frames} x {m.height} x {m.width} video), got "
                       f"{list(np.shape(req.latents))}")

  def _batch(self, reqs: list[VideoRequest]) -> np.ndarray:
    pad = self.max_batch - len(reqs)
    reqs = list(reqs) + [reqs[0]] * pad
    stack = lambda name, dtype: jnp.asarray(np.stack([getattr(r, name) for r in reqs]), dtype)
    m = self.model
    frames = wan_pipeline.generate(
        m.dit, m.sampler, self.params_high, self.params_low, m.vae, self.vae_params,
        stack("latents", jnp.float32), stack("text", m.dit.compute_dtype()),
        stack("neg_text", m.dit.compute_dtype()), mesh=self.mesh)
    self._stats["batches"] += 1
    self._stats["padded"] += pad
    return np.asarray(jnp.round(frames * 255).astype(jnp.uint8))

  def generate(self, reqs: list[VideoRequest]) -> list[np.ndarray]:
    """uint8 frames [F, H, W, 3] per request, in order, max_batch at a time."""
    reqs = list(reqs)
    for i, r in enumerate(reqs):
      try:
        self.check_request(r)
      except ValueError as e:
        raise ValueError(f"request {i}: {e}") from None
    out = []
    for s in range(0, len(reqs), self.max_batch):
      chunk = reqs[s:s + self.max_batch]
      out.extend(list(self._batch(chunk)[:len(chunk)]))
    self._stats["videos"] += len(reqs)
    return out

  def stats(self) -> dict:
    """Batches run, videos made, padding rows spent."""
    return dict(self._stats)
