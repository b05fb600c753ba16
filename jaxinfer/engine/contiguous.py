"""Batch generation over the contiguous KV cache: prefill, then the whole
decode loop on device in one jitted program (`lax.fori_loop`).

The reference path that the paged engine is checked against, and what
`experiments/generate.py` runs until the engine lands.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.engine.sampling import SamplingParams, sample
from jaxinfer.models import transformer


@functools.partial(jax.jit, static_argnums=(0, 3))
def _generate(cfg, params, prompts, max_tokens, temperature, top_k, top_p, key):
  B, T = prompts.shape
  cache = transformer.init_cache(cfg, B, T + max_tokens)
  x, cache = transformer.forward_hidden(cfg, params, prompts, cache)
  logits = transformer.head(cfg, params, x[:, -1])
  keys = jax.random.split(key, (max_tokens, B))
  first = sample(logits, keys[0], temperature, top_k, top_p)
  out = jnp.zeros((B, max_tokens), jnp.int32).at[:, 0].set(first)

  def step(i, carry):
    out, cache = carry
    prev = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)  # [B, 1]
    x, cache = transformer.forward_hidden(cfg, params, prev, cache)
    tok = sample(transformer.head(cfg, params, x[:, 0]), keys[i], temperature, top_k, top_p)
    return out.at[:, i].set(tok), cache

  out, _ = jax.lax.fori_loop(1, max_tokens, step, (out, cache))
  return out


def generate(cfg: ModelConfig, params, prompts, sampling: SamplingParams):
  """prompts int [B, T] (equal lengths) -> new tokens int32 [B, max_tokens].

  Runs exactly max_tokens steps (stop tokens are not applied here).
  """
  transformer.check_tokens(cfg, prompts, "prompts")
  total = prompts.shape[1] + sampling.max_tokens
  if total > cfg.max_position_embeddings:
    raise ValueError(f"prompt length {prompts.shape[1]} + max_tokens {sampling.max_tokens} "
                     f"exceeds the context ({cfg.max_position_embeddings})")
  B = prompts.shape[0]
  full = lambda v, dt: jnp.full((B,), v, dt)
  return _generate(cfg, params, jnp.asarray(prompts, jnp.int32), sampling.max_tokens,
                   full(sampling.temperature, jnp.float32), full(sampling.top_k, jnp.int32),
                   full(sampling.top_p, jnp.float32), jax.random.key(sampling.seed))


def greedy_reference(cfg: ModelConfig, params, prompts, max_tokens: int) -> list[list[int]]:
  """Greedy decoding by repeated full forward passes (no cache): the ground
  truth every cached / paged / speculative path must reproduce exactly.

  prompts: token-id lists of any lengths. They are right-padded to one
  length, which is exact: causal attention makes position t's logits depend
  on tokens <= t only; so the whole run compiles one program.
  """
  seqs = [list(map(int, p)) for p in prompts]
  width = max(len(s) for s in seqs) + max_tokens - 1
  for _ in range(max_tokens):
    padded = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
      padded[i, :len(s)] = s
    logits = transformer.logits(cfg, params, padded)
    last = jnp.asarray([len(s) - 1 for s in seqs])
    nxt = np.asarray(jnp.argmax(logits[jnp.arange(len(seqs)), last], axis=-1))
    for s, t in zip(seqs, nxt):
      s.append(int(t))
  return [s[len(p):] for s, p in zip(seqs, prompts)]
