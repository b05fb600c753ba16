"""Every Wan DiT weight declared once (shape, logical axes, init, diffusers tensor).

The declaration tree uses the LLMs' `models.weights` vocabulary (`Weight`,
`Stacked`), so the spec tree (init, shardings, abstract compile) and the
safetensors names come off one declaration, as for the decoder models.
Projections are ours [in, out] (heads split out: [D, N, H], [N, H, D]),
diffusers' nn.Linear [out, in]; the Conv3d patch embedding [D, C, pt, ph, pw]
is read as a linear map from the flattened (C, pt, ph, pw) patch.

Tree:
  patch_w [C*P, D], patch_b [D]
  time_w1 [Fq, D], time_b1, time_w2 [D, D], time_b2, time_proj_w [D, 6, D], time_proj_b [6, D]
  text_w1 [Dt, D], text_b1, text_w2 [D, D], text_b2
  blocks (stacked over L): table [1, 6, D] (shift, scale, gate, c_shift, c_scale, c_gate)
    self / cross: wq, wk, wv [D, N, H], bq, bk, bv [N, H], q_norm, k_norm [N, H],
                  wo [N, H, D], bo [D]
    norm2_w, norm2_b [D]; ffn_w1 [D, F], ffn_b1 [F], ffn_w2 [F, D], ffn_b2 [D]
  head_table [1, 2, D] (shift, scale); proj_w [D, P*Cout], proj_b [P*Cout]
"""

from __future__ import annotations

import math

import jax

from jaxinfer.checkpoint.hf_load import load_declared
from jaxinfer.diffusion import files
from jaxinfer.diffusion.wan_config import WanConfig
from jaxinfer.models.specs import declared_specs, init_from_specs, is_spec
from jaxinfer.models.weights import Stacked, Weight

_HEADS = ("q_heads", "head_dim")


def _linear(hf: str, shape, axes, in_dims: int = 1, hf_shape=None) -> Weight:
  return Weight(tuple(shape), axes, hf=f"{hf}.weight", stored="linear", in_dims=in_dims,
                hf_shape=hf_shape)


def _bias(hf: str, shape, axes, stored: str = "same") -> Weight:
  return Weight(tuple(shape), axes, "zeros", hf=f"{hf}.bias", stored=stored)


def _attention(cfg: WanConfig, a: str) -> dict:
  D, N, H = cfg.d_model, cfg.num_heads, cfg.head_dim
  p = {}
  for x in ("q", "k", "v"):
    p[f"w{x}"] = _linear(f"{a}.to_{x}", (D, N, H), ("embed", *_HEADS))
    p[f"b{x}"] = _bias(f"{a}.to_{x}", (N, H), _HEADS, "flat")
  for x in ("q", "k"):  # RMSNorm across all heads ([N * H] in diffusers)
    p[f"{x}_norm"] = Weight((N, H), _HEADS, "ones", hf=f"{a}.norm_{x}.weight", stored="flat")
  p["wo"] = _linear(f"{a}.to_out.0", (N, H, D), (*_HEADS, "embed"), in_dims=2)
  p["bo"] = _bias(f"{a}.to_out.0", (D,), ("embed",))
  return p


def block_weights(cfg: WanConfig) -> dict:
  """One block, names relative to `blocks.{i}`."""
  D, F = cfg.d_model, cfg.ffn_dim
  return dict(table=Weight((1, 6, D), (None, None, "embed"), hf="scale_shift_table"),
              self=_attention(cfg, "attn1"), cross=_attention(cfg, "attn2"),
              norm2_w=Weight((D,), ("embed",), "ones", hf="norm2.weight"),
              norm2_b=_bias("norm2", (D,), ("embed",)),
              ffn_w1=_linear("ffn.net.0.proj", (D, F), ("embed", "mlp")),
              ffn_b1=_bias("ffn.net.0.proj", (F,), ("mlp",)),
              ffn_w2=_linear("ffn.net.2", (F, D), ("mlp", "embed")),
              ffn_b2=_bias("ffn.net.2", (D,), ("embed",)))


def dit_weights(cfg: WanConfig) -> dict:
  """The declaration tree (module docstring)."""
  D, C, P = cfg.d_model, cfg.in_channels, cfg.patch_volume
  ce = "condition_embedder"
  e = ("embed",)
  return dict(
      patch_w=_linear("patch_embedding", (C * P, D), (None, "embed"),
                      hf_shape=(D, C, *cfg.patch_size)),
      patch_b=_bias("patch_embedding", (D,), e),
      time_w1=_linear(f"{ce}.time_embedder.linear_1", (cfg.freq_dim, D), (None, "embed")),
      time_b1=_bias(f"{ce}.time_embedder.linear_1", (D,), e),
      time_w2=_linear(f"{ce}.time_embedder.linear_2", (D, D), (None, "embed")),
      time_b2=_bias(f"{ce}.time_embedder.linear_2", (D,), e),
      time_proj_w=_linear(f"{ce}.time_proj", (D, 6, D), (None, None, "embed")),
      time_proj_b=_bias(f"{ce}.time_proj", (6, D), (None, "embed"), "flat"),
      text_w1=_linear(f"{ce}.text_embedder.linear_1", (cfg.text_dim, D), (None, "embed")),
      text_b1=_bias(f"{ce}.text_embedder.linear_1", (D,), e),
      text_w2=_linear(f"{ce}.text_embedder.linear_2", (D, D), (None, "embed")),
      text_b2=_bias(f"{ce}.text_embedder.linear_2", (D,), e),
      blocks=Stacked(cfg.num_layers, "blocks.{i}", block_weights(cfg)),
      head_table=Weight((1, 2, D), (None, None, "embed"), hf="scale_shift_table"),
      proj_w=_linear("proj_out", (D, P * cfg.out_channels), ("embed", None)),
      proj_b=_bias("proj_out", (P * cfg.out_channels,), (None,)))


def param_specs(cfg: WanConfig, dtype=None) -> dict:
  return declared_specs(dit_weights(cfg), dtype or cfg.compute_dtype())


def init_params(cfg: WanConfig, key, dtype=None) -> dict:
  """Random params (fan-in scaled normals, ones / zeros for norms and biases)."""
  return init_from_specs(param_specs(cfg, dtype), key)


def count_params(cfg: WanConfig) -> int:
  """Parameters of one expert, from the declared shapes alone."""
  return sum(math.prod(s.shape) for s in jax.tree.leaves(param_specs(cfg), is_leaf=is_spec))


def read_config(path: str, dtype="float32", **overrides) -> WanConfig:
  """The WanConfig of a diffusers `WanTransformer3DModel` directory."""
  return files.read_config(path, "WanTransformer3DModel",
                           lambda raw: WanConfig.from_diffusers(raw, dtype=str(dtype), **overrides))


def load_transformer(path: str, dtype="float32", *, shardings=None, **overrides):
  """A diffusers `WanTransformer3DModel` directory (`transformer/` or
  `transformer_2/` of a WanPipeline save: config.json + safetensors) ->
  (WanConfig, params), each leaf placed on its sharding when given (a tree
  like `wan_parallel.param_shardings`). Errors name the directory and the
  tensor (expected and found shape) or the config.json field."""
  cfg = read_config(path, dtype, **overrides)
  with files.naming(path):
    params = load_declared(path, dit_weights(cfg), dtype, shardings=shardings)
  return cfg, params
