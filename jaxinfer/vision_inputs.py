"""Qwen3-VL image and video inputs on the host: decode (Pillow), resize, patchify.

Matches transformers' Qwen2-VL image processor (its Pillow backend, which
Qwen3-VL uses for images): `smart_resize` to multiples of patch * merge
within [min_pixels, max_pixels], bicubic resize, x / 255, (x - mean) / std,
then patches of [C, temporal_patch, patch, patch] flattened in 2x2-merge
block order, an image repeated over the temporal patch. Videos are frames
as temporal patches (the frame count padded with the last frame).

`pixel_values` [N, C * Tp * P * P] float32 and `grid_thw` (t, h, w) in
patches, so an image takes t * h * w / merge**2 placeholder tokens
(`models.multimodal.expand_placeholders`).
"""

from __future__ import annotations

import dataclasses
import io
import math

import numpy as np
from PIL import Image, UnidentifiedImageError


class ImageError(ValueError):
  """An image that cannot be used: unreadable, corrupt or too large."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessorConfig:
  """The HF `preprocessor_config.json` fields that shape pixel values.

  min_pixels / max_pixels bound the resized image (HF `size.shortest_edge`
  / `longest_edge`); max_input_pixels bounds the input image, checked from
  the header before bytes or a file are decoded (an oversized image is
  refused before its pixels are allocated).
  """

  patch_size: int = 16
  temporal_patch_size: int = 2
  merge_size: int = 2
  min_pixels: int = 65536
  max_pixels: int = 16777216
  image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
  image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
  max_input_pixels: int = 64 * 1024 * 1024

  def __post_init__(self):
    for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels",
                 "max_input_pixels"):
      if getattr(self, name) <= 0:
        raise ValueError(f"ProcessorConfig: {name} must be > 0, got {getattr(self, name)}")
    if self.min_pixels > self.max_pixels:
      raise ValueError(f"ProcessorConfig: min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")
    object.__setattr__(self, "image_mean", tuple(self.image_mean))
    object.__setattr__(self, "image_std", tuple(self.image_std))

  @property
  def factor(self) -> int:
    return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
  """(h, w) rounded to multiples of factor, area in [min_pixels, max_pixels],
  aspect ratio kept as closely as the rounding allows (HF's smart_resize)."""
  if max(height, width) / min(height, width) > 200:
    raise ImageError(f"image aspect ratio must be at most 200, got {height}x{width}")
  h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
  if h_bar * w_bar > max_pixels:
    beta = math.sqrt(height * width / max_pixels)
    h_bar = max(factor, math.floor(height / beta / factor) * factor)
    w_bar = max(factor, math.floor(width / beta / factor) * factor)
  elif h_bar * w_bar < min_pixels:
    beta = math.sqrt(min_pixels / (height * width))
    h_bar = math.ceil(height * beta / factor) * factor
    w_bar = math.ceil(width * beta / factor) * factor
  return h_bar, w_bar


def load_image(image, cfg: ProcessorConfig) -> Image.Image:
  """bytes, a file path, a PIL image or a uint8 [H, W, 3] array -> RGB PIL image."""
  if isinstance(image, np.ndarray):
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
      raise ImageError(f"image array must be uint8 [H, W, 3], got {image.dtype} {image.shape}")
    image = Image.fromarray(image)
  elif isinstance(image, (bytes, bytearray, str)):
    try:
      image = Image.open(io.BytesIO(image) if not isinstance(image, str) else image)
    except (UnidentifiedImageError, OSError) as e:
      raise ImageError(f"cannot decode image: {e}") from None
    except Image.DecompressionBombError as e:  # Pillow's own cap, past 2 * MAX_IMAGE_PIXELS
      raise ImageError(f"image has too many pixels: {e}") from None
  elif not isinstance(image, Image.Image):
    raise TypeError(f"image must be bytes, a path, a PIL image or a uint8 array, "
                    f"got {type(image).__name__}")
  w, h = image.size
  if w * h > cfg.max_input_pixels:
    raise ImageError(f"image has {w}x{h} = {w * h} pixels, more than max_input_pixels "
                     f"{cfg.max_input_pixels}")
  try:
    return image.convert("RGB")
  except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt pixel data
    raise ImageError(f"cannot decode image: {e}") from None


def _resized(image: Image.Image, size: tuple[int, int]) -> np.ndarray:
  """PIL bicubic resize -> float32 [C, H, W] in [0, 1] (HF: x.astype(f64) / 255)."""
  h, w = size
  arr = np.asarray(image.resize((w, h), resample=Image.Resampling.BICUBIC)
                   if image.size != (w, h) else image)
  return np.moveaxis((arr.astype(np.float64) * (1 / 255)).astype(np.float32), -1, 0)


def _normalize(x, cfg: ProcessorConfig):
  mean = np.asarray(cfg.image_mean, np.float32)
  std = np.asarray(cfg.image_std, np.float32)
  return ((x.T - mean) / std).T


def patchify(frames: np.ndarray, cfg: ProcessorConfig):
  """frames [T, C, H, W] (T a multiple of temporal_patch_size) -> (patches
  [t * h * w, C * Tp * P * P] in merge-block order, (t, h, w))."""
  T, C, H, W = frames.shape
  P, M, Tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
  t, h, w = T // Tp, H // P, W // P
  x = frames.reshape(t, Tp, C, h // M, M, P, w // M, M, P)
  x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, h/M, w/M, M, M, C, Tp, P, P
  return x.reshape(t * h * w, C * Tp * P * P), (t, h, w)


def process_images(images, cfg: ProcessorConfig):
  """Images -> (pixel_values [N, C * Tp * P * P] float32, grid_thw [n, 3] int64)."""
  patches, grids = [], []
  for image in images:
    image = load_image(image, cfg)
    size = smart_resize(image.size[1], image.size[0], cfg.factor, cfg.min_pixels, cfg.max_pixels)
    x = _normalize(_resized(image, size), cfg)
    frames = np.broadcast_to(x[None], (cfg.temporal_patch_size, *x.shape))
    p, grid = patchify(frames, cfg)
    patches.append(p)
    grids.append(grid)
  if not patches:
    raise ValueError("process_images: no images")
  return np.concatenate(patches).astype(np.float32), np.asarray(grids, np.int64)


def process_video(frames, cfg: ProcessorConfig):
  """Video frames (all one size) -> (pixel_values, (t, h, w)): each frame
  resized like an image of the first frame's size, the count padded to a
  multiple of temporal_patch_size with the last frame."""
  frames = [load_image(f, cfg) for f in frames]
  if not frames:
    raise ValueError("process_video: no frames")
  if len({f.size for f in frames}) != 1:
    raise ImageError(f"video frames differ in size: {sorted({f.size for f in frames})}")
  w0, h0 = frames[0].size
  size = smart_resize(h0, w0, cfg.factor, cfg.min_pixels, cfg.max_pixels)
  xs = [_normalize(_resized(f, size), cfg) for f in frames]
  xs += [xs[-1]] * (-len(xs) % cfg.temporal_patch_size)
  p, grid = patchify(np.stack(xs), cfg)
  return p.astype(np.float32), grid
