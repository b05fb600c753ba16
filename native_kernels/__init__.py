"""CPU kernels written in C++ as XLA FFI custom calls, built from their
source with the machine's C++ compiler: on first use (the first op that
needs them, when a step is traced) or explicitly, `build()` /
`python -m native_kernels`; never when a library object is made.

`moe_experts.cc`: a MoE layer's routed experts, each chosen expert's
weights read once for all its rows (streamed for decode, register tiles
over prefetched panels for prefill), the cores streaming different experts. `split_experts_ffn` calls it;
`split_experts_reference` is the pure-jnp reference it is tested against.

`panel_matmul.cc`: a dense projection x @ w with w packed as 32-column
panels (`pack_panels`), each panel one contiguous stream (memory-bound
decode at ~1.4x XLA:CPU's dot on the 2-core Zen 5 EPYC). `panel_matmul`
calls it; `panel_matmul_reference` is its jnp reference.

The shared library is cached under $JAXINFER_CACHE (default
~/.cache/jaxinfer) by a hash of the sources, the compiler flags, the jax
version, the CPU and the compiler (`cache_key`: its path, size and mtime),
built with `-march=native` under a file lock (several processes may start
at once); files beside it under the same key (`library_path`) hold what was
measured with it (`engine.weight_layout`'s probe). Where the kernels cannot
run (JAXINFER_NATIVE=0, no compiler: $CXX, g++ or c++ on PATH, a failed
build or load) `available()` is False, `unavailable_reason()` says why, one
RuntimeWarning per process says so, and callers take their XLA path.
`status()` answers without building: "native", "xla: <reason>", or
"native on first use".
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

_SOURCES = tuple(Path(__file__).with_name(n) for n in ("moe_experts.cc", "panel_matmul.cc"))
_TARGET = "jaxinfer_split_experts"
_PANEL_TARGET = "jaxinfer_panel_matmul"
PANEL = 32  # columns of one `pack_panels` panel
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}  # `activation` attribute values
NO_COMPILER = "no C++ compiler ($CXX, g++ or c++ on PATH)"
_state = {"reason": None, "tiled": False, "loaded": False}


def _cpu_name() -> str:
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith(("model name", "flags")):
        return line
  except OSError:
    pass
  return platform.processor()


def compiler() -> str | None:
  """The C++ compiler a build runs: $CXX, else g++ or c++ on PATH; None without one."""
  return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _compiler_id(cxx: str | None) -> str:
  """The compiler as the cache key sees it: its resolved path, size and
  mtime (an upgrade changes them), with no process run."""
  path = shutil.which(cxx) if cxx else None
  if path is None:
    return "none"
  st = os.stat(os.path.realpath(path))
  return f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}"


def cache_key() -> str:
  """The build's key: sources, flags, jax version, CPU and compiler."""
  parts = [*(s.read_text() for s in _SOURCES), " ".join(_FLAGS), jax.__version__, _cpu_name(),
           _compiler_id(compiler())]
  return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def library_path() -> Path:
  """Where the shared library for this machine and compiler is (or goes):
  $JAXINFER_CACHE/native/cpu_kernels-<cache_key>.so."""
  root = Path(os.environ.get("JAXINFER_CACHE", Path.home() / ".cache" / "jaxinfer"))
  return root / "native" / f"cpu_kernels-{cache_key()}.so"


def _build(path: Path) -> None:
  cxx = compiler()
  if cxx is None:
    raise RuntimeError(NO_COMPILER)
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path.with_suffix(".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if path.exists():
      return
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), "-o", str(tmp), "-lpthread"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
      raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    tmp.rename(path)


def _disabled() -> str | None:
  return "JAXINFER_NATIVE=0" if os.environ.get("JAXINFER_NATIVE", "1") == "0" else None


@functools.cache
def _load() -> bool:
  """Builds (unless on disk), loads and registers the kernels, once per
  process; on failure records why and warns once."""
  reason = _disabled()
  if reason is None:
    try:
      path = library_path()
      if not path.exists():
        _build(path)
      lib = ctypes.CDLL(str(path))
      jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.JaxinferSplitExperts),
                                  platform="cpu")
      jax.ffi.register_ffi_target(_PANEL_TARGET, jax.ffi.pycapsule(lib.JaxinferPanelMatMul),
                                  platform="cpu")
      _state.update(tiled=bool(lib.JaxinferSplitExpertsTiled()), loaded=True)
      return True
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
      reason = str(e) if str(e) == NO_COMPILER else f"{type(e).__name__}: {e}"
  _state["reason"] = reason
  warnings.warn(f"native_kernels: the C++ CPU kernels are unavailable ({reason}); "
                "their ops run on XLA instead", RuntimeWarning, stacklevel=3)
  return False


def build() -> bool:
  """Builds the kernels now (unless this machine's library is on disk) and
  loads them: what their first use would do, done when asked
  (`python -m native_kernels`). -> `available()`."""
  return _load()


def available() -> bool:
  """Whether the native kernels are built and registered: the first call
  (an op's first use) builds and loads them, once per process."""
  return _load()


def tiled() -> bool:
  """Whether the built kernel runs experts of many rows on register tiles
  (AVX-512; compute-bound prefill at ~400 GFLOP/s on the 2-core Zen 5 EPYC,
  ~150 on the 2-core Xeon of round 31), else it
  streams them 8 rows at a time (fit for decode only)."""
  return available() and _state["tiled"]


def unavailable_reason() -> str | None:
  """Why `available()` is False; None when it is True or was not asked yet."""
  return _state["reason"]


def precheck() -> str | None:
  """Why the kernels cannot run here, as far as is known without building or
  loading anything: a recorded failure, JAXINFER_NATIVE=0, or no compiler
  and no library built for this machine; None where they may."""
  if _state["reason"] is not None:
    return _state["reason"]
  if _state["loaded"]:
    return None
  if _disabled():
    return _disabled()
  if compiler() is None and not library_path().exists():
    return NO_COMPILER
  return None


def status() -> str:
  """Which path the kernels' ops take, without building anything: "native"
  (loaded), "xla: <reason>" (they cannot run here: `precheck`), or
  "native on first use" (not loaded yet in this process)."""
  if _state["loaded"]:
    return "native"
  why = precheck()
  return f"xla: {why}" if why else "native on first use"


def _check(xs, sizes, w_gate_up, w_down):
  E = len(w_gate_up)
  if xs.ndim != 2:
    raise ValueError(f"xs must be [M, D] token copies, got shape {xs.shape}")
  if E == 0 or len(w_down) != E or sizes.shape != (E,):
    raise ValueError(f"{E} gate-up weights, {len(w_down)} down weights and sizes {sizes.shape} "
                     "must name the same experts")
  D = xs.shape[1]
  F = w_down[0].shape[0]
  for wg, wd in zip(w_gate_up, w_down):
    if wg.shape != (D, 2 * F) or wd.shape != (F, D):
      raise ValueError(f"expert weights {wg.shape} / {wd.shape}, expected {(D, 2 * F)} / {(F, D)}")
  if any(a.dtype != jnp.float32 for a in (xs, *w_gate_up, *w_down)):
    raise TypeError("the native expert kernel takes float32 rows and weights")


def split_experts_ffn(xs, sizes, w_gate_up, w_down, activation: str = "silu", limit: float = 0.0,
                      alpha: float = 0.0):
  """xs [M, D] float32 token copies sorted by expert, sizes [E] int32 their
  counts per expert (rows past the sum come back zero), w_gate_up E x [D, 2F]
  (gate columns first), w_down E x [F, D] -> [M, D] float32: each copy
  through its expert's gated FFN (`split_experts_reference`). The native
  kernel: RuntimeError where it is not `available()`."""
  _check(xs, sizes, w_gate_up, w_down)
  if not available():
    raise RuntimeError(f"the native CPU kernels are unavailable: {unavailable_reason()}")
  call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(xs.shape, jnp.float32))
  return call(xs, sizes.astype(jnp.int32), *w_gate_up, *w_down, activation=ACTIVATIONS[activation],
              limit=np.float32(limit), alpha=np.float32(alpha))


def split_experts_reference(xs, sizes, w_gate_up, w_down, activation: str = "silu",
                            limit: float = 0.0, alpha: float = 0.0):
  """`split_experts_ffn` in jnp: every expert on every row, each row kept
  from its own expert (E times the FLOPs; for tests)."""
  _check(xs, sizes, w_gate_up, w_down)
  M = xs.shape[0]
  ends = jnp.cumsum(sizes)
  expert = jnp.searchsorted(ends, jnp.arange(M), side="right")  # E: padding
  out = jnp.zeros(xs.shape, jnp.float32)
  hi = jax.lax.Precision.HIGHEST
  for e, (wg, wd) in enumerate(zip(w_gate_up, w_down)):
    gate, up = jnp.split(jnp.dot(xs, wg, precision=hi), 2, axis=-1)
    if activation == "silu":
      h = jax.nn.silu(gate) * up
    else:
      gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
      h = (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))
    out = jnp.where((expert == e)[:, None], jnp.dot(h, wd, precision=hi), out)
  return out


def pack_panels(w):
  """w [K, N] -> panels [P, K, 32] (P = ceil(N / 32); columns past N are
  zero): `panel_matmul`'s weight layout."""
  if w.ndim != 2:
    raise ValueError(f"pack_panels takes a [K, N] matrix, got shape {w.shape}")
  K, N = w.shape
  P = -(-N // PANEL)
  w = jnp.pad(w, ((0, 0), (0, P * PANEL - N)))
  return jnp.transpose(w.reshape(K, P, PANEL), (1, 0, 2))


def unpack_panels(wp, n: int):
  """The inverse of `pack_panels`: panels [P, K, 32] -> [K, n]."""
  P, K, _ = wp.shape
  return jnp.transpose(wp, (1, 0, 2)).reshape(K, P * PANEL)[:, :n]


def panel_matmul(x, wp):
  """x [M, K] float32 times panels wp [P, K, 32] float32 (`pack_panels`) ->
  [M, P * 32] float32, on the native kernel (RuntimeError where it is not
  `available()`)."""
  if x.ndim != 2 or wp.ndim != 3 or wp.shape[1] != x.shape[1] or wp.shape[2] != PANEL:
    raise ValueError(f"panel_matmul: x [M, K] and panels [P, K, {PANEL}], got {x.shape} "
                     f"and {wp.shape}")
  if x.dtype != jnp.float32 or wp.dtype != jnp.float32:
    raise TypeError(f"panel_matmul takes float32, got {x.dtype} and {wp.dtype}")
  if not available():
    raise RuntimeError(f"the native CPU kernels are unavailable: {unavailable_reason()}")
  out = jax.ShapeDtypeStruct((x.shape[0], wp.shape[0] * PANEL), jnp.float32)
  return jax.ffi.ffi_call(_PANEL_TARGET, out)(x, wp)


def panel_matmul_reference(x, wp):
  """`panel_matmul` in jnp (float32, highest precision)."""
  return jnp.dot(x, unpack_panels(wp, wp.shape[0] * PANEL), precision=jax.lax.Precision.HIGHEST)
