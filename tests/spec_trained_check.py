"""Trained-model greedy equality for K = 1, 2, 3 (run by
tests/test_speculative.py in a fresh process): the shipped model drafts well
enough that drafts are both accepted and rejected; held-out source of mixed
lengths, chunked prefill, preemption."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import conftest  # noqa: E402,F401  (8 CPU devices)

import jaxinfer  # noqa: E402
from jaxinfer import training  # noqa: E402
from jaxinfer.engine import Engine, EngineConfig, MTPConfig, SamplingParams  # noqa: E402

ENGINE = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=24, prefill_chunk_size=8)


def main():
  # The shipped model drafts well enough that drafts are both accepted and
  # rejected; held-out source of mixed lengths, chunked prefill, preemption.
  cfg, params, _ = jaxinfer.load_default_model()
  prompts = training.held_out_prompts([7, 40, 23])
  sampling = SamplingParams(max_tokens=16)
  ref = Engine(cfg, params, EngineConfig(**ENGINE, num_pages=18)).generate(prompts, sampling)
  for K in (1, 2, 3):
    engine = Engine(cfg, params, EngineConfig(**ENGINE, num_pages=18,
                                              speculative=MTPConfig(num_draft_tokens=K)))
    out = engine.generate(prompts, sampling)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref], K
    while engine.has_unfinished():  # a pipelined step may still be in flight
      engine.step()
    stats = engine.stats()
    assert stats["preemptions"] > 0, K
    acc = stats["spec_acceptance_per_position"]
    # Drafts were accepted, and some rejected (the accepted length stays under K + 1).
    assert len(acc) == K and acc[0] > 0.2, (K, acc)
    assert 1.0 < stats["spec_mean_accepted_length"] < K + 1, stats
    # EPLB statistics are recorded in speculative steps too: every row run, no padding.
    rows = round(stats["tokens_per_step"] * stats["steps"])
    np.testing.assert_array_equal(engine.expert_load().sum(-1), rows * cfg.num_experts_per_tok)
    print(f"ok K={K}: acceptance {acc}, accepted length {stats['spec_mean_accepted_length']:.2f}")


def pipelined():
  # Decode-only steps are pipelined (dispatched before the previous step is
  # read): requests ending mid-block on max_tokens or on a stop token, and
  # one running into the context limit, still match plain greedy exactly.
  cfg, params, _ = jaxinfer.load_default_model()
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
  print(f"ok pipelined: {stats['overlapped_steps']} of {stats['steps']} steps overlapped, "
        f"accepted length {stats['spec_mean_accepted_length']:.2f}")


if __name__ == "__main__":
  main()
  pipelined()
