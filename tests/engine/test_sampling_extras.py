"""vLLM's extra sampling parameters (`SamplingParams.min_tokens`,
`logit_bias`, the repetition / presence / frequency penalties, `ignore_eos`)
applied in the jitted steps: greedy tokens equal repeated full forwards
whose last logits go through a numpy reference of each, under async and
sync scheduling, multi-step decode and attention DP; sampled rows stay
independent of their batch and never draw a masked token; bad values and
speculative engines refuse; steps without extras keep their programs.

One small model and one engine shape for every test (fixed step shapes),
so a test worker compiles each step program once."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts
from jaxinfer import Engine, EngineConfig, MTPConfig, SamplingParams, models, presets, sharding
from jaxinfer.engine.sampling import MAX_LOGIT_BIAS

EOS = 7
CONFIG = dict(page_size=16, num_pages=16, max_num_seqs=4, max_num_batched_tokens=32,
              prefill_chunk_size=16, fixed_step_shapes=True)
FORWARD = (4, 40)  # the reference forward's one shape: sequences, tokens
SCHEDULES = [dict(async_scheduling=True), dict(async_scheduling=False),
             dict(async_scheduling=True, decode_steps=4)]


@pytest.fixture(scope="module")
def model():
  cfg = dataclasses.replace(presets.get("tiny_dense"), dtype="float32", num_layers=2,
                            eos_token_ids=(EOS,))
  return cfg, models.init_params(cfg, jax.random.key(0))


def processed_ref(logits, prompt, output, sp: SamplingParams, stops):
  """numpy float32 reference of the step's processing of one row, in
  vLLM's order: min_tokens' mask and logit_bias, repetition, then
  frequency and presence."""
  x = np.array(logits, np.float32)
  for t, v in sp.logit_bias:
    x[t] += np.float32(v)
  if len(output) < sp.min_tokens:
    x[sorted(stops)] = -np.inf
  counts = np.bincount(np.asarray(output, int), minlength=x.size).astype(np.float32)
  seen = counts > 0
  seen[prompt] = True
  r = np.float32(sp.repetition_penalty)
  x = np.where(seen, np.where(x > 0, x / r, x * r), x)
  return (x - np.float32(sp.frequency_penalty) * counts
          - np.float32(sp.presence_penalty) * (counts > 0))


def _stops(cfg, sp):
  return set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(cfg.eos_token_ids))


def reference(cfg, params, prompts, samplings) -> list[list[int]]:
  """Greedy decoding by repeated full forwards (one fixed shape), each
  sequence's last logits processed by `processed_ref`; stops as the engine."""
  outs, live = [[] for _ in prompts], set(range(len(prompts)))
  while live:
    tokens = np.zeros(FORWARD, np.int32)
    for i in live:
      seq = prompts[i] + outs[i]
      tokens[i, :len(seq)] = seq
    logits = np.asarray(models.logits(cfg, params, jnp.asarray(tokens)))
    for i in sorted(live):
      sp, n = samplings[i], len(prompts[i]) + len(outs[i])
      t = int(np.argmax(processed_ref(logits[i, n - 1], prompts[i], outs[i], sp,
                                      _stops(cfg, sp))))
      outs[i].append(t)
      if t in _stops(cfg, sp) or len(outs[i]) == sp.max_tokens:
        live.discard(i)
  return outs


PENALTIES = [SamplingParams(max_tokens=12, repetition_penalty=3.0),
             SamplingParams(max_tokens=12, frequency_penalty=2.0),
             SamplingParams(max_tokens=12, presence_penalty=2.0),
             SamplingParams(max_tokens=12)]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=["async", "sync", "decode_steps4"])
def test_penalties_equal_the_reference(model, schedule):
  cfg, params = model
  prompts = random_prompts(cfg, [9, 5, 12, 7], seed=10)
  eng = Engine(cfg, params, EngineConfig(**CONFIG, **schedule))
  got = [o.token_ids for o in eng.generate(prompts, PENALTIES)]
  assert got == reference(cfg, params, prompts, PENALTIES)
  if "decode_steps" in schedule:  # multi-step decodes with penalties ran (tokens in flight)
    assert any(k[1] == 4 and k[4] is not None for k in eng._runner.counts.programs)
  plain = reference(cfg, params, prompts, [SamplingParams(max_tokens=12)] * 4)
  assert all(g != p for g, p in zip(got[:3], plain[:3]))  # each penalty changed the tokens
  assert got[3] == plain[3]  # ... of its own request only


def test_logit_bias_equals_the_reference(model):
  cfg, params = model
  prompts = random_prompts(cfg, [6, 10], seed=2)
  plain = reference(cfg, params, prompts, [SamplingParams(max_tokens=8)] * 2)
  sp = [SamplingParams(max_tokens=8, logit_bias={42: 100.0}),
        SamplingParams(max_tokens=8, logit_bias=((plain[1][0], -100), (3, 0.5)))]
  got = [o.token_ids for o in Engine(cfg, params, EngineConfig(**CONFIG)).generate(prompts, sp)]
  assert got[0] == [42] * 8
  assert got[1] != plain[1] and got[1][0] != plain[1][0]
  assert got == reference(cfg, params, prompts, sp)


@pytest.mark.parametrize("schedule", SCHEDULES[::2], ids=["async", "decode_steps4"])
def test_min_tokens_hold_the_stop_tokens_back(model, schedule):
  # A +100 bias makes the stop token (EOS, or a stop_token_ids entry) the
  # argmax at every step: without min_tokens it comes first.
  cfg, params = model
  prompts = random_prompts(cfg, [8, 11, 6, 9], seed=3)
  sp = [SamplingParams(max_tokens=10, min_tokens=5, logit_bias={EOS: 100}),
        SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=(50,), logit_bias={50: 100}),
        SamplingParams(max_tokens=10, logit_bias={EOS: 100}),
        SamplingParams(max_tokens=10, ignore_eos=True, min_tokens=2, logit_bias={EOS: 100})]
  eng = Engine(cfg, params, EngineConfig(**CONFIG, **schedule))
  outs = eng.generate(prompts, sp)
  got = [o.token_ids for o in outs]
  assert got == reference(cfg, params, prompts, sp)
  assert [len(t) for t in got] == [6, 4, 1, 10]
  assert got[0][-1] == EOS and EOS not in got[0][:-1] and 50 not in got[1][:-1]
  assert [o.finish_reason for o in outs] == ["stop", "stop", "stop", "length"]
  assert got[3][2:] == [EOS] * 8  # ignore_eos: EOS is just a token, up to max_tokens


def test_sampled_rows_ignore_their_batch_and_masked_tokens(model):
  cfg, params = model
  prompts = random_prompts(cfg, [7, 9, 4], seed=5)
  mine = SamplingParams(max_tokens=10, temperature=1.0, seed=11, repetition_penalty=1.5,
                        frequency_penalty=0.5, presence_penalty=0.5, min_tokens=10,
                        stop_token_ids=(60,), logit_bias={60: 100, 61: 100})
  others = [SamplingParams(max_tokens=10, temperature=0.7, seed=1),
            SamplingParams(max_tokens=10, frequency_penalty=-1.0, logit_bias={9: 3.0})]
  eng = Engine(cfg, params, EngineConfig(**CONFIG))
  alone = eng.generate(prompts[:1], mine)[0].token_ids
  together = eng.generate(prompts, [mine, *others])[0].token_ids
  assert alone == together and len(alone) == 10
  # 60 (+100, a stop token) is masked until min_tokens; 61 (+100) is not.
  assert 60 not in alone and alone.count(61) >= 8


def test_attention_dp_equals_one_device(model):
  # Two ranks, then multi-step decode on both (the ranked scan), with every
  # extra: the reference's tokens, which one device gives (tests above).
  cfg, params = model
  prompts = random_prompts(cfg, [9, 5, 12, 7], seed=6)
  sp = [*PENALTIES[:2], SamplingParams(max_tokens=12, min_tokens=4, logit_bias={EOS: 100}),
        SamplingParams(max_tokens=12, presence_penalty=-2.0, logit_bias={5: 2.0, 6: -3.0})]
  mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])
  dp = Engine(cfg, params, EngineConfig(**CONFIG, decode_steps=3), mesh=mesh,
              layout="dp_attn_ep")
  got = [o.token_ids for o in dp.generate(prompts, sp)]
  assert dp.num_ranks == 2 and all(dp.stats()["requests_per_rank"])
  assert any(k[1] == 3 and k[4] for k in dp._runner.counts.programs)  # the ranked scan ran
  assert got == reference(cfg, params, prompts, sp)


def test_steps_without_extras_keep_their_programs(model):
  cfg, params = model
  prompts = random_prompts(cfg, [9, 5, 12, 7], seed=1)
  eng = Engine(cfg, params, EngineConfig(**CONFIG, enable_prefix_caching=False))
  plain = eng.generate(prompts, SamplingParams(max_tokens=6))
  keys = set(eng._runner.counts.programs)
  assert {key[4] for key in keys} == {None}
  eng.generate(prompts, PENALTIES)
  assert any(key[4] is not None for key in eng._runner.counts.programs)
  again = eng.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))  # host only
  assert [o.token_ids for o in again] == [o.token_ids for o in plain]
  assert {k for k in eng._runner.counts.programs if k[4] is None} == keys


@pytest.mark.parametrize("name,value", [
    ("ignore_eos", 1), ("ignore_eos", "yes"),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", True), ("min_tokens", 2.0),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("repetition_penalty", float("nan")), ("repetition_penalty", 1e-50), ("repetition_penalty", True),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", False),
    ("frequency_penalty", float("nan")), ("frequency_penalty", "1"),
    ("logit_bias", {1: 101.0}), ("logit_bias", {1: float("nan")}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {True: 1.0}), ("logit_bias", {1: True}), ("logit_bias", ((1, 1.0), (1, 2.0))),
    ("logit_bias", ((1,),)), ("logit_bias", "12"), ("logit_bias", 5),
    ("logit_bias", {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})])
def test_bad_values_are_refused(name, value):
  with pytest.raises(ValueError, match=name):
    SamplingParams(**{name: value})


def test_good_values_are_normalized():
  sp = SamplingParams(logit_bias={5: 1, 2: -100.0}, min_tokens=16, repetition_penalty=1e-30)
  assert sp.logit_bias == ((2, -100.0), (5, 1.0)) and hash(sp)
  assert SamplingParams(logit_bias=[(5, 1), (2, -100)]) == dataclasses.replace(sp, min_tokens=0,
                                                                               repetition_penalty=1)
  assert SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS)}).uses_extras
  assert not SamplingParams(ignore_eos=True).uses_extras


def test_engines_check_the_vocabulary_and_speculation(model):
  cfg, params = model
  eng = Engine(cfg, params, EngineConfig(**CONFIG))
  with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 256\)"):
    eng.submit([1, 2], SamplingParams(logit_bias={256: 1.0}))
  mtp_cfg = dataclasses.replace(cfg, num_mtp_layers=1)
  zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),  # values unused: nothing runs
                       jax.eval_shape(lambda: models.init_params(mtp_cfg, jax.random.key(0))))
  spec = Engine(mtp_cfg, zeros, EngineConfig(**CONFIG, speculative=MTPConfig(num_draft_tokens=2)))
  for sp in (SamplingParams(repetition_penalty=1.1), SamplingParams(min_tokens=2),
             SamplingParams(logit_bias={3: 1.0}), SamplingParams(frequency_penalty=0.1)):
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
      spec.submit([1, 2], sp)
  spec.submit([1, 2], SamplingParams(ignore_eos=True))  # host only: works everywhere
