"""The GPU compile gate for WAN-2.2-T2V-A14B: one denoising step (the guided
DiT pass of one 14B expert on [cond; uncond] and the UniPC update) at the
MLPerf shape, 720 x 1280 x 81 frames (75,600 video tokens per pass), compiled
for 8 H100s (CFG 2 x Ulysses sequence parallel 4) from abstract params on this
CPU machine, with its per-device memory printed. The compiled HLO must hold the
Pallas Triton attention and the Ulysses all-to-alls, and fit an H100."""

from benchlib import wan_plan


def test_a14b_denoising_step_compiles_for_8_h100():
  plan = wan_plan.wan_step_plan(seq=4, cfg_parallel=2, frames=81, height=720, width=1280)
  print(wan_plan.format_plan(plan))
  assert plan["tokens"] == 75600 and plan["latent"] == (1, 16, 21, 90, 160)
  assert 14.0e9 < plan["params"] < 14.5e9  # one expert
  # Weights replicated in bfloat16, then activations of 75,600 / 4 tokens a device.
  assert plan["memory"]["argument_bytes"] >= 2 * plan["params"]
  assert plan["fits"], wan_plan.format_plan(plan)
  assert plan["triton"]  # flash attention through Triton, not the XLA fallback
  # Per block: q, k, v to heads and the output back (4 all-to-alls), scanned once.
  assert plan["all_to_all"] >= 4
