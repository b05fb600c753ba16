"""The GPU compile gate for WAN-2.2-T2V-A14B: one denoising step (the guided
DiT pass of one 14B expert on [cond; uncond] and the UniPC update) at the
MLPerf shape, 720 x 1280 x 81 frames (75,600 video tokens per pass), compiled
for 8 H100s from abstract params on this CPU machine, with its per-device
memory printed: CFG 2 x Ulysses 2 x TP 2 (the blocks' heads and FFN split,
so both experts fit beside each other; `wan_plan.wan_step_plan(seq=4,
tensor=1)` compiles the replicated-weights plan, 30.1 GB a device). The
compiled HLO must hold the Pallas Triton attention, the Ulysses all-to-alls
and TP's all-reduces, and fit an H100."""

from benchlib import wan_plan


def test_a14b_denoising_step_compiles_for_8_h100():
  plan = wan_plan.wan_step_plan(seq=2, cfg_parallel=2, tensor=2, frames=81, height=720,
                                width=1280)
  print(wan_plan.format_plan(plan))
  assert plan["tokens"] == 75600 and plan["latent"] == (1, 16, 21, 90, 160)
  assert 14.0e9 < plan["params"] < 14.5e9  # one expert
  # bfloat16 weights, the blocks (all but ~0.2 B params) split in two.
  args = plan["memory"]["argument_bytes"]
  assert 0.5 * 2 * plan["params"] <= args < 0.55 * 2 * plan["params"]
  assert plan["all_reduce"] > 0
  assert plan["fits"], wan_plan.format_plan(plan)
  assert plan["triton"]  # flash attention through Triton, not the XLA fallback
  # Per block: q, k, v to heads and the output back (4 all-to-alls), scanned once.
  assert plan["all_to_all"] >= 4
