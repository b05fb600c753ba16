"""`Backend`: the kernels a program runs and the device they are built for.

One small frozen value, held by `ModelConfig.backend` (so static in every
jitted step) and handed unchanged to every `jaxinfer.ops` call:

  attention  "xla" (pure JAX), "pallas" (`pallas_kernels`, Pallas
             Triton on GPUs), "mosaic" (Hopper, jax >= 0.11: paged steps on
             the Mosaic GPU kernels where they take the shapes,
             `ops.mosaic_kernel`, the rest "pallas"), or None: "mosaic" for
             a Hopper GPU target on a jax with Mosaic GPU (prefill chunks
             past `ops.MOSAIC_AUTO_MAX_Q` tokens on "pallas", but where the
             trials for long chunks, "cluster_items" and "mla_items", take
             them), "pallas" for
             other GPU targets (A100, jax 0.10), XLA otherwise.
  grouped_matmul
             the unquantized MoE expert matmul: "xla" (`lax.ragged_dot`),
             "mosaic" (jax's Hopper kernel `ragged_dot_mgpu`, where
             `ops.mosaic_grouped_matmul` takes the shapes), "tokamax"
             (`tokamax.ragged_dot`: its Mosaic GPU kernel on a GPU, its
             XLA form elsewhere; the `tokamax` extra), or None: on a
             Hopper GPU target the newest committed winner table's choice
             (`kernel_defaults`), else "mosaic" where attention None picks
             "mosaic", else "xla". Quantized
             experts take the Pallas quantized kernel on GPUs (the
             "fused_experts" trial: ours on Mosaic, but NVFP4 / int4).
  trials     Mosaic kernel variants that compile for H100 and match their
             references interpreted but have not yet run on a GPU, named to
             try them (a tuple of `TRIALS`; none by default): "mla_cluster",
             MLA decode with a sequence's 64-row blocks of heads (2 to 8:
             DeepSeek's 128 heads are 2) as one cluster sharing each latent
             read (TMA multicast; `mosaic_mla_attention(cluster=True)`);
             "wide_items", GQA mixed steps on work items of two 64-row tiles
             on two warpgroups sharing each K / V block
             (`mosaic_ragged_attention(wide=True)`); "cluster_items", a
             chunk longer than an item of four tiles on such items, up to 8
             consecutive ones as one cluster sharing each K / V read (TMA
             multicast; `cluster=True`); "mla_items", MLA verify and mixed
             steps (prefill chunks) on work items of whole tokens, a long
             chunk's items of 8 row blocks each one cluster sharing each
             latent read (`mosaic_mla_ragged_attention(cluster=True)`;
             without it these steps run "pallas" where their rows exceed
             one 64-row block, or one cluster with "mla_cluster");
             "fused_experts", under
             grouped_matmul "mosaic", the MoE experts on our Mosaic kernel
             (`ops.mosaic_experts`): gate and up in one pass with the GLU
             and biases fused, quantized experts (fp8 / int8, MXFP4)
             dequantized tile by tile, interpreted on a CPU target. A
             variant leaves this list for the default once a GPU run has
             matched it.
  dense_attention
             attention with no cached prefix from a kernel library,
             `jax.nn.dot_product_attention`: "cudnn" (its cuDNN flash
             kernel, GPU only: bfloat16 / float16, equal q / k and v head
             dims up to 256), "jax_nn" (its XLA form, any device),
             "tokamax" (`tokamax.dot_product_attention`: the first of its
             Mosaic GPU (FlashAttention-3 style), Triton and XLA kernels
             that takes the case on this device; the `tokamax` extra),
             "ours" (our kernels as `attention` picks them), or None: on
             a Hopper GPU target the newest committed winner table's
             choice (`kernel_defaults`; with none committed, ours), else
             ours. It serves full forwards (`ops.causal_attention`), WAN's
             DiT (`ops.full_attention`; its VAE's one 384-wide head stays
             on XLA) and an Engine step whose every
             sequence is a fresh prompt chunk, as the host marks it
             (`steps.fresh_shapes`; GQA pages without scales,
             `ops.ragged_paged_attention`). Cases the library does not
             take (sinks, a traced window, MLA's latent pages, the dtypes
             and head dims above) run as with None
             (`library_attention.unfit` names why). cuDNN cannot be
             lowered without the cuDNN library and a GPU, nor tokamax's
             Mosaic kernel without a GPU device (its sm90 check reads the
             device), so the compile gate cannot build them: candidates
             until a GPU run matches them.
  target     the device the program is built for: "gpu" (Pallas kernels
             compiled through Triton, even when this process runs on CPU:
             programs lowered for compile-only GPUs, `jaxinfer.gpu_compile`),
             "cpu" (Pallas runs in interpret mode), or None: this process's
             default backend.

The target is part of the value, not read from the process, because a
program's kernels must match the devices it is compiled for, and a CPU
process can build GPU programs. Bad values raise ValueError on construction.
The default resolution happens when a program is traced (`attention_kernel`),
so a CPU process building for a compile-only H100 (`jaxinfer.gpu_compile`)
gets what the H100 would. This module imports nothing from jaxinfer but
`kernel_defaults` (which imports nothing from it): `config` and `ops` both
hold it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util

import jax

from jaxinfer import kernel_defaults
from jaxinfer.kernel_defaults import HOPPER_KINDS
from pallas_kernels import mosaic_paged_attention

ATTENTION_KERNELS = ("xla", "pallas", "mosaic")
# jax.nn.dot_product_attention's cuDNN kernel and XLA form; tokamax's attention
# ("ours": our kernels, whatever a committed winner table says)
DENSE_ATTENTION = ("cudnn", "jax_nn", "tokamax", "ours")
GROUPED_MATMULS = ("xla", "mosaic", "tokamax")
# openxla's Pallas kernel library (the `tokamax` extra): its wheel asks for
# Python >= 3.12 and jax >= 0.11.1 (tokamax 0.0.17's metadata).
TOKAMAX_NEEDS = "pip install 'jaxinfer[tokamax]': Python >= 3.12, jax >= 0.11.1"
TARGETS = ("gpu", "cpu")
# Mosaic variants not yet run on a GPU
TRIALS = ("mla_cluster", "wide_items", "cluster_items", "mla_items", "fused_experts")


def hopper_target() -> bool:
  """Whether the GPU programs are built for now is a Hopper: inside
  `gpu_compile.lowering` the compile target's device (the abstract mesh's),
  else this process's first GPU (compute capability 9.x)."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if device is not None:
    return any(kind in device.device_kind for kind in HOPPER_KINDS)
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  return bool(gpus) and str(getattr(gpus[0], "compute_capability", "")).startswith("9.")


def mosaic_default() -> bool:
  """Whether attention None picks "mosaic" for a GPU target: this jax has
  Mosaic GPU kernels and the target is a Hopper."""
  return mosaic_paged_attention.available() is None and hopper_target()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backend:
  """Which attention kernels run (`attention`) and which device the
  program's kernels are built for (`target`); None picks automatically."""

  attention: str | None = None
  target: str | None = None
  grouped_matmul: str | None = None
  trials: tuple[str, ...] = ()
  dense_attention: str | None = None

  def __post_init__(self):
    if self.attention is not None and self.attention not in ATTENTION_KERNELS:
      raise ValueError(f"Backend.attention must be None or one of {ATTENTION_KERNELS}, "
                       f"got {self.attention!r}")
    if self.dense_attention is not None and self.dense_attention not in DENSE_ATTENTION:
      raise ValueError(f"Backend.dense_attention must be None or one of {DENSE_ATTENTION}, "
                       f"got {self.dense_attention!r}")
    if self.grouped_matmul is not None and self.grouped_matmul not in GROUPED_MATMULS:
      raise ValueError(f"Backend.grouped_matmul must be None or one of {GROUPED_MATMULS}, "
                       f"got {self.grouped_matmul!r}")
    if (not isinstance(self.trials, (tuple, list))
        or not all(isinstance(t, str) and t in TRIALS for t in self.trials)):
      raise ValueError(f"Backend.trials must be a tuple of {TRIALS}, got {self.trials!r}")
    object.__setattr__(self, "trials", tuple(self.trials))  # a saved config's list
    if self.target is not None and self.target not in TARGETS:
      raise ValueError(f"Backend.target must be None or one of {TARGETS}, got {self.target!r}")
    for name in ("dense_attention", "grouped_matmul"):
      if getattr(self, name) == "tokamax" and importlib.util.find_spec("tokamax") is None:
        raise ValueError(f"Backend.{name}='tokamax' needs the tokamax package ({TOKAMAX_NEEDS})")

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
    """-> (attention kernel, interpret): `attention`, or for None on a GPU
    target "mosaic" where `mosaic_default()` holds, else "pallas", and XLA
    otherwise; kernels are interpreted unless the target is "gpu"."""
    gpu = self.on_gpu()
    if self.attention:
      return self.attention, not gpu
    if not gpu:
      return "xla", True
    return ("mosaic" if mosaic_default() else "pallas"), False

  def grouped_matmul_kernel(self) -> str:
    """The unquantized MoE matmul: `grouped_matmul`, or for None the
    committed winner table's choice on a Hopper GPU target
    (`kernel_defaults`), else "mosaic" on a GPU target where
    `mosaic_default()` holds, else "xla"."""
    if self.grouped_matmul:
      return self.grouped_matmul
    measured = self._measured("grouped_matmul")
    if measured is not None:
      return measured
    return "mosaic" if self.on_gpu() and mosaic_default() else "xla"

  def attention_library(self) -> str | None:
    """The library for attention with no cached prefix ("cudnn", "jax_nn",
    "tokamax") or None (our kernels): `dense_attention`, or for None the
    committed winner table's choice on a Hopper GPU target
    (`kernel_defaults`); "ours" is None."""
    choice = self.dense_attention or self._measured("dense_attention")
    return None if choice in (None, "ours") else choice

  def _measured(self, field: str) -> str | None:
    """`field`'s default from the newest committed winner table for a
    Hopper GPU target (`kernel_defaults.hopper_default`), or None: not a
    Hopper target, no table, or its choice is tokamax and tokamax is not
    installed (a default never asks for a missing package)."""
    if not (self.on_gpu() and hopper_target()):
      return None
    choice = kernel_defaults.hopper_default(field)
    return None if choice == "tokamax" and importlib.util.find_spec("tokamax") is None else choice


def tokamax():
  """The tokamax package (imported on first use: its import takes seconds and
  only Backends that name it need it); a `Backend` naming it has checked it
  is installed."""
  return importlib.import_module("tokamax")
