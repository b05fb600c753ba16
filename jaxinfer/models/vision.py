"""Qwen3-VL's vision tower: pixels -> LM-width visual tokens + DeepStack features.

Pure functions over params["vision"] (`weights.vision_weights`). Patches arrive
flattened [N, C * Tp * P * P] in 2x2-merge-block order (`vision_inputs`),
so each run of merge**2 consecutive patches becomes one LM token.

  patch embed   Conv3d with stride = kernel, i.e. one [C*Tp*P*P, Cv] matmul
  positions     a learned sqrt(G) x sqrt(G) grid resampled bilinearly
                (align_corners) to each frame's h x w patches, plus 2D
                rotary: half of each head's rotary frequencies by row, half by column
  blocks        pre-LayerNorm ViT blocks, attention within each frame
  merger        LayerNorm, merge**2 patches concatenated, MLP to the LM width
  DeepStack     after block deepstack_indexes[j], merger j (LayerNorm after
                the concatenation) -> features added to LM layer j's output

Grids are static (Python tuples): one compile per set of image shapes.
Shape letters: N patches, C vision width (Cv), F vision MLP, M merged tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import ops
from jaxinfer.backend import Backend
from jaxinfer.config import VisionConfig
from jaxinfer.models.layers import apply_rope


# ------------------------------------------------------------ host-side tables

def patch_rows_cols(grid_thw, merge: int) -> tuple[np.ndarray, np.ndarray]:
  """(row, col) of every patch in merge-block order, frames one after another."""
  rows, cols = [], []
  for t, h, w in grid_thw:
    r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    block = (h // merge, merge, w // merge, merge)
    rows.append(np.tile(r.reshape(block).transpose(0, 2, 1, 3).ravel(), t))
    cols.append(np.tile(c.reshape(block).transpose(0, 2, 1, 3).ravel(), t))
  return np.concatenate(rows), np.concatenate(cols)


def _axis_taps(index, size, side: int):
  """Bilinear taps with align_corners=True of `index` on an axis of `size`
  into a table of `side` (HF `_interpolation_axis_taps_weights`)."""
  src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
  floor = np.floor(src)
  taps = floor.astype(np.int64)[:, None] + np.arange(2)
  weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2)), 0, None)
  return np.clip(taps, 0, side - 1), weights.astype(np.float32)


def position_taps(vc: VisionConfig, grid_thw) -> tuple[np.ndarray, np.ndarray]:
  """Per patch, 4 indices into pos_embed and their bilinear weights."""
  side = int(round(vc.num_position_embeddings ** 0.5))
  rows, cols = patch_rows_cols(grid_thw, vc.spatial_merge_size)
  heights = np.concatenate([np.full(t * h * w, h) for t, h, w in grid_thw])
  widths = np.concatenate([np.full(t * h * w, w) for t, h, w in grid_thw])
  h_taps, h_w = _axis_taps(rows, heights, side)
  w_taps, w_w = _axis_taps(cols, widths, side)
  idx = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
  return idx, (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)


def rotary(vc: VisionConfig, grid_thw):
  """cos, sin [1, N, H / 2]: frequencies over H / 4 for the row, then the column."""
  half = vc.head_dim // 2
  inv_freq = 1.0 / (vc.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / half))
  rows, cols = patch_rows_cols(grid_thw, vc.spatial_merge_size)
  angles = np.concatenate([rows[:, None] * inv_freq, cols[:, None] * inv_freq], axis=-1)
  angles = jnp.asarray(angles, jnp.float32)[None]
  return jnp.cos(angles), jnp.sin(angles)


# ------------------------------------------------------------ forward

def layer_norm(x, w, b, eps: float = 1e-6):
  xf = x.astype(jnp.float32)
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
  return ((xf - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype) * w + b


def _attention(vc: VisionConfig, p, x, cos, sin, frames, backend: Backend):
  """Bidirectional attention within each frame (static (start, length)
  runs): XLA, or the Backend's `dense_attention` library
  (`ops.full_attention`) where it asks for one."""
  qkv = jnp.einsum("NC,CkhH->NkhH", x, p["wqkv"]) + p["bqkv"]  # [N, 3, heads, H]
  q, k, v = (apply_rope(qkv[None, :, i], cos, sin)[0] if i < 2 else qkv[:, i] for i in range(3))
  outs = []
  for start, n in frames:
    sl = slice(start, start + n)
    if backend.attention_library() is not None:
      outs.append(ops.full_attention(q[None, sl], k[None, sl], v[None, sl],
                                     scale=vc.head_dim ** -0.5, backend=backend)[0])
      continue
    s = jnp.einsum("qhd,khd->hqk", q[sl], k[sl], preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(s * vc.head_dim ** -0.5, axis=-1).astype(v.dtype)
    outs.append(jnp.einsum("hqk,khd->qhd", probs, v[sl]))
  out = jnp.concatenate(outs) if len(outs) > 1 else outs[0]
  return jnp.einsum("NhH,hHC->NC", out, p["wo"]) + p["bo"]


def _block(vc: VisionConfig, p, x, cos, sin, frames, backend: Backend):
  x = x + _attention(vc, p, layer_norm(x, p["norm1_w"], p["norm1_b"]), cos, sin, frames,
                     backend)
  h = layer_norm(x, p["norm2_w"], p["norm2_b"])
  h = jax.nn.gelu(h @ p["fc1"] + p["b1"], approximate=True)  # gelu_pytorch_tanh
  return x + h @ p["fc2"] + p["b2"]


def merge(vc: VisionConfig, p, x, postshuffle: bool):
  """[N, C] -> [N / merge**2, D]: merge**2 consecutive patches per LM token."""
  C4 = vc.hidden_size * vc.spatial_merge_size ** 2
  if postshuffle:
    x = layer_norm(x.reshape(-1, C4), p["norm_w"], p["norm_b"])
  else:
    x = layer_norm(x, p["norm_w"], p["norm_b"]).reshape(-1, C4)
  x = jax.nn.gelu(x @ p["fc1"] + p["b1"], approximate=False)
  return x @ p["fc2"] + p["b2"]


def _blocks(vc: VisionConfig, blocks, x, cos, sin, frames, lo: int, hi: int, backend: Backend):
  """Blocks lo..hi-1, scanned."""
  if hi <= lo:
    return x
  part = jax.tree.map(lambda w: w[lo:hi], blocks)
  x, _ = jax.lax.scan(lambda x, p: (_block(vc, p, x, cos, sin, frames, backend), None), x,
                      part)
  return x


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def encode(vc: VisionConfig, params, pixel_values, grid_thw, backend: Backend = Backend()):
  """pixel_values [N, C*Tp*P*P], grid_thw a tuple of (t, h, w) ->
  (visual tokens [M, D], DeepStack features [len(deepstack_indexes), M, D]).
  backend: the model's (`ModelConfig.backend`); its `dense_attention`
  library, where set, runs the blocks' attention."""
  dtype = params["patch_w"].dtype
  x = pixel_values.astype(dtype) @ params["patch_w"] + params["patch_b"]
  idx, w = position_taps(vc, grid_thw)
  x = x + jnp.einsum("Nk,NkC->NC", jnp.asarray(w, dtype), params["pos_embed"][idx])
  cos, sin = rotary(vc, grid_thw)
  sizes = [h * w for t, h, w in grid_thw for _ in range(t)]
  frames = tuple(zip(np.cumsum([0] + sizes[:-1]).tolist(), sizes))
  deep, lo = [], 0
  for j, tap in enumerate(vc.deepstack_indexes):
    x = _blocks(vc, params["blocks"], x, cos, sin, frames, lo, tap + 1, backend)
    lo = tap + 1
    deep.append(merge(vc, jax.tree.map(lambda a, j=j: a[j], params["deepstack"]), x, True))
  x = _blocks(vc, params["blocks"], x, cos, sin, frames, lo, vc.depth, backend)
  tokens = merge(vc, params["merger"], x, False)
  return tokens, (jnp.stack(deep) if deep else jnp.zeros((0, *tokens.shape), tokens.dtype))
