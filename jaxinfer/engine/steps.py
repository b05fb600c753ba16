"""The engine step, whole, for every decoder: its host side, its program,
its ranks.

Read top to bottom, one decode step is here: `Runner.dispatch` takes every
rank's chunks from the scheduler (`scheduler.schedule_ranks`), picks the
program's bucketed shapes (`step_shapes`), builds the padded batch
(`rank_batch`, `pad_batch`, `stack_batches`; an MTP step's also its
`DraftRows`, `speculative.spec_batch`) and calls the jitted `step`, which runs the decoder
(`Plain()`, `MultiStep(n)`, `speculative.Mtp(k)`: small frozen values) over
the page pool: the model writes the new K/V into the pages, and each
sequence's last token is sampled (`_sample`); `Runner.read` brings the
tokens back and hands them to the scheduler (`Scheduler.apply`).
`Engine.step` calls `dispatch`, then `read`.

The program, `step(model, state, inputs, program)`: model the `StepModel`
(params; their placement static), state the donated `StepState` (pool,
expert load, MTP draft state), inputs the `StepInputs` pytree, program one
hashable `Program` (the decoder and the sampler's static choices). The
scheduler flattens the step's tokens ([T], padded to a bucket) with
per-sequence metadata ([B], padded to a bucket): query start offsets, KV
lengths after the step, page tables ([B, pages], padded to a bucket). Each
request's temperature / top-k / top-p / seed are traced arrays. The
optional inputs are None unless a request asks, and only then does their
code run: steps whose requests ask for logprobs also return them
(`engine.logprobs`); steps whose requests set min_tokens, logit_bias or
penalties take `extras` that process the logits before sampling
(`engine.sampling_extras`); steps with an image chunk take its visual rows
(`engine.images`). Bucketed dims, and so the compiled programs: (T, B,
pages per sequence, max query tokens of one sequence). `StepShapes` names
one program.

Attention-DP ranks are a dimension of every step. A step's per-request
inputs carry a leading rank axis [n, ...]: n = 1 on one device and under the
tensor-parallel layouts, n = the mesh's batch-axis size under dp_attn_ep,
where each rank owns whole requests, its own slice of the page pool's pages
and its own rows of the draft state. `per_rank` runs a step's one-rank
program on each rank: called directly for n = 1, in one `shard_map` over the
rank axes otherwise, where the weights stay as they are placed (each rank
sees its shards) and the routed experts stay expert-parallel inside it
(`moe_ep.InRankExpertParallel`: the ranks exchange tokens by collectives,
and their routing counts are summed over the ranks). So every decoder's
step is written once, for one rank; there is no second, ranked form.

The runner. `Runner` holds the `engine.core.HostCore` it schedules and its
own host state (the queue of steps in flight, whose last output holds the
previous samples; its counters; with MTP the draft slots and acceptance
counters, `speculative.Drafts`), never the Engine. The Engine's device
state goes in explicitly on each call, the `StepModel` and the `StepState`
the step donates (the page pool, the expert load, the MTP draft state);
the runner returns the new state, and the Engine keeps it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from jaxinfer import ops
from jaxinfer.config import ModelConfig
from jaxinfer.engine import images, logprobs, map_guard, sampling, sampling_extras, scheduler
from jaxinfer.engine.core import HostCore
from jaxinfer.engine.logprobs import step_logprobs
from jaxinfer.engine.sampling import argmax, request_keys, sample
from jaxinfer.engine.scheduler import Scheduled, bucket
from jaxinfer.kv.contexts import PagedContext
from jaxinfer.models import quant
from jaxinfer.models.moe_core import ExpertCount
from jaxinfer.models.transformer import VisualInputs, head, trunk_with_counts


# ------------------------------------------------------------ ranks

@dataclasses.dataclass(frozen=True)
class Ranks:
  """The attention-DP ranks of a step (jit-static: hashable).

  mesh, axes: the mesh and its batch axes the ranks run over.
  param_specs: (treedef, PartitionSpec per leaf) of the step's params as
  placed (`of`), the shard_map specs of the weights.
  """

  mesh: Mesh
  axes: tuple[str, ...]
  param_specs: tuple

  @classmethod
  def of(cls, params, mesh: Mesh, axes: tuple[str, ...]) -> "Ranks":
    """The ranks of `axes` for params placed on mesh."""
    leaves, treedef = jax.tree.flatten(params)
    specs = []
    for a in leaves:
      sh = getattr(a, "sharding", None)
      if not isinstance(sh, NamedSharding) or sh.mesh != mesh:
        raise ValueError(f"a step under attention DP: a parameter of shape {a.shape} is not "
                         f"placed on the engine's mesh ({sh})")
      specs.append(sh.spec)
    return cls(mesh, tuple(axes), (treedef, tuple(specs)))


def expert_parallel(ep, ranks: Ranks | None):
  """The experts' plan inside a step's one-rank program: ep as it is for one
  rank, its in-rank form (`ExpertParallel.in_rank`) under attention DP."""
  return ep if ranks is None or ep is None else ep.in_rank()


def per_rank(body, ranks: Ranks | None, params, pool, ranked, rows=None, load=None):
  """body(params, pool, ranked_one, rows, load) -> (out, pool, rows, load),
  one rank's program, run on every rank.

  ranked: a pytree of arrays with a leading rank axis [n, ...] (a step's
  batch, previous samples, targets...); body gets rank r's [...] and returns
  out, which comes back stacked [n, ...]. rows: arrays whose first axis is
  split into the ranks' contiguous blocks (the draft state [n * slots, ...]),
  passed to body as its block; None: none. load: the EPLB routing counts,
  the same on every rank (replicated; the in-rank experts sum them), or None.
  pool: the page pool, its pages split over the ranks.
  -> (out [n, ...], pool, rows, load)."""

  def one(params, pool, ranked, rows, load):
    out, pool, rows, load = body(params, pool, jax.tree.map(lambda a: a[0], ranked), rows, load)
    return jax.tree.map(lambda a: a[None], out), pool, rows, load

  if ranks is None:
    return one(params, pool, ranked, rows, load)
  treedef, leaves = ranks.param_specs
  rank = P(ranks.axes)
  pool_specs = pool.spec(pages=ranks.axes)
  return jax.shard_map(
      one, mesh=ranks.mesh,
      in_specs=(jax.tree.unflatten(treedef, leaves), pool_specs, rank, rank, P()),
      out_specs=(rank, pool_specs, rank, P()), check_vma=False,
  )(params, pool, ranked, rows, load)

# ------------------------------------------------------------ the program

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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftRows:
  """An MTP step's part of its inputs (`StepInputs.drafts`; `speculative`
  builds it): which rows hold drafts and where each sequence's draft
  state, emitted tokens and limits are. A decode block is [last token, K
  draft rows]; the drafts' values stay in the device draft state."""
  draft_j: jax.Array  # [T] int32: index of the state draft this row holds, or -1
  slot: jax.Array  # [B] int32: the sequence's row of the draft state
  num_draft: jax.Array  # [B] int32: drafts verified this step (0: prefill)
  samples: jax.Array  # [B] bool: the chunk reaches the end (tokens are emitted)
  from_state: jax.Array  # [B] bool: a decode block whose last token and positions come
  #                        from the draft state (dispatched before the last step was read)
  chunk_next: jax.Array  # [B] int32: the token after a prefill chunk that does not sample
  capacity: jax.Array  # [B] int32: positions the sequence's pages hold
  max_len: jax.Array  # [B] int32: tokens the request may reach (prompt + max_tokens, or
  #                     the context)
  prompt_len: jax.Array  # [B] int32


@dataclasses.dataclass(frozen=True)
class StepShapes:
  """A step program's bucketed shapes: tokens, sequences and pages per
  sequence, the most query tokens of one sequence (max_q), and fresh: every
  sequence is a fresh prompt chunk (from position 0, no cached prefix), so
  the model's attention library (`Backend.attention_library`) may attend
  it (set only for such a model: `fresh_shapes`)."""

  tokens: int
  seqs: int
  pages: int
  max_q: int
  fresh: bool = False



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


# The fewest pages per sequence a fixed-shape step program has
# (`fixed_page_bucket`): serve.py's warm-up compiled 144 programs, ~270 memory
# maps a decode program and ~680 a prompt program (a map or three per XLA:CPU
# kernel), 64,928 maps of Linux's 65,530 (docs/known_issues.md); the buckets
# of 1, 2 and 4 pages were a third of them. Shorter contexts attend over
# masked keys, which add exactly nothing.
MIN_FIXED_PAGES = 8


def fixed_page_bucket(n: int, cap: int) -> int:
  """Pages per sequence of a fixed-shape step program: the smallest power
  of two >= n and >= MIN_FIXED_PAGES, capped at `cap`."""
  return bucket(n, cap, minimum=min(MIN_FIXED_PAGES, cap))


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
  # Every row at once (a row at a time cost 1-2 us a sequence).
  lens = np.fromiter(map(len, page_tables), np.int64, b)
  total = int(lens.sum())
  if total:
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    table[np.repeat(np.arange(b), lens), np.arange(total) - starts] = np.fromiter(
        itertools.chain.from_iterable(page_tables), np.int32, total)
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
  if extras is not None:
    logits = sampling_extras.processed(logits, extras, batch.sample_idx)
  if greedy:  # every row has temperature 0: skip the filters' full-vocab sort
    return argmax(logits)
  keys = request_keys(batch.seeds, batch.sample_idx)
  return sample(logits, keys, batch.temperature, batch.top_k, batch.top_p, k_cap)


# The per-sequence batch fields the head and the sampler read.
_SAMPLING_FIELDS = ("logits_idx", "temperature", "top_k", "top_p", "seeds", "sample_idx")


def _head_and_sample(cfg, params, x, batch, greedy, k_cap, extras, keep_logits: bool):
  """(logits [B, V] of each sequence's last row of x [T, D], or None; the
  samples [B]). A program of 16 or more sequence slots (a fixed-shape
  prompt step has max_num_seqs) runs the head and the sampler over its
  first quarter of rows when no more sequences are real (real ones come
  first; rows past the quarter sample 0): bench_dense's 32-row head took
  10.8 ms of a prompt step with 4-8 sequences on the 2-core EPYC. Its
  logits are then not kept (keep_logits, static: the step's logprobs need
  them; extras too)."""
  def rows(r):
    sub = dataclasses.replace(batch, **{f: getattr(batch, f)[:r] for f in _SAMPLING_FIELDS})
    logits = head(cfg, params, x[sub.logits_idx])
    return logits, _sample(logits, sub, greedy, k_cap, extras)

  B = batch.logits_idx.shape[0]
  if keep_logits or extras is not None or B < 16:
    return rows(B)
  r = B // 4
  few = lambda: jnp.zeros(B, jnp.int32).at[:r].set(rows(r)[1].astype(jnp.int32))
  all_rows = lambda: rows(B)[1].astype(jnp.int32)
  return None, jax.lax.cond(jnp.sum(batch.kv_lens > 0) <= r, few, all_rows)


# ------------------------------------------------------------ the one step

@dataclasses.dataclass(frozen=True)
class Plain:
  """The plain decoder: one step over every sequence's chunk, one token
  sampled per sequence that reaches its end."""

  def run(self, model: "StepModel", state: "StepState", inputs: "StepInputs", program):
    """-> (sampled [n, S] int32 (row b of rank r: its sequence b; S =
    inputs.prev's fixed size), new state, logprobs)."""
    cfg, n = model.cfg, inputs.prev.shape[0]
    extras = inputs.extras
    if extras is not None:  # only steps whose requests set extras run their code
      extras = sampling_extras.by_rank(
          sampling_extras.prepare(extras, inputs.prev.size, cfg.vocab_size), n)
    kw = _sampler_kw(model, program)

    def body(params, pool, ranked, _, load):
      batch, prev, visual, targets, extras = ranked
      sampled, pool, load, lp = _step(cfg, params, pool, batch, prev, load, visual, targets,
                                      extras=extras, max_q=program.max_q, fresh=program.fresh,
                                      **kw)
      return (sampled, lp), pool, None, load

    (sampled, lp), pool, _, load = per_rank(
        body, model.ranks, model.params, state.pool,
        (inputs.batch, inputs.prev, inputs.visual, inputs.targets, extras), load=state.load)
    return sampled, dataclasses.replace(state, pool=pool, load=load), lp

  logprob_steps = 1  # `logprobs.split_ranks`' steps

  def rows(self, out, ranks: int) -> list[tuple]:
    """A read step's output (host) -> per rank, (each row's tokens [S, 1],)."""
    return [(r,) for r in np.moveaxis(np.asarray(out).reshape(1, ranks, -1), 0, -1)]


@dataclasses.dataclass(frozen=True)
class MultiStep:
  """n plain decode steps in one program (`EngineConfig.decode_steps`): the
  batch is decode-only (one token per sequence), and step j > 0 decodes the
  tokens step j - 1 sampled, one position further, sampling token
  sample_idx + j of each request (so seeded sampling draws what single
  steps would). The host dispatches once for n tokens per sequence and
  provides pages for all n positions. Extras: each step's samples count in
  the next steps' penalties."""

  n: int

  def run(self, model: "StepModel", state: "StepState", inputs: "StepInputs", program):
    """-> (sampled [n_steps, ranks, S] int32, new state, logprobs [n_steps,
    ranks, B, 1 + MAX_LOGPROBS] or None)."""
    cfg, n = model.cfg, inputs.prev.shape[0]
    extras = inputs.extras
    if extras is not None:
      extras = sampling_extras.by_rank(
          sampling_extras.prepare(extras, inputs.prev.size, cfg.vocab_size), n)
    kw = _sampler_kw(model, program)

    def body(params, pool, ranked, _, load):
      batch, prev, extras = ranked
      sampled, pool, load, lp = _decode_steps(cfg, params, pool, batch, prev, load, extras,
                                              self.n, kw)
      return (sampled, lp), pool, None, load

    (sampled, lp), pool, _, load = per_rank(body, model.ranks, model.params, state.pool,
                                            (inputs.batch, inputs.prev, extras), load=state.load)
    steps_first = lambda a: jnp.moveaxis(a, 1, 0)  # [n, steps, ...] -> [steps, n, ...]
    return (steps_first(sampled), dataclasses.replace(state, pool=pool, load=load),
            jax.tree.map(steps_first, lp))

  @property
  def logprob_steps(self) -> int:
    return self.n

  def rows(self, out, ranks: int) -> list[tuple]:
    """A read step's output [n, ranks, S] (host) -> per rank, (each row's
    n tokens [S, n],)."""
    return [(r,) for r in np.moveaxis(np.asarray(out).reshape(self.n, ranks, -1), 0, -1)]


@dataclasses.dataclass(frozen=True)
class Program:
  """A step's static part, one hashable value: the decoder (`Plain()`,
  `MultiStep(n)`, `speculative.Mtp(k)`), the most query tokens of one
  sequence (max_q), greedy (every row has temperature 0), k_cap (the top-k
  bound of the sampled rows, `sampling.top_k_cap`; 0: sort the vocabulary),
  logprobs (the sampled rows' logprobs are returned) and fresh (every
  sequence is a fresh prompt chunk: `StepShapes.fresh`)."""

  decoder: object
  max_q: int = 1
  greedy: bool = False
  k_cap: int = 0
  logprobs: bool = False
  fresh: bool = False


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepState:
  """The device state a step donates and returns anew, the Engine's: the
  page pool, the expert load (int32 [Lm, E] routed copies per expert so
  far, EPLB statistics; None: record nothing) and the MTP draft state
  ([ranks * slots, ...], each rank its block of rows; None without MTP)."""

  pool: object
  load: object = None
  draft: object = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
  """A step's inputs, every per-request one with a leading rank axis [n, ...]:
  batch, a `StepBatch` (every decoder's). The optional parts are None
  unless a request (or the decoder) asks: prev: the previous step's samples
  [n, S] (plain decoders: tokens not yet read back come from there, async
  scheduling); visual: the step's visual rows (`images.Images.step_visual`:
  rope [n, 3, T], embeds [n, T, D] where mask [n, T], deepstack [n, k, T,
  D]); targets [n, T] int32: each row's next prompt token, scored
  (`logprobs.step_logprobs`); extras: a `sampling_extras.Extras` (rows
  [n * B], rank-major) processing the logits before sampling; drafts: the
  MTP decoder's `DraftRows`."""

  batch: object
  prev: object = None
  visual: object = None
  targets: object = None
  extras: object = None
  drafts: object = None


@functools.partial(jax.jit, static_argnums=3, donate_argnums=1)
def step(model: "StepModel", state: StepState, inputs: StepInputs, program: Program):
  """The one jitted step, every decoder's: `program.decoder` runs the model
  (a `StepModel`: params, their experts' plan, attention-DP ranks, head
  split) over the donated state (pool, load, draft state) and the inputs,
  on every rank (`per_rank`). -> (out, new `StepState`, logprobs or None):
  out is the decoder's (`Plain`: sampled [n, S]; `MultiStep`: [steps, n,
  S]; `Mtp`: emitted [n, B, K + 3])."""
  return program.decoder.run(model, state, inputs, program)


def _sampler_kw(model: "StepModel", program: Program) -> dict:
  """The one-rank step's static keywords from the model and the program."""
  return dict(ep=expert_parallel(model.ep, model.ranks), greedy=program.greedy,
              k_cap=program.k_cap, logprobs=program.logprobs, **model.head_kw)


def _step(cfg, params, pool, batch, prev_sampled, load, visual, targets=None, *, max_q, ep,
          greedy, k_cap, mesh=None, head_axis=None, logprobs=False, extras=None, fresh=False):
  """One rank's plain step (batch fields without the rank axis; fresh:
  `Program.fresh`)."""
  tokens = jnp.where(batch.from_prev >= 0, prev_sampled[jnp.maximum(batch.from_prev, 0)],
                     batch.tokens)
  ctx = PagedContext(positions=batch.positions, token_seq=batch.token_seq, valid=batch.valid,
                     cu_q_lens=batch.cu_q_lens, kv_lens=batch.kv_lens,
                     page_table=batch.page_table, max_q=max_q, mesh=mesh,
                     head_axis=head_axis, fresh=fresh, rope_positions=batch.rope_positions)
  x, caches, counts = trunk_with_counts(cfg, params, tokens[None], ctx, pool.model, ep,
                                      None if load is None else ExpertCount.LOGICAL,
                                      _visual_inputs(cfg, params, tokens[None],
                                                     jax.tree.map(lambda a: a[None], visual)))
  pool = pool.with_segments(caches)
  logits, sampled = _head_and_sample(cfg, params, x[0], batch, greedy, k_cap, extras, logprobs)
  lp = (step_logprobs(cfg, params, logits, sampled, x[0], targets, logprobs)
        if logprobs or targets is not None else None)
  return (jnp.zeros_like(prev_sampled).at[:sampled.shape[0]].set(sampled), pool,
          _add_load(load, counts), lp)


def _decode_steps(cfg, params, pool, batch, prev_sampled, load, extras, num_steps: int, kw):
  """One rank's `MultiStep` (batch fields without the rank axis)."""
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
    if extras is not None:
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

# ------------------------------------------------------------ the host side: one runner

Events = list[tuple[int, list[int], bool]]  # (request id, new token ids, finished)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params"],
                   meta_fields=["cfg", "ep", "ranks", "heads"])
@dataclasses.dataclass(frozen=True)
class StepModel:
  """What an Engine's steps run (`step`'s first argument: the params its
  array leaves, the rest static): the model config, the params in the
  step's layout (`Engine._set_params`) and how they are placed: ep, the
  experts' plan (`moe_ep.plan_from_params`); ranks, the attention-DP ranks
  (`Ranks`, None without attention DP); heads, (("mesh", mesh),
  ("head_axis", axis)) when a mesh axis splits the attention heads
  (`sharding.head_axis`), else () (a dict is taken too). The Engine makes
  one per params (`rebalance` makes another)."""
  cfg: ModelConfig
  params: object
  ep: object = None
  ranks: Ranks | None = None
  heads: tuple = ()

  def __post_init__(self):
    if isinstance(self.heads, dict):
      object.__setattr__(self, "heads", tuple(sorted(self.heads.items())))

  @property
  def head_kw(self) -> dict:
    """heads as keywords (mesh=, head_axis=), or {}."""
    return dict(self.heads)


@dataclasses.dataclass
class StepCounts:
  """What a runner dispatched: steps, their real (unpadded) tokens, steps
  dispatched before the previous one was read, the distinct programs, and
  the host seconds spent dispatching steps whose program was compiled
  already (building the batch and the call; not the first call of a
  program, which compiles it) over the model steps they ran (a multi-step
  decode runs its n steps in one dispatch)."""
  steps: int = 0
  tokens: int = 0
  overlapped: int = 0
  programs: set = dataclasses.field(default_factory=set)
  host_s: float = 0.0
  host_steps: int = 0

  def record(self, program, num_tokens: int, overlapped: bool, host_s: float,
             model_steps: int = 1) -> None:
    if program in self.programs:
      self.host_s += host_s
      self.host_steps += model_steps
    self.programs.add(program)
    self.steps += 1
    self.tokens += num_tokens
    self.overlapped += overlapped


def sampling_fields(reqs) -> dict:
  """Per-request sampling fields, as the step batches take them."""
  return dict(temperature=[r.sampling.temperature for r in reqs],
              top_k=[r.sampling.top_k for r in reqs], top_p=[r.sampling.top_p for r in reqs],
              seeds=[r.sampling.seed % (1 << 32) for r in reqs])


def asks(per_rank) -> tuple[bool, bool, bool]:
  """What a step's requests ask beyond text and sampling, over every rank's
  chunks: (images, logprobs, sampling extras). A step none asks runs no code
  of `images`, `logprobs` or `sampling_extras`."""
  reqs = [s.request for sch in per_rank for s in sch]
  return (any(r.mm is not None for r in reqs),
          any(r.logprobs is not None or r.prompt_logprobs is not None for r in reqs),
          any(s.samples and s.request.sampling.uses_extras for sch in per_rank for s in sch))


def all_greedy(scheduled) -> bool:
  """Every request of the chunks has temperature 0 (the step skips sampling)."""
  return all(s.request.sampling.temperature == 0 for s in scheduled)


def sampler_mode(busy) -> tuple[bool, int]:
  """A step's static sampling arguments over its ranks' chunks: (greedy,
  k_cap) as `Program` takes them."""
  chunks = [s for scheduled in busy for s in scheduled]
  greedy = all_greedy(chunks)
  return greedy, 0 if greedy else sampling.top_k_cap(s.request.sampling for s in chunks)


def kernel_choice(cfg: ModelConfig, pool, *, num_seqs: int, pages_per_seq: int,
                  max_q: int, form=None) -> dict[str, str]:
  """The kernels the steps run, from shapes alone, as the ops pick them:
  the attention of decode-only steps ("decode") and of steps with up to
  max_q tokens a sequence ("mixed"), `ops.paged_kernel`'s names; for MoE
  models the unquantized experts' matmul ("grouped_matmul": "mosaic" or
  "xla", with why not Mosaic where the Backend asked for it), and with
  experts split on a CPU target (form: the steps' `WeightForm`) the split
  experts' path ("cpu_experts"), and where the steps may run the C++ CPU
  kernels (split experts open to them, or "panels" weights) their path
  ("cpu_kernels"); those two marked `NATIVE_CPU` here, read when asked
  (`kernels_now`), as the kernels build on first use."""
  k_pages, v_pages = jax.eval_shape(pool.layout.kernel_pools, pool[0])
  windows = cfg.window_choices()
  kw = dict(values_dim=None if v_pages is None else v_pages.shape[-1],
            latent_dim=cfg.kv_lora_rank if v_pages is None else None,
            window=0 if windows == (0,) else max(windows), sinks=cfg.attention_sinks,
            quantized=bool(pool.layout.scale_names), backend=cfg.backend)
  q_shape, dtype = (num_seqs, cfg.num_heads, k_pages.shape[-1]), cfg.compute_dtype()
  out = {name: ops.paged_kernel(q_shape, dtype, k_pages.shape, (num_seqs, pages_per_seq),
                                max_q=q, **kw)[0]
         for name, q in (("decode", 1), ("mixed", max_q))}
  if cfg.is_moe:
    out["grouped_matmul"] = _experts_kernel(cfg, dtype)
  if cfg.is_moe and form is not None and form.split_experts and not cfg.backend.on_gpu():
    # split experts run XLA's loop, or the C++ kernel where the form lets them
    quantized = cfg.quant is not None and any(cfg.quant.quantizes(f"experts.{w}")
                                              for w in ("w_gate", "w_up", "w_down"))
    native = form.native_experts and ops.cpu_experts_fit(cfg.compute_dtype(), quantized,
                                                         cfg.expert_bias)
    out["cpu_experts"] = NATIVE_CPU if native else "xla"
  if form is not None and not cfg.backend.on_gpu() and (
      form.panels or out.get("cpu_experts") == NATIVE_CPU):
    out["cpu_kernels"] = NATIVE_CPU
  return out


NATIVE_CPU = "native_cpu"  # `kernel_choice`'s mark: the C++ CPU kernels decide, when asked


def kernels_now(kernels: dict) -> dict:
  """`kernel_choice`'s kernels with the C++ CPU kernels' entries as they
  stand now, building nothing: "cpu_experts" `ops.cpu_experts_choice`,
  "cpu_kernels" `native_kernels.status()` ("native", "xla: <reason>",
  or "native on first use" before a step has traced them)."""
  out = dict(kernels)
  if out.get("cpu_experts") == NATIVE_CPU:
    out["cpu_experts"] = ops.cpu_experts_choice(True)
  if out.get("cpu_kernels") == NATIVE_CPU:
    out["cpu_kernels"] = ops.cpu_kernels.status()
  return out


def _experts_kernel(cfg: ModelConfig, dtype) -> str:
  """kernel_choice's "grouped_matmul": "mosaic_fused" where the experts'
  gate-up runs on our Mosaic kernel (the "fused_experts" trial; interpreted
  on a CPU target), else "mosaic" (jax's `ragged_dot_mgpu`) or "xla", with
  why not Mosaic where the Backend asked for it."""
  b = cfg.backend
  trial = "fused_experts" in b.trials and b.grouped_matmul_kernel() == "mosaic"
  if trial:
    q = cfg.quant if cfg.quant is not None and cfg.quant.quantizes("experts.w_gate") else None
    E, D, F = cfg.num_experts, cfg.d_model, cfg.moe_ffn_dim
    packed = None if q is None else quant.PACKING.get(q.method)
    why = (ops.mosaic_experts_fit(dtype, (E, D, F), dtype) if q is None else
           ops.mosaic_experts_fit(dtype, (E, F, D // 2 if packed else D),
                                  quant.VALUE_DTYPES[q.method],
                                  quant.FIXED_BLOCKS.get(q.method, q.block), packed))
    if why is None:
      return "mosaic_fused"
  kernel = b.grouped_matmul_kernel() if b.on_gpu() else "xla"
  if kernel == "mosaic":
    _, why = ops.mosaic_grouped_matmul((1, cfg.d_model), (1, cfg.d_model, cfg.moe_ffn_dim),
                                       dtype, dtype)
    kernel = f"xla ({why})" if why else kernel
  return kernel


# With fixed_prefill_shapes, a step with a prompt chunk pads its tokens to
# the budget or to a quarter of it. Each size is another program per page
# bucket and sampler, and each XLA:CPU program holds hundreds of memory maps
# (docs/known_issues.md): at serve.py's defaults four sizes (halvings) made
# 180 programs, 427 s of warm-up and 52,325 maps of Linux's 65,530.
PROMPT_TOKEN_DIVISORS = (4, 1)


def prompt_token_buckets(budget: int) -> list[int]:
  """The token counts a fixed-shape prompt step pads to: the budget and
  a quarter of it (none under 16, unless the budget is)."""
  return sorted({min(budget, max(16, budget // d)) for d in PROMPT_TOKEN_DIVISORS})


def prompt_step_shapes(config, tokens: int, pages: int, max_q_cap: int) -> StepShapes:
  """A fixed-shape prompt step's program shape (`step_shapes` at run time,
  `warmup.programs` ahead of it): every sequence, `tokens` of
  `prompt_token_buckets`, queries up to the chunk cap."""
  return StepShapes(tokens=tokens, seqs=config.max_num_seqs, pages=pages,
                    max_q=min(max_q_cap, tokens))


def step_shapes(core: HostCore, busy, max_q_cap: int) -> StepShapes:
  """The bucketed program shapes for a core's non-empty per-rank schedules.
  With fixed_prefill_shapes a step with a prompt chunk takes all sequences
  and the smallest of `prompt_token_buckets` that holds its tokens (a
  128-token prompt beside a few decodes does not pay for a 1024-token
  budget), its pages in powers of two (the XLA path gathers and attends
  over every page of the shape: the whole context would cost a short prompt
  a full-context attention); a decode-only step its sequences and pages in
  powers of two (`engine.warmup` compiles them all); pages at least
  MIN_FIXED_PAGES in both (`fixed_page_bucket`)."""
  c = core.config
  need = max(len(s.request.pages) for sch in busy for s in sch)
  pages = (fixed_page_bucket(need, core.max_pages_per_seq) if c.fixed_prefill_shapes else
           page_bucket(need, core.max_pages_per_seq))
  if c.fixed_prefill_shapes and any(s.is_prompt for sch in busy for s in sch):
    total = max(sum(s.num_tokens for s in sch) for sch in busy)
    tokens = next(t for t in prompt_token_buckets(c.max_num_batched_tokens) if t >= total)
    return prompt_step_shapes(c, tokens, pages, max_q_cap)
  if c.fixed_step_shapes:
    return StepShapes(tokens=c.max_num_batched_tokens, seqs=c.max_num_seqs, pages=pages,
                      max_q=max_q_cap)
  return StepShapes(
      tokens=bucket(max(sum(s.num_tokens for s in sch) for sch in busy),
                    c.max_num_batched_tokens),
      seqs=bucket(max(len(sch) for sch in busy), c.max_num_seqs),
      pages=pages, max_q=bucket(max(s.num_tokens for sch in busy for s in sch), max_q_cap))


def fresh_shapes(cfg, shapes: StepShapes, busy, n: int = 1, K: int = 0) -> StepShapes:
  """`shapes` marked fresh (`StepShapes.fresh`) where the model's Backend
  takes library attention (`Backend.attention_library`) and every chunk of
  the plain step (n == 1, K == 0: no multi-step decode or drafts) starts a
  prompt at position 0: the choice is made here once for the step, not by a
  traced branch in each layer."""
  if (n > 1 or K or shapes.max_q == 1 or cfg.backend.attention_library() is None
      or not all(s.start == 0 and s.num_draft == 0 and not s.from_state
                 for sch in busy for s in sch)):
    return shapes
  return dataclasses.replace(shapes, fresh=True)


def rank_batch(scheduled: list[Scheduled], shapes: StepShapes):
  """One rank's chunks -> (padded `StepBatch`, real tokens). A token sampled
  by the step still in flight is taken on device from its row there."""
  # The chunks' numbers and known tokens (a few each: never the whole
  # context) in comprehensions, then numpy over the tokens where a chunk
  # holds more than one.
  reqs = [s.request for s in scheduled]
  starts = [s.start for s in scheduled]
  q = [s.num_tokens for s in scheduled]
  got = [r.known(a, a + n) for r, a, n in zip(reqs, starts, q)]
  fields = dict(q_lens=q, kv_lens=[a + n for a, n in zip(starts, q)],
                page_tables=[r.pages for r in reqs], **sampling_fields(reqs),
                sample_idx=[len(r.output) + r.pending for r in reqs],
                rope_positions=(images.step_rope(scheduled)
                                if any(r.mm is not None for r in reqs) else None))
  # A token past its request's known ones was sampled by the previous
  # step, not read back yet: taken on device from its row there.
  if len(got) == sum(q):  # one token a chunk (decodes): no per-token arrays to build
    return pad_batch(shapes, tokens=[g[0] if g else 0 for g in got],
                     from_prev=[-1 if g else r.pending_row for g, r in zip(got, reqs)],
                     positions=starts, token_seq=range(len(q)), **fields), len(q)
  q = np.asarray(q, np.int32)
  first = np.repeat(np.cumsum(q) - q, q)
  offset = np.arange(len(first), dtype=np.int32) - first  # each token's place in its chunk
  later = offset >= np.repeat(np.fromiter(map(len, got), np.int32, len(got)), q)
  tokens = np.zeros(len(first), np.int32)
  tokens[~later] = list(itertools.chain.from_iterable(got))
  rows = np.fromiter([r.pending_row for r in reqs], np.int32, len(reqs))
  return pad_batch(
      shapes, tokens=tokens, from_prev=np.where(later, np.repeat(rows, q), -1),
      positions=np.repeat(np.asarray(starts, np.int32), q) + offset,
      token_seq=np.repeat(np.arange(len(q), dtype=np.int32), q), **fields), len(first)


def multi_step(schedulers, per_rank, n: int):
  """Every rank's chunks as n-step decodes (`Scheduler.plan_decode`, then
  `take_decode` once every rank can: an idle rank is all padding), or None."""
  if n < 2:
    return None
  plans = [sch.plan_decode(scheduled, n) for sch, scheduled in zip(schedulers, per_rank)]
  if any(p is None for p in plans):
    return None
  return [sch.take_decode(scheduled, p, n)
          for sch, scheduled, p in zip(schedulers, per_rank, plans)]


@dataclasses.dataclass(frozen=True)
class InFlight:
  """A dispatched step: each rank's chunks, its decoder and its output on
  device (the decoder's `step` output: samples [n, S], [steps, n, S], or an
  MTP step's emitted rows [n, B, K + 3]), and its logprobs if computed."""
  per_rank: list[list[Scheduled]]
  decoder: object
  out: jax.Array
  logprobs: dict | None = None


def _holds_prompt(done: InFlight) -> bool:
  """Whether a dispatched step has a prompt chunk."""
  return any(s.is_prompt for sch in done.per_rank for s in sch)


class Runner:
  """Steps on every rank together (an idle rank on an all-padding batch),
  every decoder's: it schedules, builds the inputs, dispatches `step` and
  keeps what is in flight until it reads it back into the schedulers
  (`Scheduler.apply`). It holds the host core, never the Engine nor its
  device state: the Engine's `StepModel` and `StepState` (pool, load,
  draft state) go in on each `dispatch`, which returns the new state.

  Plain decoding: with async scheduling step N + 1 is dispatched before step
  N's samples are read; the tokens it needs from step N come from the device
  (the previous samples: the output of the step in flight, kept with it).
  drafts: MTP speculation's host side (`speculative.Drafts`: the draft-slot
  map and the acceptance counters), or None: with it a decode-only batch is
  pipelined (the next step dispatched before the one in flight is read, its
  last tokens and positions left to the device: `Scheduler.plan_continue`),
  and anything else (admissions, prefill chunks, preemption, a new draft
  budget K) reads the step in flight first and schedules with K as the
  draft budget. images: the Engine's `images.Images` (a step's visual rows)."""

  def __init__(self, core: HostCore, images: images.Images, drafts=None):
    self.core, self.images, self.drafts = core, images, drafts
    self.counts = StepCounts()
    self.in_flight: collections.deque[InFlight] = collections.deque()
    self._prev_sampled = jnp.zeros((core.num_ranks, core.config.max_num_seqs), jnp.int32)
    # The last dispatch's samples, every decode step of a multi-step one:
    # where penalties find the tokens still in flight (`sampling_extras`).
    self._prev_out = self._prev_sampled
    self._keep = 0  # steps `read` leaves in flight
    self._events: Events = []  # read by `dispatch`, for `read`
    self.guard = map_guard.ProgramGuard(core.config.max_map_fraction)

  def dispatch(self, model: StepModel, state: StepState) -> StepState:
    """Schedules every rank and dispatches their step (when any has a chunk)
    -> the new state. The events of steps it had to read first wait for
    `read`."""
    core = self.core
    self._events = []
    if self.drafts is None:
      if core.config.async_scheduling and self.in_flight and _holds_prompt(self.in_flight[-1]):
        # Behind a prompt step nothing is dispatched until it is read: the
        # requests that arrive while it runs join the next step (a burst split
        # by its arrival times is one prompt step, and the running sequences'
        # next decode rides in it), at the cost of one host gap of a few ms
        # after a step of hundreds.
        self._keep = 0
        return state
      per_rank, K = scheduler.schedule_ranks(core.schedulers, [0] * core.num_ranks,
                                             core.config), 0
    else:
      per_rank, K, self._events, draft = self.drafts.schedule(
          core, self.in_flight, lambda keep: self._read(keep, state.draft), state.draft)
      state = dataclasses.replace(state, draft=draft)
    scheduled = any(per_rank)
    self._keep = 1 if scheduled and core.config.async_scheduling else 0
    if not scheduled:
      return state
    t0 = time.perf_counter()
    n = core.config.decode_steps
    multi = multi_step(core.schedulers, per_rank, n) if self.drafts is None else None
    if multi is None:
      return self._dispatch(model, state, per_rank, t0, K=K)
    return self._dispatch(model, state, multi, t0, n)

  def read(self, draft=None) -> Events:
    """The events of the steps `dispatch` read, then of those in flight but,
    with async scheduling, the one `dispatch` just dispatched. draft: the
    Engine's draft state (MTP: a finished hand-over request's row is copied
    from it)."""
    events, self._events = self._events, []
    return events + self._read(self._keep, draft)

  def warm(self, model: StepModel, state: StepState, programs,
           map_fraction: float = 1.0) -> tuple[int, int, StepState]:
    """Compiles each program ((shapes, decode steps, greedy, k_cap), as
    `warmup.programs` lists them) by running it on all-padding batches,
    leaving the counters other than the compiled programs as they were
    (`Engine.warmup`); stops where the process holds map_fraction of
    vm.max_map_count memory maps (`map_guard.room`). -> (programs compiled
    now, programs left out, new state)."""
    if self.in_flight or self.core.has_unfinished():  # their events would be lost
      raise RuntimeError("Engine.warmup: requests are unfinished (warm up while idle)")
    before = dataclasses.replace(self.counts, programs=set())
    known = len(self.counts.programs)
    idle = [[] for _ in range(self.core.num_ranks)]
    done = 0
    for shapes, n, greedy, k_cap in programs:
      if not map_guard.room(map_fraction):
        break
      state = self._dispatch(model, state, idle, time.perf_counter(), n,
                             program=(shapes, greedy, k_cap))
      self._read(0, state.draft)
      done += 1
    compiled = self.counts.programs
    self.counts = dataclasses.replace(before, programs=compiled)
    return len(compiled) - known, len(programs) - done, state

  def _inputs(self, per_rank, shapes: StepShapes, n: int, K: int):
    """-> (the step's `StepInputs`, its decoder, its real tokens, want: the
    logprobs asked (sampled rows, prompt rows), its extras' program key)."""
    busy = [s for sch in per_rank for s in sch]
    images_, lp_, extras_ = asks(per_rank)
    want = logprobs.wanted(busy) if lp_ else (False, False)
    targets = logprobs.step_targets(per_rank, shapes.tokens) if want[1] and n == 1 else None
    if self.drafts is not None:
      batch, rows, tokens = self.drafts.batch(self.core, per_rank, shapes)
      return (StepInputs(batch, targets=targets, drafts=rows), self.drafts.decoder(K), tokens,
              want, None)
    built = [rank_batch(sch, shapes) for sch in per_rank]
    extras = (sampling_extras.step_extras(per_rank, shapes.seqs, self.core.config.max_num_seqs,
                                          self._prev_out) if extras_ else None)
    inputs = StepInputs(
        stack_batches([b for b, _ in built]), self._prev_sampled,
        visual=self.images.step_visual(per_rank, shapes.tokens) if images_ and n == 1 else None,
        targets=targets, extras=extras)
    return (inputs, MultiStep(n) if n > 1 else Plain(), n * sum(k for _, k in built), want,
            None if extras is None else sampling_extras.program_key(extras))

  def _dispatch(self, model: StepModel, state: StepState, per_rank, t0: float, n: int = 1,
                program=None, K: int = 0) -> StepState:
    """One program over every rank's chunks: a step, n decode steps
    (`MultiStep`) of `multi_step`'s chunks, or an MTP step with K drafts ->
    the new state. program: (shapes, greedy, k_cap) for chunks that do not
    say (`warm`'s empty ones)."""
    core = self.core
    busy = [sch for sch in per_rank if sch]
    shapes, greedy, k_cap = program or (
        fresh_shapes(model.cfg, step_shapes(core, busy, core.chunk + K), busy, n, K),
        *sampler_mode(busy))
    inputs, decoder, tokens, want, extras_key = self._inputs(per_rank, shapes, n, K)
    key = ((shapes, K, greedy, want, k_cap) if self.drafts is not None else
           (shapes, n, greedy, want, extras_key, k_cap))
    self.guard.before(key)
    out, state, lp = step(model, state, inputs,
                          Program(decoder, max_q=1 if n > 1 else shapes.max_q, greedy=greedy,
                                  k_cap=k_cap, logprobs=want[0], fresh=shapes.fresh))
    if self.drafts is None:
      self._prev_sampled = out[-1] if n > 1 else out
      self._prev_out = out
    for sch, rank_scheduled in zip(core.schedulers, per_rank):
      sch.on_dispatch(rank_scheduled)
    self.counts.record(key, tokens, bool(self.in_flight), time.perf_counter() - t0, n)
    self.in_flight.append(InFlight(per_rank, decoder, out, lp))
    return state

  def _read(self, keep: int, draft=None) -> Events:
    """Reads the steps in flight, oldest first, leaving `keep`."""
    events, ranks = [], self.core.num_ranks
    while len(self.in_flight) > keep:
      done = self.in_flight.popleft()
      # The one device-to-host read: the tokens, and their logprobs if computed.
      out, lp = jax.device_get((done.out, done.logprobs))
      lps = ([None] * ranks if lp is None else
             logprobs.split_ranks(lp, ranks, done.decoder.logprob_steps))
      for sch, rank_done, rows, rank_lp in zip(self.core.schedulers, done.per_rank,
                                               done.decoder.rows(out, ranks), lps):
        args = [a[:len(rank_done)] for a in rows]
        if self.drafts is not None:  # the acceptance counted: -> (tokens, emitted, K)
          args = self.drafts.after_read(rank_done, args, self.counts)
        events += (sch.apply(rank_done, *args) if rank_lp is None else
                   logprobs.applied(rank_lp, sch.apply, rank_done, *args))
        if self.drafts is not None:
          self.drafts.keep_handover(self.core, rank_done, draft)
    return events

  def stats(self) -> dict:
    return {} if self.drafts is None else self.drafts.stats()

  def release(self) -> None:
    """Drops what it holds on device (`Engine.release`)."""
    self.in_flight.clear()
    self._prev_sampled = self._prev_out = None
