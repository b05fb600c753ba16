"""`VideoEngine`: text-to-video requests through WAN-2.2-T2V-A14B sampling.

The video counterpart of the LLM `Engine`: it owns the device state (both
experts' params, the VAE decoder's and the text encoder's), takes requests
that carry what the MLPerf benchmark fixes per sample (the prompt, the
negative prompt and the initial latent), and runs them in batches of a
fixed size (a short batch is padded with copies of its first request, whose
outputs are dropped), so a serving run compiles one sampling program, one
decode program and one text-encoder program. A prompt is a string, its
UMT5 token ids or its embeddings [L, Dt]; strings and ids go through the
text encoder (`wan_text.PromptEncoder`: `loading.load_pipeline`'s
params.text), all of a batch's in one call. Everything a request holds is
checked before any device work; outputs are uint8 frames [F, H, W, 3].

  model, params = loading.load_pipeline(path)
  engine = VideoEngine(model, params.high, params.low, params.vae, text=params.text)
  videos = engine.generate([VideoRequest("a cat surfing", "", latents), ...])
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxinfer.diffusion import wan_pipeline, wan_text
from jaxinfer.diffusion.presets import WanModel


@dataclasses.dataclass(frozen=True)
class VideoRequest:
  text: str | np.ndarray  # the prompt, its token ids [n] or embeddings [L, Dt] (padded to L)
  neg_text: str | np.ndarray  # the negative prompt, likewise ("": WanPipeline's default)
  latents: np.ndarray  # [C, F, h, w] the initial latent (float32 noise)


class VideoEngine:
  def __init__(self, model: WanModel, params_high, params_low, vae_params, *,
               max_batch: int = 1, mesh=None, text: wan_text.PromptEncoder | None = None):
    if not isinstance(max_batch, int) or max_batch < 1:
      raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    if text is not None and text.cfg.d_model != model.dit.text_dim:
      raise ValueError(f"the text encoder's d_model ({text.cfg.d_model}) is not the DiT's "
                       f"text_dim ({model.dit.text_dim})")
    self.model, self.max_batch, self.mesh, self.text = model, max_batch, mesh, text
    self.params_high, self.params_low, self.vae_params = params_high, params_low, vae_params
    self._stats = dict(batches=0, videos=0, padded=0)

  def check_request(self, req: VideoRequest) -> None:
    """ValueError naming the field the model cannot take (CheckpointError: a
    prompt string and no tokenizer, naming the file looked for)."""
    m = self.model
    text_shape = (m.text_len, m.dit.text_dim)
    for name in ("text", "neg_text"):
      value = getattr(req, name)
      if wan_text.is_prompt(value):
        if self.text is None:
          raise ValueError(f"VideoRequest.{name} is a prompt (a string or token ids), but the "
                           "engine has no text encoder: VideoEngine(..., text=params.text), "
                           "params loaded from a pipeline directory with text_encoder/")
        try:
          self.text.check(value, m.text_len)
        except ValueError as e:
          raise type(e)(f"VideoRequest.{name}: {e}") from None
      elif np.shape(value) != text_shape:
        raise ValueError(f"VideoRequest.{name} must be a string, token ids or embeddings "
                         f"{list(text_shape)}, got {list(np.shape(value))}")
    latent = m.latent_shape()[1:]
    if np.shape(req.latents) != latent:
      raise ValueError(f"VideoRequest.latents must be {list(latent)} (the model's "
                       f"{m.frames} x {m.height} x {m.width} video), got "
                       f"{list(np.shape(req.latents))}")

  def _batch(self, reqs: list[VideoRequest]) -> np.ndarray:
    pad = self.max_batch - len(reqs)
    reqs = list(reqs) + [reqs[0]] * pad
    m = self.model
    latents = jnp.asarray(np.stack([r.latents for r in reqs]), jnp.float32)
    text2 = self._embeddings([r.text for r in reqs] + [r.neg_text for r in reqs])
    frames = wan_pipeline.generate(
        m.dit, m.sampler, self.params_high, self.params_low, m.vae, self.vae_params,
        latents, text2[:len(reqs)], text2[len(reqs):], mesh=self.mesh)
    self._stats["batches"] += 1
    self._stats["padded"] += pad
    return np.asarray(jnp.round(frames * 255).astype(jnp.uint8))

  def _embeddings(self, texts: list):
    """[n, L, Dt]: prompts and token ids through the text encoder (all n rows
    in one call, so one program: embeddings' rows ride along as one token),
    embeddings as given."""
    dtype = self.model.dit.compute_dtype()
    prompts = [wan_text.is_prompt(t) for t in texts]
    if not any(prompts):
      return jnp.asarray(np.stack(texts), dtype)
    encoded = self.text.embed([t if p else [0] for t, p in zip(texts, prompts)],
                              self.model.text_len).astype(dtype)
    return jnp.stack([e if p else jnp.asarray(t, dtype)
                      for e, t, p in zip(encoded, texts, prompts)])

  def generate(self, reqs: list[VideoRequest]) -> list[np.ndarray]:
    """uint8 frames [F, H, W, 3] per request, in order, max_batch at a time."""
    reqs = list(reqs)
    for i, r in enumerate(reqs):
      try:
        self.check_request(r)
      except ValueError as e:
        raise type(e)(f"request {i}: {e}") from None
    out = []
    for s in range(0, len(reqs), self.max_batch):
      chunk = reqs[s:s + self.max_batch]
      out.extend(list(self._batch(chunk)[:len(chunk)]))
    self._stats["videos"] += len(reqs)
    return out

  def stats(self) -> dict:
    """Batches run, videos made, padding rows spent."""
    return dict(self._stats)
