"""Functional model definitions: pure functions over param pytrees.

  weights      every weight declared once: shape, logical axes, init, HF tensor
  specs        the abstract param tree (shape, dtype, logical axes, init)
  layers       RMSNorm, RoPE, gated MLP
  layouts      typed alternative param layouts (fused MLP, absorbed MLA, split
               or dense-reference experts); blocks dispatch on their type
  attention    GQA and MLA blocks (with a contiguous KV cache)
  moe          routers and the dense / grouped expert paths
  transformer  the decoder: `logits` (full forward) and `forward` (cached)
"""

from jaxinfer.models.specs import (ParamSpec, abstract_params, count_params, init_params,
                                   param_specs)
from jaxinfer.models.transformer import check_tokens, forward, init_cache, logits

__all__ = ["ParamSpec", "abstract_params", "count_params", "init_params", "param_specs",
           "check_tokens", "forward", "init_cache", "logits"]
