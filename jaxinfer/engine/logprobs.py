"""Per-token logprobs (`SamplingParams.logprobs` / `prompt_logprobs`), taken
inside the step programs from the hidden states and logits they already
have: no extra forward pass, and nothing at all in steps whose requests do
not ask.

Device: `token_logprobs` scores tokens against logits [..., V] as two
arrays [..., 1 + K]: column 0 the token (its id, its logprob), then the
K = MAX_LOGPROBS most likely tokens, most likely first. One K for every
request keeps one program; the host keeps each request's k of them.
`step_logprobs` is what a step program returns besides its tokens: the
sampled (or, speculating, emitted) tokens' entries, and, when the step has
prompt rows to score, every token row's against `targets` (row t at
position p scores prompt token p + 1, which the host knows).

Host: `wanted` picks a step's program, `step_targets` builds its targets,
and `applied` appends the read arrays to the requests' lists as the
scheduler takes the step's tokens, so a request's `logprobs` stay aligned
with its output (tokens dropped past a stop or max_tokens drop theirs) and
its `prompt_logprobs` with its prompt (a position recomputed after a
preemption is not recorded twice).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.sampling import MAX_LOGPROBS, TokenLogprobs
from jaxinfer.models.transformer import head

# ------------------------------------------------------------ device


def token_logprobs(logits, tokens):
  """logits [..., V], tokens [...] -> (ids int32, logprobs float32), each
  [..., 1 + K]: the token, then the K most likely tokens (K = MAX_LOGPROBS,
  or V if smaller). Logprobs of the raw distribution: log_softmax of the
  float32 logits, before temperature and filters (the OpenAI API's meaning)."""
  lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  top_lp, top_ids = jax.lax.top_k(lp, min(MAX_LOGPROBS, lp.shape[-1]))
  tokens = tokens.astype(jnp.int32)[..., None]
  return (jnp.concatenate([tokens, top_ids.astype(jnp.int32)], -1),
          jnp.concatenate([jnp.take_along_axis(lp, tokens, -1), top_lp], -1))


def step_logprobs(cfg, params, logits, tokens, x, targets, sampled: bool):
  """A step program's logprobs: {"sampled": `token_logprobs(logits,
  tokens)`} when sampled (static), {"prompt": every row of the hidden x
  [..., T, D] scored against targets [..., T]} when targets is not None
  (only then is the head run over all T rows); None when neither."""
  out = {}
  if sampled:
    out["sampled"] = token_logprobs(logits, tokens)
  if targets is not None:
    out["prompt"] = token_logprobs(head(cfg, params, x), targets)
  return out or None


# ------------------------------------------------------------ host


def _prompt_rows(s) -> range:
  """Positions of chunk s's rows whose prompt logprob is still to record
  (the row at position p scores prompt token p + 1; entry 0 is None)."""
  req = s.request
  if req.prompt_logprobs is None:
    return range(0)
  return range(max(s.start, len(req.prompt_logprobs) - 1),
               min(s.start + s.num_tokens, len(req.prompt) - 1))


def wanted(chunks) -> tuple[bool, bool]:
  """A step's logprobs over every rank's chunks: (the sampled rows', as
  the steps' static `logprobs`; the prompt rows', i.e. pass targets)."""
  return (any(s.samples and s.request.logprobs is not None for s in chunks),
          any(_prompt_rows(s) for s in chunks))


def step_targets(per_rank, size: int) -> np.ndarray:
  """Each rank's [size] row targets: a row's next prompt token (0 past the
  prompt: a chunk's sampled token is scored with the sampled rows).
  -> [ranks, size]."""
  rows = np.zeros((len(per_rank), size), np.int32)
  for r, scheduled in enumerate(per_rank):
    row = 0
    for s in scheduled:
      nxt = s.request.prompt[s.start + 1:s.start + 1 + s.num_tokens]
      rows[r, row:row + len(nxt)] = nxt
      row += s.num_tokens
  return rows


def split_ranks(lp, ranks: int, steps: int | None = None) -> list:
  """A read step's logprobs (host arrays, or None) -> per rank, a dict of
  "sampled" (ids, logprobs) [B, J, 1 + K] (J: the tokens a row may emit)
  and "prompt" [T, 1 + K], or None. steps: a plain step's decode steps,
  stacked first ([steps, (ranks,) B, ...]); None: a speculative step's rows
  hold their J already ([(ranks,) B, J, ...])."""
  if lp is None:
    return [None] * ranks

  def sampled(a):
    if steps is None:
      return a.reshape(ranks, -1, *a.shape[-2:])
    return np.moveaxis(a.reshape(steps, ranks, -1, a.shape[-1]), 0, 2)

  out = [{} for _ in range(ranks)]
  for name, pair in lp.items():
    fix = sampled if name == "sampled" else lambda a: a.reshape(ranks, -1, a.shape[-1])
    for r, rank_pair in enumerate(zip(*(fix(np.asarray(a)) for a in pair))):
      out[r][name] = rank_pair
  return out


def _entry(ids, lps, k: int) -> TokenLogprobs:
  ids, lps = ids[:k + 1].tolist(), lps[:k + 1].tolist()
  return TokenLogprobs(ids[0], lps[0], tuple(zip(ids[1:], lps[1:])))


def applied(lp, apply, scheduled, *args):
  """apply(scheduled, *args) (the scheduler taking a read step's tokens)
  with the step's logprobs (this rank's `split_ranks` entry) recorded: the
  prompt rows' first (a request may finish in apply), then one entry per
  token apply appended. Finished (aborted) requests record nothing."""
  if lp is not None and "prompt" in lp:
    _record_prompt(scheduled, *lp["prompt"])
  before = [len(s.request.output) for s in scheduled]
  events = apply(scheduled, *args)
  if lp is not None and "sampled" in lp:
    _record_sampled(scheduled, before, *lp["sampled"])
  return events


def _record_prompt(scheduled, ids, lps) -> None:
  """Rows [T, 1 + K] -> the prompt entries each chunk still lacks."""
  row = 0
  for s in scheduled:
    req = s.request
    for p in () if req.finished else _prompt_rows(s):
      r = row + p - s.start
      req.prompt_logprobs.append(_entry(ids[r], lps[r], req.sampling.prompt_logprobs))
    row += s.num_tokens


def _record_sampled(scheduled, before, ids, lps) -> None:
  """Rows [B, J, 1 + K] -> an entry for each token appended to an output
  since it had `before` tokens (none past a stop or max_tokens)."""
  for s, n, row_ids, row_lps in zip(scheduled, before, ids, lps):
    req = s.request
    for j in range(len(req.output) - n if req.logprobs is not None else 0):
      req.logprobs.append(_entry(row_ids[j], row_lps[j], req.sampling.logprobs))
