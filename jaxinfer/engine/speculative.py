"""Speculative decoding with the model's own MTP modules: one jitted program
per step drafts, verifies and accepts, with no host sync inside.

A step runs the usual token-flattened batch (prefill chunks and decodes)
through the target model. A decode row block is [last token, d_1 .. d_K]:
the K tokens the MTP chain drafted in the previous step, read from the
device-resident draft state (never copied to the host). Then, per sequence:

  verify   target logits at the K + 1 positions (one forward, the paged
           kernels' Q > 1 path)
  accept   greedy rows: d_j is accepted while it equals the target argmax;
           sampled rows: d_j is accepted with probability min(1, p(d_j) /
           q(d_j)), and the first rejection resamples from norm(max(0, p -
           q)) (lossless: the output follows the target's distribution). All
           accepted: a bonus token from p at K + 1. So 1 .. K + 1 tokens per
           sequence per step. The K/V of rejected positions is left beyond the
           sequence's length, where the next step overwrites it.
  MTP KV   MTP module 1 runs over every row of the step (its inputs: the
           target's hidden state and the row's next token, now known), so its
           cache at positions up to the accepted frontier stays in step.
  draft    from the frontier, the chain drafts K new tokens: depth k runs
           module min(k, M) at the frontier position + k - 1 on the previous
           depth's hidden and draft (writing K/V there, overwritten once those
           positions are accepted). Greedy rows take the argmax, sampled rows
           sample q (the request's temperature / top-k / top-p) and keep q for
           the next step's acceptance test.

The MTP modules' pages are the target's: the pool holds one more stacked
entry (the MTP layers) indexed by the same page tables.

Pipelining: the state also keeps each slot's last emitted token and its
position. A decode block marked `from_state` takes its token and positions
from there, so the engine can dispatch step N + 1 before it has read how
many tokens step N accepted (the host only reserves pages for the most step
N could have accepted, and never waits on the device between the two).

The host side (`Drafts`, the end of this file) is what `steps.Runner` holds
with MTP: each request's row of the draft state (`DraftSlots`), the
acceptance counters, and the batch's `steps.DraftRows` (`spec_batch`). The
draft state itself is the Engine's, in its `steps.StepState`. A decode-only
batch is pipelined with async scheduling; anything else (admissions,
prefill chunks, preemption, a new draft budget K) reads the step in flight
first and schedules as usual, with K as the draft budget.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.engine import scheduler, steps
from jaxinfer.engine.core import HostCore
from jaxinfer.engine.logprobs import step_logprobs
from jaxinfer.engine.scheduler import Scheduled
from jaxinfer.engine.steps import (DraftRows, StepBatch, expert_parallel, per_rank,
                                   sampling_fields)
from jaxinfer.engine.sampling import argmax, filter_logits, request_keys
from jaxinfer.kv.contexts import PagedContext
from jaxinfer.models import mtp
from jaxinfer.models.layers import rope_cos_sin
from jaxinfer.models.moe_core import ExpertCount
from jaxinfer.models.transformer import head, trunk_with_counts


@dataclasses.dataclass(frozen=True, kw_only=True)
class MTPConfig:
  """Speculative decoding with the model's MTP modules.

  num_draft_tokens: K, tokens drafted per step (1..8).
  batch_schedule: (batch size, K) pairs: from that many running sequences
    on, draft that many tokens instead (0: speculation off). Speculation pays
    less as the batch grows. The default drafts 2 from 16 sequences, where
    `experiments/bench_speculative.py` measured K = 2 ahead of K = 3 on the
    default model on CPU (1.39x vs 1.31x over plain decoding;
    results/bench_speculative.json). Larger batches were not measured.
  """

  num_draft_tokens: int = 3
  batch_schedule: tuple[tuple[int, int], ...] = ((16, 2),)

  def __post_init__(self):
    if not isinstance(self.num_draft_tokens, int) or not 1 <= self.num_draft_tokens <= 8:
      raise ValueError(f"MTPConfig: num_draft_tokens must be an int in [1, 8], "
                       f"got {self.num_draft_tokens!r}")
    for pair in self.batch_schedule:
      if len(pair) != 2 or pair[0] < 1 or not 0 <= pair[1] <= 8:
        raise ValueError(f"MTPConfig: batch_schedule entries must be (batch >= 1, K in "
                         f"[0, 8]), got {pair!r}")

  def draft_tokens_for(self, batch: int) -> int:
    k = self.num_draft_tokens
    for b, kb in sorted(self.batch_schedule):
      if batch >= b:
        k = min(kb, self.num_draft_tokens)
    return k

  def draft_tokens_of(self, sch, max_num_seqs: int) -> int:
    """The drafts K of a rank's next speculative step, by its batch (a
    `Scheduler`'s running and waiting requests, at most max_num_seqs)."""
    return self.draft_tokens_for(min(len(sch.running) + len(sch.waiting), max_num_seqs))


def zero_state(cfg: ModelConfig, slots: int, max_draft: int, ranks=None) -> dict:
  """`init_state`, placed: under attention DP (`steps.Ranks`) each rank's
  block of rows on its devices (as the pool's pages are split)."""
  state = init_state(cfg, slots, max_draft)
  if ranks is None:
    return state
  return jax.device_put(state, NamedSharding(ranks.mesh, P(ranks.axes)))


def init_state(cfg: ModelConfig, slots: int, max_draft: int) -> dict:
  """Per-slot drafts [S, K], their draft distributions q [S, K, V], and the
  last emitted token [S] with its position [S] (not in the KV cache yet)."""
  return dict(drafts=jnp.zeros((slots, max_draft), jnp.int32),
              q=jnp.zeros((slots, max_draft, cfg.vocab_size), jnp.float32),
              last=jnp.zeros((slots,), jnp.int32), pos=jnp.zeros((slots,), jnp.int32))


@functools.partial(jax.jit, static_argnums=(2,))
def take_drafts(state, row, num: int) -> dict:
  """Row `row`'s first `num` drafts with their q, its last token and
  position: what a hand-over carries to another engine (`put_drafts`)."""
  return dict(drafts=state["drafts"][row, :num], q=state["q"][row, :num],
              last=state["last"][row], pos=state["pos"][row])


@functools.partial(jax.jit, donate_argnums=(0,))
def put_drafts(state, row, drafts: dict) -> dict:
  """Writes `take_drafts` output (from any engine, up to this state's K
  drafts) into row `row`."""
  k = min(state["drafts"].shape[1], drafts["drafts"].shape[0])
  return dict(drafts=state["drafts"].at[row, :k].set(drafts["drafts"][:k]),
              q=state["q"].at[row, :k].set(drafts["q"][:k]),
              last=state["last"].at[row].set(drafts["last"]),
              pos=state["pos"].at[row].set(drafts["pos"]))


def _probs(logits, temperature, top_k, top_p, k_cap: int = 0):
  """[B, V] -> the sampling distribution (one-hot argmax for greedy rows);
  k_cap (static): `filter_logits`' top-k fast path."""
  greedy = jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
  sampled = jax.nn.softmax(filter_logits(logits, temperature, top_k, top_p, k_cap), axis=-1)
  return jnp.where((temperature > 0)[:, None], sampled, greedy)


def _draw(keys, probs):
  """One token per row from probs [B, V] (rows need not be normalised)."""
  return jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(keys, probs).astype(jnp.int32)


def _prefix_len(ok):
  """ok [B, K] bool -> [B]: how many leading entries are True (the accepted drafts)."""
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def _accept_greedy(logits, drafts, num_draft):
  """Greedy: accept the longest prefix of drafts equal to the target's argmax.
  The first mismatch (or the bonus position K + 1) emits the argmax there."""
  K1 = logits.shape[1]
  target = argmax(logits)  # [B, K + 1]
  n_acc = _prefix_len((drafts == target[:, :-1]) & (jnp.arange(K1 - 1) < num_draft[:, None]))
  # Accepted drafts equal the target there, so the target row is the output.
  return target, n_acc


def _accept_sampled(p, logits, drafts, q, num_draft, temperature, k_u):
  """Draft d_j ~ q is kept with probability min(1, p(d_j) / q(d_j)): u q < p
  for u ~ U[0, 1). Greedy rows of a mixed batch keep the argmax rule.
  p [B, K + 1, V], q [B, K, V] -> accepted drafts [B] (the prefix before the
  first rejection)."""
  K = drafts.shape[1]
  p_d = jnp.take_along_axis(p[:, :K], drafts[..., None], -1)[..., 0]  # [B, K]
  q_d = jnp.take_along_axis(q, drafts[..., None], -1)[..., 0]
  u = jax.vmap(lambda k: jax.random.uniform(k, (K,)))(k_u)
  ok_sampled = u * q_d < p_d  # u < p / q without dividing by zero
  ok_greedy = drafts == argmax(logits[:, :K])
  ok = jnp.where((temperature > 0)[:, None], ok_sampled, ok_greedy)
  return _prefix_len(ok & (jnp.arange(K) < num_draft[:, None]))


def _correction(p, q, n_acc, num_draft):
  """The distribution of the token after the accepted drafts. On a rejection
  at j: norm(max(0, p_j - q_j)), which makes the emitted token p-distributed
  (P(x) = q(x) min(1, p/q) + (1 - sum min(p, q)) norm(max(0, p - q))(x) = p(x)).
  All K accepted: the bonus token from p at K + 1. [B, V], unnormalised."""
  p_last = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]  # [B, V]
  if not q.shape[1]:
    return p_last
  q_last = jnp.take_along_axis(jnp.pad(q, ((0, 0), (0, 1), (0, 0))), n_acc[:, None, None],
                               axis=1)[:, 0]
  residual = jnp.maximum(p_last - q_last, 0.0)
  # p == q exactly leaves nothing to resample from: then any draw from p is right.
  residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_last)
  return jnp.where((n_acc < num_draft)[:, None], residual, p_last)


def accept(logits, drafts, q, num_draft, temperature, top_k, top_p, keys, greedy=False,
           k_cap: int = 0):
  """Verification. logits [B, K + 1, V] (target at the K + 1 positions),
  drafts [B, K], q [B, K, V], num_draft [B]. -> (tokens [B, K + 1], accepted
  drafts [B]); row b emits tokens[b, :accepted + 1]. greedy (static): every
  row has temperature 0, so q, the keys and the filters go unused. k_cap
  (static): the filters' top-k fast path (`sampling.top_k_cap`)."""
  if greedy:
    return _accept_greedy(logits, drafts, num_draft)
  B, K1, V = logits.shape
  K = K1 - 1
  flat = lambda a: jnp.repeat(a, K1, axis=0)
  p = _probs(logits.reshape(B * K1, V), flat(temperature), flat(top_k), flat(top_p), k_cap)
  p = p.reshape(B, K1, V)
  split = jax.vmap(lambda k: jax.random.split(k, 2))(keys)
  k_u, k_final = split[:, 0], split[:, 1]
  n_acc = (_accept_sampled(p, logits, drafts, q, num_draft, temperature, k_u) if K
           else jnp.zeros((B,), jnp.int32))
  p_last = _correction(p, q, n_acc, num_draft)
  last = jnp.where(temperature > 0, _draw(k_final, p_last), argmax(p_last))
  tokens = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
  tokens = jnp.where(jnp.arange(K1) == n_acc[:, None], last[:, None].astype(jnp.int32), tokens)
  return tokens, n_acc


@dataclasses.dataclass(frozen=True)
class _Rows:
  """The step's rows once pipelined blocks are resolved against the state."""
  tokens: jax.Array  # [T]
  positions: jax.Array  # [T]
  ctx: PagedContext
  num_draft: jax.Array  # [B]: drafts verified (cut at max_len for pipelined blocks)
  base: jax.Array  # [B]: each block's first verified row


def _resolve_rows(batch: StepBatch, d: DraftRows, state, max_q, mesh, head_axis) -> _Rows:
  """Pipelining: a `from_state` decode block takes its last token and its
  positions from the draft state (the host dispatched it before reading the
  step in flight), and its drafts are cut where the request would pass
  max_len. Draft rows read their tokens from the state too."""
  T = batch.tokens.shape[0]
  b = batch.token_seq
  j_row = jnp.arange(T) - batch.cu_q_lens[b]  # row index within its sequence's block
  pos0 = state["pos"][d.slot]
  num_draft = jnp.where(d.from_state,
                        jnp.clip(jnp.minimum(d.num_draft, d.max_len - pos0 - 2), 0),
                        d.num_draft)
  fs = d.from_state[b]
  positions = jnp.where(fs, pos0[b] + j_row, batch.positions)
  valid = batch.valid & (~fs | (j_row <= num_draft[b]))
  # The kernels place a block's rows at the end of its KV length, so a cut
  # block keeps its full length; its cut rows are invalid (their K/V goes to
  # the null page) and, being later in the causal order, unseen by the rest.
  kv_lens = jnp.where(d.from_state, pos0 + d.num_draft + 1, batch.kv_lens)
  row_slot = d.slot[b]
  tokens = jnp.where(d.draft_j >= 0,
                     state["drafts"][row_slot, jnp.maximum(d.draft_j, 0)], batch.tokens)
  tokens = jnp.where(fs & (j_row == 0), state["last"][row_slot], tokens)
  ctx = PagedContext(positions=positions, token_seq=b, valid=valid, cu_q_lens=batch.cu_q_lens,
                     kv_lens=kv_lens, page_table=batch.page_table, max_q=max_q, mesh=mesh,
                     head_axis=head_axis)
  base = jnp.clip(batch.logits_idx - d.num_draft, 0, T - 1)
  return _Rows(tokens, positions, ctx, num_draft, base)


def _verify(cfg, params, x, rows: _Rows, batch: StepBatch, d: DraftRows, state, K: int,
            greedy: bool, k_cap: int):
  """Target logits at each block's K + 1 rows (the last known token and its
  drafts: one forward, the kernels' Q > 1 path), then `accept`.
  -> (tokens [B, K + 1], accepted [B], draft keys [B] or None, the logits)."""
  T = x.shape[0]
  idx = jnp.clip(rows.base[:, None] + jnp.arange(K + 1), 0, T - 1)  # [B, K + 1]
  logits = head(cfg, params, x[idx])  # [B, K + 1, V]
  drafts_in = state["drafts"][d.slot, :K]
  if greedy:
    q_in = k_acc = k_draft = None
  else:
    # Keyed by the index of the request's first token emitted this step.
    keys = request_keys(batch.seeds, rows.positions[rows.base] + 1 - d.prompt_len)
    split = jax.vmap(lambda k: jax.random.split(k, 2))(keys)
    k_acc, k_draft = split[:, 0], split[:, 1]
    q_in = state["q"][d.slot, :K]
  out, n_acc = accept(logits, drafts_in, q_in, rows.num_draft, batch.temperature, batch.top_k,
                      batch.top_p, k_acc, greedy, k_cap)
  return out, n_acc, k_draft, logits


def _add_mtp_load(cfg, mtp_load, load, m: int, counts):
  """Adds module m's routed copies to its EPLB row (after the trunk's)."""
  if mtp_load is None or counts is None:
    return load
  return load.at[load.shape[0] - cfg.num_mtp_layers + m].add(counts)


def _catch_up(cfg, params, x, rows: _Rows, batch: StepBatch, d: DraftRows, out, mtp_pool, ep,
              mtp_load, load):
  """MTP module 1 over every row of the step, input (h_i, t_{i + 1}): the
  next token is the next row's, the step's output inside a verified window,
  or `chunk_next` after a prefill chunk that does not sample. Its K/V up to
  the accepted frontier stays in step with the target's. mtp_load: the load
  when it has rows for the MTP modules (their routing is counted), else
  None. -> (h [T, D], pool, load)."""
  T, K = x.shape[0], out.shape[1] - 1
  r = jnp.arange(T)
  b = batch.token_seq
  jr = r - rows.base[b]
  in_window = d.samples[b] & (jr >= 0) & (jr <= rows.num_draft[b])
  nxt = rows.tokens[jnp.minimum(r + 1, T - 1)]
  nxt = jnp.where(in_window, out[b, jnp.clip(jr, 0, K)], nxt)
  nxt = jnp.where((r == batch.logits_idx[b]) & ~d.samples[b], d.chunk_next[b], nxt)
  cos, sin = rope_cos_sin(cfg, rows.positions[None])
  m = mtp.module_for(cfg, 1)
  h, mtp_pool, counts = mtp.apply_with_counts(
      cfg, params, m, x[None], nxt[None], cos, sin, rows.ctx, mtp_pool, ep,
      None if mtp_load is None else ExpertCount.LOGICAL)
  return h[0], mtp_pool, _add_mtp_load(cfg, mtp_load, load, m, counts)


def _draft(cfg, params, h, pos, batch: StepBatch, d: DraftRows, mtp_pool, ep, k_draft, mtp_load,
           load, *, K, greedy, k_cap, mesh, head_axis):
  """From the accepted frontier (h [B, D] at position pos [B]) the chain
  drafts K tokens: depth k runs module min(k, M) at pos + k - 1 on the
  previous depth's hidden and draft, writing K/V there (overwritten once
  those positions are accepted). Greedy rows take the argmax; sampled rows
  draw from q (the request's filters) and keep q for the next acceptance
  test. mtp_load as in `_catch_up`. -> (drafts: K of [B], qs: K of [B, V] or []
  when greedy, pool, load)."""
  B = h.shape[0]
  drafts, qs = [], []
  for k in range(1, K + 1):
    m = mtp.module_for(cfg, k)
    if k > 1:
      pos_k = pos + k - 1
      ok = d.samples & (pos_k < d.capacity)
      ctx_k = PagedContext(positions=pos_k, token_seq=jnp.arange(B, dtype=jnp.int32), valid=ok,
                           cu_q_lens=jnp.arange(B + 1, dtype=jnp.int32),
                           kv_lens=jnp.where(ok, pos_k + 1, 0), page_table=batch.page_table,
                           max_q=1, mesh=mesh, head_axis=head_axis)
      cos_k, sin_k = rope_cos_sin(cfg, pos_k[None])
      h, mtp_pool, counts = mtp.apply_with_counts(
          cfg, params, m, h[None], drafts[-1][None], cos_k, sin_k, ctx_k, mtp_pool, ep,
          None if mtp_load is None else ExpertCount.LOGICAL)
      load = _add_mtp_load(cfg, mtp_load, load, m, counts)
      h = h[0]
    draft_logits = mtp.logits(cfg, params, m, h)
    if greedy:
      drafts.append(argmax(draft_logits))
      continue
    q = _probs(draft_logits, batch.temperature, batch.top_k, batch.top_p, k_cap)
    key_k = jax.vmap(lambda kk: jax.random.fold_in(kk, k))(k_draft)
    drafts.append(jnp.where(batch.temperature > 0, _draw(key_k, q), argmax(q)))  # int32
    qs.append(q)
  return drafts, qs, mtp_pool, load


def _write_state(state, d: DraftRows, out, n_acc, pos, drafts, qs):
  """Per sampling slot: the last emitted token (out[n_acc]: not in the KV
  cache yet), its position pos + 1, the new drafts and their q. Rows that
  do not sample write nothing (their index is out of range: dropped)."""
  state = dict(state)
  write = jnp.where(d.samples, d.slot, state["drafts"].shape[0])
  last = jnp.take_along_axis(out, n_acc[:, None], 1)[:, 0]
  state["last"] = state["last"].at[write].set(last, mode="drop")
  state["pos"] = state["pos"].at[write].set(pos + 1, mode="drop")
  if drafts:
    K = len(drafts)
    state["drafts"] = state["drafts"].at[write, :K].set(jnp.stack(drafts, 1), mode="drop")
    if qs:
      state["q"] = state["q"].at[write, :K].set(jnp.stack(qs, 1), mode="drop")
  return state


@dataclasses.dataclass(frozen=True)
class Mtp:
  """The MTP decoder (`steps.step` with `Program(Mtp(k), ...)`): each step
  verifies the drafts of K = k, accepts, catches the MTP cache up and
  drafts anew (the module docstring). Its inputs are the `StepBatch` and the
  `DraftRows` of each rank, stacked [n, ...], and targets as the plain decoder's; the
  state's draft is the draft state, [n * slots, ...] (each rank its block of
  rows); the pool holds the target's stacked caches per segment plus the MTP
  entry last; the load counts the target's MoE layers, then (EPLB over the
  MTP experts) one row per module. The emitted tokens' logprobs are scored
  by the verify logits, as plain decoding scores them ([n, B, K + 1,
  1 + MAX_LOGPROBS] arrays: entry j is emitted token j's).
  -> (emitted [n, B, K + 3] int32, new state, logprobs): row b of rank r
  emitted emitted[r, b, :m] with m = emitted[r, b, K + 1] (0 for a prefill
  chunk that does not sample), after verifying emitted[r, b, K + 2] drafts
  (fewer than the batch's num_draft where a pipelined block reached
  max_len)."""

  k: int

  def run(self, model, state, inputs, program):
    kw = dict(max_q=program.max_q, K=self.k, ep=expert_parallel(model.ep, model.ranks),
              greedy=program.greedy, k_cap=program.k_cap, logprobs=program.logprobs,
              **model.head_kw)
    cfg = model.cfg

    def body(params, pool, ranked, draft, load):
      batch, rows, targets = ranked
      emitted, pool, draft, load, lp = _spec_body(cfg, params, pool, batch, rows, draft, load,
                                                  targets, **kw)
      return (emitted, lp), pool, draft, load

    (emitted, lp), pool, draft, load = per_rank(body, model.ranks, model.params, state.pool,
                                                (inputs.batch, inputs.drafts, inputs.targets),
                                                state.draft, state.load)
    return emitted, dataclasses.replace(state, pool=pool, load=load, draft=draft), lp

  logprob_steps = None  # `logprobs.split_ranks`: the rows hold their K + 1 already

  def rows(self, out, ranks: int) -> list[tuple]:
    """A read step's emitted rows (host) -> per rank, (tokens [B, K + 1],
    emitted [B], drafts verified [B])."""
    e = np.asarray(out).reshape(ranks, -1, self.k + 3)
    return [(r[:, :self.k + 1], r[:, self.k + 1], r[:, self.k + 2]) for r in e]


def _spec_body(cfg, params, pool, batch: StepBatch, d: DraftRows, state, load, targets, *,
               max_q, K, ep, greedy, k_cap, mesh=None, head_axis=None, logprobs=False):
  """One rank's `Mtp` step (batch, draft rows and targets without the rank axis)."""
  rows = _resolve_rows(batch, d, state, max_q, mesh, head_axis)
  main_pool, mtp_pool = pool.model, pool.mtp_entry
  x, main_pool, counts = trunk_with_counts(cfg, params, rows.tokens[None], rows.ctx, main_pool,
                                           ep, None if load is None else ExpertCount.LOGICAL)
  # load: the trunk's MoE layers' rows, then (EPLB over the MTP experts) one per module.
  mtp_load = load is not None and load.shape[0] > counts.shape[0]
  load = load if load is None else load.at[:counts.shape[0]].add(counts)
  x = x[0]  # [T, D]
  out, n_acc, k_draft, logits = _verify(cfg, params, x, rows, batch, d, state, K, greedy, k_cap)
  h, mtp_pool, load = _catch_up(cfg, params, x, rows, batch, d, out, mtp_pool, ep,
                                load if mtp_load else None, load)
  frontier = jnp.clip(rows.base + n_acc, 0, x.shape[0] - 1)  # each block's last accepted row
  pos = rows.positions[frontier]
  drafts, qs, mtp_pool, load = _draft(cfg, params, h[frontier], pos, batch, d, mtp_pool, ep,
                                      k_draft, load if mtp_load else None, load, K=K,
                                      greedy=greedy, k_cap=k_cap, mesh=mesh, head_axis=head_axis)
  state = _write_state(state, d, out, n_acc, pos, drafts, qs)
  num_emitted = jnp.where(d.samples, n_acc + 1, 0)
  emitted = jnp.concatenate([out, num_emitted[:, None], rows.num_draft[:, None]], 1)
  lp = (step_logprobs(cfg, params, logits, out, x, targets, logprobs)
        if logprobs or targets is not None else None)
  return emitted, pool.with_segments(main_pool, mtp_pool), state, load, lp


# ------------------------------------------------------------ the host side

class Drafts:
  """MTP speculation's host side, which `steps.Runner` holds as its drafts:
  each rank's draft-state slots (`DraftSlots`: rows of the Engine's device
  draft state [ranks * slots, K], each rank its block) and the acceptance
  counters (`Acceptance`)."""

  def __init__(self, core: HostCore):
    self.config = core.spec
    S = core.config.max_num_seqs
    self._slots = [DraftSlots(S) for _ in range(core.num_ranks)]
    self._acceptance = Acceptance(self.config.num_draft_tokens)

  def decoder(self, K: int) -> "Mtp":
    return Mtp(K)

  def schedule(self, core: HostCore, in_flight, read, draft):
    """Continues the step in flight (pipelined) or reads it (read(keep=0))
    and schedules anew -> (every rank's chunks, K, the events read, the
    draft state with hand-over requests' drafts placed)."""
    K = min(self.config.draft_tokens_of(sch, core.config.max_num_seqs)
            for sch in core.schedulers)
    per_rank, events = None, []
    if in_flight and core.config.async_scheduling and in_flight[-1].decoder.k == K:
      per_rank = _continue(core.schedulers, in_flight[-1].per_rank, K)
    if per_rank is None:
      events = read(0)
      per_rank = scheduler.schedule_ranks(core.schedulers, [K] * core.num_ranks, core.config)
      for slots, sch, scheduled in zip(self._slots, core.schedulers, per_rank):
        slots.assign(sch.running, scheduled)
      draft = self._place_arrived(per_rank, core.config.max_num_seqs, draft)
    return per_rank, K, events, draft

  def _place_arrived(self, per_rank, slots_per_rank: int, draft):
    """Writes the drafts that came with hand-over requests into their new
    slots of the draft state -> the new draft state."""
    for rank, (slots, scheduled) in enumerate(zip(self._slots, per_rank)):
      for s in scheduled:
        if s.request.drafts is not None:
          row = rank * slots_per_rank + slots.of[s.request.id]
          draft = put_drafts(draft, row, s.request.drafts)
          s.request.drafts = None
    return draft

  def batch(self, core: HostCore, per_rank, shapes: steps.StepShapes):
    """Every rank's chunks -> (`StepBatch`, `DraftRows`, each stacked [n, ...],
    real tokens)."""
    built = [spec_batch(scheduled, shapes, slots.of, page_size=core.config.page_size,
                        max_model_len=core.max_model_len)
             for scheduled, slots in zip(per_rank, self._slots)]
    return (steps.stack_batches([b for b, _, _ in built]),
            steps.stack_batches([r for _, r, _ in built]), sum(n for _, _, n in built))

  def after_read(self, scheduled: list[Scheduled], rows, counts) -> tuple:
    """A read step's rows of one rank ((tokens, emitted, verified), `Mtp.rows`):
    counts the acceptance and the drafts cut on device at max_len ->
    `Scheduler.apply`'s (tokens, emitted, K)."""
    out, n_emit, n_verified = rows
    for s, n, d in zip(scheduled, n_emit, n_verified):
      counts.tokens -= s.num_draft - int(d)  # drafts cut on device at max_len
      if s.samples and s.num_draft and not s.request.finished:
        self._acceptance.record(int(d), int(n))
    return out, n_emit, out.shape[1] - 1

  def keep_handover(self, core: HostCore, scheduled: list[Scheduled], draft) -> None:
    """Held requests that finished (a disaggregated prefill): snapshot their
    row of the draft state now, before the slot can go to another request."""
    for s in scheduled:
      req = s.request
      if req.hold_pages and req.finish_reason not in (None, "abort") and req.num_drafts:
        row = req.rank * core.config.max_num_seqs + self._slots[req.rank].of[req.id]
        req.drafts = take_drafts(draft, row, req.num_drafts)

  def stats(self) -> dict:
    return self._acceptance.stats(self.config.num_draft_tokens)


class DraftSlots:
  """Rows of the device draft state, one per running request."""

  def __init__(self, num_slots: int):
    self.of: dict[int, int] = {}  # request id -> slot
    self._free = list(range(num_slots))

  def assign(self, running, scheduled: list[Scheduled]) -> None:
    """Frees the slots of requests no longer running (finished or
    preempted), then gives each newly scheduled request one."""
    live = {r.id for r in running}
    for rid in [rid for rid in self.of if rid not in live]:
      self._free.append(self.of.pop(rid))
    for s in scheduled:
      if s.request.id not in self.of:
        self.of[s.request.id] = self._free.pop()


class Acceptance:
  """Per draft position: drafts verified and accepted; per sequence-step
  that verified drafts: the tokens it emitted (accepted + 1)."""

  def __init__(self, max_draft: int):
    self.drafted = np.zeros(max_draft, np.int64)
    self.accepted = np.zeros(max_draft, np.int64)
    self.verifies = self.verify_tokens = 0

  def record(self, num_verified: int, num_emitted: int) -> None:
    self.drafted[:num_verified] += 1
    self.accepted[:num_emitted - 1] += 1
    self.verifies += 1
    self.verify_tokens += num_emitted

  def stats(self, num_draft_tokens: int) -> dict:
    with np.errstate(invalid="ignore", divide="ignore"):
      per_pos = np.where(self.drafted > 0, self.accepted / np.maximum(self.drafted, 1), np.nan)
    return dict(
        spec_num_draft_tokens=num_draft_tokens,
        spec_verify_steps=self.verifies,  # sequence-steps that verified drafts
        spec_mean_accepted_length=(self.verify_tokens / self.verifies if self.verifies
                                   else float("nan")),
        spec_acceptance_per_position=[float(a) for a in per_pos],
        spec_drafted_per_position=[int(d) for d in self.drafted])


def spec_batch(scheduled: list[Scheduled], shapes: steps.StepShapes, slot_of: dict, *,
               page_size: int, max_model_len: int):
  """One rank's chunks -> (padded `StepBatch`, its `DraftRows`, real tokens).
  A decode block is [last token, K draft rows]: the drafts' values stay on
  device (`draft_j`), and a pipelined block (`from_state`) takes its last
  token from there too."""
  tokens, draft_j, positions, token_seq, chunk_next = [], [], [], [], []
  for i, s in enumerate(scheduled):
    known = s.request.tokens
    n_known = s.num_tokens - s.num_draft
    if s.from_state:  # the last token and the positions come from the device
      tokens += [0] * s.num_tokens
    else:
      tokens += known[s.start:s.start + n_known] + [0] * s.num_draft
    draft_j += [-1] * n_known + list(range(s.num_draft))
    positions += range(s.start, s.start + s.num_tokens)
    token_seq += [i] * s.num_tokens
    chunk_next.append(0 if s.samples else known[s.start + s.num_tokens])
  reqs = [s.request for s in scheduled]
  T, B, pad = shapes.tokens, shapes.seqs, steps.pad
  batch = steps.pad_batch(
      shapes, tokens=tokens, from_prev=[-1] * len(tokens), positions=positions,
      token_seq=token_seq, q_lens=[s.num_tokens for s in scheduled],
      kv_lens=[s.start + s.num_tokens for s in scheduled], page_tables=[r.pages for r in reqs],
      **sampling_fields(reqs), sample_idx=[len(r.output) for r in reqs])
  rows = steps.DraftRows(
      draft_j=pad(draft_j, T, np.int32, -1), slot=pad([slot_of[r.id] for r in reqs], B, np.int32),
      num_draft=pad([s.num_draft for s in scheduled], B, np.int32),
      samples=pad([s.samples for s in scheduled], B, bool),
      from_state=pad([s.from_state for s in scheduled], B, bool),
      chunk_next=pad(chunk_next, B, np.int32),
      capacity=pad([len(r.pages) * page_size for r in reqs], B, np.int32),
      max_len=pad([min(len(r.prompt) + r.sampling.max_tokens, max_model_len) for r in reqs],
                  B, np.int32),
      prompt_len=pad([len(r.prompt) for r in reqs], B, np.int32))
  return batch, rows, len(tokens)


def _continue(schedulers, previous: list[list[Scheduled]], K: int):
  """Pipelined blocks for every rank, or None (then the step in flight is
  read first). All ranks continue or none does: each is checked before any
  takes pages. A rank with no work stays idle."""
  plans = []
  for sch, prev in zip(schedulers, previous):
    plan = sch.plan_continue(prev, K) if sch.has_work() else []
    if plan is None:
      return None
    plans.append(plan)
  if not any(plans):
    return None
  return [sch.continue_with(plan, K) for sch, plan in zip(schedulers, plans)]
