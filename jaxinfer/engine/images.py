"""Requests with images (Qwen3-VL): the prompt's visual tokens on the host
and their rows of each engine step.

`Images.check` runs once per request, on submit, before it is queued: a
text prompt must hold no image or video placeholder; a prompt with images
goes to `Images.prepare`, which decodes and patchifies each image
(`vision_inputs.process_images`), widens the prompt's one <|image_pad|> per
image to the image's tokens (`multimodal.expand_placeholders`), encodes
each image (the vision tower runs once per distinct image: `EncoderCache`,
keyed by the content hash `image_hash`), and lays out the prompt's 3-D
MRoPE positions (`multimodal.rope_positions`). Every bad input raises there
(a named `ValueError`), so it never reaches a step. `per_prompt` checks
`Engine.generate`'s image lists.

`step_visual` builds the visual rows of a step that holds a visual token:
a chunk may start or end inside an image (chunked prefill, a prefix-cache
hit, a recompute after preemption). Prompt token p takes the embedding row
and the MRoPE position the prompt's layout gives it; a generated token at
sequence position p takes rotary position p + delta on all three axes
(Qwen3-VL's rope delta: the prompt's largest position + 1 - its length).
Every other step (decode, text chunks) is a text step: no visual rows, its
rotary positions from `step_rope` (one per token: MRoPE over three equal
axes is RoPE).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxinfer import vision_inputs
from jaxinfer.config import ModelConfig
from jaxinfer.engine.encoder_cache import EncoderCache, image_hash, split_images
from jaxinfer.models import multimodal


@dataclasses.dataclass(frozen=True, eq=False)
class MultimodalPrompt:
  """One request's visual inputs, on the host."""

  tokens: list[int]  # the prompt, placeholders expanded
  rope: np.ndarray  # [3, L] int32 MRoPE positions of the prompt's tokens
  delta: int  # rotary position of sequence position p >= L: p + delta
  row: np.ndarray  # [L] int32: row of feats for a visual token, else -1
  feats: np.ndarray  # [M, D] the visual tokens' embeddings (prompt order)
  deepstack: np.ndarray  # [k, M, D] their DeepStack features
  spans: tuple  # (start, end, image content hash bytes) per image


class Images:
  """The engine's image path: processor settings and the encoder (cached
  or not). cache_tokens: the encoder cache's capacity in visual tokens,
  0 to encode every image of every request (no cache)."""

  def __init__(self, cfg: ModelConfig, params, processor: vision_inputs.ProcessorConfig | None,
               cache_tokens: int):
    self.cfg, self.params = cfg, params
    vc = cfg.vision
    self.processor = processor or (None if vc is None else vision_inputs.ProcessorConfig(
        patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size,
        merge_size=vc.spatial_merge_size))
    self.cache = EncoderCache(cfg, params, cache_tokens) if vc is not None and cache_tokens else None
    self.encodes = 0  # images run through the vision tower
    self.visual_steps = 0  # steps that carried visual rows

  def _encode(self, pixels, grid):
    if self.cache is not None:
      misses = self.cache.misses
      out = self.cache.encode(pixels, [grid])
      self.encodes += self.cache.misses - misses
      return out
    self.encodes += 1
    return multimodal.encode_images(self.cfg, self.params, pixels, [grid])

  def check(self, tokens, images, *, plain_steps: bool) -> MultimodalPrompt | None:
    """A request's visual inputs (`prepare`), or None for a text prompt;
    raises on bad input. plain_steps: the engine runs plain steps (with or
    without attention DP), the only steps that take visual rows."""
    if images is None:
      vc = self.cfg.vision
      for name, tok in (() if vc is None else (("image", vc.image_token_id),
                                               ("video", vc.video_token_id))):
        if tok in tokens:
          raise ValueError(f"prompt has {tokens.count(tok)} {name} placeholders (id {tok}) "
                           f"for 0 {name}s")
      return None
    if not plain_steps:
      raise ValueError("images: requests with images run on plain steps "
                       "(no speculative decoding)")
    return self.prepare(tokens, images)

  def prepare(self, prompt, images) -> MultimodalPrompt:
    """prompt: token ids with one image placeholder per image; images:
    encoded bytes, file paths, PIL images or uint8 [H, W, 3] arrays."""
    cfg = self.cfg
    if cfg.vision is None:
      raise ValueError(f"images sent to a text-only model ({cfg.model_type}: no vision tower)")
    if not isinstance(images, (list, tuple)) or not images:
      raise TypeError(f"images must be a non-empty list, got {type(images).__name__}")
    pixels, grids = vision_inputs.process_images(images, self.processor)
    tokens = multimodal.expand_placeholders(cfg, prompt, grids)
    rope, deltas = multimodal.rope_positions(cfg, np.asarray([tokens]), grids)
    feats, deep, spans = [], [], []
    starts = _image_starts(tokens, cfg.vision.image_token_id, grids, cfg)
    for (pv, grid), start in zip(split_images(pixels, grids), starts):
      f, d = self._encode(pv, grid)
      feats.append(np.asarray(f, np.float32))
      deep.append(np.asarray(d, np.float32))
      spans.append((start, start + f.shape[0], bytes.fromhex(image_hash(pv, grid))))
    is_img = np.asarray(tokens) == cfg.vision.image_token_id
    row = np.full(len(tokens), -1, np.int32)
    row[is_img] = np.arange(int(is_img.sum()), dtype=np.int32)
    return MultimodalPrompt(tokens=tokens, rope=rope[:, 0], delta=int(deltas[0]), row=row,
                            feats=np.concatenate(feats), deepstack=np.concatenate(deep, axis=1),
                            spans=tuple(spans))

  def release(self) -> None:
    """Drops the weights and the cached features (`Engine.release`)."""
    self.params = None
    if self.cache is not None:
      self.cache.release()

  def step_visual(self, per_rank, num_rows: int) -> dict | None:
    """A step's visual rows (`steps.StepInputs.visual`), each rank's
    stacked [n, ...], when any rank's chunks hold a visual token, else None:
    the text step, rotated by `step_rope` (decode steps, and prefill chunks
    between images). A rank without one gets its text rows: token embeddings
    (mask 0), DeepStack 0, and its rotary positions on all three MRoPE axes
    (MRoPE over equal axes is RoPE)."""
    if not any(s.request.mm is not None for sch in per_rank for s in sch):
      return None
    chunks = [[_chunk_rows(s) for s in sch] for sch in per_rank]
    if not any((img >= 0).any() for rank in chunks for _, img in rank):
      return None
    self.visual_steps += 1
    n, k, D = len(per_rank), len(self.cfg.vision.deepstack_indexes), self.cfg.d_model
    rope = np.zeros((n, 3, num_rows), np.int32)
    embeds = np.zeros((n, num_rows, D), np.float32)
    mask = np.zeros((n, num_rows), bool)
    deep = np.zeros((n, k, num_rows, D), np.float32)
    for r, (sch, rank_chunks) in enumerate(zip(per_rank, chunks)):
      t = 0
      for s, (pos, img) in zip(sch, rank_chunks):
        rope[r, :, t:t + s.num_tokens] = pos
        hit = img >= 0
        idx = t + np.flatnonzero(hit)
        t += s.num_tokens
        if not hit.any():  # text rows: embedded in the step, DeepStack 0
          continue
        embeds[r, idx] = s.request.mm.feats[img[hit]]
        deep[r][:, idx] = s.request.mm.deepstack[:, img[hit]]
        mask[r, idx] = True
    return dict(rope=rope, embeds=embeds, mask=mask, deepstack=deep)

  def stats(self) -> dict:
    """Vision models: encoder_calls, visual_steps, encoder_cache_* (with a
    cache); text models: nothing."""
    if self.cfg.vision is None:
      return {}
    out = dict(encoder_calls=self.encodes, visual_steps=self.visual_steps)
    if self.cache is not None:
      out.update({f"encoder_cache_{k}": v for k, v in self.cache.stats().items()})
    return out


def per_prompt(images, num_prompts: int) -> list:
  """`Engine.generate`'s images -> per prompt, its images or None."""
  images = [None] * num_prompts if images is None else list(images)
  if len(images) != num_prompts:
    raise ValueError(f"images: got {len(images)} image lists for {num_prompts} prompts")
  return images


def _image_starts(tokens, image_id: int, grids, cfg: ModelConfig) -> list[int]:
  """The first token of each image's run of placeholder tokens."""
  starts, i = [], 0
  for g in grids:
    i = tokens.index(image_id, i)
    starts.append(i)
    i += multimodal.num_tokens(cfg, g)
  return starts


def _chunk_rows(s) -> tuple[np.ndarray, np.ndarray]:
  """A chunk's MRoPE positions [3, n] and rows of its request's feats [n]
  (-1: not a visual token)."""
  mm, pos = s.request.mm, np.arange(s.start, s.start + s.num_tokens)
  if mm is None:
    return np.broadcast_to(pos, (3, len(pos))), np.full(len(pos), -1, np.int32)
  L = len(mm.tokens)
  in_prompt, at = pos < L, np.minimum(pos, L - 1)
  return (np.where(in_prompt, mm.rope[:, at], pos + mm.delta),
          np.where(in_prompt, mm.row[at], -1))


def step_rope(scheduled) -> np.ndarray | None:
  """A text step's rotary positions [real tokens] when any of its chunks is
  multimodal, else None (the sequence positions). A text token's three MRoPE
  axes hold one position (`multimodal.rope_positions`; generated tokens
  p + delta on all three), and interleaved MRoPE over equal axes is plain
  RoPE at that position (`layers.mrope_cos_sin`), so the text step rotates
  by the temporal axis. Steps with a visual token take `step_visual`'s rows."""
  if not any(s.request.mm is not None for s in scheduled):
    return None
  return np.concatenate([_chunk_rows(s)[0][0] for s in scheduled])
