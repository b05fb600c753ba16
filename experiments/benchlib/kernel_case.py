"""What the kernel bench's cases are made of (`Impl`, `Case`) and the random
inputs and skips they share; the MoE grouped-matmul cases (`kernel_gmm`) and
the attention / quantized-matmul cases (`kernels`) build on it."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Impl:
  """fn(*args) is jitted and timed. prep(*args) -> args runs once per input set,
  untimed (layout adapters). temp_bytes: memory it needs beyond its inputs; past
  the run's budget it is skipped. skip: a reason not to run it at all.
  A peer outside jax (torch) sets `sync(out)`, which waits for its outputs:
  fn is then called as it is, not jitted; `post(out)` turns its output into a
  jax array [in the reference's layout] for the error check."""
  fn: Callable
  prep: Callable | None = None
  temp_bytes: float = 0.0
  note: str = ""
  skip: str = ""
  sync: Callable | None = None
  post: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Case:
  """One shape of one kernel. make_args(key) -> the inputs (one input set);
  impls: "ours" first; reference: the float32 check, given float32 inputs."""
  kernel: str
  label: str
  series: str  # curves in the plot: cases of one series differ only in context
  context: int
  shape: dict
  flops: float
  bytes: float
  make_args: Callable
  impls: dict
  reference: Impl


def normal(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def short_error(e):
  """An exception as one line: 'Type: first line of the message' (<= 300 chars)."""
  text = f"{type(e).__name__}: {e}".strip().splitlines()
  return (text[0] if text else type(e).__name__)[:300]


def gpu_peer(env, module):
  """-> (module, "") for a GPU-only peer that can run here, else (None, why not)."""
  if not env.gpu:
    return None, "GPU only"
  try:
    return importlib.import_module(module), ""
  except Exception as e:  # noqa: BLE001  (any import failure means "not available")
    return None, f"not importable: {short_error(e)}"


def mosaic_skip(env, unsupported) -> str:
  """Why a Mosaic GPU kernel cannot run this case here ("" if it can);
  unsupported: the kernel's own verdict on the shapes (None: it takes them)."""
  if not env.gpu:
    return "GPU only (Hopper)"
  if not str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9"):
    return "Hopper (sm90) only"
  return "" if unsupported is None else unsupported[1]


def random_codes(key, shape, dtype):
  """Random stored codes of one format: every byte pattern for packed uint8,
  normal values for fp8, the int8 range."""
  if dtype == jnp.uint8:
    return jax.random.randint(key, shape, 0, 256, jnp.int32).astype(jnp.uint8)
  if dtype == jnp.int8:
    return jax.random.randint(key, shape, -127, 128, jnp.int32).astype(jnp.int8)
  return normal(key, shape, dtype)


def random_scales(key, shape, dtype):
  """Positive block scales: E8M0 exponents 2^-9..2^-4, else uniform 0.25..1."""
  if dtype == jnp.uint8:
    return jax.random.randint(key, shape, 118, 124, jnp.int32).astype(jnp.uint8)
  return jax.random.uniform(key, shape, jnp.float32, 0.25, 1.0).astype(dtype)
