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
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.engine.logprobs import step_logprobs
from jaxinfer.engine.steps import expert_parallel, per_rank
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecBatch:
  tokens: jax.Array  # [T] int32 (draft rows: ignored, read from the draft state)
  draft_j: jax.Array  # [T] int32: index of the state draft this row holds, or -1
  positions: jax.Array  # [T]
  token_seq: jax.Array  # [T]
  valid: jax.Array  # [T] bool
  cu_q_lens: jax.Array  # [B + 1]
  kv_lens: jax.Array  # [B]
  page_table: jax.Array  # [B, pages]
  logits_idx: jax.Array  # [B]: each sequence's last row
  slot: jax.Array  # [B]: the sequence's row of the draft state
  num_draft: jax.Array  # [B]: drafts verified this step (0: prefill)
  samples: jax.Array  # [B] bool: the chunk reaches the end (tokens are emitted)
  from_state: jax.Array  # [B] bool: a decode block whose last token and positions come
  #                        from the draft state (dispatched before the last step was read)
  chunk_next: jax.Array  # [B]: the token after a prefill chunk that does not sample
  capacity: jax.Array  # [B]: positions the sequence's pages hold
  max_len: jax.Array  # [B]: tokens the request may reach (prompt + max_tokens, or the context)
  prompt_len: jax.Array  # [B]
  temperature: jax.Array  # [B] float32
  top_k: jax.Array  # [B]
  top_p: jax.Array  # [B]
  seeds: jax.Array  # [B] uint32

  _ROWS = ("tokens", "draft_j", "positions", "token_seq", "valid")
  _SEQS = ("kv_lens", "logits_idx", "slot", "num_draft", "samples", "from_state", "chunk_next",
           "capacity", "max_len", "prompt_len", "top_k", "seeds")

  def pack(self) -> tuple:
    """Host numpy fields -> 5 arrays (one transfer each instead of 19)."""
    rows = np.stack([np.asarray(getattr(self, f)).astype(np.int32) for f in self._ROWS])
    seqs = np.stack([np.asarray(getattr(self, f)).view(np.int32) if f == "seeds"
                     else np.asarray(getattr(self, f)).astype(np.int32) for f in self._SEQS])
    floats = np.stack([self.temperature, self.top_p]).astype(np.float32)
    return rows, seqs, np.asarray(self.cu_q_lens, np.int32), np.asarray(self.page_table, np.int32), floats

  @classmethod
  def unpack(cls, packed) -> "SpecBatch":
    rows, seqs, cu, table, floats = packed
    f = {name: rows[i] for i, name in enumerate(cls._ROWS)}
    f.update({name: seqs[i] for i, name in enumerate(cls._SEQS)})
    f["valid"] = f["valid"] > 0
    f["samples"] = f["samples"] > 0
    f["from_state"] = f["from_state"] > 0
    f["seeds"] = jax.lax.bitcast_convert_type(f["seeds"], jnp.uint32)
    return cls(cu_q_lens=cu, page_table=table, temperature=floats[0], top_p=floats[1], **f)


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


def _resolve_rows(batch: SpecBatch, state, max_q, mesh, head_axis) -> _Rows:
  """Pipelining: a `from_state` decode block takes its last token and its
  positions from the draft state (the host dispatched it before reading the
  step in flight), and its drafts are cut where the request would pass
  max_len. Draft rows read their tokens from the state too."""
  T = batch.tokens.shape[0]
  b = batch.token_seq
  j_row = jnp.arange(T) - batch.cu_q_lens[b]  # row index within its sequence's block
  pos0 = state["pos"][batch.slot]
  num_draft = jnp.where(batch.from_state,
                        jnp.clip(jnp.minimum(batch.num_draft, batch.max_len - pos0 - 2), 0),
                        batch.num_draft)
  fs = batch.from_state[b]
  positions = jnp.where(fs, pos0[b] + j_row, batch.positions)
  valid = batch.valid & (~fs | (j_row <= num_draft[b]))
  # The kernels place a block's rows at the end of its KV length, so a cut
  # block keeps its full length; its cut rows are invalid (their K/V goes to
  # the null page) and, being later in the causal order, unseen by the rest.
  kv_lens = jnp.where(batch.from_state, pos0 + batch.num_draft + 1, batch.kv_lens)
  row_slot = batch.slot[b]
  tokens = jnp.where(batch.draft_j >= 0,
                     state["drafts"][row_slot, jnp.maximum(batch.draft_j, 0)], batch.tokens)
  tokens = jnp.where(fs & (j_row == 0), state["last"][row_slot], tokens)
  ctx = PagedContext(positions=positions, token_seq=b, valid=valid, cu_q_lens=batch.cu_q_lens,
                     kv_lens=kv_lens, page_table=batch.page_table, max_q=max_q, mesh=mesh,
                     head_axis=head_axis)
  base = jnp.clip(batch.logits_idx - batch.num_draft, 0, T - 1)
  return _Rows(tokens, positions, ctx, num_draft, base)


def _verify(cfg, params, x, rows: _Rows, batch: SpecBatch, state, K: int, greedy: bool,
            k_cap: int):
  """Target logits at each block's K + 1 rows (the last known token and its
  drafts: one forward, the kernels' Q > 1 path), then `accept`.
  -> (tokens [B, K + 1], accepted [B], draft keys [B] or None, the logits)."""
  T = x.shape[0]
  idx = jnp.clip(rows.base[:, None] + jnp.arange(K + 1), 0, T - 1)  # [B, K + 1]
  logits = head(cfg, params, x[idx])  # [B, K + 1, V]
  drafts_in = state["drafts"][batch.slot, :K]
  if greedy:
    q_in = k_acc = k_draft = None
  else:
    # Keyed by the index of the request's first token emitted this step.
    keys = request_keys(batch.seeds, rows.positions[rows.base] + 1 - batch.prompt_len)
    split = jax.vmap(lambda k: jax.random.split(k, 2))(keys)
    k_acc, k_draft = split[:, 0], split[:, 1]
    q_in = state["q"][batch.slot, :K]
  out, n_acc = accept(logits, drafts_in, q_in, rows.num_draft, batch.temperature, batch.top_k,
                      batch.top_p, k_acc, greedy, k_cap)
  return out, n_acc, k_draft, logits


def _add_mtp_load(cfg, mtp_load, load, m: int, counts):
  """Adds module m's routed copies to its EPLB row (after the trunk's)."""
  if mtp_load is None or counts is None:
    return load
  return load.at[load.shape[0] - cfg.num_mtp_layers + m].add(counts)


def _catch_up(cfg, params, x, rows: _Rows, batch: SpecBatch, out, mtp_pool, ep, mtp_load,
              load):
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
  in_window = batch.samples[b] & (jr >= 0) & (jr <= rows.num_draft[b])
  nxt = rows.tokens[jnp.minimum(r + 1, T - 1)]
  nxt = jnp.where(in_window, out[b, jnp.clip(jr, 0, K)], nxt)
  nxt = jnp.where((r == batch.logits_idx[b]) & ~batch.samples[b], batch.chunk_next[b], nxt)
  cos, sin = rope_cos_sin(cfg, rows.positions[None])
  m = mtp.module_for(cfg, 1)
  h, mtp_pool, counts = mtp.apply_with_counts(
      cfg, params, m, x[None], nxt[None], cos, sin, rows.ctx, mtp_pool, ep,
      None if mtp_load is None else ExpertCount.LOGICAL)
  return h[0], mtp_pool, _add_mtp_load(cfg, mtp_load, load, m, counts)


def _draft(cfg, params, h, pos, batch: SpecBatch, mtp_pool, ep, k_draft, mtp_load, load, *, K,
           greedy, k_cap, mesh, head_axis):
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
      ok = batch.samples & (pos_k < batch.capacity)
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


def _write_state(state, batch: SpecBatch, out, n_acc, pos, drafts, qs):
  """Per sampling slot: the last emitted token (out[n_acc]: not in the KV
  cache yet), its position pos + 1, the new drafts and their q. Rows that
  do not sample write nothing (their index is out of range: dropped)."""
  state = dict(state)
  write = jnp.where(batch.samples, batch.slot, state["drafts"].shape[0])
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
  drafts anew (the module docstring). Its inputs' batch is `SpecBatch.pack()`
  of each rank, stacked [n, ...], and targets as the plain decoder's; the
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
      packed, targets = ranked
      emitted, pool, draft, load, lp = _spec_body(cfg, params, pool, packed, draft, load,
                                                  targets, **kw)
      return (emitted, lp), pool, draft, load

    (emitted, lp), pool, draft, load = per_rank(body, model.ranks, model.params, state.pool,
                                                (inputs.batch, inputs.targets), state.draft,
                                                state.load)
    return emitted, dataclasses.replace(state, pool=pool, load=load, draft=draft), lp

  logprob_steps = None  # `logprobs.split_ranks`: the rows hold their K + 1 already

  def rows(self, out, ranks: int) -> list[tuple]:
    """A read step's emitted rows (host) -> per rank, (tokens [B, K + 1],
    emitted [B], drafts verified [B])."""
    e = np.asarray(out).reshape(ranks, -1, self.k + 3)
    return [(r[:, :self.k + 1], r[:, self.k + 1], r[:, self.k + 2]) for r in e]


def _spec_body(cfg, params, pool, packed, state, load, targets, *, max_q, K, ep, greedy, k_cap,
               mesh=None, head_axis=None, logprobs=False):
  """One rank's `Mtp` step (packed fields and targets without the rank axis)."""
  batch = SpecBatch.unpack(packed)
  rows = _resolve_rows(batch, state, max_q, mesh, head_axis)
  main_pool, mtp_pool = pool.model, pool.mtp_entry
  x, main_pool, counts = trunk_with_counts(cfg, params, rows.tokens[None], rows.ctx, main_pool,
                                           ep, None if load is None else ExpertCount.LOGICAL)
  # load: the trunk's MoE layers' rows, then (EPLB over the MTP experts) one per module.
  mtp_load = load is not None and load.shape[0] > counts.shape[0]
  load = load if load is None else load.at[:counts.shape[0]].add(counts)
  x = x[0]  # [T, D]
  out, n_acc, k_draft, logits = _verify(cfg, params, x, rows, batch, state, K, greedy, k_cap)
  h, mtp_pool, load = _catch_up(cfg, params, x, rows, batch, out, mtp_pool, ep,
                                load if mtp_load else None, load)
  frontier = jnp.clip(rows.base + n_acc, 0, x.shape[0] - 1)  # each block's last accepted row
  pos = rows.positions[frontier]
  drafts, qs, mtp_pool, load = _draft(cfg, params, h[frontier], pos, batch, mtp_pool, ep,
                                      k_draft, load if mtp_load else None, load, K=K,
                                      greedy=greedy, k_cap=k_cap, mesh=mesh, head_axis=head_axis)
  state = _write_state(state, batch, out, n_acc, pos, drafts, qs)
  num_emitted = jnp.where(batch.samples, n_acc + 1, 0)
  emitted = jnp.concatenate([out, num_emitted[:, None], rows.num_draft[:, None]], 1)
  lp = (step_logprobs(cfg, params, logits, out, x, targets, logprobs)
        if logprobs or targets is not None else None)
  return emitted, pool.with_segments(main_pool, mtp_pool), state, load, lp
