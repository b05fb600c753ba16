"""The C++ CPU expert kernel (`native_kernels`) against its jnp
reference, and its bad-input errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import native_kernels as cpu


def _experts(r, E, D, F):
  w_gate_up = [jnp.asarray(r.standard_normal((D, 2 * F)) / np.sqrt(D), jnp.float32) for _ in range(E)]
  w_down = [jnp.asarray(r.standard_normal((F, D)) / np.sqrt(F), jnp.float32) for _ in range(E)]
  return w_gate_up, w_down


def test_the_kernel_builds_here():
  assert cpu.available(), cpu.unavailable_reason()


# sizes: experts with no rows, one row, more rows than one pass (8) takes,
# padding rows past the sum; D and 2F off the kernel's 256-column blocks and
# its 4-row unroll.
@pytest.mark.parametrize("sizes,pad,D,F", [
    ([1, 0, 2, 0, 1, 3], 0, 64, 32),
    ([0, 11, 1, 0, 17, 2], 5, 70, 150),
    ([0, 0, 0, 0], 3, 16, 8),
])
@pytest.mark.parametrize("activation", ["silu", "clamped_swiglu"])
def test_native_experts_equal_the_reference(sizes, pad, D, F, activation):
  r = np.random.default_rng(len(sizes) + D)
  E = len(sizes)
  w_gate_up, w_down = _experts(r, E, D, F)
  xs = jnp.asarray(r.standard_normal((sum(sizes) + pad, D)), jnp.float32)
  n = jnp.asarray(sizes, jnp.int32)
  kw = dict(activation=activation, limit=0.7, alpha=1.702)
  got = jax.jit(lambda xs, n: cpu.split_experts_ffn(xs, n, w_gate_up, w_down, **kw))(xs, n)
  want = cpu.split_experts_reference(xs, n, w_gate_up, w_down, **kw)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  assert not np.any(np.asarray(got)[sum(sizes):]), "padding rows must come back zero"


def test_bad_inputs_are_named():
  r = np.random.default_rng(0)
  w_gate_up, w_down = _experts(r, 3, 16, 8)
  xs = jnp.zeros((4, 16), jnp.float32)
  with pytest.raises(ValueError, match="same experts"):
    cpu.split_experts_ffn(xs, jnp.asarray([1, 1], jnp.int32), w_gate_up, w_down)
  with pytest.raises(ValueError, match=r"\[M, D\]"):
    cpu.split_experts_ffn(xs[None], jnp.asarray([1, 1, 1], jnp.int32), w_gate_up, w_down)
  with pytest.raises(ValueError, match="expert weights"):
    cpu.split_experts_ffn(jnp.zeros((4, 12), jnp.float32), jnp.asarray([1, 1, 1], jnp.int32),
                          w_gate_up, w_down)
  with pytest.raises(TypeError, match="float32"):
    cpu.split_experts_ffn(xs.astype(jnp.bfloat16), jnp.asarray([1, 1, 1], jnp.int32), w_gate_up,
                          w_down)
  with pytest.raises(Exception, match="more than xs's rows"):
    jax.block_until_ready(cpu.split_experts_ffn(xs, jnp.asarray([2, 2, 2], jnp.int32), w_gate_up,
                                                w_down))


def test_engine_with_split_experts_runs_the_native_kernel_and_matches_the_scanned_engine():
  """An Engine whose unrolled steps hold split experts names the native
  kernel in stats()["kernels"] and generates the same greedy tokens as one
  scanning the stacked layers (XLA's grouped experts), batched and alone."""
  from jaxinfer import models, presets
  from jaxinfer.engine import Engine, EngineConfig, SamplingParams
  cfg = presets.get("tiny_moe")
  params = models.init_params(cfg, jax.random.key(7))
  small = dict(page_size=16, num_pages=64, max_num_seqs=4, max_num_batched_tokens=64)
  split = Engine(cfg, params, EngineConfig(unroll_layers=True, **small))
  scanned = Engine(cfg, params, EngineConfig(unroll_layers=False, **small))
  assert split.stats()["kernels"]["cpu_experts"].startswith("native")
  assert "cpu_experts" not in scanned.stats()["kernels"]
  r = np.random.default_rng(8)
  prompts = [r.integers(3, cfg.vocab_size, n).tolist() for n in (5, 17, 9)]
  sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
  got = [o.token_ids for o in split.generate(prompts, sp)]
  assert got == [o.token_ids for o in scanned.generate(prompts, sp)]


def test_only_unsharded_split_experts_may_run_the_kernel():
  """The custom call has no sharding rule: the Engine's weight form opens
  split experts to it only without a mesh (and never expert-parallel ones,
  which are not split)."""
  from jaxinfer import models, presets
  from jaxinfer.engine import EngineConfig, weight_layout
  cfg = presets.get("tiny_moe")
  params = models.init_params(cfg, jax.random.key(9))
  config = EngineConfig(unroll_layers=True, cpu_weight_layout="in_out")
  assert weight_layout.choose(cfg, config, params).native_experts
  mesh = jax.make_mesh((2,), ("tensor",), devices=jax.devices()[:2])
  assert not weight_layout.choose(cfg, config, params, mesh).native_experts
  assert not weight_layout.choose(cfg, config, params, expert_parallel=True).native_experts


# M: one row, a partial block, two blocks and a tail, prefill-sized; N off
# the 32-column panels; K odd.
@pytest.mark.parametrize("M,K,N", [(1, 64, 32), (5, 37, 70), (17, 128, 100), (300, 96, 33)])
def test_panel_matmul_equals_the_reference(M, K, N):
  r = np.random.default_rng(M + K + N)
  w = jnp.asarray(r.standard_normal((K, N)) / np.sqrt(K), jnp.float32)
  x = jnp.asarray(r.standard_normal((M, K)), jnp.float32)
  wp = cpu.pack_panels(w)
  assert wp.shape == (-(-N // cpu.PANEL), K, cpu.PANEL)
  np.testing.assert_array_equal(cpu.unpack_panels(wp, N), w)
  got = jax.jit(cpu.panel_matmul)(x, wp)
  assert got.shape == (M, wp.shape[0] * cpu.PANEL)
  np.testing.assert_allclose(got, cpu.panel_matmul_reference(x, wp), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(got[:, :N], np.asarray(x, np.float64) @ np.asarray(w, np.float64),
                             rtol=2e-5, atol=2e-5)
  assert not np.any(np.asarray(got)[:, N:]), "the padding columns must come back zero"


def test_panel_matmul_bad_inputs_are_named():
  wp = cpu.pack_panels(jnp.zeros((16, 40), jnp.float32))
  with pytest.raises(ValueError, match=r"x \[M, K\] and panels"):
    cpu.panel_matmul(jnp.zeros((4, 12), jnp.float32), wp)
  with pytest.raises(ValueError, match=r"x \[M, K\] and panels"):
    cpu.panel_matmul(jnp.zeros((4, 16), jnp.float32), wp[0])
  with pytest.raises(TypeError, match="float32"):
    cpu.panel_matmul(jnp.zeros((4, 16), jnp.bfloat16), wp)
  with pytest.raises(ValueError, match=r"\[K, N\] matrix"):
    cpu.pack_panels(jnp.zeros((2, 3, 4), jnp.float32))
