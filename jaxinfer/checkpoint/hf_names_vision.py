"""Qwen3-VL's vision tower: HF tensor names -> params["vision"] leaves.

HF linears are [out, in], ours [in, out]; the Conv3d patch embedding
[Cv, C, Tp, P, P] becomes one [C*Tp*P*P, Cv] matrix (the flattening order of
the processor's patches); qkv [3*Cv, Cv] splits as [Cv, 3, heads, H].
"""

from __future__ import annotations

from jaxinfer.checkpoint.hf_names import Source, _one
from jaxinfer.config import VisionConfig

_PREFIX = "model.visual"


def _t(shape_in_out):
  """HF [out, in] -> ours [in, *out_shape]."""
  d_in, out_shape = shape_in_out
  return lambda w: w.T.reshape(d_in, *out_shape)


def _merger(vc: VisionConfig, D: int, p: str, postshuffle: bool) -> dict:
  C4 = vc.hidden_size * vc.spatial_merge_size ** 2
  norm = C4 if postshuffle else vc.hidden_size
  return {("norm_w",): _one(f"{p}.norm.weight", (norm,)), ("norm_b",): _one(f"{p}.norm.bias", (norm,)),
          ("fc1",): _one(f"{p}.linear_fc1.weight", (C4, C4), lambda w: w.T),
          ("b1",): _one(f"{p}.linear_fc1.bias", (C4,)),
          ("fc2",): _one(f"{p}.linear_fc2.weight", (D, C4), lambda w: w.T),
          ("b2",): _one(f"{p}.linear_fc2.bias", (D,))}


def _block(vc: VisionConfig, p: str) -> dict:
  C, F, N, H = vc.hidden_size, vc.intermediate_size, vc.num_heads, vc.head_dim
  s = {(k,): _one(f"{p}.{hf}.{leaf}", (C,)) for k, hf, leaf in (
      ("norm1_w", "norm1", "weight"), ("norm1_b", "norm1", "bias"),
      ("norm2_w", "norm2", "weight"), ("norm2_b", "norm2", "bias"))}
  s.update({("wqkv",): _one(f"{p}.attn.qkv.weight", (3 * C, C), _t((C, (3, N, H)))),
            ("bqkv",): _one(f"{p}.attn.qkv.bias", (3 * C,), lambda b: b.reshape(3, N, H)),
            ("wo",): _one(f"{p}.attn.proj.weight", (C, C), lambda w: w.T.reshape(N, H, C)),
            ("bo",): _one(f"{p}.attn.proj.bias", (C,)),
            ("fc1",): _one(f"{p}.mlp.linear_fc1.weight", (F, C), lambda w: w.T),
            ("b1",): _one(f"{p}.mlp.linear_fc1.bias", (F,)),
            ("fc2",): _one(f"{p}.mlp.linear_fc2.weight", (C, F), lambda w: w.T),
            ("b2",): _one(f"{p}.mlp.linear_fc2.bias", (C,))})
  return s


def vision_sources(vc: VisionConfig, D: int) -> dict:
  """Key path under params["vision"] -> a Source, or a list of Sources for a
  stacked leaf (one per block / DeepStack merger)."""
  C, p = vc.hidden_size, _PREFIX
  s: dict = {("patch_w",): _one(f"{p}.patch_embed.proj.weight",
                                (C, vc.in_channels, vc.temporal_patch_size, vc.patch_size,
                                 vc.patch_size), lambda w: w.reshape(C, -1).T),
             ("patch_b",): _one(f"{p}.patch_embed.proj.bias", (C,)),
             ("pos_embed",): _one(f"{p}.pos_embed.weight", (vc.num_position_embeddings, C))}
  s.update({("merger", *k): v for k, v in _merger(vc, D, f"{p}.merger", False).items()})
  blocks = [_block(vc, f"{p}.blocks.{i}") for i in range(vc.depth)]
  s.update({("blocks", *k): [b[k] for b in blocks] for k in blocks[0]})
  taps = [_merger(vc, D, f"{p}.deepstack_merger_list.{j}", True)
          for j in range(len(vc.deepstack_indexes))]
  if taps:
    s.update({("deepstack", *k): [t[k] for t in taps] for k in taps[0]})
  return s


__all__ = ["Source", "vision_sources"]
