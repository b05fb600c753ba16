"""vLLM's extra sampling parameters, applied inside the step programs:
`SamplingParams.min_tokens`, `logit_bias` and the repetition / presence /
frequency penalties (`ignore_eos` is the host's: the request's stop set).

Order, as vLLM's v1 sampler: on the raw float32 logits, min_tokens' mask
and logit_bias, then the repetition penalty, then frequency and presence;
then `sampling.sample` (temperature, top-k, top-p; greedy rows: argmax of
the result). Logprobs stay the raw logits' (`engine.logprobs`).

A step takes an `Extras` only when one of its sampling rows needs it
(`step_extras`; None otherwise, so other steps compile and run the
programs they always did). Its parts, each None when no row needs it:

  Bias       per row, N (token, value, until) entries (N bucketed), each
             added while the token being sampled has index < until:
             logit_bias (until INT32_MAX) and -inf on the request's stop
             tokens while its output is short of min_tokens (until
             min_tokens: a multi-step decode lifts the mask on time).
  Penalties  per row, its known tokens (prompt, then output; [B, H], H
             bucketed), the prompt's length, and where its tokens still in
             flight are: the last `pending` steps of the previous dispatch's
             samples (`in_flight`, on device: async scheduling), at row
             `pending_at`. `prepare` counts these into `Counts` [B, V]; a
             multi-step decode adds each step's samples (`advance`).

Why counts rebuilt on device from the history each step rather than a
device-resident [slots, V] count state: nothing to keep in step through
preemption, abort, recovery, attention-DP ranks or a disaggregated
hand-over, and steps without penalised requests pay nothing. The price is
a [B, H] int32 transfer and a scatter in steps that have them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.sampling import INT32_MAX

NONE = INT32_MAX  # an id past any vocabulary: its scatter is dropped
MIN_BIAS_ENTRIES, MIN_HISTORY = 8, 64  # the smallest buckets (few programs; small arrays)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Bias:
  ids: jax.Array  # [B, N] int32 (NONE: no entry)
  values: jax.Array  # [B, N] float32
  until: jax.Array  # [B, N] int32: applies while the sampled token's index < until


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Penalties:
  history: jax.Array  # [B, H] int32: known tokens, prompt then output (NONE: padding)
  prompt_len: jax.Array  # [B] int32
  pending: jax.Array  # [B] int32: output tokens in flight (in in_flight's last steps)
  pending_at: jax.Array  # [B] int32: their row in in_flight, ranks flattened
  repetition: jax.Array  # [B] float32
  presence: jax.Array  # [B] float32
  frequency: jax.Array  # [B] float32
  in_flight: jax.Array  # the previous dispatch's samples: [(steps,) ranks, S] int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Counts:
  output: jax.Array  # [B, V] float32: occurrences in the output so far
  in_prompt: jax.Array  # [B, V] bool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Extras:
  """A step's extras input, rows as its logits over every rank ([ranks *
  B], rank-major); counts is `prepare`'s, on device."""
  bias: Bias | None = None
  penalties: Penalties | None = None
  counts: Counts | None = None


# ------------------------------------------------------------ device


def prepare(extras: Extras | None, slots: int, vocab: int) -> Extras | None:
  """The penalties' `Counts` from the history and the in-flight tokens.
  slots: rows of one step's samples (in_flight is [steps, slots] or
  [slots] once flattened)."""
  if extras is None or extras.penalties is None:
    return extras
  p = extras.penalties
  B, H = p.history.shape
  flight = p.in_flight.reshape(-1, slots)  # [steps, ranks * S]
  n = flight.shape[0]
  ahead = flight[:, p.pending_at].T  # [B, steps]
  ahead = jnp.where(jnp.arange(n) >= n - p.pending[:, None], ahead, NONE)
  prompt = jnp.arange(H) < p.prompt_len[:, None]
  rows = jnp.arange(B)[:, None]
  out_ids = jnp.concatenate([jnp.where(prompt, NONE, p.history), ahead], axis=1)
  output = jnp.zeros((B, vocab), jnp.float32).at[rows, out_ids].add(1.0, mode="drop")
  in_prompt = jnp.zeros((B, vocab), bool).at[rows, jnp.where(prompt, p.history, NONE)].set(
      True, mode="drop")
  return dataclasses.replace(extras, counts=Counts(output, in_prompt))


def by_rank(extras: Extras | None, ranks: int) -> Extras | None:
  """`prepare`'s extras (rows [ranks * B], rank-major) -> every array
  [ranks, B, ...], as a step hands each rank its rows (`ranks.per_rank`).
  The in-flight samples, read by `prepare` only, are dropped."""
  if extras is None:
    return None
  if extras.penalties is not None:
    p = extras.penalties
    extras = dataclasses.replace(extras, penalties=dataclasses.replace(
        p, in_flight=jnp.zeros_like(p.pending)))
  return jax.tree.map(lambda a: a.reshape(ranks, -1, *a.shape[1:]), extras)


def processed(logits, extras: Extras | None, sample_idx):
  """logits [B, V] float32, sample_idx [B] (index of the token being
  sampled) -> the logits the sampler draws from (unchanged for None)."""
  if extras is None:
    return logits
  rows = jnp.arange(logits.shape[0])[:, None]
  if extras.bias is not None:
    b = extras.bias
    add = jnp.where(sample_idx[:, None] < b.until, b.values, 0.0)
    logits = logits.at[rows, b.ids].add(add, mode="drop")
  if extras.counts is not None:
    logits = penalized(logits, extras.counts, extras.penalties)
  return logits


def penalized(logits, counts: Counts, p: Penalties):
  """vLLM / HF repetition (tokens of the prompt or output: logit / r if
  positive, else logit * r), then OpenAI frequency and presence (output
  counts c: logit - f * c - p * (c > 0)). A row with r = 1, f = p = 0
  keeps its logits bit for bit."""
  seen = counts.in_prompt | (counts.output > 0)
  r = jnp.where(seen, p.repetition[:, None], 1.0)
  logits = jnp.where(logits > 0, logits / r, logits * r)
  return (logits - p.frequency[:, None] * counts.output
          - p.presence[:, None] * (counts.output > 0))


def advance(extras: Extras | None, sampled) -> Extras | None:
  """After one step of a multi-step decode: its samples [B] join the
  output counts (the next step penalises them)."""
  if extras is None or extras.counts is None:
    return extras
  c = extras.counts
  output = c.output.at[jnp.arange(sampled.shape[0]), sampled].add(1.0)
  return dataclasses.replace(extras, counts=dataclasses.replace(c, output=output))


# ------------------------------------------------------------ host


def _bucket(n: int, minimum: int) -> int:
  return max(minimum, 1 << max(0, n - 1).bit_length())


def bias_entries(req) -> list[tuple[int, float, int]]:
  """A request's (token, value, until) entries now: its logit_bias, and
  -inf on its stop tokens while its output (pending tokens included) is
  short of min_tokens."""
  sp = req.sampling
  out = [(t, v, INT32_MAX) for t, v in sp.logit_bias]
  if len(req.output) + req.pending < sp.min_tokens:
    out += [(t, -np.inf, sp.min_tokens) for t in sorted(req.stop_ids)]
  return out


def _bias(rows, size: int) -> Bias | None:
  entries = [(row, bias_entries(req)) for row, _, req in rows]
  n = max(len(e) for _, e in entries)
  if n == 0:
    return None
  N = _bucket(n, MIN_BIAS_ENTRIES)
  ids = np.full((size, N), NONE, np.int32)
  values = np.zeros((size, N), np.float32)
  until = np.zeros((size, N), np.int32)
  for row, e in entries:
    if e:
      ids[row, :len(e)], values[row, :len(e)], until[row, :len(e)] = zip(*e)
  return Bias(ids, values, until)


def _penalties(rows, size: int, in_flight) -> Penalties | None:
  rows = [r for r in rows if r[2].sampling.has_penalties]
  if not rows:
    return None
  history = np.full((size, _bucket(max(req.num_known for _, _, req in rows), MIN_HISTORY)),
                    NONE, np.int32)
  ints = np.zeros((3, size), np.int32)  # prompt_len, pending, pending_at
  floats = np.zeros((3, size), np.float32)  # repetition, presence, frequency
  floats[0] = 1.0
  for row, base, req in rows:
    n, sp = len(req.prompt), req.sampling
    history[row, :n] = req.prompt
    history[row, n:req.num_known] = req.output
    ints[:, row] = n, req.pending, base + max(req.pending_row, 0)
    floats[:, row] = sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty
  return Penalties(history, *ints, *floats, in_flight=in_flight)


def step_extras(per_rank, seqs: int, slots: int, in_flight) -> Extras | None:
  """A plain step's `Extras` over every rank's chunks (rank r's chunk i is
  row r * seqs + i, as the step orders its ranks' rows), or None when
  none of its sampling chunks needs one. slots: rows of one rank's samples
  in in_flight (the previous dispatch's, on device)."""
  rows = [(r * seqs + i, r * slots, s.request) for r, scheduled in enumerate(per_rank)
          for i, s in enumerate(scheduled) if s.samples and s.request.sampling.uses_extras]
  if not rows:
    return None
  size = len(per_rank) * seqs
  bias, penalties = _bias(rows, size), _penalties(rows, size, in_flight)
  return None if bias is None and penalties is None else Extras(bias, penalties)


def program_key(extras: Extras | None):
  """What of an `Extras` picks the program: each part's presence and shapes."""
  if extras is None:
    return None
  return tuple(None if part is None else tuple(np.shape(a) for a in jax.tree.leaves(part))
               for part in (extras.bias, extras.penalties))
