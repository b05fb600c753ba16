"""`recsys.synthetic_requests` draws requests of MLPerf's generator's shape;
`recsys.request.DlrmRequest` checks its fields."""

import numpy as np
import pytest

from jaxinfer.recsys import synthetic_requests as sr
from jaxinfer.recsys.request import ACTION_WEIGHTS, DlrmRequest

SPEC = sr.RequestSpec(num_users=1000, num_items=128_000, num_categories=32, num_timestamps=20,
                      samples_per_item=4, num_candidates=16, max_uih_len=300)


def test_requests_follow_the_generator():
  reqs = [sr.request(SPEC, u) for u in range(0, 1000, 50)]
  again = sr.request(SPEC, 50)
  np.testing.assert_array_equal(again.item_ids, reqs[1].item_ids)  # a function of (seed, user)
  ipc = SPEC.items_per_category
  for r in reqs:
    assert len(r.candidate_ids) == SPEC.num_candidates
    assert 33 <= len(r.item_ids) <= SPEC.max_uih_len
    np.testing.assert_array_equal(r.category_ids, r.item_ids // ipc)
    np.testing.assert_array_equal(r.candidate_category_ids, r.candidate_ids // ipc)
    # a user's items come from its 4 liked categories only
    assert len(set(r.category_ids) | set(r.candidate_category_ids)) <= SPEC.categories_per_user
    assert r.ratings.min() >= 1.0 and r.ratings.max() <= 5.0
    np.testing.assert_array_equal(r.action_weights,
                                  np.asarray(ACTION_WEIGHTS)[r.ratings.astype(int) - 1])
  labels = np.concatenate([r.labels for r in reqs])
  assert 0.2 < labels.mean() < 0.8, labels.mean()  # both classes, as the benchmark's data
  # the history is truncated at its start (the reference keeps y[:max_len])
  short = sr.request(sr.RequestSpec(**{**SPEC.__dict__, "max_uih_len": 40}), 50)
  np.testing.assert_array_equal(short.item_ids, again.item_ids[:40])


def test_bad_requests_name_the_field():
  ok = dict(user_id=7, item_ids=[1, 2], ratings=[4.0, 2.5], timestamps=[1, 1],
            category_ids=[0, 0], candidate_ids=[3], candidate_category_ids=[0], query_time=1)
  DlrmRequest(**ok)
  for change, word in [(dict(ratings=[4.0]), "ratings"), (dict(timestamps=[1, 1, 1]), "timestamps"),
                       (dict(candidate_category_ids=[0, 1]), "candidate_category_ids"),
                       (dict(ratings=[0.5, 3.0]), "ratings"), (dict(item_ids=[1.5, 2.0]), "item_ids"),
                       (dict(candidate_ratings=[1.0, 2.0]), "candidate_ratings")]:
    with pytest.raises(ValueError, match=f"user 7.*{word}"):
      DlrmRequest(**{**ok, **change})
  with pytest.raises(ValueError, match="no candidate_ratings"):
    _ = DlrmRequest(**ok).labels
  with pytest.raises(ValueError, match="user 1000 out of range"):
    sr.request(SPEC, 1000)
  with pytest.raises(ValueError, match="ts 3"):
    sr.request(SPEC, 0, ts=3)


def test_samples_are_distinct_requests_past_the_user_count():
  spec = sr.RequestSpec(**{**SPEC.__dict__, "num_users": 10})  # 10 users x 2 inference ts
  reqs = sr.samples(spec, 20)
  keys = {(r.user_id, tuple(r.candidate_ids)) for r in reqs}
  assert len(keys) == 20 and {r.user_id for r in reqs} == set(range(10))
  with pytest.raises(ValueError, match="hold only 20"):
    sr.samples(spec, 21)
