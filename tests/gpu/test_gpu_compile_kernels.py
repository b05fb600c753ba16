"""The GPU compile gate for the kernels: every case of `benchlib.gpu_cases`
(seed-model shapes, 32k-page pools, verify Q = 1..4, mixed 512+-token steps)
is compiled into an H100 (or A100) executable on this CPU machine, from
abstract shapes. A missing toolchain fails here: the gate never skips."""

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from benchlib import gpu_cases
from jaxinfer import gpu_compile


def test_toolchain_present():
  assert gpu_compile.toolchain_error() is None, gpu_compile.toolchain_error()


def test_at_least_twenty_cases_cover_every_kernel():
  kinds = {c.kernel for c in gpu_cases.CASES}
  assert kinds == {"flash", "paged", "mla", "ragged"}
  assert len([c for c in gpu_cases.CASES if "h100" in c.gpus]) >= 20
  assert all(c.pages_per_seq * c.ps == c.ctx for c in gpu_cases.CASES)
  assert gpu_cases.POOL_PAGES >= 32768
  assert {c.Q for c in gpu_cases.CASES if c.kernel in ("paged", "mla")} >= {1, 2, 4}
  assert max(c.prefill_tokens for c in gpu_cases.CASES) >= 512


@pytest.mark.parametrize("gpu,kind", [("h100", "NVIDIA H100"), ("a100", "NVIDIA A100")])
def test_lowering_names_each_targets_gpu_model(gpu, kind):
  # jax >= 0.11's Triton lowering takes the compute capability from this device.
  mesh = gpu_compile.mesh({"data": 1}, gpu=gpu)
  with gpu_compile.lowering(mesh):
    device = jax.sharding.get_abstract_mesh().abstract_device
  assert device.device_kind.startswith(kind) and device.platform == "gpu"


@pytest.mark.parametrize("case", gpu_cases.CASES, ids=lambda c: c.name)
def test_kernel_compiles_for_gpu(case):
  gpu = case.gpus[0]
  mesh = gpu_compile.mesh({"data": 1}, gpu=gpu)
  fn, args = gpu_cases.build(case, NamedSharding(mesh, P()))
  with gpu_compile.lowering(mesh):
    compiled = jax.jit(fn).lower(*args).compile()
  text = compiled.as_text()
  assert "__gpu$xla.gpu.triton" in text  # the Pallas kernel, not an XLA fallback
  mem = gpu_compile.MemoryReport.of(compiled)
  assert 0 < mem.peak_bytes < gpu_compile.target(gpu).hbm_bytes


@pytest.mark.parametrize("case", gpu_cases.HSTU_CASES, ids=lambda c: c.name)
def test_hstu_attention_compiles_for_gpu(case):
  # DLRMv3's jagged HSTU attention (packed users, in-kernel bias gathers).
  gpu = case.gpus[0]
  mesh = gpu_compile.mesh({"data": 1}, gpu=gpu)
  fn, args = gpu_cases.build_hstu(case, NamedSharding(mesh, P()))
  with gpu_compile.lowering(mesh):
    compiled = jax.jit(fn).lower(*args).compile()
  assert "__gpu$xla.gpu.triton" in compiled.as_text()
  mem = gpu_compile.MemoryReport.of(compiled)
  assert 0 < mem.peak_bytes < gpu_compile.target(gpu).hbm_bytes
