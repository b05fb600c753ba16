"""MTP speculation on a mesh: greedy tokens under tp, tp_attn_ep and
dp_attn_ep equal single-device plain greedy, and the drafts verified and
accepted per position equal single-device speculation, on the shipped model
(MLA + MoE + MTP, drafts accepted and rejected). Pipelined (async) steps,
ranks idle while others decode, requests that end mid-draft (max_tokens not a
multiple of K + 1) and a request submitted while the others run."""

import dataclasses

import jax
import numpy as np
import pytest

import jaxinfer
from jaxinfer import sharding, training
from jaxinfer.engine import Engine, EngineConfig, MTPConfig, SamplingParams

ENGINE = EngineConfig(page_size=8, num_pages=48, max_num_seqs=4, max_num_batched_tokens=32,
                      prefill_chunk_size=16)
MAX_TOKENS = (10, 7, 13)  # none a multiple of K + 1 for every K: some end mid-draft


@pytest.fixture(scope="module")
def model():
  cfg, params, _ = jaxinfer.load_default_model()
  cfg = dataclasses.replace(cfg, dtype="float32")
  params = jax.tree.map(lambda a: a.astype(np.float32), params)
  prompts = training.held_out_prompts([5, 30, 12])
  return cfg, params, prompts


def _run(engine, prompts):
  """Two requests first; the third joins once they decode (the ranks that
  hold nothing stay idle meanwhile). -> (tokens per request, stats)."""
  ids = [engine.submit(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts[:2], MAX_TOKENS)]
  for _ in range(3):
    engine.step()
  ids.append(engine.submit(prompts[2], SamplingParams(max_tokens=MAX_TOKENS[2])))
  while engine.has_unfinished():
    engine.step()
  for a in engine.allocators:
    a.check_consistency()
  return [engine.output(i).token_ids for i in ids], engine.stats()


@pytest.fixture(scope="module")
def refs(model):
  """Single device: plain greedy tokens, and speculation's stats per K (each
  K run when a test first asks for it: a test worker runs only its own)."""
  cfg, params, prompts = model
  plain, _ = _run(Engine(cfg, params, ENGINE), prompts)
  spec = {}

  def spec_stats(K):
    if K not in spec:
      tokens, spec[K] = _run(Engine(cfg, params, _spec(K)), prompts)
      assert tokens == plain, K
    return spec[K]
  return plain, spec_stats


def _spec(K):
  return dataclasses.replace(ENGINE, speculative=MTPConfig(num_draft_tokens=K))


@pytest.mark.parametrize("layout,axes,K", [
    ("dp_attn_ep", {"data": 4, "expert": 2}, 3),
    ("tp_attn_ep", {"tensor": 2, "expert": 4}, 3),
    # (CI time: one case per placement of the step. Attention DP runs the
    # one-rank step whole per rank (`ranks.per_rank`), the path of the plain
    # DP steps in tests/sharding/test_sharding.py and tests/engine/test_multistep.py, with K = 2
    # in tests/engine/test_logprobs.py; tp_attn_ep splits heads as tp does.)
])
def test_speculative_on_mesh_equals_single_device(model, refs, layout, axes, K):
  cfg, params, prompts = model
  plain, spec = refs
  engine = Engine(cfg, params, _spec(K), mesh=sharding.make_mesh(axes), layout=layout)
  tokens, stats = _run(engine, prompts)
  assert tokens == plain
  for key in ("spec_drafted_per_position", "spec_acceptance_per_position", "spec_verify_steps"):
    assert stats[key] == spec(K)[key], key
  acc = stats["spec_acceptance_per_position"]
  assert 0 < acc[0] < 1, acc  # drafts were both accepted and rejected
  assert stats["overlapped_steps"] > 0  # pipelined steps ran
  if layout == "dp_attn_ep":
    assert engine.num_ranks == 8 and sorted(stats["requests_per_rank"])[-3:] == [1, 1, 1]
  assert stats["kv_pages_used"] == 0


def test_disaggregated_prefill_to_speculating_dp_decode(model, refs):
  # Prefill tensor-parallel on devices 0-3, decode attention-DP + EP on 4-7,
  # both speculating: the MTP modules' K/V travels in the pages and the
  # prefill's drafts with them, so the decode side verifies drafts from its
  # first step, exactly as one engine does.
  from jaxinfer.serving.cluster import Cluster
  from jaxinfer.serving.disagg import DisaggConfig
  from jaxinfer.serving.worker import Worker
  cfg, params, prompts = model
  plain, _ = refs
  K = 2
  one = Engine(cfg, params, _spec(K))
  sampling = [SamplingParams(max_tokens=n) for n in MAX_TOKENS]
  ref = one.generate(prompts, sampling)
  assert [o.token_ids for o in ref] == plain
  devices = jax.devices()
  prefill = Worker(cfg, params, _spec(K), role="prefill", devices=devices[:4],
                   mesh_axes={"tensor": 4}, layout="tp", name="prefill")
  decode = Worker(cfg, params, _spec(K), role="decode", devices=devices[4:8],
                  mesh_axes={"data": 2, "expert": 2}, layout="dp_attn_ep", name="decode")
  cluster = Cluster([prefill, decode], disagg=DisaggConfig(mode="always"))
  outs = cluster.generate(prompts, sampling)
  assert [o.token_ids for o in outs] == plain
  assert all(o.prefill_worker == 0 and o.worker == 1 for o in outs)
  got, want = decode.engine.stats(), one.stats()
  for key in ("spec_drafted_per_position", "spec_acceptance_per_position", "spec_verify_steps"):
    assert got[key] == want[key], key
  for w in cluster.workers:
    for a in w.engine.allocators:
      a.check_consistency()
      assert a.num_used() == 0
