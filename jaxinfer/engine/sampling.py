"""Sampling: `SamplingParams` (validated on the host) and a jittable `sample`
whose per-row temperature / top-k / top-p are traced arrays, so new values
never recompile."""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """Per-request sampling settings. temperature 0 is greedy; top_k 0 and
  top_p 1 disable those filters.

  logprobs: for each generated token, its logprob and those of the
  `logprobs` most likely tokens (0..MAX_LOGPROBS; 0: the token's alone);
  prompt_logprobs: the same for each prompt token after the first. None:
  not computed. Logprobs are of the model's raw distribution (log_softmax
  of the float32 logits, before temperature / top-k / top-p / the extras).

  vLLM's extras, applied in the step (`engine.sampling_extras`) to the
  raw logits before temperature / top-k / top-p, in vLLM's order (greedy
  rows take the argmax of the result):
  min_tokens (<= max_tokens): the request's stop tokens (stop_token_ids,
    and EOS unless ignored) are masked (-inf) until it has min_tokens
    output tokens;
  logit_bias: (token id, bias in [-100, 100]) pairs, or a dict, added; at
    most MAX_LOGIT_BIAS, ids in the vocabulary;
  repetition_penalty (> 0): the logit of a token in the prompt or the
    output so far is divided by it if positive, else multiplied;
  presence_penalty, frequency_penalty (in [-2, 2]): a token that occurs
    c > 0 times in the output so far loses presence + frequency * c;
  ignore_eos: do not stop at the model's EOS ids (`EngineConfig.ignore_eos`
    does so for every request).
  Speculative engines refuse all but ignore_eos."""

  max_tokens: int = 16
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop_token_ids: tuple[int, ...] = ()
  logprobs: int | None = None
  prompt_logprobs: int | None = None
  ignore_eos: bool = False
  min_tokens: int = 0
  repetition_penalty: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: tuple[tuple[int, float], ...] = ()

  def __post_init__(self):
    # Each value must fit the step's arrays: int32 counts, float32 temperatures,
    # uint32 seeds. Booleans are not numbers here.
    _check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
    _check_real("temperature", self.temperature)
    if not 0 <= self.temperature <= FLOAT32_MAX:
      raise ValueError(f"SamplingParams: temperature must be in [0, {FLOAT32_MAX:.4g}] "
                       f"(finite in float32), got {self.temperature}")
    _check_int("top_k", self.top_k, 0, INT32_MAX, "(0: off)")
    _check_real("top_p", self.top_p)
    if not 0 < self.top_p <= 1:
      raise ValueError(f"SamplingParams: top_p must be in (0, 1], got {self.top_p}")
    _check_int("seed", self.seed, 0, UINT32_MAX)
    for t in self.stop_token_ids:
      _check_int("stop_token_ids", t, 0, INT32_MAX)
    for name in ("logprobs", "prompt_logprobs"):
      if getattr(self, name) is not None:
        _check_int(name, getattr(self, name), 0, MAX_LOGPROBS, "or None")
    self._check_extras()

  def _check_extras(self):
    if not isinstance(self.ignore_eos, bool):
      raise ValueError(f"SamplingParams: ignore_eos must be a bool, got {self.ignore_eos!r}")
    _check_int("min_tokens", self.min_tokens, 0, self.max_tokens, "(max_tokens)")
    _check_real("repetition_penalty", self.repetition_penalty)
    # float32 in the step: a value that rounds to 0 there is refused too.
    if not 0 < self.repetition_penalty <= FLOAT32_MAX or np.float32(self.repetition_penalty) == 0:
      raise ValueError(f"SamplingParams: repetition_penalty must be > 0 and finite in "
                       f"float32, got {self.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
      _check_real(name, getattr(self, name))
      if not -2 <= getattr(self, name) <= 2:
        raise ValueError(f"SamplingParams: {name} must be in [-2, 2], got {getattr(self, name)}")
    object.__setattr__(self, "logit_bias", _normalized_bias(self.logit_bias))

  @functools.cached_property  # read for every row of every step: computed once
  def uses_extras(self) -> bool:
    """Whether the step must process this request's logits (min_tokens,
    logit_bias or a penalty; ignore_eos is the host's)."""
    return bool(self.min_tokens or self.logit_bias or self.has_penalties)

  @property
  def has_penalties(self) -> bool:
    return (self.repetition_penalty != 1 or self.presence_penalty != 0
            or self.frequency_penalty != 0)


INT32_MAX, UINT32_MAX = 2**31 - 1, 2**32 - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_LOGPROBS = 20  # most likely alternatives per token at most (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 300  # (token, bias) pairs per request at most


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
  """One token's logprob under the model's raw distribution, and the k most
  likely tokens there as (token id, logprob), most likely first."""

  token_id: int
  logprob: float
  top: tuple[tuple[int, float], ...]


def _check_int(name, v, lo, hi, note=""):
  if not isinstance(v, numbers.Integral) or isinstance(v, bool) or not lo <= v <= hi:
    raise ValueError(f"SamplingParams: {name} must be an int in [{lo}, {hi}]"
                     f"{' ' + note if note else ''}, got {v!r}")


def _check_real(name, v):
  if isinstance(v, bool) or not isinstance(v, numbers.Real):
    raise ValueError(f"SamplingParams: {name} must be a number, got {v!r}")


def _normalized_bias(bias) -> tuple[tuple[int, float], ...]:
  """logit_bias as a dict or (id, bias) pairs -> pairs sorted by id (one
  hashable form); raises on a bad pair, a repeated id or too many."""
  if isinstance(bias, (str, bytes)):
    raise ValueError(f"SamplingParams: logit_bias must be a dict or (token id, bias) pairs, "
                     f"got {bias!r}")
  try:
    pairs = list(bias.items() if isinstance(bias, Mapping) else bias)
  except TypeError:
    raise ValueError(f"SamplingParams: logit_bias must be a dict or (token id, bias) pairs, "
                     f"got {bias!r}") from None
  if len(pairs) > MAX_LOGIT_BIAS:
    raise ValueError(f"SamplingParams: logit_bias takes at most {MAX_LOGIT_BIAS} tokens, "
                     f"got {len(pairs)}")
  out = {}
  for pair in pairs:
    if isinstance(pair, (str, bytes)) or not hasattr(pair, "__len__") or len(pair) != 2:
      raise ValueError(f"SamplingParams: logit_bias entries must be (token id, bias) pairs, "
                       f"got {pair!r}")
    t, v = pair
    _check_int("logit_bias token id", t, 0, INT32_MAX)
    _check_real("logit_bias value", v)
    if not -100 <= v <= 100:
      raise ValueError(f"SamplingParams: logit_bias values must be in [-100, 100], got {v!r} "
                       f"for token {t}")
    if int(t) in out:
      raise ValueError(f"SamplingParams: logit_bias names token {t} twice")
    out[int(t)] = float(v)
  return tuple(sorted(out.items()))


def request_keys(seeds, indices):
  """Per-row PRNG keys from (request seed, index of the token being sampled):
  a request's samples never depend on what else is in the batch."""
  return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, indices)


# top_k_cap's buckets: powers of two from 16 to 1024. Larger top_k, or a
# sampled row without top_k, sorts the whole vocabulary.
MIN_TOP_K_CAP, MAX_TOP_K_CAP = 16, 1024


def top_k_cap(samplings) -> int:
  """The static bound for `filter_logits`' top-k fast path over a batch's
  `SamplingParams`: the smallest power of two >= 16 covering the top_k of
  every sampled row (temperature > 0; greedy rows take the argmax and are
  not filtered), when each has 0 < top_k <= 1024; else 0 (full sort).
  Powers of two keep the step programs per batch few."""
  ks = [p.top_k for p in samplings if p.temperature > 0]
  if not ks or min(ks) == 0 or max(ks) > MAX_TOP_K_CAP:
    return 0
  return max(MIN_TOP_K_CAP, 1 << (max(ks) - 1).bit_length())


def filter_logits(logits, temperature, top_k, top_p, k_cap: int = 0):
  """logits [B, V] -> logits / T with tokens outside the top_k largest (if
  top_k > 0) and outside the nucleus (the smallest set whose probability
  reaches top_p) set to -inf. Rows with temperature 0 are scaled by 1e6.

  k_cap (static): 0 sorts the whole vocabulary. k_cap > 0 promises that
  every row that will be sampled has 0 < top_k <= k_cap (`top_k_cap`), so
  only the k_cap largest logits are needed (`lax.top_k`, not a [B, V]
  sort); rows that break the promise are filtered with min(top_k, k_cap)
  (greedy rows, whose filtered logits are not used). The result equals the
  full sort's except under exact ties with the k_cap-th largest logit."""
  B, V = logits.shape
  scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
  if 0 < k_cap < V:
    sorted_desc = jax.lax.top_k(scaled, k_cap)[0]  # [B, k_cap], descending
    k = jnp.clip(top_k, 1, k_cap)
  else:
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
  kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
  scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
  # Nucleus: keep a token if the mass strictly above it is < top_p.
  probs_sorted = jax.nn.softmax(jnp.where(sorted_desc < kth, -jnp.inf, sorted_desc), axis=-1)
  mass_above = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
  keep_sorted = mass_above < top_p[:, None]
  cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(scaled < cutoff, -jnp.inf, scaled)


def argmax(logits):
  """[..., V] -> int32 [...]: the first index of each row's largest value (a
  NaN counts as the largest), as `jnp.argmax`. As a max and then a min over
  the indices that reach it: two plain reductions, which XLA:CPU runs 4-7x
  faster than argmax's (value, index) pair reduction over [1-32, 32000] and
  [1-32, 128256] logits (`experiments/results/sampling_bench*.json`)."""
  top = jnp.max(logits, axis=-1, keepdims=True)
  hit = (logits == top) | jnp.isnan(logits)
  V = logits.shape[-1]
  return jnp.min(jnp.where(hit, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def sample(logits, keys, temperature, top_k, top_p, k_cap: int = 0):
  """logits [B, V] float32; keys [B] PRNG keys; temperature/top_p [B] float32;
  top_k [B] int32; k_cap (static): `filter_logits`' top-k fast path.

  Rows with temperature 0 take the argmax. Others sample from
  softmax(logits / T) restricted to the top_k largest (if top_k > 0) and to
  the smallest set whose probability reaches top_p (nucleus).
  """
  greedy = argmax(logits)
  scaled = filter_logits(logits, temperature, top_k, top_p, k_cap)
  sampled = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
  return jnp.where(temperature > 0, sampled, greedy)
