"""Workloads: arrival processes, the prefix structure of each generator, the
Mooncake trace replay, and the summary's shared-prefix fraction."""

import json

import numpy as np
import pytest

from jaxinfer.serving import workloads as wl
from jaxinfer.serving.workloads import Item

V = 1000


def _in_vocab(items, vocab=V):
  return all(0 <= t < vocab for it in items for t in it.prompt)


def test_poisson_mean_gap_and_burst():
  t = wl.poisson_times(20000, 5.0, seed=1, start=2.0)
  gaps = np.diff(t)
  assert t[0] == 2.0 and np.all(gaps >= 0)
  assert gaps.mean() == pytest.approx(0.2, rel=0.03)
  assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
  assert np.array_equal(t, wl.poisson_times(20000, 5.0, seed=1, start=2.0))
  assert not np.array_equal(t, wl.poisson_times(20000, 5.0, seed=2, start=2.0))
  assert np.array_equal(wl.poisson_times(4, float("inf"), start=1.5), [1.5] * 4)


def test_independent_shares_no_prefix():
  items = wl.independent(200, 10.0, vocab_size=V, min_len=16, max_len=40, max_tokens=8, seed=0)
  assert len(items) == 200 and _in_vocab(items)
  assert all(16 <= len(it.prompt) <= 40 and it.max_tokens == 8 for it in items)
  assert len({it.prompt[:16] for it in items}) == 200
  assert [it.arrival_s for it in items] == sorted(it.arrival_s for it in items)
  assert wl.summary(items)["shared_prefix_fraction"] < 0.01


def test_shared_system_prompt_items_share_the_prefix():
  items = wl.shared_system_prompt(60, 10.0, vocab_size=V, num_system_prompts=3, system_len=32,
                                  user_min=4, user_max=12, max_tokens=8, seed=0)
  assert _in_vocab(items)
  systems = {it.prompt[:32] for it in items}
  assert len(systems) == 3  # 60 draws over 3 prompts: all used
  assert all(4 <= len(it.prompt) - 32 <= 12 for it in items)
  assert len({it.prompt[32:] for it in items}) == 60  # user parts differ
  assert wl.summary(items)["shared_prefix_fraction"] > 0.6


def test_multi_turn_extends_the_previous_turn_exactly():
  items = wl.multi_turn(5, 4, 2.0, vocab_size=V, system_len=16, user_len=8, reply_len=6,
                        think_s=3.0, max_tokens=8, seed=0)
  assert len(items) == 20 and _in_vocab(items)
  assert [it.arrival_s for it in items] == sorted(it.arrival_s for it in items)
  assert len({it.prompt[:16] for it in items}) == 1  # one system prompt for all
  by = {(it.session, it.turn): it for it in items}
  for s in range(5):
    assert len(by[s, 0].prompt) == 16 + 8
    for t in range(1, 4):
      prev, cur = by[s, t - 1], by[s, t]
      assert cur.prompt[:len(prev.prompt)] == prev.prompt
      assert len(cur.prompt) == len(prev.prompt) + 6 + 8
      assert cur.arrival_s == pytest.approx(prev.arrival_s + 3.0)
  assert len({by[s, 0].prompt for s in range(5)}) == 5  # conversations differ after the system prompt
  again = wl.multi_turn(5, 4, 2.0, vocab_size=V, system_len=16, user_len=8, reply_len=6,
                        think_s=3.0, max_tokens=8, seed=0)
  assert again == items
  assert wl.summary(items)["shared_prefix_fraction"] > 0.5


def _rows():
  return [
      {"timestamp": 0, "input_length": 20, "output_length": 5, "hash_ids": [0, 1, 2]},
      {"timestamp": 1500, "input_length": 18, "output_length": 900, "hash_ids": [0, 1, 3]},
      {"timestamp": 500, "input_length": 7, "output_length": 0, "hash_ids": [4]},
      {"timestamp": 2000, "input_length": 12, "output_length": 3, "hash_ids": [5]},
  ]


def test_mooncake_shared_hash_ids_give_shared_prefixes(tmp_path):
  items = wl.from_mooncake_trace(_rows(), vocab_size=V, block_size=8, time_scale=2.0,
                                 max_tokens_cap=64)
  assert _in_vocab(items)
  assert [it.arrival_s for it in items] == [0.0, 1.0, 3.0, 4.0]  # sorted, ms / 1000 * 2
  a, c, b, d = items
  assert [len(it.prompt) for it in items] == [20, 7, 18, 12]
  assert a.prompt[:16] == b.prompt[:16] and a.prompt[16:18] != b.prompt[16:18]
  assert a.prompt[:8] != c.prompt[:8]
  assert [it.max_tokens for it in items] == [5, 1, 64, 3]
  # Row d has one 8-token block for 12 tokens: the rest is its own.
  alone = wl.from_mooncake_trace([_rows()[3]], vocab_size=V, block_size=8)[0]
  assert d.prompt[:8] == alone.prompt[:8]
  path = tmp_path / "trace.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in _rows()) + "\n")
  assert wl.from_mooncake_trace(str(path), vocab_size=V, block_size=8, time_scale=2.0,
                                max_tokens_cap=64) == items
  with pytest.raises(ValueError, match="row 0 lacks the field 'hash_ids'"):
    wl.from_mooncake_trace([{"timestamp": 0, "input_length": 3, "output_length": 1}],
                           vocab_size=V)


def test_scaled_multiplies_the_offered_rate():
  items = wl.independent(50, 4.0, vocab_size=V, min_len=4, max_len=8, max_tokens=4, seed=0)
  fast = wl.scaled(items, 2.5)
  assert [f.arrival_s for f in fast] == pytest.approx([it.arrival_s / 2.5 for it in items])
  assert [f.prompt for f in fast] == [it.prompt for it in items]
  assert wl.summary(fast)["offered_rate"] == pytest.approx(2.5 * wl.summary(items)["offered_rate"])


def test_summary_exact_small_case():
  items = [Item(0.0, (1, 2, 3, 4), 4), Item(2.0, (5,), 2), Item(1.0, (1, 2, 9), 6),
           Item(3.0, (1, 2, 9, 9), 8)]
  s = wl.summary(items)
  # By arrival: (1,2,3,4) 0, (1,2,9) 2, (5,) 0, (1,2,9,9) 3 -> 5 of 12 tokens.
  assert s["shared_prefix_fraction"] == pytest.approx(5 / 12)
  assert s["count"] == 4 and s["duration_s"] == 3.0 and s["offered_rate"] == 1.0
  assert s["mean_prompt_len"] == 3.0 and s["mean_max_tokens"] == 5.0
  # A prefix shared only with a later prompt does not count.
  assert wl.summary([Item(0.0, (1, 2), 1), Item(1.0, (1, 2, 3), 1)])["shared_prefix_fraction"] \
      == pytest.approx(2 / 5)
  assert wl.summary([Item(1.0, (1, 2, 3), 1), Item(0.0, (1, 2), 1)])["shared_prefix_fraction"] \
      == pytest.approx(2 / 5)
  assert wl.summary([Item(0.0, (7,), 1)] * 2)["offered_rate"] == float("inf")


def test_summary_long_prompts_cross_compare_chunks():
  rng = np.random.default_rng(0)
  base = tuple(rng.integers(0, V, 1000).tolist())
  prompts = [base[:700], base[:300] + (V + 1,) * 50, base[:513] + (V + 2,), base]
  items = [Item(float(i), p, 1) for i, p in enumerate(prompts)]
  shared = 0 + 300 + 513 + 700
  assert wl.summary(items)["shared_prefix_fraction"] == pytest.approx(
      shared / sum(len(p) for p in prompts))


@pytest.mark.parametrize("fn, kwargs, match", [
    (wl.poisson_times, dict(n=0, rate=1.0), "n must be >= 1"),
    (wl.poisson_times, dict(n=3, rate=0.0), "rate must be > 0"),
    (wl.poisson_times, dict(n=3, rate=float("nan")), "rate must be > 0"),
    (wl.independent, dict(n=3, rate=1.0, vocab_size=V, min_len=5, max_len=4, max_tokens=1),
     r"max_len \(4\) must be >= min_len \(5\)"),
    (wl.independent, dict(n=3, rate=1.0, vocab_size=V, min_len=0, max_len=4, max_tokens=1),
     "min_len"),
    (wl.independent, dict(n=3, rate=1.0, vocab_size=1, min_len=1, max_len=4, max_tokens=1),
     "vocab_size"),
    (wl.shared_system_prompt, dict(n=3, rate=1.0, vocab_size=V, num_system_prompts=0,
                                   system_len=4, user_min=1, user_max=2, max_tokens=1),
     "num_system_prompts"),
    (wl.multi_turn, dict(num_sessions=2, turns=0, rate=1.0, vocab_size=V, system_len=4,
                         user_len=2, reply_len=2, think_s=1.0, max_tokens=1), "turns"),
    (wl.multi_turn, dict(num_sessions=2, turns=2, rate=1.0, vocab_size=V, system_len=4,
                         user_len=2, reply_len=2, think_s=-1.0, max_tokens=1), "think_s"),
    (wl.from_mooncake_trace, dict(rows=[], vocab_size=V, block_size=0), "block_size"),
    (wl.scaled, dict(items=[], factor=0), "factor"),
    (wl.summary, dict(items=[]), "items is empty"),
])
def test_bad_arguments(fn, kwargs, match):
  with pytest.raises(ValueError, match=match):
    fn(**kwargs)
