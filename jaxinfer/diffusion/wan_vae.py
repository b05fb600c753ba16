"""The Wan 2.1 VAE decoder (the one WAN-2.2-T2V-A14B uses), decoded chunk by chunk.

diffusers' `AutoencoderKLWan.decode` (is_residual False): post_quant_conv,
then the decoder on one latent frame at a time, each causal 3D conv (time
kernel 3, two zero frames in front) keeping the last two frames of its
input as a cache for the next chunk, so a chunk's program is the same for
every frame and memory holds one chunk's activations (720p x 81 frames
would not fit whole). The temporal upsamplers skip their time conv on the
first chunk (frame 0 decodes to one frame; every later latent frame to
two per upsampler): 1 + 4 (F - 1) frames. Here chunk 0 is traced once
(`first`), and chunks 1.. run in one `lax.scan` over the latent frames
with the caches as its carry. Layout inside: channels last [B, T, H, W, C].

Decoder (dims d_i = base * ([mult[-1]] + mult[::-1])_i):
  conv_in (z -> d0); mid: res, attention (one head over a frame's pixels), res
  up block i: res x (num_res_blocks + 1) (in d_i, halved past block 0 ->
    d_{i+1}); then, but for the last, resample: 2x nearest + conv2d 3x3
    (to d_{i+1} / 2), with a causal time conv (C -> 2C, frames interleaved)
    where `temporal_upsample[i]`
  RMS norm, SiLU, conv_out (-> 3). Output clamped to [-1, 1].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxinfer import ops
from jaxinfer.backend import Backend
from jaxinfer.checkpoint.hf_load import load_declared
from jaxinfer.diffusion import files
from jaxinfer.models.specs import declared_specs, init_from_specs
from jaxinfer.models.weights import Weight

CACHE_T = 2  # frames a causal conv keeps from the previous chunk
# The mid block's one head is 4 x base_dim wide (384): the XLA form, blocked past one block.
_ATTENTION = Backend(attention="xla")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VaeConfig:
  base_dim: int = 96
  z_dim: int = 16
  dim_mult: tuple[int, ...] = (1, 2, 4, 4)
  num_res_blocks: int = 2
  temporal_upsample: tuple[bool, ...] = (True, True, False)  # reversed temperal_downsample
  out_channels: int = 3
  latents_mean: tuple[float, ...] = ()
  latents_std: tuple[float, ...] = ()
  dtype: str = "float32"

  def __post_init__(self):
    if len(self.temporal_upsample) != len(self.dim_mult) - 1:
      raise ValueError(f"VaeConfig: temporal_upsample ({self.temporal_upsample}) needs "
                       f"len(dim_mult) - 1 = {len(self.dim_mult) - 1} entries")
    for name in ("latents_mean", "latents_std"):
      if getattr(self, name) and len(getattr(self, name)) != self.z_dim:
        raise ValueError(f"VaeConfig.{name} needs z_dim ({self.z_dim}) entries")

  @property
  def dims(self) -> tuple[int, ...]:
    return tuple(self.base_dim * u for u in (self.dim_mult[-1], *self.dim_mult[::-1]))

  @property
  def temporal_factor(self) -> int:
    return 2 ** sum(self.temporal_upsample)

  def frames(self, latent_frames: int) -> int:
    return 1 + self.temporal_factor * (latent_frames - 1)

  @classmethod
  def from_diffusers(cls, c: dict, **overrides) -> "VaeConfig":
    if c.get("is_residual", False) or c.get("patch_size") is not None:
      raise ValueError("VaeConfig.from_diffusers: is_residual / patch_size (the Wan 2.2 TI2V "
                       "VAE) are not supported; the Wan 2.1 VAE only")
    return cls(base_dim=c.get("decoder_base_dim") or c.get("base_dim", 96),
               z_dim=c.get("z_dim", 16), dim_mult=tuple(c.get("dim_mult", (1, 2, 4, 4))),
               num_res_blocks=c.get("num_res_blocks", 2),
               temporal_upsample=tuple(c.get("temperal_downsample", (False, True, True)))[::-1],
               out_channels=c.get("out_channels", 3),
               latents_mean=tuple(c.get("latents_mean", ())),
               latents_std=tuple(c.get("latents_std", ())), **overrides)


# --------------------------------------------------------------- weights

def _conv(hf: str, c_in: int, c_out: int, kernel: tuple[int, ...]) -> dict:
  """A torch conv [O, I, *k] read as ours [I, *k, O] (a linear map from the
  flattened (I, *k) window), and its bias."""
  w = Weight((c_in, *kernel, c_out), (None,) * (len(kernel) + 2), hf=f"{hf}.weight",
             stored="linear", in_dims=1 + len(kernel), hf_shape=(c_out, c_in, *kernel))
  return dict(w=w, b=Weight((c_out,), (None,), "zeros", hf=f"{hf}.bias"))


def _norm(hf: str, dim: int, spatial: int = 3) -> Weight:
  """WanRMS_norm's gamma, stored [C, 1, 1, 1] (videos) or [C, 1, 1] (images)."""
  return Weight((dim, *(1,) * spatial), (None,) * (1 + spatial), "ones", hf=f"{hf}.gamma")


def _res_weights(hf: str, c_in: int, c_out: int) -> dict:
  p = dict(norm1=_norm(f"{hf}.norm1", c_in), conv1=_conv(f"{hf}.conv1", c_in, c_out, (3, 3, 3)),
           norm2=_norm(f"{hf}.norm2", c_out), conv2=_conv(f"{hf}.conv2", c_out, c_out, (3, 3, 3)))
  if c_in != c_out:
    p["shortcut"] = _conv(f"{hf}.conv_shortcut", c_in, c_out, (1, 1, 1))
  return p


def _up_block(cfg: VaeConfig, i: int) -> dict:
  dims, hf = cfg.dims, f"decoder.up_blocks.{i}"
  c_in = dims[i] // 2 if i > 0 else dims[i]
  c_out = dims[i + 1]
  res = []
  for j in range(cfg.num_res_blocks + 1):
    res.append(_res_weights(f"{hf}.resnets.{j}", c_in if j == 0 else c_out, c_out))
  p = dict(res=res)
  if i < len(cfg.dim_mult) - 1:
    u = f"{hf}.upsamplers.0"
    p["up"] = _conv(f"{u}.resample.1", c_out, c_out // 2, (3, 3))
    if cfg.temporal_upsample[i]:
      p["time"] = _conv(f"{u}.time_conv", c_out, 2 * c_out, (3, 1, 1))
  return p


def decoder_weights(cfg: VaeConfig) -> dict:
  """The declaration tree of post_quant_conv and the decoder (module docstring)."""
  d0, z = cfg.dims[0], cfg.z_dim
  m = "decoder.mid_block"
  last = cfg.dims[-1]
  return dict(
      post_quant=_conv("post_quant_conv", z, z, (1, 1, 1)),
      conv_in=_conv("decoder.conv_in", z, d0, (3, 3, 3)),
      mid=dict(res0=_res_weights(f"{m}.resnets.0", d0, d0),
               res1=_res_weights(f"{m}.resnets.1", d0, d0),
               attn=dict(norm=_norm(f"{m}.attentions.0.norm", d0, 2),
                         qkv=_conv(f"{m}.attentions.0.to_qkv", d0, 3 * d0, (1, 1)),
                         proj=_conv(f"{m}.attentions.0.proj", d0, d0, (1, 1)))),
      up=[_up_block(cfg, i) for i in range(len(cfg.dim_mult))],
      norm_out=_norm("decoder.norm_out", last),
      conv_out=_conv("decoder.conv_out", last, cfg.out_channels, (3, 3, 3)))


def param_specs(cfg: VaeConfig, dtype=None) -> dict:
  return declared_specs(decoder_weights(cfg), dtype or cfg.dtype)


def init_params(cfg: VaeConfig, key, dtype=None) -> dict:
  return init_from_specs(param_specs(cfg, dtype), key)


def load_vae(path: str, dtype="float32"):
  """A diffusers `AutoencoderKLWan` directory (`vae/`) -> (VaeConfig,
  decoder params); the encoder's tensors are left unread."""
  cfg = files.read_config(path, "AutoencoderKLWan",
                          lambda raw: VaeConfig.from_diffusers(raw, dtype=str(dtype)))
  with files.naming(path):
    params = load_declared(path, decoder_weights(cfg), dtype, unread=("encoder.", "quant_conv."))
  return cfg, params


# --------------------------------------------------------------- decoder

def _conv3d(p, x, pad: int):
  """x [B, T, H, W, C] -> valid in time, `pad` zeros each side in space."""
  y = jax.lax.conv_general_dilated(x, p["w"].astype(x.dtype), (1, 1, 1),
                                   [(0, 0), (pad, pad), (pad, pad)],
                                   dimension_numbers=("NTHWC", "ITHWO", "NTHWC"))
  return y + p["b"].astype(x.dtype)


def _causal(p, x, name: str, cin, cout):
  """A causal conv over the chunk x, the previous chunk's last CACHE_T input
  frames (zeros before the first) in front; records this chunk's in cout."""
  if p["w"].shape[1] == 1:  # time kernel 1: no history
    return _conv3d(p, x, p["w"].shape[2] // 2)
  prev = cin[name] if cin is not None else jnp.zeros((x.shape[0], CACHE_T, *x.shape[2:]), x.dtype)
  xx = jnp.concatenate([prev, x], axis=1)
  cout[name] = xx[:, -CACHE_T:]
  return _conv3d(p, xx, p["w"].shape[2] // 2)


def _rms(x, gamma):
  """F.normalize over channels, times sqrt(C) and gamma (WanRMS_norm)."""
  xf = x.astype(jnp.float32)
  norm = jnp.sqrt(jnp.sum(jnp.square(xf), axis=-1, keepdims=True))
  out = xf / jnp.maximum(norm, 1e-12) * (x.shape[-1] ** 0.5) * gamma.reshape(-1).astype(jnp.float32)
  return out.astype(x.dtype)


def _res(p, x, name: str, cin, cout):
  h = _conv3d(p["shortcut"], x, 0) if "shortcut" in p else x
  x = _causal(p["conv1"], jax.nn.silu(_rms(x, p["norm1"])), f"{name}.conv1", cin, cout)
  x = _causal(p["conv2"], jax.nn.silu(_rms(x, p["norm2"])), f"{name}.conv2", cin, cout)
  return x + h


def _attention(p, x):
  """One head over each frame's H x W pixels (WanAttentionBlock)."""
  B, T, H, W, C = x.shape
  h = _rms(x, p["norm"]).reshape(B * T, H * W, C)
  qkv = h @ p["qkv"]["w"].reshape(C, 3 * C).astype(x.dtype) + p["qkv"]["b"].astype(x.dtype)
  q, k, v = (a[:, :, None, :] for a in jnp.split(qkv, 3, axis=-1))  # [BT, HW, 1, C]
  o = ops.full_attention(q, k, v, scale=C ** -0.5, backend=_ATTENTION)[:, :, 0]
  o = o @ p["proj"]["w"].reshape(C, C).astype(x.dtype) + p["proj"]["b"].astype(x.dtype)
  return x + o.reshape(B, T, H, W, C)


def _upsample(p, x, name: str, cin, cout, first: bool):
  """Time conv (C -> 2C, each frame to two; skipped on the first chunk, whose
  cache stays zero), then 2x nearest in space and a 3x3 conv per frame."""
  if "time" in p:
    if first:
      cout[name] = jnp.zeros((x.shape[0], CACHE_T, *x.shape[2:]), x.dtype)
    else:
      y = _causal(p["time"], x, name, cin, cout)  # [B, T, H, W, 2C]
      B, T, H, W, C = x.shape
      x = y.reshape(B, T, H, W, 2, C).transpose(0, 1, 4, 2, 3, 5).reshape(B, 2 * T, H, W, C)
  x = jnp.repeat(jnp.repeat(x, 2, axis=2), 2, axis=3)
  B, T, H, W, C = x.shape
  y = jax.lax.conv_general_dilated(x.reshape(B * T, H, W, C), p["up"]["w"].astype(x.dtype),
                                   (1, 1), [(1, 1), (1, 1)],
                                   dimension_numbers=("NHWC", "IHWO", "NHWC"))
  y = y + p["up"]["b"].astype(x.dtype)
  return y.reshape(B, T, H, W, -1)


def decode_chunk(cfg: VaeConfig, params, x, caches, first: bool):
  """One chunk of latent frames x [B, t, h, w, z] (after post_quant_conv) ->
  (pixels [B, t', 8h, 8w, 3], the caches for the next chunk)."""
  cout: dict = {}
  x = _causal(params["conv_in"], x, "conv_in", caches, cout)
  mid = params["mid"]
  x = _res(mid["res0"], x, "mid.res0", caches, cout)
  x = _attention(mid["attn"], x)
  x = _res(mid["res1"], x, "mid.res1", caches, cout)
  for i, block in enumerate(params["up"]):
    for j, r in enumerate(block["res"]):
      x = _res(r, x, f"up{i}.res{j}", caches, cout)
    if "up" in block:
      x = _upsample(block, x, f"up{i}.up", caches, cout, first)
  x = jax.nn.silu(_rms(x, params["norm_out"]))
  return _causal(params["conv_out"], x, "conv_out", caches, cout), cout


def check_latents(cfg: VaeConfig, z) -> None:
  if z.ndim != 5 or z.shape[1] != cfg.z_dim:
    raise ValueError(f"VAE latents must be [B, {cfg.z_dim}, F, H, W], got {z.shape}")


@functools.partial(jax.jit, static_argnames=("cfg",))
def _decode(cfg: VaeConfig, params, z):
  x = z.astype(cfg.dtype).transpose(0, 2, 3, 4, 1)  # [B, F, h, w, z]
  x = _conv3d(params["post_quant"], x, 0)
  y, caches = decode_chunk(cfg, params, x[:, :1], None, first=True)
  if x.shape[1] > 1:
    def body(c, frame):
      out, c = decode_chunk(cfg, params, frame[:, None], c, first=False)
      return c, out
    _, ys = jax.lax.scan(body, caches, x[:, 1:].swapaxes(0, 1))  # [F-1, B, tf, H, W, 3]
    ys = ys.swapaxes(0, 1)
    y = jnp.concatenate([y, ys.reshape(ys.shape[0], -1, *ys.shape[3:])], axis=1)
  return jnp.clip(y, -1.0, 1.0).transpose(0, 4, 1, 2, 3)


def decode(cfg: VaeConfig, params, z):
  """`AutoencoderKLWan.decode`: latents z [B, z_dim, F, h, w] -> video
  [B, 3, 1 + 4 (F - 1), 8h, 8w] in [-1, 1], one latent frame per chunk."""
  check_latents(cfg, z)
  return _decode(cfg, params, z)


def denormalize(cfg: VaeConfig, z):
  """The DiT's latents -> the VAE's: z * std + mean per channel (WanPipeline)."""
  check_latents(cfg, z)
  if not cfg.latents_mean:
    raise ValueError("VaeConfig has no latents_mean / latents_std (from the VAE's config.json)")
  mean = jnp.asarray(cfg.latents_mean, jnp.float32).reshape(1, -1, 1, 1, 1)
  std = jnp.asarray(cfg.latents_std, jnp.float32).reshape(1, -1, 1, 1, 1)
  return z.astype(jnp.float32) * std + mean
