"""Blocked XLA attention (online softmax) == dense XLA attention; the engine's
greedy tokens do not move when prefill runs blocked."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import Engine, EngineConfig, SamplingParams, engine, models, ops, presets
from jaxinfer import xla_attention as xa

# (B, T, S, N, K, window, sinks, kv_lengths, query offsets): T and S span
# several blocks of 16 x 32 and end mid-block; GQA 1 / 4; padded KV.
CASES = {
    "causal_gqa4": (1, 70, 70, 8, 2, 0, False, None, None),
    "window_sinks": (2, 70, 100, 8, 2, 19, True, None, None),
    "kv_padding_ragged": (2, 50, 120, 4, 4, 0, False, (40, 120), (0, 70)),
    "window_padding_sinks": (3, 41, 97, 4, 1, 33, True, (97, 60, 10), (56, 30, 5)),
}


def _inputs(B, T, S, N, K, window, sinks, lengths, offsets, seed=0):
  r = np.random.default_rng(seed)
  q, k = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in [(B, T, N, 24), (B, S, K, 24)])
  v = jnp.asarray(r.standard_normal((B, S, K, 16)), jnp.float32)
  offsets = offsets or [S - T] * B
  pos = jnp.asarray(np.asarray(offsets)[:, None] + np.arange(T), jnp.int32)
  lengths = jnp.asarray(lengths or [S] * B, jnp.int32)
  sinks = jnp.linspace(-1.0, 2.0, N, dtype=jnp.float32) if sinks else None
  return q, k, v, pos, lengths, window, sinks


def _blocked(q, k, v, pos, lengths, window, sinks, scale=0.2):
  return xa.blocked(q, k, v, pos, lengths, window, sinks, scale, block_q=16, block_k=32)


def _seen(pos, lengths, window, S):
  """[B, T] bool: rows with at least one visible key."""
  return np.asarray(xa._visible(pos, lengths, jnp.int32(window), jnp.arange(S))).any(-1)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("traced_window", [False, True])
def test_blocked_matches_dense(name, traced_window):
  q, k, v, pos, lengths, window, sinks = _inputs(*CASES[name])
  ref = xa.dense(q, k, v, pos, lengths, window, sinks, 0.2)
  if traced_window:
    out = jax.jit(lambda w: _blocked(q, k, v, pos, lengths, w, sinks))(jnp.int32(window))
  else:
    out = jax.jit(lambda: _blocked(q, k, v, pos, lengths, window, sinks))()
  seen = _seen(pos, lengths, window, k.shape[1])
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  # A row that sees no key returns zeros (the flash kernel's rule), never NaN.
  assert np.all(np.asarray(out)[~seen] == 0) and np.all(np.asarray(ref)[~seen] == 0)
  if name == "window_padding_sinks":
    assert (~seen).any(), "the case should hold fully masked rows"


def test_dispatch_blocks_long_sequences_only():
  q, k, v, pos, lengths, window, sinks = _inputs(1, 200, 300, 8, 2, 64, True, None, None)
  full = jax.jit(xa.attention, static_argnums=(7,))
  ref = xa.dense(q, k, v, pos, lengths, window, sinks, 0.2)
  np.testing.assert_allclose(full(q, k, v, pos, lengths, window, sinks, 0.2), ref, atol=1e-5)
  hlo = full.lower(q, k, v, pos, lengths, window, sinks, 0.2).as_text()
  assert "while" in hlo  # blocked: a loop over blocks
  short = full.lower(q[:, :8], k, v, pos[:, :8], lengths, window, sinks, 0.2).as_text()
  assert "while" not in short  # one query block: dense


def test_blocked_gradients_match_dense():
  q, k, v, pos, lengths, window, sinks = _inputs(*CASES["window_sinks"])
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, pos, lengths, window, sinks, 0.2)))
  ref = jax.grad(loss(xa.dense), argnums=(0, 1, 2))(q, k, v)
  out = jax.jit(jax.grad(loss(_blocked), argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(out, ref):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["tiny_dense", "gpt_oss_like"])
def test_engine_greedy_unchanged_by_blocked_prefill(name, monkeypatch):
  cfg = presets.get("tiny_dense")
  if name == "gpt_oss_like":  # sinks and a sliding window shorter than the prompt
    cfg = dataclasses.replace(cfg, attention_sinks=True, sliding_window=48,
                              layer_types=("sliding_attention", "full_attention") * 2)
  cfg = dataclasses.replace(cfg, dtype="float32")
  params = models.init_params(cfg, jax.random.key(0))
  prompts = [np.random.default_rng(0).integers(0, cfg.vocab_size, n).tolist() for n in (200, 150)]
  # The whole prompts prefill in one step: [2, 200] queries, blocked.
  eng = Engine(cfg, params, EngineConfig(page_size=16, num_pages=64, max_num_batched_tokens=512))
  outs = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=6))]
  jax.clear_caches()
  monkeypatch.setattr(xa, "BLOCK_Q", 1 << 30)  # the reference runs dense throughout
  try:
    assert outs == engine.greedy_reference(cfg, params, prompts, 6)
  finally:
    jax.clear_caches()


def test_item_size_pads_at_most_twice():
  assert xa.item_size(256, 32, 1) == 1  # decode: a row per sequence
  assert xa.item_size(4096, 32, 128) == 128  # prompts only: [B, max_q] is the tokens
  assert xa.item_size(256, 32, 256) == 8  # a chunk among decodes: rows of 8 tokens
  assert xa.item_size(64, 32, 64) == 2
  assert xa.item_size(16, 32, 16) == 1
  for T, B, q in [(256, 32, 256), (96, 8, 64), (40, 32, 33)]:
    p = xa.item_size(T, B, q)
    assert B * p <= max(T, B) and 1 <= p <= q


# (sequences' query counts, their KV lengths, window, sinks, latent): a long
# chunk among decodes and short chunks, padding tokens and sequences.
ITEM_CASES = {
    "chunk_among_decodes": ((37, 1, 1, 5, 1, 0), (60, 9, 33, 5, 17, 0), 0, False, False),
    "window_sinks": ((23, 1, 12, 1), (23, 40, 30, 2), 7, True, False),
    "mla_latent": ((19, 1, 3), (40, 12, 3), 0, False, True),
}


@pytest.mark.parametrize("name", sorted(ITEM_CASES))
@pytest.mark.parametrize("per_item", [1, 4, 16])
def test_item_rows_equal_the_reference(name, per_item):
  """The XLA path in rows of per_item tokens (`xla_attention.item_size`'s layout for
  mixed steps) equals the float32 reference, and the row-per-sequence layout."""
  from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
  q_lens, kv_lens, window, sinks, latent = ITEM_CASES[name]
  r = np.random.default_rng(0)
  N, K, H, ps, pages = 8, (1 if latent else 2), 16, 4, 16  # 64 tokens a sequence at most
  B, T = len(q_lens), sum(q_lens) + 3  # 3 padding tokens
  max_q = max(q_lens)
  q = jnp.asarray(r.standard_normal((T, N, H)), jnp.float32)
  k_pages = jnp.asarray(r.standard_normal((K, 128, ps, H)), jnp.float32)
  v_pages = None if latent else jnp.asarray(r.standard_normal((K, 128, ps, 12)), jnp.float32)
  table = jnp.asarray(r.permutation(128)[:B * pages].reshape(B, pages), jnp.int32)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
  kv = jnp.asarray(kv_lens, jnp.int32)
  sink = jnp.linspace(-1.0, 1.0, N, dtype=jnp.float32) if sinks else None
  kw = dict(window=window, sinks=sink, scale=0.3, v_head_dim=12 if latent else None, layer=0,
            kv_scales=(None, None))
  args = (q, k_pages[None], None if latent else v_pages[None], kv, table, cu, max_q)
  got = xa.ragged_paged(*args, **{k: v for k, v in kw.items() if k != "window"},
                        window=window, per_item=per_item)
  rows = xa.ragged_paged(*args, **{k: v for k, v in kw.items() if k != "window"},
                         window=window, per_item=max_q)
  want = ragged_paged_attention_reference(q, k_pages, v_pages, kv, table, cu, max_q=max_q,
                                          sm_scale=0.3, window=window, sinks=sink,
                                          v_head_dim=12 if latent else None)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(got, rows, atol=2e-5, rtol=2e-5)
  assert not np.any(np.asarray(got[sum(q_lens):]))  # padding tokens are zeros


def _paged(q, k_pages, v_pages, *, kv_lens, page_table, cu_q_lens, max_q, window=0, sinks=None,
           scale, new_kv=None):
  """`ops.ragged_paged_attention` of one call (`ops.AttentionCall`) from its parts."""
  kv = ops.PagedKV(k_pages=k_pages, v_pages=v_pages, kv_lens=kv_lens, page_table=page_table,
                   cu_q_lens=cu_q_lens, max_q=max_q)
  return ops.ragged_paged_attention(ops.AttentionCall(q=q, kv=kv, new_kv=new_kv, window=window,
                                                      sinks=sinks, scale=scale))


# (sequences' query counts, window, sinks, packed block): fresh prompts (each
# chunk from position 0) of uneven lengths, an empty sequence, padding tokens.
FRESH_CASES = {
    "one_block": ((37, 5, 0, 64), 0, False, 128),
    "blocks_window_sinks": ((37, 5, 0, 64), 9, True, 16),
    "blocks_straddled": ((3, 30, 17, 1), 0, False, 8),
}


def _step_with_new_kv(r, q_lens, kv_lens, padding, N=8, K=2, H=16, Hv=12, ps=4, pages=16):
  """Random q [T, N, H], the step's new k/v [T, K, *] and 128-page pools
  with each sequence's new k/v written at its newest positions (it has
  kv_lens[b] tokens, the last q_lens[b] of them new) -> (q, k_new, v_new,
  k_pages, v_pages, table, cu_q_lens); T = sum(q_lens) + padding."""
  B, T = len(q_lens), sum(q_lens) + padding
  q = jnp.asarray(r.standard_normal((T, N, H)), jnp.float32)
  k_new = r.standard_normal((T, K, H)).astype(np.float32)
  v_new = r.standard_normal((T, K, Hv)).astype(np.float32)
  k_pages = r.standard_normal((K, 128, ps, H)).astype(np.float32)
  v_pages = r.standard_normal((K, 128, ps, Hv)).astype(np.float32)
  table = r.permutation(128)[:B * pages].reshape(B, pages).astype(np.int32)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  for b in range(B):
    for i in range(q_lens[b]):
      pos = kv_lens[b] - q_lens[b] + i
      k_pages[:, table[b, pos // ps], pos % ps] = k_new[cu[b] + i]
      v_pages[:, table[b, pos // ps], pos % ps] = v_new[cu[b] + i]
  return q, k_new, v_new, k_pages, v_pages, table, cu


@pytest.mark.parametrize("name", sorted(FRESH_CASES))
def test_packed_fresh_prompts_equal_the_reference(name, monkeypatch):
  """A step of fresh prompts attends over its own keys packed
  (`xla_attention.packed`, chosen by value inside the step) and equals the
  float32 reference over the pages; once one chunk starts past position 0
  the same program takes the pages, and equals the reference too."""
  from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
  q_lens, window, sinks, block = FRESH_CASES[name]
  monkeypatch.setattr(xa, "PACKED_BLOCK", block)
  q, k_new, v_new, k_pages, v_pages, table, cu = _step_with_new_kv(
      np.random.default_rng(1), q_lens, q_lens, padding=3)
  sink = jnp.linspace(-1.0, 1.0, q.shape[1], dtype=jnp.float32) if sinks else None
  step = jax.jit(lambda kv, kp, vp: _paged(
      q, kp, vp, kv_lens=kv, page_table=jnp.asarray(table), cu_q_lens=jnp.asarray(cu),
      max_q=max(q_lens), window=window, sinks=sink, scale=0.3,
      new_kv=(jnp.asarray(k_new), jnp.asarray(v_new))))
  # Fresh prompts never read the pages: zeroed ones give the same answer.
  fresh = step(jnp.asarray(q_lens, jnp.int32), jnp.zeros_like(k_pages), jnp.zeros_like(v_pages))
  for kv_lens in (np.asarray(q_lens), np.asarray(q_lens) + np.asarray([0, 0, 0, 2])):
    kv = jnp.asarray(kv_lens, jnp.int32)
    want = ragged_paged_attention_reference(q, jnp.asarray(k_pages), jnp.asarray(v_pages), kv,
                                            jnp.asarray(table), jnp.asarray(cu),
                                            max_q=max(q_lens), sm_scale=0.3, window=window,
                                            sinks=sink)
    got = step(kv, jnp.asarray(k_pages), jnp.asarray(v_pages))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    assert not np.any(np.asarray(got[sum(q_lens):]))  # padding tokens are zeros
  np.testing.assert_allclose(fresh, step(jnp.asarray(q_lens, jnp.int32), jnp.asarray(k_pages),
                                         jnp.asarray(v_pages)), atol=1e-6, rtol=1e-6)


# (query counts, KV lengths, window, sinks): fresh prompts (query count = KV
# length; a 1-token prompt among them) and decode tokens (1 query past position
# 0), the decodes' pages gathered for all sequences or for a quarter of them.
MIXED_CASES = {
    "decodes_in_all_rows": ((37, 1, 20, 1, 0, 1), (37, 50, 20, 9, 0, 1), 0, False),
    "decodes_in_a_quarter": ((37, 20, 1, 0, 1, 5, 1, 3), (37, 20, 13, 0, 1, 5, 30, 3), 7, True),
}


@pytest.mark.parametrize("name", sorted(MIXED_CASES))
def test_fresh_prompts_beside_decodes_equal_the_reference(name, monkeypatch):
  """A step of fresh prompts and decode tokens (a continuous-batching step
  that admits prompts while others decode): the prompts attend packed over
  the step's own keys, the decode tokens over their pages, and the step
  equals the float32 reference; zeroing the fresh sequences' pages changes
  nothing, so they were not read."""
  from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
  monkeypatch.setattr(xa, "PACKED_BLOCK", 16)
  q_lens, kv_lens, window, sinks = MIXED_CASES[name]
  q, k_new, v_new, k_pages, v_pages, table, cu = _step_with_new_kv(
      np.random.default_rng(2), q_lens, kv_lens, padding=5)
  B = len(q_lens)
  sink = jnp.linspace(-1.0, 1.0, q.shape[1], dtype=jnp.float32) if sinks else None
  kv = jnp.asarray(kv_lens, jnp.int32)
  step = jax.jit(lambda kp, vp: _paged(
      q, kp, vp, kv_lens=kv, page_table=jnp.asarray(table), cu_q_lens=jnp.asarray(cu),
      max_q=max(q_lens), window=window, sinks=sink, scale=0.3,
      new_kv=(jnp.asarray(k_new), jnp.asarray(v_new))))
  want = ragged_paged_attention_reference(q, jnp.asarray(k_pages), jnp.asarray(v_pages), kv,
                                          jnp.asarray(table), jnp.asarray(cu),
                                          max_q=max(q_lens), sm_scale=0.3, window=window,
                                          sinks=sink)
  got = step(jnp.asarray(k_pages), jnp.asarray(v_pages))
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  assert not np.any(np.asarray(got[sum(q_lens):]))  # padding tokens are zeros
  for b in (b for b in range(B) if q_lens[b] == kv_lens[b]):  # the fresh sequences' pages zeroed
    k_pages[:, table[b]] = 0
    v_pages[:, table[b]] = 0
  np.testing.assert_allclose(step(jnp.asarray(k_pages), jnp.asarray(v_pages)), got,
                             atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window,sinks", [(0, False), (5, True)])
def test_decode_reads_three_quarters_of_the_pages_when_they_hold_every_key(window, sinks):
  """A decode step's XLA path (`ragged_paged_attention`, max_q 1) gathers
  only the first three quarters of its pages when every sequence's keys fit
  there: NaN values in the last quarter's pages then never reach the
  output (over all pages they would, through 0 x NaN), and the output
  equals the float32 reference; one sequence longer reads every page."""
  from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
  r = np.random.default_rng(3)
  N, K, H, ps, pages, B = 8, 2, 16, 4, 16, 4  # 64 keys a sequence, 48 in three quarters
  q = jnp.asarray(r.standard_normal((B, N, H)), jnp.float32)
  k_pages = r.standard_normal((K, 128, ps, H)).astype(np.float32)
  v_pages = r.standard_normal((K, 128, ps, H)).astype(np.float32)
  table = r.permutation(128)[:B * pages].reshape(B, pages).astype(np.int32)
  cu = jnp.arange(B + 1, dtype=jnp.int32)
  sink = jnp.linspace(-1.0, 1.0, N, dtype=jnp.float32) if sinks else None
  for kv_lens, trimmed in [((48, 9, 30, 1), True), ((49, 9, 30, 1), False)]:
    kv = jnp.asarray(kv_lens, jnp.int32)
    want = ragged_paged_attention_reference(q, jnp.asarray(k_pages), jnp.asarray(v_pages), kv,
                                            jnp.asarray(table), cu, max_q=1, sm_scale=0.3,
                                            window=window, sinks=sink)
    poisoned = v_pages.copy()
    if trimmed:
      poisoned[:, table[:, 3 * pages // 4:]] = np.nan
    got = _paged(q, jnp.asarray(k_pages), jnp.asarray(poisoned), kv_lens=kv,
                 page_table=jnp.asarray(table), cu_q_lens=cu, max_q=1, window=window,
                 sinks=sink, scale=0.3)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


# (query counts, KV lengths): MLA steps of fresh prompts and decode tokens,
# then one with a chunk continuing past position 0 (the absorbed form over
# the pages for every token).
MLA_CASES = {
    "fresh_prompts": ((37, 20, 1, 5), (37, 20, 1, 5)),
    "fresh_beside_decodes": ((37, 1, 20, 1), (37, 50, 20, 9)),
    "a_continuing_chunk": ((37, 1, 20, 1), (45, 50, 20, 9)),
}


@pytest.mark.parametrize("name", sorted(MLA_CASES))
def test_mla_fresh_prompts_in_the_expanded_form_equal_the_absorbed_form(name, monkeypatch):
  """MLA on the XLA path, as `models.attention.mla` chooses: where
  `ops.fresh_prompts` finds every sequence a fresh prompt or a decode token,
  the prompts attend packed in the expanded form (per-head k = [c W_uk,
  k_rope], v = c W_uv, `ops.packed_attention`) and the decodes over the
  latent pages (`ops.fresh_and_decodes`); it equals the absorbed form over
  the pages times W_uv, and zeroed pages of the fresh sequences change
  nothing (they were not read). A step with a chunk past position 0 takes
  the pages."""
  monkeypatch.setattr(xa, "PACKED_BLOCK", 16)
  q_lens, kv_lens = MLA_CASES[name]
  r = np.random.default_rng(4)
  N, Hn, Hr, R, Hv, ps, pages = 4, 8, 4, 16, 8, 4, 16
  B, T = len(q_lens), sum(q_lens) + 3
  f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  q_nope, q_rope, c, k_rope, w_uk, w_uv = (f(T, N, Hn), f(T, N, Hr), f(T, R), f(T, Hr),
                                           f(N, R, Hn) / 4, f(N, Hv, R))
  q_abs = jnp.concatenate([jnp.einsum("TNH,NRH->TNR", q_nope, w_uk), q_rope], axis=-1)
  pool = r.standard_normal((1, 128, ps, R + Hr)).astype(np.float32)
  table = r.permutation(np.arange(1, 128))[:B * pages].reshape(B, pages).astype(np.int32)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  new = np.concatenate([c, k_rope], axis=-1)
  for b in range(B):
    for i in range(q_lens[b]):
      pos = kv_lens[b] - q_lens[b] + i
      pool[0, table[b, pos // ps], pos % ps] = new[cu[b] + i]

  def expand():
    k = jnp.concatenate([jnp.einsum("TR,NRH->TNH", c, w_uk),
                         jnp.broadcast_to(k_rope[:, None], (T, N, Hr))], axis=-1)
    return jnp.concatenate([q_nope, q_rope], axis=-1), k, jnp.einsum("TR,NHR->TNH", c, w_uv)

  kv = lambda kp: ops.PagedKV(k_pages=kp, v_pages=None, kv_lens=jnp.asarray(kv_lens, jnp.int32),
                              page_table=jnp.asarray(table), cu_q_lens=jnp.asarray(cu),
                              max_q=max(q_lens), latent_dim=R)
  absorbed = jax.jit(lambda kp: ops.ragged_paged_attention(
      ops.AttentionCall(q=q_abs, kv=kv(kp), scale=0.3)))

  @jax.jit
  def step(kp):  # the model's choice (`models.attention._fresh_or_absorbed`)
    call = ops.AttentionCall(q=q_abs, kv=kv(kp), scale=0.3)
    every_fresh, decodes = ops.fresh_prompts(call)

    def prompts():
      packed = ops.packed_attention(*expand(), call.kv.cu_q_lens, scale=0.3)
      firsts = q_abs[jnp.clip(call.kv.cu_q_lens[:-1], 0, T - 1)]
      return ops.fresh_and_decodes(firsts, call.kv, packed, decodes, scale=0.3, values=w_uv)

    return jax.lax.cond(every_fresh, prompts,
                        lambda: ops.latent_values(ops.ragged_paged_attention(call), w_uv))
  want = jnp.einsum("TNR,NHR->TNH", absorbed(jnp.asarray(pool)), w_uv)
  got = step(jnp.asarray(pool))
  np.testing.assert_allclose(got, want, atol=3e-4, rtol=3e-4)
  assert not np.any(np.asarray(got[sum(q_lens):]))  # padding tokens are zeros
  fresh = [b for b in range(B) if q_lens[b] == kv_lens[b]]
  for b in fresh:
    pool[:, table[b]] = 0
  zeroed = step(jnp.asarray(pool))
  if name == "a_continuing_chunk":  # every token over the pages: fresh rows change
    assert not np.allclose(zeroed, got, atol=1e-3)
  else:
    np.testing.assert_allclose(zeroed, got, atol=1e-6, rtol=1e-6)
