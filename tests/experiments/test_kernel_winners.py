"""The winner table: the fastest candidate that ran and matched its
reference wins a case, never a faster wrong or unchecked one."""

import pytest

from benchlib import kernel_winners


def _impl(ms=None, ok=None, status="ok"):
  rec = dict(status=status)
  if ms is not None:
    rec["time_s"] = ms / 1e3
  if ok is not None:
    rec["numerics_ok"] = ok
  return rec


RESULT = dict(
    meta=dict(device_kind="NVIDIA H100 80GB HBM3", jax="0.11.2", time="2026-12-07T08:00:00",
              dtype="bfloat16"),
    results=dict(
        flash=[dict(label="B8 T2048 N32/K8 H128 causal", impls=dict(
            ours=_impl(2.0, True), cudnn=_impl(1.0, True), fast_wrong=_impl(0.5, False),
            unchecked=_impl(0.1), tokamax_mosaic=_impl(status="skipped"),
            torch_sdpa=_impl(status="error")))],
        gmm=[dict(label="E32 M4096", impls=dict(ours=_impl(3.0, False), xla=_impl(4.0)))]))


def test_the_fastest_matching_candidate_wins():
  table = kernel_winners.winner_table(RESULT)
  assert table["meta"] == dict(device_kind="NVIDIA H100 80GB HBM3", jax="0.11.2",
                               date="2026-12-07", dtype="bfloat16")
  flash, gmm = table["rows"]
  assert flash["winner"] == "cudnn" and flash["runner_up"] == "ours"
  assert flash["winner_ms"] == pytest.approx(1.0) and flash["ours_over_winner"] == pytest.approx(2)
  assert flash["ran"] == ["cudnn", "fast_wrong", "ours", "unchecked"]
  assert flash["matched"] == ["cudnn", "ours"]
  # Nothing matched its reference: no winner, so nothing to take as a default.
  assert gmm["winner"] is None and gmm["matched"] == [] and gmm["ours_over_winner"] is None


def test_the_table_format():
  text = kernel_winners.format_winners(kernel_winners.winner_table(RESULT)).splitlines()
  assert text[0] == "Measured on NVIDIA H100 80GB HBM3, jax 0.11.2, 2026-12-07 (bfloat16)."
  assert text[2] == "| " + " | ".join(kernel_winners.COLUMNS) + " |"
  assert text[4] == ("| flash | B8 T2048 N32/K8 H128 causal | cudnn | 1.000 | 2.000 | 2.00 | ours "
                     "| cudnn, fast_wrong, ours, unchecked | cudnn, ours |")
  assert text[5].startswith("| gmm | E32 M4096 | none matched | - | 3.000 | - | - |")
  assert kernel_winners.winners_path("/r/kernel_bench_nvidia_h100_2026-12-07.json") == (
      "/r/kernel_winners_nvidia_h100_2026-12-07.json")


@pytest.mark.parametrize("bad, field", [(dict(results={}), "meta"),
                                        (dict(meta={}, results={}), "device_kind")])
def test_a_result_that_is_not_a_kernel_bench_one_is_named(bad, field):
  with pytest.raises(ValueError, match=field):
    kernel_winners.winner_table(bad)
