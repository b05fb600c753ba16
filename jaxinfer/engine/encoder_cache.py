"""The vision encoder's cache: each distinct image is encoded once.

Images are keyed by a content hash of their patches and grid
(`image_hash`), the same key a prefix cache folds into its page hashes so
the same text with a different image never matches. The cache holds the
merged visual tokens and DeepStack features on the host side of the
device (jax arrays), least recently used first out past `max_tokens`.
"""

from __future__ import annotations

import collections
import hashlib

import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models import multimodal


def image_hash(pixel_values, grid_thw) -> str:
  """sha256 of one image's (or video's) grid and float32 patches."""
  h = hashlib.sha256(np.asarray(grid_thw, np.int64).reshape(3).tobytes())
  h.update(np.ascontiguousarray(np.asarray(pixel_values, np.float32)).tobytes())
  return h.hexdigest()


def split_images(pixel_values, grid_thw):
  """Concatenated patches of n images -> [(patches, (t, h, w))] per image."""
  grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
  sizes = grid.prod(axis=1)
  if int(sizes.sum()) != len(pixel_values):
    raise ValueError(f"pixel_values has {len(pixel_values)} patches; grids {grid.tolist()} "
                     f"need {int(sizes.sum())}")
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  return [(pixel_values[s:s + n], tuple(int(v) for v in g))
          for s, n, g in zip(starts, sizes, grid)]


class EncoderCache:
  """Visual tokens per distinct image (see the module docstring).

  `encode(pixel_values, grid_thw)` has `multimodal.encode_images`'
  signature and result, so `multimodal.visual_inputs(..., encoder=cache.encode)`
  runs the vision tower only for images it has not seen.
  """

  def __init__(self, cfg: ModelConfig, params, max_tokens: int = 1 << 16):
    if max_tokens <= 0:
      raise ValueError(f"EncoderCache: max_tokens must be > 0, got {max_tokens}")
    self.cfg, self.params, self.max_tokens = cfg, params, max_tokens
    self._entries: collections.OrderedDict = collections.OrderedDict()
    self.hits = self.misses = self.tokens = 0

  def encode(self, pixel_values, grid_thw):
    feats, deep = [], []
    pixel_values = np.asarray(pixel_values, np.float32)
    for pv, grid in split_images(pixel_values, grid_thw):
      key = image_hash(pv, grid)
      entry = self._entries.get(key)
      if entry is None:
        self.misses += 1
        entry = multimodal.encode_images(self.cfg, self.params, pv, [grid])
        self._entries[key] = entry
        self.tokens += entry[0].shape[0]
        self._evict(keep=key)
      else:
        self.hits += 1
        self._entries.move_to_end(key)
      feats.append(entry[0])
      deep.append(entry[1])
    return jnp.concatenate(feats), jnp.concatenate(deep, axis=1)

  def _evict(self, keep: str) -> None:
    while self.tokens > self.max_tokens and len(self._entries) > 1:
      key = next(iter(self._entries))
      if key == keep:
        break
      self.tokens -= self._entries.pop(key)[0].shape[0]

  def release(self) -> None:
    """Drops the weights and every cached feature."""
    self.params = None
    self._entries.clear()
    self.tokens = 0

  def stats(self) -> dict:
    total = self.hits + self.misses
    return dict(hits=self.hits, misses=self.misses, entries=len(self._entries), tokens=self.tokens,
                hit_rate=self.hits / total if total else 0.0)
