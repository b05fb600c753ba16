"""The jitted engine step: one mixed batch of prefill chunks and decode tokens.

The scheduler flattens the step's tokens ([T], padded to a bucket) with
per-sequence metadata ([B], padded to a bucket): query start offsets, KV
lengths after the step, page tables ([B, pages], padded to a bucket). One
program runs the model over the page pool (writing the new K/V into the
pages), picks each sequence's last token, and samples it with that request's
temperature / top-k / top-p / seed as traced arrays. The pool is donated.
Steps whose requests ask for logprobs also return them (`engine.logprobs`);
steps whose requests set min_tokens, logit_bias or penalties take an
`extras` input that processes the logits before sampling
(`engine.sampling_extras`).

Bucketed dims, and so the compiled programs: (T, B, pages per sequence, max
query tokens of one sequence). `StepShapes` names one program.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.engine import sampling_extras
from jaxinfer.engine.logprobs import step_logprobs
from jaxinfer.engine.ranks import Ranks, expert_parallel, per_rank
from jaxinfer.engine.sampling import argmax, request_keys, sample
from jaxinfer.kv.contexts import PagedContext
from jaxinfer.models.moe_core import ExpertCount
from jaxinfer.models.transformer import VisualInputs, head, trunk_with_counts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
  tokens: jax.Array  # [T] int32
  from_prev: jax.Array  # [T] int32: row of the previous step's samples holding this
  #                       token (still on device when this step was built), or -1
  positions: jax.Array  # [T] int32: sequence position (the K/V slot)
  rope_positions: jax.Array  # [T] int32: rotary position on the text path (`images.step_rope`)
  token_seq: jax.Array  # [T] int32
  valid: jax.Array  # [T] bool
  cu_q_lens: jax.Array  # [B + 1] int32
  kv_lens: jax.Array  # [B] int32
  page_table: jax.Array  # [B, pages] int32
  logits_idx: jax.Array  # [B] int32: each sequence's last token in this step
  temperature: jax.Array  # [B] float32
  top_k: jax.Array  # [B] int32
  top_p: jax.Array  # [B] float32
  seeds: jax.Array  # [B] uint32
  sample_idx: jax.Array  # [B] int32: index of the token being sampled in its request


@dataclasses.dataclass(frozen=True)
class StepShapes:
  tokens: int
  seqs: int
  pages: int
  max_q: int


def bucket(n: int, cap: int, minimum: int = 1) -> int:
  """Smallest power of two >= n (at least `minimum`), capped at `cap`."""
  b = max(minimum, 1 << max(0, int(n - 1).bit_length()))
  return min(b, cap) if n <= cap else n


def page_bucket(n: int, cap: int) -> int:
  """Pages per sequence of a step's program: the smallest of 1, 2, 3, 4, 6,
  8, 12, 16, 24, ... (powers of two and 1.5x each) >= n, capped at `cap`.
  The XLA path gathers and attends over every bucketed page, so a finer
  bucket than `bucket`'s powers of two cuts that work by up to a third at
  the price of one more program per doubling of the context."""
  if n > cap:
    return n
  b = bucket(n, 1 << 62)  # the power of two
  three = 3 * b // 4  # the 1.5x step below it
  return min(three if three >= n else b, cap)


def pad(values, size: int, dtype, fill=0) -> np.ndarray:
  """values padded with fill to `size`."""
  out = np.full(size, fill, dtype)
  out[:len(values)] = values
  return out


def ragged_layout(shapes: StepShapes, q_lens, page_tables):
  """-> (cu_q_lens [B + 1], page table [B, pages], last row per sequence [B])."""
  B, P, b = shapes.seqs, shapes.pages, len(q_lens)
  cu = np.zeros(B + 1, np.int32)
  cu[1:b + 1] = np.cumsum(q_lens)
  cu[b + 1:] = cu[b]
  table = np.zeros((B, P), np.int32)
  for i, pages in enumerate(page_tables):
    table[i, :len(pages)] = pages
  last = np.zeros(B, np.int32)
  last[:b] = cu[1:b + 1] - 1
  return cu, table, last


def pad_batch(shapes: StepShapes, *, tokens, from_prev, positions, token_seq, q_lens, kv_lens,
              page_tables, temperature, top_k, top_p, seeds, sample_idx,
              rope_positions=None) -> StepBatch:
  """Host lists -> a padded StepBatch of numpy arrays (one transfer per step).
  rope_positions None: the sequence positions."""
  T, B = shapes.tokens, shapes.seqs
  n = len(tokens)
  cu, table, last = ragged_layout(shapes, q_lens, page_tables)
  return StepBatch(
      tokens=pad(tokens, T, np.int32), from_prev=pad(from_prev, T, np.int32, -1),
      positions=pad(positions, T, np.int32),
      rope_positions=pad(positions if rope_positions is None else rope_positions, T, np.int32),
      token_seq=pad(token_seq, T, np.int32), valid=pad(np.ones(n, bool), T, bool),
      cu_q_lens=cu, kv_lens=pad(kv_lens, B, np.int32), page_table=table, logits_idx=last,
      temperature=pad(temperature, B, np.float32), top_k=pad(top_k, B, np.int32),
      top_p=pad(top_p, B, np.float32, 1.0), seeds=pad(seeds, B, np.uint32),
      sample_idx=pad(sample_idx, B, np.int32))


def _add_load(load, counts):
  """Adds the trunk's counts [Lm, E] to its rows of load (MTP rows follow)."""
  return load if load is None else load.at[:counts.shape[0]].add(counts)


def _sample(logits, batch, greedy, k_cap, extras=None):
  """The rows' tokens from their logits [B, V], processed first by the
  step's extras (`sampling_extras.processed`; None: as they are)."""
  logits = sampling_extras.processed(logits, extras, batch.sample_idx)
  if greedy:  # every row has temperature 0: skip the filters' full-vocab sort
    return argmax(logits)
  keys = request_keys(batch.seeds, batch.sample_idx)
  return sample(logits, keys, batch.temperature, batch.top_k, batch.top_p, k_cap)


@functools.partial(jax.jit, static_argnames=("cfg", "max_q", "ep", "greedy", "k_cap", "mesh",
                                              "head_axis", "ranks", "logprobs"),
                   donate_argnames=("pool", "load"))
def step(cfg: ModelConfig, params, pool, batch: StepBatch, prev_sampled, load=None, visual=None,
         targets=None, *, max_q: int, ep=None, greedy: bool = False, k_cap: int = 0, mesh=None,
         head_axis=None, ranks: Ranks | None = None, logprobs: bool = False, extras=None):
  """One step on every rank -> (sampled tokens [n, S] int32 (row b of rank
  r: its sequence b; S = prev_sampled's fixed size), new pool, new load,
  logprobs).

  Every per-request input has a leading rank axis: batch fields [n, ...],
  prev_sampled [n, S] (the previous step's output, from which tokens not yet
  read back by the host are taken: async scheduling), visual and targets
  [n, ...]; n = 1 unless ranks (static, `ranks.Ranks`: attention DP) runs
  the step whole on each rank of its axes, over its own pages. load: int32
  [Lm, E] routed copies per expert so far (EPLB statistics, padding rows
  excluded), or None to record nothing. greedy (static): every row has
  temperature 0. k_cap (static): the top-k bound of the sampled rows
  (`sampling.top_k_cap`; 0: sort the vocabulary). mesh, head_axis (static):
  the mesh axis the layout splits attention heads and the pool over
  (`sharding.head_axis`), so attention runs per device in shard_map; None:
  no split. visual: a step's visual rows (`engine.images.Images.step_visual`):
  rope [n, 3, T] MRoPE positions, embeds [n, T, D] where mask [n, T]
  (visual tokens), deepstack [n, k, T, D]; None: text (RoPE at
  batch.rope_positions). logprobs (static) and targets [n, T] int32 (each
  row's next prompt token, or None): `logprobs.step_logprobs` of the sampled
  rows ([n, B, 1 + MAX_LOGPROBS]) and of every row against targets ([n, T,
  ...]), None when neither. extras: a `sampling_extras.Extras` (rows [n * B],
  rank-major) processing the logits before sampling, or None."""
  n = prev_sampled.shape[0]
  extras = sampling_extras.by_rank(
      sampling_extras.prepare(extras, prev_sampled.size, cfg.vocab_size), n)
  kw = dict(max_q=max_q, ep=expert_parallel(ep, ranks), greedy=greedy, k_cap=k_cap, mesh=mesh,
            head_axis=head_axis, logprobs=logprobs)

  def body(params, pool, ranked, _, load):
    batch, prev, visual, targets, extras = ranked
    sampled, pool, load, lp = _step(cfg, params, pool, batch, prev, load, visual, targets,
                                    extras=extras, **kw)
    return (sampled, lp), pool, None, load

  (sampled, lp), pool, _, load = per_rank(body, ranks, params, pool,
                                          (batch, prev_sampled, visual, targets, extras),
                                          load=load)
  return sampled, pool, load, lp


def _step(cfg, params, pool, batch, prev_sampled, load, visual, targets=None, *, max_q, ep,
          greedy, k_cap, mesh, head_axis, logprobs=False, extras=None):
  """One rank's step (batch fields without the rank axis)."""
  tokens = jnp.where(batch.from_prev >= 0, prev_sampled[jnp.maximum(batch.from_prev, 0)],
                     batch.tokens)
  ctx = PagedContext(positions=batch.positions, token_seq=batch.token_seq, valid=batch.valid,
                     cu_q_lens=batch.cu_q_lens, kv_lens=batch.kv_lens,
                     page_table=batch.page_table, max_q=max_q, mesh=mesh,
                     head_axis=head_axis, rope_positions=batch.rope_positions)
  x, caches, counts = trunk_with_counts(cfg, params, tokens[None], ctx, pool.model, ep,
                                      None if load is None else ExpertCount.LOGICAL,
                                      _visual_inputs(cfg, params, tokens[None],
                                                     jax.tree.map(lambda a: a[None], visual)))
  pool = pool.with_segments(caches)
  logits = head(cfg, params, x[0, batch.logits_idx])  # [B, V]
  sampled = _sample(logits, batch, greedy, k_cap, extras)
  return (jnp.zeros_like(prev_sampled).at[:sampled.shape[0]].set(sampled), pool,
          _add_load(load, counts), step_logprobs(cfg, params, logits, sampled, x[0], targets,
                                                 logprobs))


@functools.partial(jax.jit, static_argnames=("cfg", "num_steps", "ep", "greedy", "k_cap", "mesh",
                                              "head_axis", "ranks", "logprobs"),
                   donate_argnames=("pool", "load"))
def decode_steps(cfg: ModelConfig, params, pool, batch: StepBatch, prev_sampled, load=None, *,
                 num_steps: int, ep=None, greedy: bool = False, k_cap: int = 0, mesh=None,
                 head_axis=None, ranks: Ranks | None = None, logprobs: bool = False,
                 extras=None):
  """num_steps plain decode steps in one program (`EngineConfig.decode_steps`):
  batch is a decode-only `step` batch (one token per sequence), and step
  j > 0 decodes the tokens step j - 1 sampled, one position further,
  sampling token sample_idx + j of each request (so seeded sampling draws
  what single steps would). The host dispatches once for num_steps tokens
  per sequence. The caller provides pages for all num_steps positions.
  Arguments as `step`'s (batch fields and prev_sampled [n, ...]); extras:
  each step's samples count in the next steps' penalties.
  -> (sampled [num_steps, n, S] int32, new pool, new load,
  logprobs [num_steps, n, B, 1 + MAX_LOGPROBS] or None)."""
  n = prev_sampled.shape[0]
  extras = sampling_extras.by_rank(
      sampling_extras.prepare(extras, prev_sampled.size, cfg.vocab_size), n)
  kw = dict(ep=expert_parallel(ep, ranks), greedy=greedy, k_cap=k_cap, mesh=mesh,
            head_axis=head_axis, logprobs=logprobs)

  def body(params, pool, ranked, _, load):
    batch, prev, extras = ranked
    sampled, pool, load, lp = _decode_steps(cfg, params, pool, batch, prev, load, extras,
                                            num_steps, kw)
    return (sampled, lp), pool, None, load

  (sampled, lp), pool, _, load = per_rank(body, ranks, params, pool,
                                          (batch, prev_sampled, extras), load=load)
  steps_first = lambda a: jnp.moveaxis(a, 1, 0)  # [n, steps, ...] -> [steps, n, ...]
  return steps_first(sampled), pool, load, jax.tree.map(steps_first, lp)


def _decode_steps(cfg, params, pool, batch, prev_sampled, load, extras, num_steps: int, kw):
  """One rank's `decode_steps` (batch fields without the rank axis)."""
  live = batch.valid.astype(jnp.int32)  # padding rows stay where they are
  seq_live = (batch.kv_lens > 0).astype(jnp.int32)
  follow = jnp.where(batch.valid, batch.token_seq, -1)  # step j > 0: each row's own last sample
  B = batch.kv_lens.shape[0]

  def one(carry, j):
    pool, load, prev, extras = carry
    b = dataclasses.replace(
        batch, from_prev=jnp.where(j > 0, follow, batch.from_prev),
        positions=batch.positions + j * live, rope_positions=batch.rope_positions + j * live,
        kv_lens=batch.kv_lens + j * seq_live, sample_idx=batch.sample_idx + j)
    prev, pool, load, lp = _step(cfg, params, pool, b, prev, load, None, max_q=1,
                                 extras=extras, **kw)
    extras = sampling_extras.advance(extras, prev[:B])
    return (pool, load, prev, extras), (prev, lp)

  (pool, load, _, _), (sampled, lp) = jax.lax.scan(one, (pool, load, prev_sampled, extras),
                                                   jnp.arange(num_steps, dtype=jnp.int32))
  return sampled, pool, load, lp


def _visual_inputs(cfg: ModelConfig, params, tokens, visual) -> VisualInputs | None:
  """A multimodal step's rows, each with a leading batch axis (tokens [B, T];
  visual rope [B, 3, T], embeds [B, T, D], mask [B, T], deepstack
  [B, k, T, D]) -> the trunk's `VisualInputs`."""
  if visual is None:
    return None
  x = params["embed"][tokens].astype(cfg.compute_dtype())
  x = jnp.where(visual["mask"][..., None], visual["embeds"].astype(x.dtype), x)
  return VisualInputs(embeds=x, positions=jnp.moveaxis(visual["rope"], 1, 0),
                      deepstack=jnp.moveaxis(visual["deepstack"], 1, 0).astype(x.dtype))


def stack_batches(batches: list[StepBatch]) -> StepBatch:
  """Per-rank batches of equal shapes -> one batch with a leading rank axis
(one rank: views of its arrays, no copy in the per-token path)."""
  if len(batches) == 1:
    return jax.tree.map(lambda a: a[None], batches[0])
  return jax.tree.map(lambda *xs: np.stack(xs), *batches)
