"""Qwen3-VL prompts: placeholder tokens, 3-D MRoPE positions, and the
full forward with images and videos (`vl_logits`).

A prompt holds one <|image_pad|> per image (one <|video_pad|> per video)
until `expand_placeholders` widens it to the grid's token count,
t * h * w / merge**2 (a video's pad as <|vision_start|> pads <|vision_end|>
per temporal patch, as HF's Qwen3-VL processor writes it less the
"<t seconds>" text before each frame, which needs the tokenizer).
Visual tokens take the vision tower's outputs in prompt order (images in
image order, videos in video order) and their DeepStack features.

Cached decoding (`vl_forward`, the contiguous cache of `models.forward`):
a prompt's `VisualInputs` are fed in chunks (`slice_inputs`, a chunk may
end inside an image); the tokens after it take `text_inputs` at rotary
position cache length + delta (`rope_positions`' deltas), so positions
continue where the prompt's last image left them.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.kv.contexts import ContiguousContext, FullContext
from jaxinfer.models import vision
from jaxinfer.models.moe_ep import plan_from_params
from jaxinfer.models.transformer import VisualInputs, check_tokens, head, trunk_with_counts


def _grids(grid_thw) -> tuple[tuple[int, int, int], ...]:
  grid = np.asarray(grid_thw if grid_thw is not None else np.zeros((0, 3)), np.int64).reshape(-1, 3)
  if (grid <= 0).any():
    raise ValueError(f"grid_thw entries must be > 0, got {grid.tolist()}")
  return tuple(tuple(int(v) for v in g) for g in grid)


def _need_vision(cfg: ModelConfig):
  if cfg.vision is None:
    raise ValueError(f"images or videos sent to a text-only model ({cfg.model_type}: no vision tower)")
  return cfg.vision


def num_tokens(cfg: ModelConfig, grid) -> int:
  """LM tokens of one image / video grid (t, h, w)."""
  return int(np.prod(grid)) // _need_vision(cfg).spatial_merge_size ** 2


def expand_placeholders(cfg: ModelConfig, token_ids, image_grid_thw=None, video_grid_thw=None):
  """One <|image_pad|> / <|video_pad|> id per image / video -> each widened
  to its grid's tokens (list of ids). Raises if the counts do not match."""
  vc = _need_vision(cfg)
  ids = [int(t) for t in token_ids]
  images, videos = _grids(image_grid_thw), _grids(video_grid_thw)
  for name, tok, grids in (("image", vc.image_token_id, images), ("video", vc.video_token_id, videos)):
    if ids.count(tok) != len(grids):
      raise ValueError(f"prompt has {ids.count(tok)} {name} placeholders (id {tok}) for "
                       f"{len(grids)} {name}s")
  out, it_i, it_v = [], iter(images), iter(videos)
  for t in ids:
    if t == vc.image_token_id:
      out += [t] * num_tokens(cfg, next(it_i))
    elif t == vc.video_token_id:
      gt, gh, gw = next(it_v)
      frame = [vc.vision_start_token_id] + [t] * num_tokens(cfg, (1, gh, gw))
      out += (frame + [vc.vision_end_token_id]) * gt
    else:
      out.append(t)
  return out


def _runs(types):
  """(type, start, end) of each run of equal token types."""
  out, start = [], 0
  for key, group in itertools.groupby(types):
    n = len(list(group))
    out.append((key, start, start + n))
    start += n
  return out


def rope_positions(cfg: ModelConfig, tokens, image_grid_thw=None, video_grid_thw=None):
  """tokens [B, T] (expanded) -> (positions [3, B, T] int32, deltas [B]):
  text counts on from the last position; an image's tokens take (t, row,
  col) offsets from where it starts, and the text after it resumes at
  start + max(h, w) / merge. deltas: next position - T (decode goes on
  from there). Video frames are one grid each (HF get_rope_index)."""
  vc = _need_vision(cfg)
  tokens = np.asarray(tokens)
  m = vc.spatial_merge_size
  images = list(_grids(image_grid_thw))
  videos = [(1, h, w) for t, h, w in _grids(video_grid_thw) for _ in range(t)]
  types = np.where(tokens == vc.image_token_id, 1, np.where(tokens == vc.video_token_id, 2, 0))
  pos = np.zeros((3, *tokens.shape), np.int64)
  deltas, grids = [], {1: iter(images), 2: iter(videos)}
  for b in range(tokens.shape[0]):
    cur, parts = 0, []
    for kind, s, e in _runs(types[b].tolist()):
      if kind == 0:
        parts.append(np.broadcast_to(np.arange(e - s) + cur, (3, e - s)))
        cur += e - s
        continue
      g = next(grids[kind], None)
      if g is None or num_tokens(cfg, g) != e - s:
        raise ValueError(f"row {b}: a run of {e - s} {('image', 'video')[kind - 1]} tokens at "
                         f"{s} does not match the next grid {g} (expand_placeholders first)")
      t, h, w = g[0], g[1] // m, g[2] // m
      tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
      parts.append(np.stack([tt, hh, ww]).reshape(3, -1) + cur)
      cur += max(h, w)
    pos[:, b] = np.concatenate(parts, axis=1)
    deltas.append(int(pos[:, b].max()) + 1 - tokens.shape[1])
  return pos.astype(np.int32), np.asarray(deltas, np.int32)


def encode_images(cfg: ModelConfig, params, pixel_values, grid_thw):
  """-> (visual tokens [M, D], DeepStack features [k, M, D])."""
  vc, grids = _need_vision(cfg), _grids(grid_thw)
  pixel_values = jnp.asarray(pixel_values)
  n = sum(t * h * w for t, h, w in grids)
  if pixel_values.shape != (n, vc.patch_dim):
    raise ValueError(f"pixel_values has shape {pixel_values.shape}; grids {grids} need "
                     f"({n}, {vc.patch_dim})")
  bad = [g for g in grids if g[1] % vc.spatial_merge_size or g[2] % vc.spatial_merge_size]
  if bad:
    raise ValueError(f"grid_thw {bad}: h and w must be multiples of {vc.spatial_merge_size}")
  return vision.encode(vc, params["vision"], pixel_values, grids, cfg.backend)


def visual_inputs(cfg: ModelConfig, params, tokens, pixel_values=None, image_grid_thw=None,
                  pixel_values_videos=None, video_grid_thw=None, encoder=None) -> VisualInputs:
  """Embeddings with visual tokens scattered in, MRoPE positions, DeepStack.
  encoder(pixel_values, grid_thw) -> (tokens, DeepStack): `encode_images`
  by default, or an encoder cache's `encode`."""
  encoder = encoder or functools.partial(encode_images, cfg, params)
  vc = _need_vision(cfg)
  tokens = np.asarray(tokens)
  x = params["embed"][jnp.asarray(tokens, jnp.int32)].astype(cfg.compute_dtype())
  k = len(vc.deepstack_indexes)
  deep = jnp.zeros((k, *x.shape), x.dtype)
  for tok, pv, grid in ((vc.image_token_id, pixel_values, image_grid_thw),
                        (vc.video_token_id, pixel_values_videos, video_grid_thw)):
    rows, cols = np.nonzero(tokens == tok)
    if pv is None:
      if len(rows):
        raise ValueError(f"prompt has {len(rows)} placeholder tokens (id {tok}) but no pixels")
      continue
    feats, ds = encoder(pv, grid)
    if feats.shape[0] != len(rows):
      raise ValueError(f"prompt has {len(rows)} placeholder tokens (id {tok}); the images "
                       f"{_grids(grid)} make {feats.shape[0]}")
    x = x.at[rows, cols].set(feats.astype(x.dtype))
    deep = deep.at[:, rows, cols].set(ds.astype(x.dtype))
  positions, _ = rope_positions(cfg, tokens, image_grid_thw, video_grid_thw)
  return VisualInputs(embeds=x, positions=jnp.asarray(positions), deepstack=deep)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _vl_logits(cfg, params, visual, ep):
  B, T = visual.embeds.shape[:2]
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  x, _, _ = trunk_with_counts(cfg, params, jnp.zeros((B, T), jnp.int32),
                              FullContext(positions, cfg.window_choices()), ep=ep, visual=visual)
  return head(cfg, params, x)


def vl_logits(cfg: ModelConfig, params, tokens, pixel_values=None, image_grid_thw=None,
              pixel_values_videos=None, video_grid_thw=None):
  """Full causal forward of a multimodal prompt: tokens [B, T] (placeholders
  expanded), pixels and grids as `vision_inputs` makes them -> float32
  logits [B, T, V]."""
  check_tokens(cfg, tokens)
  visual = visual_inputs(cfg, params, tokens, pixel_values, image_grid_thw, pixel_values_videos,
                         video_grid_thw)
  return _vl_logits(cfg, params, visual, plan_from_params(params))


def slice_inputs(visual: VisualInputs, start: int, end: int) -> VisualInputs:
  """Tokens [start, end) of a prompt's inputs (a prefill chunk)."""
  return VisualInputs(embeds=visual.embeds[:, start:end], positions=visual.positions[:, :, start:end],
                      deepstack=visual.deepstack[:, :, start:end])


def text_inputs(cfg: ModelConfig, params, tokens, positions) -> VisualInputs:
  """Text tokens [B, T] at rotary positions [B, T] (all three MRoPE axes
  alike), no DeepStack: the tokens generated after a multimodal prompt."""
  x = params["embed"][jnp.asarray(tokens, jnp.int32)].astype(cfg.compute_dtype())
  positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (3, *x.shape[:2]))
  return VisualInputs(embeds=x, positions=positions, deepstack=jnp.zeros((0, *x.shape), x.dtype))


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=3)
def _vl_forward(cfg, params, visual, cache, ep):
  B, T = visual.embeds.shape[:2]
  starts = cache["lengths"]
  x, layers, _ = trunk_with_counts(cfg, params, jnp.zeros((B, T), jnp.int32), ContiguousContext(starts),
                                   cache["layers"], ep, visual=visual)
  return head(cfg, params, x), dict(layers=layers, lengths=starts + T)


def vl_forward(cfg: ModelConfig, params, visual: VisualInputs, cache):
  """Appends a chunk of inputs (`visual_inputs` / `slice_inputs` /
  `text_inputs`) to each sequence of the contiguous cache
  (`models.init_cache`): -> (float32 logits [B, T, V], new cache); the
  cache is donated."""
  B, T = visual.embeds.shape[:2]
  if cache["lengths"].shape != (B,):
    raise ValueError(f"vl_forward: cache holds {cache['lengths'].shape[0]} sequences, inputs {B}")
  max_len = jax.tree.leaves(cache["layers"])[0].shape[2]
  longest = int(np.max(cache["lengths"])) + T
  if longest > max_len:
    raise ValueError(f"vl_forward: {longest} tokens would overflow the cache (max_len {max_len})")
  return _vl_forward(cfg, params, visual, cache, plan_from_params(params))
