"""`Backend`: the kernels a program runs and the device they are built for.

One small frozen value, held by `ModelConfig.backend` (so static in every
jitted step) and handed unchanged to every `jaxinfer.ops` call:

  attention  "xla" (pure JAX), "pallas" (`pallas_kernels`), "mosaic"
             (opt-in, Hopper, jax >= 0.11: "pallas", but decode-only paged
             steps on the Mosaic GPU kernels where they take the shapes,
             `ops.mosaic_decode_kernel`), or None: Pallas for a GPU target,
             XLA otherwise.
  target     the device the program is built for: "gpu" (Pallas kernels
             compiled through Triton, even when this process runs on CPU:
             programs lowered for compile-only GPUs, `jaxinfer.gpu_compile`),
             "cpu" (Pallas runs in interpret mode), or None: this process's
             default backend.

The target is part of the value, not read from the process, because a
program's kernels must match the devices it is compiled for, and a CPU
process can build GPU programs. Bad values raise ValueError on construction.
This module imports nothing from jaxinfer: `config` and `ops` both hold it.
"""

from __future__ import annotations

import dataclasses

import jax

ATTENTION_KERNELS = ("xla", "pallas", "mosaic")
TARGETS = ("gpu", "cpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backend:
  """Which attention kernels run (`attention`) and which device the
  program's kernels are built for (`target`); None picks automatically."""

  attention: str | None = None
  target: str | None = None

  def __post_init__(self):
    if self.attention is not None and self.attention not in ATTENTION_KERNELS:
      raise ValueError(f"Backend.attention must be None or one of {ATTENTION_KERNELS}, "
                       f"got {self.attention!r}")
    if self.target is not None and self.target not in TARGETS:
      raise ValueError(f"Backend.target must be None or one of {TARGETS}, got {self.target!r}")

  def resolved_target(self) -> str:
    """The kernel target: `target` itself, or for None this process's
    default backend ("gpu" on a GPU process, "cpu" on anything else)."""
    if self.target is not None:
      return self.target
    return "gpu" if jax.default_backend() == "gpu" else "cpu"

  def on_gpu(self) -> bool:
    """Whether the program is built for GPUs (Pallas kernels compiled
    through Triton, never interpreted)."""
    return self.resolved_target() == "gpu"

  def attention_kernel(self) -> tuple[str, bool]:
    """-> (attention kernel, interpret): `attention`, or for None Pallas on a
    GPU target and XLA otherwise; Pallas kernels are interpreted unless the
    target is "gpu"."""
    gpu = self.on_gpu()
    return self.attention or ("pallas" if gpu else "xla"), not gpu
