"""Speculative MTP decoding: the acceptance rule, exact greedy equality with
plain decoding (mixed lengths, chunked prefill, preemption), and the sampled
output distribution equal to the target's."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer import models, presets, training
from jaxinfer.engine import Engine, EngineConfig, SamplingParams
from jaxinfer.engine.sampling import filter_logits
from jaxinfer.engine.speculative import MTPConfig, accept
from jaxinfer.models.layers import PackedLinear


def _cfg(**kw):
  return dataclasses.replace(presets.get("tiny_moe"), dtype="float32", num_layers=2, **kw)


def _onehot_logits(ids, V=8):
  return jnp.asarray(np.eye(V, dtype=np.float32)[np.asarray(ids)] * 10.0)


def test_greedy_accept_rule():
  # Target argmax at the 4 positions: 5 6 7 1. Drafts 5 6 0: two accepted,
  # then the target's 7 replaces the third.
  logits = _onehot_logits([[5, 6, 7, 1], [5, 6, 7, 1], [2, 6, 7, 1]])
  drafts = jnp.asarray([[5, 6, 0], [5, 6, 7], [5, 6, 7]], jnp.int32)
  q = jnp.zeros((3, 3, 8))
  zeros = jnp.zeros((3,))
  tokens, n_acc = accept(logits, drafts, q, jnp.asarray([3, 3, 3]), zeros,
                         jnp.zeros((3,), jnp.int32), jnp.ones((3,)),
                         jax.random.split(jax.random.key(0), 3))
  np.testing.assert_array_equal(n_acc, [2, 3, 0])
  np.testing.assert_array_equal(tokens[0, :3], [5, 6, 7])
  np.testing.assert_array_equal(tokens[1], [5, 6, 7, 1])  # all accepted + the bonus token
  assert int(tokens[2, 0]) == 2
  # Fewer drafts than K: only num_draft are tested, the bonus comes after them.
  tokens, n_acc = accept(logits, drafts, q, jnp.asarray([1, 2, 0]), zeros,
                         jnp.zeros((3,), jnp.int32), jnp.ones((3,)),
                         jax.random.split(jax.random.key(0), 3))
  np.testing.assert_array_equal(n_acc, [1, 2, 0])
  np.testing.assert_array_equal(tokens[0, :2], [5, 6])
  np.testing.assert_array_equal(tokens[1, :3], [5, 6, 7])


def test_sampled_accept_rule_is_lossless_per_position():
  # One position, V = 4: draft x ~ q, then accept/resample. The emitted
  # token's distribution must be p, whatever q is.
  p_logits = jnp.log(jnp.asarray([0.5, 0.3, 0.15, 0.05]))
  q = jnp.asarray([0.1, 0.2, 0.3, 0.4])
  n = 40_000
  kd, ka = jax.random.split(jax.random.key(0))
  drafts = jax.random.categorical(kd, jnp.log(q), shape=(n,)).astype(jnp.int32)
  logits = jnp.broadcast_to(p_logits, (n, 2, 4))
  tokens, n_acc = accept(logits, drafts[:, None], jnp.broadcast_to(q, (n, 1, 4)),
                         jnp.ones((n,), jnp.int32), jnp.ones((n,)), jnp.zeros((n,), jnp.int32),
                         jnp.ones((n,)), jax.random.split(ka, n))
  first = np.asarray(tokens[:, 0])
  freq = np.bincount(first, minlength=4) / n
  np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.01)
  # Acceptance rate is sum(min(p, q)) = 0.1 + 0.2 + 0.15 + 0.05 = 0.5.
  assert abs(float(np.mean(n_acc)) - 0.5) < 0.01


ENGINE = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=24, prefill_chunk_size=8)


@pytest.fixture(scope="module")
def random_model():
  cfg = _cfg()
  return cfg, models.init_params(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def trained_model():
  cfg, params, _ = jaxinfer.load_default_model()
  return cfg, params


TRAINED_PROMPT_LENGTHS, TRAINED_SAMPLING = [7, 40, 23], SamplingParams(max_tokens=16)


@pytest.fixture(scope="module")
def trained_reference(trained_model):
  """Plain greedy tokens of the K tests' prompts (one run per test worker)."""
  cfg, params = trained_model
  prompts = training.held_out_prompts(TRAINED_PROMPT_LENGTHS)
  ref = Engine(cfg, params, EngineConfig(**ENGINE, num_pages=18)).generate(prompts,
                                                                           TRAINED_SAMPLING)
  return [r.token_ids for r in ref]


@pytest.mark.parametrize("K", [3])  # (CI time; K = 2 against plain decoding: tests/engine/test_logprobs.py)
def test_trained_model_greedy_speculative_equals_plain_greedy(trained_model, trained_reference,
                                                              K):
  # The shipped model drafts well enough that drafts are both accepted and
  # rejected; held-out source of mixed lengths, chunked prefill, preemption.
  # (K = 2 on this model: tests/sharding/test_spec_mesh.py's single-device reference.)
  cfg, params = trained_model
  prompts = training.held_out_prompts(TRAINED_PROMPT_LENGTHS)
  engine = Engine(cfg, params, EngineConfig(**ENGINE, num_pages=18,
                                            speculative=MTPConfig(num_draft_tokens=K)))
  out = engine.generate(prompts, TRAINED_SAMPLING)
  assert [o.token_ids for o in out] == trained_reference
  while engine.has_unfinished():  # a pipelined step may still be in flight
    engine.step()
  stats = engine.stats()
  assert stats["preemptions"] > 0
  acc = stats["spec_acceptance_per_position"]
  # Drafts were accepted, and some rejected (the accepted length stays under K + 1).
  assert len(acc) == K and acc[0] > 0.2, acc
  assert 1.0 < stats["spec_mean_accepted_length"] < K + 1, stats
  # EPLB statistics are recorded in speculative steps too: every row run, no padding.
  rows = round(stats["tokens_per_step"] * stats["steps"])
  np.testing.assert_array_equal(engine.expert_load().sum(-1), rows * cfg.num_experts_per_tok)


def test_trained_model_pipelined_speculative_equals_plain_greedy(trained_model):
  # Decode-only steps are pipelined (dispatched before the previous step is
  # read): requests ending mid-block on max_tokens or on a stop token, and
  # one running into the context limit, still match plain greedy exactly.
  cfg, params = trained_model
  prompts = training.held_out_prompts([9, 30, 17])
  sampling = [SamplingParams(max_tokens=37), SamplingParams(max_tokens=50, stop_token_ids=(10,)),
              SamplingParams(max_tokens=200)]
  config = dict(ENGINE, num_pages=64, max_model_len=61)
  ref = Engine(cfg, params, EngineConfig(**config)).generate(prompts, sampling)
  engine = Engine(cfg, params, EngineConfig(**config, speculative=MTPConfig(num_draft_tokens=3)))
  out = engine.generate(prompts, sampling)
  assert [o.token_ids for o in out] == [r.token_ids for r in ref]
  assert [o.finish_reason for o in out] == [r.finish_reason for r in ref]
  assert {r.finish_reason for r in ref} == {"stop", "length"}, [r.finish_reason for r in ref]
  stats = engine.stats()
  assert stats["overlapped_steps"] >= stats["steps"] // 2, stats
  while engine.has_unfinished():
    engine.step()
  assert engine.stats()["kv_pages_used"] == 0


def test_speculative_rejects_bad_config(random_model):
  cfg, params = random_model
  with pytest.raises(ValueError, match="num_draft_tokens"):
    MTPConfig(num_draft_tokens=0)
  with pytest.raises(ValueError, match="batch_schedule"):
    MTPConfig(num_draft_tokens=2, batch_schedule=((4, 9),))
  with pytest.raises(TypeError, match="MTPConfig"):
    EngineConfig(speculative=3)
  no_mtp = dataclasses.replace(cfg, num_mtp_layers=0)
  with pytest.raises(ValueError, match="MTP modules"):
    Engine(no_mtp, models.init_params(no_mtp, jax.random.key(0)),
           EngineConfig(**ENGINE, num_pages=16, speculative=MTPConfig()))
  assert MTPConfig(num_draft_tokens=3, batch_schedule=((8, 1), (32, 0))).draft_tokens_for(9) == 1
  assert MTPConfig(num_draft_tokens=3, batch_schedule=((8, 1), (32, 0))).draft_tokens_for(40) == 0
  assert MTPConfig().draft_tokens_for(15) == 3 and MTPConfig().draft_tokens_for(16) == 2
  assert MTPConfig(num_draft_tokens=1).draft_tokens_for(16) == 1  # the schedule never raises K


def test_sampled_speculative_output_follows_the_target_distribution():
  # Vocab 8, peaked logits; the random MTP modules draft from a different q.
  V, T, TOP_K = 8, 0.9, 6
  cfg = _cfg(vocab_size=V)
  params = models.init_params(cfg, jax.random.key(3))
  params = dict(params, lm_head=params["lm_head"] * 4.0)
  prompt = [1, 5, 2]
  n = 1600
  sampling = [SamplingParams(max_tokens=4, temperature=T, top_k=TOP_K, seed=i) for i in range(n)]
  # One page a request and 160 at a time: 4 step programs and 41 steps
  # (pages of 4 tokens and 32 at a time compiled 6 and took 202 steps).
  engine = Engine(cfg, params, EngineConfig(page_size=16, num_pages=170, max_num_seqs=160,
                                            max_num_batched_tokens=512,
                                            enable_prefix_caching=False,
                                            speculative=MTPConfig(num_draft_tokens=2,
                                                                  batch_schedule=())))
  outs = engine.generate([prompt] * n, sampling)
  stats = engine.stats()
  acc = stats["spec_acceptance_per_position"]
  assert 0.05 < acc[0] < 0.95, acc  # both accepted and resampled paths ran

  # Exact target distribution of the first three tokens.
  seqs = np.asarray([prompt + list(t) for t in itertools.product(range(V), repeat=2)], np.int32)
  logits = models.logits(cfg, params, seqs)[:, len(prompt) - 1:]  # [64, 3, V]

  def probs(lg):
    flat = lg.reshape(-1, V)
    f = filter_logits(flat, jnp.full((len(flat),), T), jnp.full((len(flat),), TOP_K, jnp.int32),
                      jnp.ones((len(flat),)))
    return np.asarray(jax.nn.softmax(f, -1)).reshape(lg.shape)

  p = probs(logits)
  exact = np.einsum("a,abc->abc", p[0, 0],
                    np.einsum("ab,abc->abc", p[::V, 1].reshape(V, V),
                              p[:, 2].reshape(V, V, V)))
  counts = np.zeros((V, V, V))
  for o in outs:
    a, b, c = o.token_ids[:3]
    counts[a, b, c] += 1
  expected = exact.reshape(-1) * n
  observed = counts.reshape(-1)
  big = expected >= 5
  obs = np.append(observed[big], observed[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  chi2 = float(np.sum((obs - exp) ** 2 / np.maximum(exp, 1e-9)))
  dof = len(obs) - 1
  print(f"chi2 {chi2:.1f} on {dof} dof; acceptance {acc}")
  assert chi2 < dof + 6 * np.sqrt(2 * dof), (chi2, dof)
  # The test has power: the drafts' own distribution is far from the target's.
  assert np.abs(counts.sum((1, 2)) / n - p[0, 0]).max() < 0.05


def test_unrolled_speculative_greedy_equals_scanned_plain_greedy():
  """The step layout (per-layer, transposed projections, split experts)
  under MTP speculation: the greedy tokens of plain scanned decoding."""
  cfg = _cfg()
  params = models.init_params(cfg, jax.random.PRNGKey(3))
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 23, 40)]
  sampling = SamplingParams(max_tokens=12)
  outs = []
  for unroll, spec in ((False, None), (True, MTPConfig(num_draft_tokens=2))):
    eng = Engine(cfg, params, EngineConfig(page_size=8, num_pages=64, max_num_batched_tokens=32,
                                           unroll_layers=unroll, speculative=spec,
                                           cpu_weight_layout="out_in"))
    outs.append([o.token_ids for o in eng.generate(prompts, sampling)])
  assert isinstance(eng._model.params["layers"][0], tuple)  # the unrolled engine ran last
  assert any(isinstance(w, PackedLinear) for w in jax.tree.leaves(
      eng._model.params, is_leaf=lambda w: isinstance(w, PackedLinear)))
  assert outs[0] == outs[1]
  assert all(len(o) == 12 for o in outs[1])
