"""The UMT5 text encoder of Wan (google/umt5-xxl's encoder), as pure functions.

transformers' `UMT5EncoderModel`: token embeddings, L pre-norm blocks
  x += O(softmax(Q K^T + bias_l(j - i) + mask) V)     (no 1/sqrt(d) scaling)
  x += Wo(gelu_tanh(Wi0 h) * Wi1 h)                  (gated-gelu)
with RMS norms (no mean, no bias) and every block its own bucketed relative
position bias (T5's bidirectional buckets: half for keys before the query,
half after; exact up to a quarter of the buckets, logarithmic to
max_distance), then a final RMS norm. `prompt_embeddings` is what
WanPipeline feeds the DiT: the encoder's output with padded positions zeroed
(it trims each prompt to its tokens and pads with zeros to the text length).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxinfer.checkpoint.hf_load import load_declared
from jaxinfer.diffusion import files
from jaxinfer.models.specs import declared_specs, init_from_specs
from jaxinfer.models.weights import Stacked, Weight


@dataclasses.dataclass(frozen=True, kw_only=True)
class UMT5Config:
  vocab_size: int = 256384
  d_model: int = 4096
  d_kv: int = 64
  num_heads: int = 64
  d_ff: int = 10240
  num_layers: int = 24
  num_buckets: int = 32
  max_distance: int = 128
  eps: float = 1e-6
  dtype: str = "float32"

  @classmethod
  def from_hf(cls, c: dict, **overrides) -> "UMT5Config":
    """An HF UMT5 config.json (the encoder of a gated-gelu UMT5)."""
    if c.get("feed_forward_proj", "gated-gelu") != "gated-gelu":
      raise ValueError(f"UMT5Config.from_hf: feed_forward_proj {c['feed_forward_proj']!r} is "
                       "not 'gated-gelu'")
    return cls(vocab_size=c["vocab_size"], d_model=c["d_model"], d_kv=c["d_kv"],
               num_heads=c["num_heads"], d_ff=c["d_ff"], num_layers=c["num_layers"],
               num_buckets=c.get("relative_attention_num_buckets", 32),
               max_distance=c.get("relative_attention_max_distance", 128),
               eps=c.get("layer_norm_epsilon", 1e-6), **overrides)


def encoder_weights(cfg: UMT5Config) -> dict:
  D, N, H, F = cfg.d_model, cfg.num_heads, cfg.d_kv, cfg.d_ff
  lin = lambda hf, shape, axes, in_dims=1: Weight(shape, axes, hf=f"{hf}.weight",
                                                  stored="linear", in_dims=in_dims)
  a, f = "layer.0.SelfAttention", "layer.1.DenseReluDense"
  heads = ("q_heads", "head_dim")
  block = dict(
      attn_norm=Weight((D,), ("embed",), "ones", hf="layer.0.layer_norm.weight"),
      wq=lin(f"{a}.q", (D, N, H), ("embed", *heads)), wk=lin(f"{a}.k", (D, N, H), ("embed", *heads)),
      wv=lin(f"{a}.v", (D, N, H), ("embed", *heads)),
      wo=lin(f"{a}.o", (N, H, D), (*heads, "embed"), in_dims=2),
      rel_bias=Weight((cfg.num_buckets, N), (None, "q_heads"),
                      hf=f"{a}.relative_attention_bias.weight"),
      ffn_norm=Weight((D,), ("embed",), "ones", hf="layer.1.layer_norm.weight"),
      wi0=lin(f"{f}.wi_0", (D, F), ("embed", "mlp")), wi1=lin(f"{f}.wi_1", (D, F), ("embed", "mlp")),
      wo_ff=lin(f"{f}.wo", (F, D), ("mlp", "embed")))
  return dict(embed=Weight((cfg.vocab_size, D), ("vocab", "embed"), hf="shared.weight"),
              blocks=Stacked(cfg.num_layers, "encoder.block.{i}", block),
              final_norm=Weight((D,), ("embed",), "ones", hf="encoder.final_layer_norm.weight"))


def init_params(cfg: UMT5Config, key) -> dict:
  return init_from_specs(declared_specs(encoder_weights(cfg), cfg.dtype), key)


def load_encoder(path: str, dtype="float32"):
  """An HF `UMT5EncoderModel` directory (the pipeline's `text_encoder/`)."""
  cfg = files.read_config(path, "UMT5EncoderModel",
                          lambda raw: UMT5Config.from_hf(raw, dtype=str(dtype)))
  # The tied copy of the embeddings some saves hold is not read twice.
  with files.naming(path):
    params = load_declared(path, encoder_weights(cfg), dtype, unread=("encoder.embed_tokens.",))
  return cfg, params


def relative_buckets(cfg: UMT5Config, length: int):
  """[T, T] int32: T5's bidirectional bucket of key j - query i."""
  rel = jnp.arange(length)[None, :] - jnp.arange(length)[:, None]
  nb = cfg.num_buckets // 2
  base = (rel > 0).astype(jnp.int32) * nb
  rel = jnp.abs(rel)
  exact = nb // 2
  ratio = jnp.log(jnp.maximum(rel, 1).astype(jnp.float32) / exact) / math.log(cfg.max_distance / exact)
  large = jnp.minimum(exact + (ratio * (nb - exact)).astype(jnp.int32), nb - 1)
  return base + jnp.where(rel < exact, rel, large)


def _rms(x, w, eps):
  var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
  return (x.astype(jnp.float32) * jax.lax.rsqrt(var + eps)).astype(x.dtype) * w


def _block(cfg: UMT5Config, p, x, buckets, mask):
  h = _rms(x, p["attn_norm"], cfg.eps)
  q = jnp.einsum("BTD,DNH->BNTH", h, p["wq"])
  k = jnp.einsum("BSD,DNH->BNSH", h, p["wk"])
  v = jnp.einsum("BSD,DNH->BNSH", h, p["wv"])
  bias = p["rel_bias"][buckets].transpose(2, 0, 1)[None]  # [1, N, T, T]
  s = jnp.einsum("BNTH,BNSH->BNTS", q, k).astype(jnp.float32) + bias
  s = jnp.where(mask[:, None, None, :], s, jnp.finfo(jnp.float32).min)
  o = jnp.einsum("BNTS,BNSH->BTNH", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)
  x = x + jnp.einsum("BTNH,NHD->BTD", o, p["wo"])
  h = _rms(x, p["ffn_norm"], cfg.eps)
  ff = jax.nn.gelu(h @ p["wi0"], approximate=True) * (h @ p["wi1"])
  return x + ff @ p["wo_ff"]


def check_tokens(cfg: UMT5Config, ids, mask) -> None:
  if ids.ndim != 2 or mask.shape != ids.shape:
    raise ValueError(f"token ids must be [B, L] with a mask of one shape, got {ids.shape} and "
                     f"{mask.shape}")


@functools.partial(jax.jit, static_argnames=("cfg",))
def encode(cfg: UMT5Config, params, ids, mask):
  """ids [B, L] int, mask [B, L] (1: a token, 0: padding) -> [B, L, D], the
  encoder's last hidden state (padded positions included, as transformers)."""
  x = params["embed"][ids]
  buckets = relative_buckets(cfg, ids.shape[1])
  mask = mask.astype(bool)

  def one(x, p):
    return _block(cfg, p, x, buckets, mask), None
  x = jax.lax.scan(one, x, params["blocks"])[0]
  return _rms(x, params["final_norm"], cfg.eps)


def prompt_embeddings(cfg: UMT5Config, params, ids, mask):
  """WanPipeline's prompt embeddings: `encode` with padded positions zeroed."""
  check_tokens(cfg, ids, mask)
  out = encode(cfg, params, ids, mask)
  return out * jnp.asarray(mask, out.dtype)[..., None]
