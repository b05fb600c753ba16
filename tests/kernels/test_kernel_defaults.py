"""`kernel_defaults`: a committed GPU winner table sets `Backend`'s Hopper
defaults for library kernels, and only candidates that matched their
reference on that run can become defaults."""

import json

import pytest

from benchlib import kernel_winners
from jaxinfer import Backend, gpu_compile, kernel_defaults
from jaxinfer.backend import mosaic_default


def _row(kernel, ours, **ms_ok):
  """A winner-table row: ours' ms (matched) and each candidate's (ms, matched)."""
  ms_ok = dict(ours=(ours, True), **ms_ok)
  ran = sorted(ms_ok)
  return dict(kernel=kernel, ran=ran, matched=sorted(n for n, (_, ok) in ms_ok.items() if ok),
              ms={n: m for n, (m, _) in ms_ok.items()}, ours_ms=ours)


def _table(rows, device="NVIDIA H100 80GB HBM3", date="2026-12-07"):
  return dict(meta=dict(device_kind=device, jax="0.11.2", date=date, dtype="bfloat16"),
              rows=rows)


LLAMA = dict(cudnn=(1.0, True), xla=(0.2, False), tokamax_mosaic=(0.8, True))


def test_the_fastest_candidate_that_never_mismatched_is_the_default():
  # cuDNN did not run the MLA case (192 / 128 head dims): ours stands in there.
  mla = _row("flash", 3.0, tokamax_mosaic=(2.5, True))
  assert kernel_defaults.choose(_table([_row("flash", 2.0, **LLAMA), mla]),
                                "dense_attention") == "tokamax"  # 3.3 ms against cuDNN's 4.0
  # tokamax wrong once: out, whatever its speed; XLA wrong in the first case: out.
  mla = _row("flash", 3.0, tokamax_mosaic=(2.5, False))
  assert kernel_defaults.choose(_table([_row("flash", 2.0, **LLAMA), mla]),
                                "dense_attention") == "cudnn"
  # Ours fastest: the field's "ours" (our kernels).
  assert kernel_defaults.choose(_table([_row("flash", 0.5, **LLAMA)]), "dense_attention") == "ours"
  gmm = _row("gmm", 3.0, xla_ragged_dot=(2.0, True), tokamax_mosaic=(1.0, False))
  assert kernel_defaults.choose(_table([gmm]), "grouped_matmul") == "xla"


def test_no_table_another_gpu_or_nothing_matched_keeps_the_built_in_defaults():
  rows = [_row("flash", 2.0, **LLAMA)]
  assert kernel_defaults.choose(None, "dense_attention") is None
  assert kernel_defaults.choose(_table(rows, device="NVIDIA A100-SXM4-80GB"),
                                "dense_attention") is None
  assert kernel_defaults.choose(_table(rows), "grouped_matmul") is None  # no gmm rows
  wrong = _row("flash", 2.0, cudnn=(1.0, False))
  wrong["matched"] = []  # ours mismatched too
  assert kernel_defaults.choose(_table([wrong]), "dense_attention") is None


def test_the_newest_committed_table_is_read_and_a_bad_one_is_named(tmp_path):
  old = _table([_row("flash", 2.0, cudnn=(1.0, True))], date="2026-11-01")
  new = _table([_row("flash", 0.5, cudnn=(1.0, True))], date="2026-12-01")
  (tmp_path / "kernel_winners_h100_a.json").write_text(json.dumps(new))
  (tmp_path / "kernel_winners_h200_b.json").write_text(json.dumps(old))
  assert kernel_defaults.latest(str(tmp_path)) == new
  assert kernel_defaults.latest(str(tmp_path / "none")) is None
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "kernel_winners_x.json").write_text("{not json")
  with pytest.raises(ValueError, match="kernel_winners_x.json: not a winner table"):
    kernel_defaults.latest(str(bad))
  row = _row("flash", 2.0)
  del row["ms"]
  (bad / "kernel_winners_x.json").write_text(json.dumps(_table([row])))
  with pytest.raises(ValueError, match=r"kernel_winners_x.json: rows lack \['ms'\]"):
    kernel_defaults.latest.__wrapped__(str(bad))


@pytest.mark.parametrize("gmm_winner, value", [("ours", "mosaic"), ("xla_ragged_dot", "xla")])
def test_a_hopper_target_takes_the_committed_table_and_explicit_choices_win(monkeypatch,
                                                                            gmm_winner, value):
  gmm = _row("gmm", 3.0, xla_ragged_dot=(2.0, True))
  gmm["matched"] = [gmm_winner]  # only the winner matched its reference
  table = _table([_row("flash", 2.0, cudnn=(1.0, True)), gmm])
  monkeypatch.setattr(kernel_defaults, "latest", lambda: table)
  gpu = Backend(target="gpu")
  with gpu_compile.lowering(gpu_compile.mesh({"data": 1}, gpu="h100")):
    assert gpu.attention_library() == "cudnn" and gpu.grouped_matmul_kernel() == value
    assert Backend(target="gpu", dense_attention="ours").attention_library() is None
    assert Backend(target="gpu", dense_attention="jax_nn").attention_library() == "jax_nn"
    assert Backend(target="gpu", grouped_matmul="xla").grouped_matmul_kernel() == "xla"
  with gpu_compile.lowering(gpu_compile.mesh({"data": 1}, gpu="a100")):  # not a Hopper
    assert gpu.attention_library() is None
  assert Backend(target="cpu").attention_library() is None
  # No table: the built-in defaults.
  monkeypatch.setattr(kernel_defaults, "latest", lambda: None)
  with gpu_compile.lowering(gpu_compile.mesh({"data": 1}, gpu="h100")):
    assert gpu.attention_library() is None
    assert gpu.grouped_matmul_kernel() == ("mosaic" if mosaic_default() else "xla")


def test_a_kernel_bench_winner_table_reads_as_the_defaults_say():
  """What `kernel_winners.winner_table` writes is what `choose` reads."""
  impl = lambda ms, ok: dict(status="ok", time_s=ms / 1e3, numerics_ok=ok)
  result = dict(meta=dict(device_kind="NVIDIA H200", jax="0.11.2", time="2026-12-07T08:00",
                          dtype="bfloat16"),
                results=dict(flash=[dict(label="causal", impls=dict(
                    ours=impl(2.0, True), cudnn=impl(1.0, True), xla=impl(0.5, False)))]))
  table = kernel_winners.winner_table(result)
  assert kernel_defaults.choose(table, "dense_attention") == "cudnn"
