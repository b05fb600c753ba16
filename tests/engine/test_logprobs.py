"""Per-token logprobs (`SamplingParams.logprobs` / `prompt_logprobs`):
every entry equals log_softmax of a full forward over the request's tokens
at its position, through async and sync scheduling, multi-step decode,
chunked prefill, the prefix cache, preemption, abort, attention DP and MTP
speculation; bad values are refused; steps without them keep their programs.

One small model (2 layers, an MTP module) and one engine shape for every
test (fixed step shapes, one pool size), so a test worker compiles each
step program once: the time here is compiling."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts
from jaxinfer import Engine, EngineConfig, MTPConfig, SamplingParams, models, presets, sharding
from jaxinfer.engine import TokenLogprobs
from jaxinfer.engine.sampling import MAX_LOGPROBS

TOL = 1e-4
# 8 pages of 8 tokens: the preemption test's requests do not fit together.
CONFIG = dict(page_size=8, num_pages=9, max_num_seqs=4, max_num_batched_tokens=32,
              prefill_chunk_size=8, fixed_step_shapes=True)
FORWARD = (4, 40)  # the reference forward's one shape: sequences, tokens


@pytest.fixture(scope="module")
def model():
  cfg = dataclasses.replace(presets.get("tiny_dense"), dtype="float32", num_layers=2,
                            num_mtp_layers=1)
  return cfg, models.init_params(cfg, jax.random.key(0))


def _forward_logprobs(cfg, params, seqs) -> list[np.ndarray]:
  """log_softmax of the full forward over each sequence, [len, V] (one batch:
  causal, so the padding after a sequence leaves its rows alone)."""
  tokens = np.zeros(FORWARD, np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  ref = np.asarray(jax.nn.log_softmax(models.logits(cfg, params, jnp.asarray(tokens)), -1))
  return [r[:len(s)] for r, s in zip(ref, seqs)]


def _check_entry(entry, ref_row, token: int, k: int):
  """entry scores `token` under ref_row (the logprobs predicting it), with
  the k most likely tokens."""
  assert isinstance(entry, TokenLogprobs) and entry.token_id == token
  assert abs(entry.logprob - ref_row[token]) < TOL
  ids, lps = [i for i, _ in entry.top], [lp for _, lp in entry.top]
  assert len(ids) == k and len(set(ids)) == k
  np.testing.assert_allclose(lps, np.sort(ref_row)[::-1][:k], atol=TOL)  # the k largest
  np.testing.assert_allclose(lps, ref_row[ids], atol=TOL)  # ... of these tokens


def assert_match_forward(cfg, params, prompts, samplings, outs):
  """Each output's logprobs (aligned with its tokens) and prompt logprobs
  equal the full forward's; greedy requests' tokens are its argmax."""
  seqs = [p + o.token_ids for p, o in zip(prompts, outs)]
  for p, sp, o, ref in zip(prompts, samplings, outs, _forward_logprobs(cfg, params, seqs)):
    n = len(p)
    if sp.temperature == 0:
      assert o.token_ids == ref[n - 1:-1].argmax(-1).tolist()
    if sp.logprobs is None:
      assert o.logprobs is None
    else:
      assert len(o.logprobs) == len(o.token_ids) > 0
      for j, (entry, token) in enumerate(zip(o.logprobs, o.token_ids)):
        _check_entry(entry, ref[n - 1 + j], token, sp.logprobs)
    if sp.prompt_logprobs is None:
      assert o.prompt_logprobs is None
    else:
      assert len(o.prompt_logprobs) == n and o.prompt_logprobs[0] is None
      for i in range(1, n):
        _check_entry(o.prompt_logprobs[i], ref[i - 1], p[i], sp.prompt_logprobs)


MIXED = [SamplingParams(max_tokens=7, logprobs=5),
         SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=0),
         SamplingParams(max_tokens=5)]


@pytest.mark.parametrize("async_scheduling,decode_steps", [(True, 1), (False, 1), (True, 4)])
def test_generated_logprobs_equal_full_forward(model, async_scheduling, decode_steps):
  cfg, params = model
  prompts = random_prompts(cfg, [11, 5, 7])
  eng = Engine(cfg, params, EngineConfig(**CONFIG, async_scheduling=async_scheduling,
                                         decode_steps=decode_steps))
  outs = eng.generate(prompts, MIXED)
  assert [len(o.token_ids) for o in outs] == [7, 6, 5]  # multi-step: tokens past max_tokens dropped
  assert_match_forward(cfg, params, prompts, MIXED, outs)
  # A stop token: the tokens computed after it (and their logprobs) are dropped.
  stop = SamplingParams(max_tokens=7, logprobs=2, stop_token_ids=(outs[0].token_ids[2],))
  out = eng.generate(prompts[:1], stop)[0]
  assert out.finish_reason == "stop" and out.token_ids[-1] == outs[0].token_ids[2]
  assert_match_forward(cfg, params, prompts[:1], [stop], [out])


def test_prompt_logprobs_span_chunks_and_skip_the_prefix_cache(model):
  cfg, params = model
  prompt = random_prompts(cfg, [21], seed=1)[0]  # 3 chunks of 8
  eng = Engine(cfg, params, EngineConfig(**CONFIG))
  sp = SamplingParams(max_tokens=3, logprobs=1, prompt_logprobs=4)
  first = eng.generate([prompt], sp)[0]
  assert_match_forward(cfg, params, [prompt], [sp], [first])
  # Its pages are cached now: a request asking prompt logprobs computes the
  # whole prompt anyway, one that does not reuses them.
  again, plain = (eng.generate([prompt], s)[0] for s in (sp, SamplingParams(max_tokens=3)))
  assert again.metrics.cached_prompt_tokens == 0 and plain.metrics.cached_prompt_tokens == 16
  assert again.prompt_logprobs[0] is None
  for a, b in zip(again.prompt_logprobs[1:], first.prompt_logprobs[1:]):
    assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < TOL
  assert again.token_ids == plain.token_ids == first.token_ids


def test_logprobs_stay_aligned_through_preemption_and_abort(model):
  cfg, params = model
  prompts = random_prompts(cfg, [14, 17, 11], seed=2)
  sp = [SamplingParams(max_tokens=12, logprobs=1, prompt_logprobs=1)] * 3
  eng = Engine(cfg, params, EngineConfig(**CONFIG))  # they need 4 + 4 + 3 pages at the end
  outs = eng.generate(prompts, sp)
  assert eng.stats()["preemptions"] > 0
  assert_match_forward(cfg, params, prompts, sp, outs)
  # Abort mid-decode, with a step in flight: the lists stop with the tokens.
  eng = Engine(cfg, params, EngineConfig(**CONFIG))
  rid = eng.submit(prompts[0], sp[0])
  while len(eng.output(rid).token_ids) < 2:
    eng.step()
  out = eng.abort(rid)
  while eng.has_unfinished():
    eng.step()
  assert out.finish_reason == "abort" and eng.output(rid).logprobs == out.logprobs
  assert_match_forward(cfg, params, prompts[:1], sp[:1], [out])


def test_attention_dp_logprobs_equal_full_forward(model):
  # Two ranks, chunked prompts, then multi-step decode on both (the ranked scan).
  cfg, params = model
  prompts = random_prompts(cfg, [19, 6, 9], seed=3)
  sp = [SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2), MIXED[1], MIXED[2]]
  mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])
  eng = Engine(cfg, params, EngineConfig(**CONFIG, decode_steps=3), mesh=mesh,
               layout="dp_attn_ep")
  outs = eng.generate(prompts, sp)
  assert eng.num_ranks == 2 and all(eng.stats()["requests_per_rank"])
  assert any(key[1] == 3 for key in eng._runner.counts.programs)  # a multi-step decode ran
  assert_match_forward(cfg, params, prompts, sp, outs)


def _near_bigram(cfg, params, scale=0.3):
  """Small layer outputs and an MTP module that passes the next token's
  embedding through: the target's next token depends mostly on the last
  one, which the MTP draft predicts. Drafts are accepted and rejected."""
  params = jax.tree.map(lambda a: a, params)
  for block in (params["layers"][0], params["mtp"]["block"]):
    block["attn"]["wo"] = block["attn"]["wo"] * scale
    block["mlp"]["w_down"] = block["mlp"]["w_down"] * scale
  D = cfg.d_model
  params["mtp"]["eh_proj"] = jnp.concatenate([jnp.eye(D), jnp.zeros((D, D))])[None]
  return params


@pytest.mark.parametrize("ranks", [1, 2])
def test_speculative_logprobs_equal_plain_decoding(model, ranks):
  # The accepted drafts' logprobs come from the verify logits: the full
  # forward's, as plain decoding gives them (greedy tokens equal its argmax).
  # ranks 2: attention DP (the Mtp step run whole per rank).
  cfg, params = model
  params = _near_bigram(cfg, params)
  prompts = random_prompts(cfg, [13, 5, 9], seed=4)
  sp = [SamplingParams(max_tokens=12, logprobs=3, prompt_logprobs=2),
        SamplingParams(max_tokens=9, logprobs=MAX_LOGPROBS),
        SamplingParams(max_tokens=5, temperature=0.9, logprobs=1, prompt_logprobs=0)]
  mesh = dict(mesh=sharding.make_mesh({"data": 2}, jax.devices()[:2]),
              layout="dp_attn_ep") if ranks > 1 else {}
  eng = Engine(cfg, params, EngineConfig(**CONFIG, speculative=MTPConfig(num_draft_tokens=2,
                                                                         batch_schedule=())),
               **mesh)
  outs = eng.generate(prompts, sp)
  accepted = eng.stats()["spec_acceptance_per_position"]
  assert 0 < accepted[0] < 1, accepted  # drafts accepted and rejected
  assert_match_forward(cfg, params, prompts, sp, outs)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, True, 1.5, "2"])
def test_bad_values_are_refused(name, value):
  with pytest.raises(ValueError, match=name):
    SamplingParams(**{name: value})
  assert getattr(SamplingParams(**{name: MAX_LOGPROBS}), name) == MAX_LOGPROBS


def test_steps_without_logprobs_keep_their_programs(model):
  # A plain run's programs take no logprobs (their key says so, and each
  # request's lists stay None); a run asking for them compiles its own, and
  # plain requests afterwards reuse the plain programs.
  cfg, params = model
  prompts = random_prompts(cfg, [11, 5, 7])
  eng = Engine(cfg, params, EngineConfig(**CONFIG, enable_prefix_caching=False))  # same shapes
  plain = eng.generate(prompts, MIXED[2])
  keys = set(eng._runner.counts.programs)
  assert {key[3] for key in keys} == {(False, False)}
  assert all(o.logprobs is None and o.prompt_logprobs is None for o in plain)
  eng.generate(prompts, SamplingParams(max_tokens=5, logprobs=0, prompt_logprobs=0))
  assert {key[3] for key in eng._runner.counts.programs} == {(False, False), (True, False),
                                                             (True, True)}
  assert [o.token_ids for o in eng.generate(prompts, MIXED[2])] == [o.token_ids for o in plain]
  assert {k for k in eng._runner.counts.programs if k[3] == (False, False)} == keys
