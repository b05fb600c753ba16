"""Compile for GPUs from a CPU process: compile-only H100 / A100 devices.

With a CUDA PJRT plugin and ptxas installed (the `gpu-compile` extra: on Python
3.11 / jax 0.10.2 `jax-cuda12-plugin` and `nvidia-cuda-nvcc-cu12`, on Python 3.12+ /
the newest jax `jax-cuda13-plugin` and `nvidia-cuda-nvcc` 13), XLA builds real
GPU executables on a machine without a GPU: `jax.experimental.topologies`
describes the devices from a `GpuTargetConfig` (the text protos in
`jaxinfer/gpu_targets/`), and programs lowered for a mesh of them compile
into the same code a GPU process would run, with `memory_analysis()`.
Lower inside `lowering(mesh)`, so Pallas Triton kernels target the mesh's GPU.

  gpu = gpu_compile.target("h100")                 # device facts + roofline numbers
  mesh = gpu_compile.mesh({"data": 2, "expert": 4}, gpu="h100")
  with gpu_compile.lowering(mesh):
    lowered = jax.jit(f).lower(*abstract_args_on(mesh))
  compiled = lowered.compile()

Multi-host topologies (e.g. 4 hosts x 8 GPUs) come from `hosts=`; the mesh
then spans every host's devices, as under `jax.distributed` on a cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import pathlib
from typing import Mapping

import jax

from jaxinfer import sharding

_TARGETS_DIR = pathlib.Path(__file__).parent / "gpu_targets"
INSTALL_HINT = ('pip install -e ".[gpu-compile]" (a CUDA PJRT plugin matching the installed '
                'jax and its ptxas: jax-cuda13-plugin + nvidia-cuda-nvcc on Python 3.12+, '
                'jax-cuda12-plugin + nvidia-cuda-nvcc-cu12 on 3.11)')
# (PJRT plugin module, the pip package that ships its ptxas), newest CUDA first.
TOOLCHAINS = (("jax_plugins.xla_cuda13", "nvidia.cu13"),
              ("jax_plugins.xla_cuda12", "nvidia.cuda_nvcc"))


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """One GPU model: its XLA target config and the figures rooflines use."""

  name: str
  proto: str  # file in jaxinfer/gpu_targets/
  hbm_bytes: float  # device memory
  hbm_bandwidth: float  # bytes/s (datasheet)
  bf16_flops: float  # dense bf16 tensor-core FLOP/s (datasheet)
  smem_per_block: int  # opt-in shared memory per thread block, bytes

  def config_text(self) -> str:
    return (_TARGETS_DIR / self.proto).read_text()


TARGETS = {
    "h100": GpuTarget("h100", "h100_sxm.txtpb", hbm_bytes=80e9, hbm_bandwidth=3.35e12,
                      bf16_flops=989e12, smem_per_block=232448),
    "a100": GpuTarget("a100", "a100_sxm.txtpb", hbm_bytes=80e9, hbm_bandwidth=2.039e12,
                      bf16_flops=312e12, smem_per_block=166912),
}


def target(gpu: str = "h100") -> GpuTarget:
  if gpu not in TARGETS:
    raise ValueError(f"gpu must be one of {sorted(TARGETS)}, got {gpu!r}")
  return TARGETS[gpu]


def toolchain_error() -> str | None:
  """Why GPU programs cannot be compiled in this environment, or None."""
  for plugin, nvcc in TOOLCHAINS:
    if _importable(plugin) and _ptxas_in(nvcc):
      return None
  found = [m for pair in TOOLCHAINS for m in pair if _importable(m)]
  return (f"the GPU compile toolchain is not installed (no CUDA plugin with its ptxas; found "
          f"{found or 'neither'} of {[m for pair in TOOLCHAINS for m in pair]}): {INSTALL_HINT}")


def ptxas_path() -> pathlib.Path | None:
  """The ptxas the `gpu-compile` extra installed (CUDA 13's first), or None."""
  for plugin, nvcc in TOOLCHAINS:
    if _importable(plugin) and (path := _ptxas_in(nvcc)):
      return path
  return None


def _ptxas_in(package: str) -> pathlib.Path | None:
  if not _importable(package):
    return None
  spec = importlib.util.find_spec(package)
  for root in spec.submodule_search_locations or ():
    if (path := pathlib.Path(root) / "bin" / "ptxas").exists():
      return path
  return None


def _importable(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:
    return False


@functools.cache
def topology(gpu: str = "h100", *, hosts: int = 1, devices_per_host: int = 1):
  """A compile-only topology of `hosts` x `devices_per_host` GPUs of one model."""
  for name, v in (("hosts", hosts), ("devices_per_host", devices_per_host)):
    if not isinstance(v, int) or v < 1:
      raise ValueError(f"{name} must be an int >= 1, got {v!r}")
  why = toolchain_error()
  if why:
    raise RuntimeError(why)
  from jax.experimental import topologies
  try:
    return topologies.get_topology_desc(platform="cuda", target_config=target(gpu).config_text(),
                                        topology=f"1x{hosts}x{devices_per_host}")
  except NotImplementedError as e:  # the plugin tried CUDA at start-up, failed, and left
    raise RuntimeError("no compile-only CUDA topology in this process: on a machine without "
                       "a GPU, start it with JAX_PLATFORMS=cpu (set before jax is imported)") from e


def devices(gpu: str = "h100", *, hosts: int = 1, devices_per_host: int = 1) -> list:
  return list(topology(gpu, hosts=hosts, devices_per_host=devices_per_host).devices)


def mesh(axes: Mapping[str, int], *, gpu: str = "h100", hosts: int = 1) -> jax.sharding.Mesh:
  """A mesh of compile-only GPUs: product(axes) devices spread over `hosts`
  (devices are ordered host by host, so inner mesh axes stay inside a host)."""
  n = math.prod(axes.values())
  if n % hosts:
    raise ValueError(f"mesh {dict(axes)} has {n} devices, not divisible by hosts={hosts}")
  return sharding.make_mesh(axes, devices(gpu, hosts=hosts, devices_per_host=n // hosts))


def lowering(mesh: jax.sharding.Mesh):
  """A context to `.lower(...)` programs for `mesh`'s devices in.

  From jax 0.11 the Pallas Triton lowering no longer assumes an sm90 GPU when
  none is present: it reads the target from the current abstract mesh's
  `AbstractDevice` and raises "No supported GPU devices found" without one.
  `mesh.abstract_mesh` carries that device, built from the compile-only
  devices: device_kind from the target proto ("NVIDIA H100 80GB HBM3",
  "NVIDIA A100-SXM4-80GB", so each target keeps its own compute capability),
  num_cores, platform "gpu". Its axes keep the mesh's types (Auto), so
  sharding semantics do not change. jax 0.10's lowering ignores the context
  (it assumes sm90 without a GPU); a jax without abstract devices gets no context.
  """
  abstract_mesh = getattr(mesh, "abstract_mesh", None)
  if getattr(abstract_mesh, "abstract_device", None) is None:
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(abstract_mesh)


def abstract(tree, shardings):
  """ShapeDtypeStructs of `tree` (arrays or ShapeDtypeStructs) placed on `shardings`
  (a matching tree, or one sharding for every leaf)."""
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings), tree)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
                      shardings)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Per-device bytes of one compiled program (from `memory_analysis()`)."""

  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int

  @classmethod
  def of(cls, compiled) -> "MemoryReport":
    m = compiled.memory_analysis()
    return cls(int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
               int(m.alias_size_in_bytes), int(m.temp_size_in_bytes))

  @property
  def peak_bytes(self) -> int:
    """Arguments + outputs not aliased to an argument + temporaries."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
