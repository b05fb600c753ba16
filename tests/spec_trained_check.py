"""Trained-model greedy equality for K = 1, 2, 3 (run by
tests/test_speculative.py in a fresh process): the shipped model drafts well
enough that drafts are both accepted and rejected; held-out source of mixed
lengths, chunked prefill, preemption."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import conftest  # noqa: E402,F401  (8 CPU devices, compile cache)

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


if __name__ == "__main__":
  main()
