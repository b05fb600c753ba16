"""DeepSeek-V3 multi-token prediction (MTP) modules.

Module m (params["mtp"] stacked over M modules) at position i, depth k:

  h^k_i = block_m(eh_proj_m [enorm_m(emb(t_{i+k})); hnorm_m(h^{k-1}_i)])
  logits = head(norm_m(h^k_i))        predicts t_{i+k+1}

h^0 is the main model's final-normed hidden state (as vLLM and SGLang feed
the released weights); the embedding and the output head are the main
model's. The block is dense or MoE, MLA or GQA, as the config says (V3: MoE).

Depth k uses module `module_for(cfg, k)` = min(k, M) - 1: M separate modules,
or (M = 1, as DeepSeek-R1 ships) one module applied K times as a chain.

Two forms:
  train_logits   the training form over full sequences: depth k at the same
                 positions i, causal attention over depth k's inputs.
  apply          one module over any KV context (paged, for the engine's
                 speculative step: `engine/speculative.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.kv.contexts import FullContext
from jaxinfer.models.layers import linear, rms_norm, rope_cos_sin
from jaxinfer.models.transformer import block, head


def is_moe(cfg: ModelConfig) -> bool:
  """The MTP block follows the last main layer: MoE unless listed dense."""
  return cfg.is_moe and cfg.num_layers not in cfg.dense_layers


def module_for(cfg: ModelConfig, depth: int) -> int:
  """The module drafting depth `depth` (1-based)."""
  if not cfg.num_mtp_layers:
    raise ValueError("the config has no MTP modules (num_mtp_layers=0)")
  if depth < 1:
    raise ValueError(f"MTP depth must be >= 1, got {depth}")
  return min(depth, cfg.num_mtp_layers) - 1


def _module(params, m: int):
  return jax.tree.map(lambda a: a[m], params["mtp"])


def apply(cfg: ModelConfig, params, m: int, h, next_tokens, cos, sin, ctx, cache=None, ep=None):
  """Module m: h [B, T, D] (previous depth), next_tokens [B, T] int ->
  (hidden h^k [B, T, D] before the module's norm, cache). cache: the MTP
  pool slice stack (indexed at [m]) or None."""
  x, cache, _ = apply_with_counts(cfg, params, m, h, next_tokens, cos, sin, ctx, cache, ep)
  return x, cache


def apply_with_counts(cfg: ModelConfig, params, m: int, h, next_tokens, cos, sin, ctx,
                      cache=None, ep=None, count_experts=None):
  """`apply`, plus the MoE block's routed copies per expert [E] when
  count_experts is a `moe_core.ExpertCount` (EPLB over the MTP experts);
  else None. -> (hidden, cache, counts)."""
  p = _module(params, m)
  dtype = cfg.compute_dtype()
  e = rms_norm(params["embed"][next_tokens].astype(dtype), p["enorm"], cfg.norm_eps)
  x = jnp.concatenate([e, rms_norm(h.astype(dtype), p["hnorm"], cfg.norm_eps)], axis=-1)
  x = linear(x, p["eh_proj"], backend=cfg.backend)
  x, cache, counts = block(cfg, is_moe(cfg), p["block"], x, cos, sin, ctx, 0,
                           None if cache is None else (cache, m), ep, count_experts)
  return x, None if cache is None else cache[0], counts


def logits(cfg: ModelConfig, params, m: int, x):
  """Module m's hidden [..., D] -> float32 logits [..., V] (shared head)."""
  return head(cfg, params, rms_norm(x, params["mtp"]["norm"][m], cfg.norm_eps))


def train_logits(cfg: ModelConfig, params, hidden, tokens, depths: int, ep=None):
  """Training form. hidden [B, T, D]: the main model's final-normed hidden
  for tokens [B, T]. Returns float32 logits [depths, B, T, V]: at depth k
  (index k - 1) position i predicts t_{i+k+1}; positions with i + k >= T have
  no input token (their logits are meaningless; mask them in the loss)."""
  B, T = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  ctx = FullContext(positions, (0,))
  cos, sin = rope_cos_sin(cfg, positions)
  out, h = [], hidden
  for k in range(1, depths + 1):
    nxt = jnp.pad(tokens[:, k:], ((0, 0), (0, k)))  # t_{i+k}
    h, _ = apply(cfg, params, module_for(cfg, k), h, nxt, cos, sin, ctx, None, ep)
    out.append(logits(cfg, params, module_for(cfg, k), h))
  return jnp.stack(out)
