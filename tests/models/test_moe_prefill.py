"""The MoE prefill variants `bench.moe_prefill` times: every one computes
the dense reference's output (chunk sizes, capacity blocks, unfused
gate/up, the C++ kernel, the grouped ragged_dot)."""

import pytest

from benchlib import moe_prefill


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_every_variant_matches_the_dense_reference(tokens):
  rows = moe_prefill.run("tiny_moe", tokens=tokens, repeats=1)
  names = [r["variant"] for r in rows]
  assert len(names) == len(set(names)) >= 8
  assert sum(n.endswith("(default)") for n in names) == 1
  assert "native (C++ kernel)" in names  # g++ is on every machine the suite runs on
  for r in rows:
    assert r["ref_max_abs"] > 0
    assert r["max_abs_err"] <= 1e-5 * r["ref_max_abs"], r
    assert r["ms"] > 0 and r["vs_default"] > 0
