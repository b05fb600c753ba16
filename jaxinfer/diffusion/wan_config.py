"""The Wan 2.x video DiT's config (one expert of WAN-2.2-T2V-A14B, or a tiny one).

`WanConfig` mirrors diffusers' `WanTransformer3DModel` config.json (the
text-to-video form: no image embedder, no added K/V, cross-attention norm
on); `from_diffusers` maps one and rejects what this module does not run.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jaxinfer.backend import Backend


@dataclasses.dataclass(frozen=True, kw_only=True)
class WanConfig:
  patch_size: tuple[int, int, int] = (1, 2, 2)  # (frames, height, width) of a latent patch
  num_heads: int = 40
  head_dim: int = 128
  in_channels: int = 16
  out_channels: int = 16
  text_dim: int = 4096  # UMT5-XXL hidden size
  freq_dim: int = 256  # sinusoidal timestep features
  ffn_dim: int = 13824
  num_layers: int = 40
  eps: float = 1e-6
  rope_max_seq_len: int = 1024
  rope_theta: float = 10000.0
  dtype: str = "float32"
  backend: Backend = Backend()

  def __post_init__(self):
    if len(self.patch_size) != 3 or min(self.patch_size) < 1:
      raise ValueError(f"WanConfig.patch_size must be 3 positive ints, got {self.patch_size}")
    for name in ("num_heads", "head_dim", "in_channels", "out_channels", "text_dim", "freq_dim",
                 "ffn_dim", "num_layers"):
      if getattr(self, name) < 1:
        raise ValueError(f"WanConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.head_dim % 2 or self.freq_dim % 2 or 2 * (self.head_dim // 6) < 2:
      raise ValueError(f"WanConfig: head_dim ({self.head_dim}) must be even and >= 6, "
                       f"freq_dim ({self.freq_dim}) even")

  @property
  def d_model(self) -> int:
    return self.num_heads * self.head_dim

  @property
  def patch_volume(self) -> int:
    return math.prod(self.patch_size)

  @property
  def rope_dims(self) -> tuple[int, int, int]:
    """Head dims rotated by frame, height, width position (diffusers' split)."""
    hw = 2 * (self.head_dim // 6)
    return self.head_dim - 2 * hw, hw, hw

  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  def tokens(self, frames: int, height: int, width: int) -> int:
    """Video tokens of a latent of that many frames x height x width."""
    pt, ph, pw = self.patch_size
    return (frames // pt) * (height // ph) * (width // pw)

  @classmethod
  def from_diffusers(cls, c: dict, **overrides) -> "WanConfig":
    """A diffusers `WanTransformer3DModel` config.json (text to video)."""
    for key in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
      if c.get(key) is not None:
        raise ValueError(f"WanConfig.from_diffusers: {key}={c[key]} (image conditioning) is "
                         "not supported; text to video only")
    if c.get("cross_attn_norm", True) is not True:
      raise ValueError("WanConfig.from_diffusers: cross_attn_norm must be true")
    if c.get("qk_norm", "rms_norm_across_heads") != "rms_norm_across_heads":
      raise ValueError(f"WanConfig.from_diffusers: qk_norm {c.get('qk_norm')!r} is not "
                       "'rms_norm_across_heads'")
    out = c.get("out_channels") or c.get("in_channels", 16)
    return cls(patch_size=tuple(c.get("patch_size", (1, 2, 2))),
               num_heads=c.get("num_attention_heads", 40), head_dim=c.get("attention_head_dim", 128),
               in_channels=c.get("in_channels", 16), out_channels=out,
               text_dim=c.get("text_dim", 4096), freq_dim=c.get("freq_dim", 256),
               ffn_dim=c.get("ffn_dim", 13824), num_layers=c.get("num_layers", 40),
               eps=c.get("eps", 1e-6), rope_max_seq_len=c.get("rope_max_seq_len", 1024),
               **overrides)


def a14b_expert(**overrides) -> WanConfig:
  """One 14B expert of WAN-2.2-T2V-A14B (`transformer/` and `transformer_2/`
  share these dimensions): 40 layers, 40 heads of 128, FFN 13824, UMT5-XXL text."""
  return WanConfig(**{"dtype": "bfloat16", **overrides})
