"""KV-aware router: prefix overlap from hash events, the cost, pending load
spreading a burst, the baseline policies, and argument errors."""

import numpy as np
import pytest

from jaxinfer.kv.allocator import PageAllocator, hash_page
from jaxinfer.serving.router import POLICIES, Router

PS = 4


def _prompt(n, seed=0):
  return list(np.random.default_rng(seed).integers(0, 1000, n))


def _stored(router, tokens, pages=None):
  hashes = router.page_hashes(tokens)
  return [("stored", hashes[i]) for i in (range(len(hashes)) if pages is None else pages)]


def test_page_hashes_chain_full_pages_only():
  r, tokens = Router(1, PS), _prompt(3 * PS + 2)
  h0 = hash_page(None, tokens[:PS])
  h1 = hash_page(h0, tokens[PS:2 * PS])
  hashes = r.page_hashes(tokens)
  assert len(hashes) == 3 and hashes[:2] == [h0, h1]
  # Same second page after a different first page: a different chained hash.
  other = _prompt(PS, seed=1) + tokens[PS:2 * PS]
  assert r.page_hashes(other)[1] != h1


def test_overlap_counts_leading_pages_and_stops_at_first_miss():
  r, tokens = Router(3, PS), _prompt(4 * PS)
  r.report(0, events=_stored(r, tokens))
  r.report(1, events=_stored(r, tokens, pages=[0, 2, 3]))  # page 1 missing
  r.report(2, events=_stored(r, tokens, pages=[1, 2, 3]))  # page 0 missing
  assert [r.overlap(w, tokens) for w in range(3)] == [4, 1, 0]
  assert r.overlap(0, tokens + [7, 7]) == 4  # a partial page never matches
  assert r.overlap(0, tokens[:2 * PS]) == 2


def test_evicted_events_remove_hashes():
  r, tokens = Router(1, PS), _prompt(3 * PS)
  hashes = r.page_hashes(tokens)
  r.report(0, events=_stored(r, tokens))
  r.report(0, events=[("evicted", hashes[1])])
  assert r.overlap(0, tokens) == 1
  r.report(0, events=[("evicted", hashes[0]), ("evicted", b"never stored")])
  assert r.overlap(0, tokens) == 0


def test_overlap_matches_page_allocator_events():
  alloc, r = PageAllocator(16, PS), Router(1, PS)
  tokens = _prompt(5 * PS)
  pages = alloc.allocate(5)
  for page, h in zip(pages[:3], r.page_hashes(tokens)):
    alloc.register(page, h)
  alloc.release(pages)
  alloc.allocate(alloc.num_available() - 1)  # evicts LRU cached pages: the first two
  r.report(0, events=alloc.events)
  matched, _ = alloc.match_prefix(tokens, 5)
  assert r.overlap(0, tokens) == len(matched)


def test_cost_formula():
  r = Router(2, PS, prefill_load_scale=2.0, overlap_credit=0.5)
  tokens = _prompt(4 * PS)  # ISL 16 = 4 pages
  r.report(0, events=_stored(r, tokens, pages=[0, 1, 2]), active_prefill_tokens=8, decode_pages=5)
  costs = r.costs(tokens, [0, 1])
  assert costs[0] == pytest.approx(2.0 * ((8 + 16) / PS - 0.5 * 3) + 5)
  assert costs[1] == pytest.approx(2.0 * 16 / PS)
  # Credit larger than the work: the prefill term floors at 0.
  r2 = Router(1, PS, overlap_credit=10.0)
  r2.report(0, events=_stored(r2, tokens), decode_pages=3)
  assert r2.costs(tokens, [0]) == {0: 3.0}


def test_kv_picks_the_worker_holding_the_prefix():
  r, tokens = Router(4, PS), _prompt(8 * PS)
  r.report(2, events=_stored(r, tokens))
  assert r.pick(tokens) == 2
  # Longer overlap wins over shorter.
  r2 = Router(3, PS)
  r2.report(0, events=_stored(r2, tokens, pages=[0, 1]))
  r2.report(1, events=_stored(r2, tokens, pages=range(6)))
  assert r2.pick(tokens) == 1


def test_kv_with_equal_overlap_picks_the_less_loaded():
  tokens = _prompt(4 * PS)
  r = Router(2, PS)
  for w in range(2):
    r.report(w, events=_stored(r, tokens))
  r.report(0, active_prefill_tokens=40)
  assert r.pick(tokens) == 1
  r = Router(2, PS)
  r.report(1, decode_pages=3)
  assert r.pick(tokens) == 0


def test_kv_prefix_does_not_win_against_a_heavy_queue():
  tokens = _prompt(4 * PS)
  r = Router(2, PS)
  r.report(0, events=_stored(r, tokens), active_prefill_tokens=100 * PS, decode_pages=50)
  assert r.pick(tokens) == 1


@pytest.mark.parametrize("policy", ["kv", "least_loaded"])
def test_pending_load_spreads_a_burst(policy):
  r, tokens = Router(4, PS, policy), _prompt(4 * PS)
  picks = [r.pick(tokens) for _ in range(8)]
  assert np.bincount(picks, minlength=4).tolist() == [2, 2, 2, 2]
  assert r.stats()["routed"] == [2, 2, 2, 2]


def test_report_clears_pending_load():
  r, tokens = Router(2, PS), _prompt(4 * PS)
  assert r.pick(tokens) == 0
  before = r.costs(tokens, [0, 1])
  assert before[0] > before[1]
  r.report(0, events=[])  # events alone: load unchanged
  assert r.costs(tokens, [0, 1]) == before
  r.report(0, active_prefill_tokens=0)  # clears only the prefill term
  mid = r.costs(tokens, [0, 1])
  assert before[1] < mid[0] < before[0]
  r.report(0, decode_pages=0)
  after = r.costs(tokens, [0, 1])
  assert after[0] == after[1]
  assert r.pick(tokens) == 1  # equal: the least recently picked
  assert r.pick(tokens) == 0  # now worker 1 carries the pending load


def test_idle_equal_workers_take_turns():
  # No prefixes and every report back to idle: ties rotate, not pile on worker 0.
  r = Router(4, PS)
  picks = []
  for k in range(8):
    picks.append(r.pick(_prompt(3 * PS, seed=k)))
    r.report(picks[-1], active_prefill_tokens=0, decode_pages=0)
  assert sorted(picks) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_pending_load_counts_only_uncached_work():
  r, tokens = Router(2, PS), _prompt(4 * PS)
  r.report(0, events=_stored(r, tokens, pages=[0, 1, 2]))
  assert r.pick(tokens) == 0
  # One page (PS tokens) left to compute, one new page to hold: cost 2 * 1.
  assert r.costs(tokens, [0])[0] == pytest.approx((PS + 4 * PS) / PS - 3 + 1)


def test_round_robin_cycles():
  r, tokens = Router(3, PS, "round_robin"), _prompt(PS)
  r.report(1, events=_stored(r, tokens), active_prefill_tokens=0)  # ignored by the policy
  assert [r.pick(tokens) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
  assert [r.pick(tokens, [0, 2]) for _ in range(3)] == [2, 0, 2]


def test_least_loaded():
  r, tokens = Router(3, PS, "least_loaded"), _prompt(2 * PS)
  r.report(0, active_prefill_tokens=3 * PS, decode_pages=1)  # load 4
  r.report(1, decode_pages=2)                                # load 2
  r.report(2, active_prefill_tokens=PS, decode_pages=2)      # load 3
  r.report(0, events=_stored(r, tokens))  # the prefix on the busiest: ignored by the policy
  assert r.pick(tokens) == 1  # then load 2 + 8/4 + 2 pages = 6
  assert r.pick(tokens) == 2  # then 7
  assert r.pick(tokens) == 0  # cached there: adds nothing, stays 4
  assert r.pick(tokens) == 0


def test_random_is_seeded_and_covers_candidates():
  tokens = _prompt(PS)
  a = [Router(4, PS, "random", seed=3).pick(tokens)]
  r1, r2 = Router(4, PS, "random", seed=3), Router(4, PS, "random", seed=3)
  s1, s2 = [r1.pick(tokens) for _ in range(40)], [r2.pick(tokens) for _ in range(40)]
  assert s1 == s2 and s1[:1] == a and set(s1) == {0, 1, 2, 3}
  assert set(r1.pick(tokens, [1, 3]) for _ in range(20)) == {1, 3}


def _sampled(seed, n=300):
  r, tokens = Router(4, PS, temperature=0.5, seed=seed), _prompt(8 * PS)
  r.report(0, events=_stored(r, tokens))
  picks = []
  for _ in range(n):
    picks.append(r.pick(tokens))
    for w in range(4):
      r.report(w, active_prefill_tokens=0, decode_pages=0)  # keep the costs fixed
  return picks


def test_temperature_sampling_is_seeded_and_prefers_low_cost():
  a, b, c = _sampled(0), _sampled(0), _sampled(1)
  assert a == b and a != c
  counts = np.bincount(a, minlength=4)
  # Normalised costs 0, 1, 1, 1 at T=0.5: p(0) = 1 / (1 + 3 e^-2) ~ 0.71.
  assert 0.6 < counts[0] / len(a) < 0.82
  assert all(counts[1:] > 0)  # still explores


def test_removed_worker_is_never_picked():
  r, tokens = Router(3, PS), _prompt(4 * PS)
  r.report(0, events=_stored(r, tokens))
  r.remove_worker(0)
  assert r.overlap(0, tokens) == 0
  assert all(r.pick(tokens) != 0 for _ in range(10))
  r.report(0, events=_stored(r, tokens))  # a late report is dropped
  assert r.pick(tokens) != 0
  with pytest.raises(ValueError, match="removed"):
    r.pick(tokens, [0, 1])
  r.remove_worker(1)
  r.remove_worker(2)
  with pytest.raises(ValueError, match="all workers were removed"):
    r.pick(tokens)
  assert r.add_worker() == 3
  assert r.pick(tokens) == 3
  assert r.alive() == [3]


def test_stats():
  r, tokens = Router(2, PS), _prompt(4 * PS)
  r.report(1, events=_stored(r, tokens, pages=[0, 1]))
  assert r.pick(tokens) == 1
  assert r.pick(_prompt(4 * PS, seed=5), [0]) == 0
  s = r.stats()
  assert s["routed"] == [1, 1] and s["picks"] == 2
  assert s["mean_overlap_pages"] == 1.0
  assert s["hit_rate"] == pytest.approx(2 * PS / (8 * PS))


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_workers=2, page_size=4, policy="sglang"), "policy"),
    (dict(num_workers=0, page_size=4), "num_workers"),
    (dict(num_workers=2, page_size=0), "page_size"),
    (dict(num_workers=2, page_size=4, temperature=-1.0), "temperature"),
    (dict(num_workers=2, page_size=4, overlap_credit=-1.0), "overlap_credit"),
])
def test_bad_constructor_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Router(**kwargs)


def test_bad_call_arguments():
  r, tokens = Router(2, PS), _prompt(PS)
  assert POLICIES == ("kv", "round_robin", "random", "least_loaded")
  with pytest.raises(ValueError, match="worker 2 out of range"):
    r.report(2, decode_pages=1)
  with pytest.raises(ValueError, match="out of range"):
    r.overlap(-1, tokens)
  with pytest.raises(ValueError, match="out of range"):
    r.pick(tokens, [0, 5])
  with pytest.raises(ValueError, match="candidates is empty"):
    r.pick(tokens, [])
  with pytest.raises(ValueError, match="event kind"):
    r.report(0, events=[("added", b"x")])
  with pytest.raises(TypeError, match="bytes"):
    r.report(0, events=[("stored", "x")])
  with pytest.raises(ValueError, match="decode_pages"):
    r.report(0, decode_pages=-1)
