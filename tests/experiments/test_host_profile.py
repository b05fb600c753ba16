"""`bench.host_profile` times every part of a real decode step's dispatch and
leaves the engine able to keep generating."""

from benchlib import host_profile


def test_host_profile_times_each_part_in_the_engine_and_alone():
  r = host_profile.run("tiny_moe", batch=2, prompt_len=8, new_tokens=4, repeats=3)
  assert set(r["in_engine"]) == {"dispatch", "step call", "rank_batch", "schedule"}
  for v in r["in_engine"].values():
    assert v["wall_ms"] > 0 and v["cpu_ms"] >= 0
  # The dispatch contains the batch building and the call.
  assert r["in_engine"]["dispatch"]["wall_ms"] >= r["in_engine"]["step call"]["wall_ms"]
  assert set(r["alone"]) == {"rank_batch", "step call, inputs ready",
                             "step call, behind a running step", "trivial jit of the same weights"}
  assert all(ms > 0 for ms in r["alone"].values())
  assert r["param_leaves"] > 10


def test_host_profile_of_a_multi_step_decode():
  r = host_profile.run("tiny_moe", batch=2, prompt_len=8, new_tokens=9, repeats=3, decode_steps=4)
  assert set(r["in_engine"]) == {"dispatch", "step call", "rank_batch", "schedule"}
  assert r["in_engine"]["dispatch"]["wall_ms"] >= r["in_engine"]["step call"]["wall_ms"] > 0
  assert all(ms > 0 for ms in r["alone"].values())
