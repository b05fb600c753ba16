"""The MoE grouped matmul (`ops.grouped_matmul`): XLA's ragged_dot on CPU
(the Mosaic choice included: jax's `ragged_dot_mgpu` has no interpreter),
the shapes jax's Hopper kernel takes, and (jax >= 0.11) the Engine's MoE
steps compiled for one H100 with it at DeepSeek-V3 (32 local experts under
EP 8) and GPT-OSS-120B (128 experts, sliding window and sinks) widths.
`TestGroupedMatmulGpu` (a GPU only) checks the kernel against ragged_dot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ON_GPU, compile_moe_step_for_h100
from jaxinfer import Backend, gpu_compile, ops
from pallas_kernels import mosaic_paged_attention as mpa


def _inputs(M, E, In, Out, dtype, seed=0, short=0):
  """Rows sorted over E experts with random sizes summing to M - short."""
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.integers(0, M - short + 1, E - 1))
  sizes = np.diff(np.concatenate([[0], cuts, [M - short]])).astype(np.int32)
  xs = jnp.asarray(rng.normal(size=(M, In)), dtype)
  w = jnp.asarray(rng.normal(size=(E, In, Out)) * 0.05, dtype)
  return xs, w, jnp.asarray(sizes)


@pytest.mark.parametrize("backend", [Backend(), Backend(grouped_matmul="mosaic"),
                                     Backend(grouped_matmul="xla")])
def test_cpu_runs_xla_ragged_dot(backend):
  xs, w, sizes = _inputs(40, 4, 64, 128, jnp.float32, short=6)
  out = ops.grouped_matmul(xs, w, sizes, backend=backend)
  np.testing.assert_array_equal(out, jax.lax.ragged_dot(xs, w, sizes))
  assert not np.asarray(out[-6:]).any()  # rows past sum(sizes)


def test_mosaic_tiling_or_why_not():
  bf = jnp.bfloat16
  tiling, why = ops.mosaic_grouped_matmul((64, 7168), (32, 7168, 2048), bf, bf)
  assert why is None and tiling["block_n"] == 128 and tiling["block_k"] == 64
  assert ops.mosaic_grouped_matmul((64, 2880), (128, 2880, 2880), bf, bf)[0]["block_n"] == 64
  for xs, w, dt, wdt, match in [((8, 64), (2, 64, 64), jnp.float32, jnp.float32, "bf16 / f16"),
                                ((8, 64), (2, 64, 64), bf, jnp.float16, "bf16 / f16"),
                                ((8, 96), (2, 96, 64), bf, bf, "multiples of 64"),
                                ((8, 64), (2, 64, 100), bf, bf, "multiples of 64")]:
    tiling, why = ops.mosaic_grouped_matmul(xs, w, dt, wdt)
    assert tiling is None and match in why


if mpa.available() is None:

  @pytest.mark.parametrize("model,mesh,layout,program", [
      ("deepseek_v3", {"data": 1, "expert": 8}, "dp_attn_ep", "mixed"),
      ("gpt_oss_120b", {"data": 1}, "tp", "decode")])
  def test_moe_step_compiles_on_mosaic_for_h100(model, mesh, layout, program):
    """A Hopper target's default Backend puts the unquantized experts on
    jax's ragged_dot_mgpu inside the Engine's step (as many Mosaic calls as
    expert matmuls and Mosaic attention calls in the one scanned layer)."""
    with gpu_compile.lowering(gpu_compile.mesh(mesh, gpu="h100")):
      assert Backend(target="gpu").grouped_matmul_kernel() == "mosaic"
    entry = compile_moe_step_for_h100(model, mesh, layout, program)
    attention = 1 if model == "gpt_oss_120b" else 0  # DeepSeek's mixed step: MLA on Triton
    assert entry["mosaic_kernels"] >= 3 + attention, entry["mosaic_kernels"]
    assert entry["fits"]

else:

  def test_older_jax_keeps_xla_for_a_hopper_target():
    with gpu_compile.lowering(gpu_compile.mesh({"data": 1}, gpu="h100")):
      assert Backend(target="gpu").grouped_matmul_kernel() == "xla"


if ON_GPU:

  class TestGroupedMatmulGpu:
    """jax's ragged_dot_mgpu through ops on this GPU (Hopper) against XLA's
    ragged_dot in float32."""

    @pytest.mark.parametrize("M,E,In,Out,short", [
        (256, 32, 7168, 2048, 0), (300, 8, 2048, 512, 17), (64, 128, 2880, 2880, 0),
        (8, 4, 128, 128, 3)])
    def test_matches_ragged_dot(self, M, E, In, Out, short):
      xs, w, sizes = _inputs(M, E, In, Out, jnp.bfloat16, seed=M, short=short)
      out = jax.jit(lambda *a: ops.grouped_matmul(
          *a, backend=Backend(target="gpu", grouped_matmul="mosaic")))(xs, w, sizes)
      f32 = lambda x: x.astype(jnp.float32)
      ref = np.asarray(jax.lax.ragged_dot(f32(xs), f32(w), sizes))
      out = np.asarray(out, np.float32)
      assert np.isfinite(out).all()
      assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) <= 2e-2
      if short:
        assert not out[-short:].any()
