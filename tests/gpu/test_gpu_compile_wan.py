"""The GPU compile gate for WAN-2.2-T2V-A14B: one denoising step (the guided
DiT pass of one 14B expert on [cond; uncond] and the UniPC update) at the
MLPerf shape, 720 x 1280 x 81 frames (75,600 video tokens per pass), compiled
for 8 H100s from abstract params on this CPU machine, with its per-device
memory printed: CFG 2 x Ulysses 4 (weights replicated), and CFG 2 x Ulysses 2
x TP 2 (the blocks' heads and FFN split, so both experts fit beside each
other). The compiled HLO must hold the Pallas Triton attention, the Ulysses
all-to-alls (and TP's all-reduces), and fit an H100."""

import pytest

from benchlib import wan_plan


@pytest.mark.parametrize("seq,tensor", [(4, 1), (2, 2)])
def test_a14b_denoising_step_compiles_for_8_h100(seq, tensor):
  plan = wan_plan.wan_step_plan(seq=seq, cfg_parallel=2, tensor=tensor, frames=81, height=720,
                                width=1280)
  print(wan_plan.format_plan(plan))
  assert plan["tokens"] == 75600 and plan["latent"] == (1, 16, 21, 90, 160)
  assert 14.0e9 < plan["params"] < 14.5e9  # one expert
  args = plan["memory"]["argument_bytes"]
  if tensor == 1:  # the expert replicated in bfloat16
    assert args >= 2 * plan["params"]
  else:  # the blocks (all but ~0.2 B params) split in two
    assert 0.5 * 2 * plan["params"] <= args < 0.55 * 2 * plan["params"]
    assert plan["all_reduce"] > 0
  assert plan["fits"], wan_plan.format_plan(plan)
  assert plan["triton"]  # flash attention through Triton, not the XLA fallback
  # Per block: q, k, v to heads and the output back (4 all-to-alls), scanned once.
  assert plan["all_to_all"] >= 4
