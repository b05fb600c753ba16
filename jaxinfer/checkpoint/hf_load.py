"""`load_hf(path)`: an HF checkpoint directory -> (ModelConfig, params).

Reads `config.json` and `*.safetensors` (one file, or shards listed by
`model.safetensors.index.json`) tensor by tensor: each param leaf is filled
layer by layer from memory-mapped files, placed on device and released before
the next, so host memory holds at most one leaf beyond the files' page cache.
Errors name the tensor (missing, unexpected, wrong shape or dtype) or the file
(unreadable, truncated, missing shard).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import warnings
from contextlib import ExitStack

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxinfer.checkpoint import hf_names, hf_quant
from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.checkpoint.safetensors_header import read_header
from jaxinfer.config import ModelConfig, QuantConfig
from jaxinfer.models import quant as quant_lib
from jaxinfer.models.quant import QuantizedWeight
from jaxinfer.models.specs import declared_specs, is_spec, param_specs

_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": ml_dtypes.bfloat16,
              "F8_E4M3": ml_dtypes.float8_e4m3fn, "U8": np.uint8, "I8": np.int8}
# Non-parameter buffers some checkpoints carry.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _index(path: str) -> dict[str, str]:
  """Tensor name -> file holding it."""
  index_file = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index_file):
    try:
      with open(index_file) as f:
        index = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise CheckpointError(f"{index_file}: invalid JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index_file}: no 'weight_map'")
    for v in weight_map.values():  # files of this directory only (no paths elsewhere)
      if not isinstance(v, str) or os.path.basename(v) != v or v in ("", ".", ".."):
        raise CheckpointError(f"{index_file}: {v!r} is not a file name in {path}")
    files = {os.path.join(path, v) for v in weight_map.values()}
    for fn in sorted(files):
      if not os.path.exists(fn):
        raise CheckpointError(f"{index_file} lists {os.path.basename(fn)}, which does not exist")
    return {k: os.path.join(path, v) for k, v in weight_map.items()}
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise CheckpointError(f"{path}: no *.safetensors files")
  index = {}
  for fn in files:
    for name in read_header(fn)[0]:
      index[name] = fn
  return index


def _check_files(index: dict[str, str]) -> None:
  """Every file's header validated (`safetensors_header`) and every indexed
  tensor present in its file, before any tensor is read."""
  headers = {fn: read_header(fn)[0] for fn in sorted(set(index.values()))}
  for name, fn in index.items():
    if name not in headers[fn]:
      raise CheckpointError(f"the index lists {name!r} in {os.path.basename(fn)}, which does not "
                            "hold it")


def _open(fn: str):
  try:
    return safe_open(fn, framework="numpy")
  except (SafetensorError, OSError) as e:
    raise CheckpointError(f"cannot read {os.path.basename(fn)}: {e}") from None


class _Reader:
  def __init__(self, path: str, stack: ExitStack, nonfinite: str = "error"):
    self.index = _index(path)
    _check_files(self.index)
    self.stack, self.nonfinite = stack, nonfinite
    self.handles: dict[str, object] = {}
    self.headers: dict[str, tuple[dict, int]] = {}
    self.used: set[str] = set()

  def has(self, name: str) -> bool:
    return name in self.index

  def shape(self, name: str) -> tuple[int, ...] | None:
    """A tensor's shape from its file's header (None: not in the checkpoint)."""
    fn = self.index.get(name)
    return None if fn is None else tuple(self.header(fn)[0][name]["shape"])

  def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    fn = self.index.get(name)
    if fn is None:
      raise CheckpointError(f"missing tensor {name!r}")
    if fn not in self.handles:
      self.handles[fn] = self.stack.enter_context(_open(fn))
    handle = self.handles[fn]
    try:
      sl = handle.get_slice(name)
    except SafetensorError as e:
      raise CheckpointError(f"tensor {name!r} in {os.path.basename(fn)}: {e}") from None
    dtype, got = sl.get_dtype(), tuple(sl.get_shape())
    if dtype not in _FLOAT_DTYPES:
      raise CheckpointError(f"tensor {name!r} has dtype {dtype}; expected a float dtype "
                            f"{_FLOAT_DTYPES} (a quantized tensor that config.json's "
                            "quantization_config does not cover)")
    if got != tuple(shape):
      raise CheckpointError(f"tensor {name!r} has shape {list(got)}, expected {list(shape)}")
    try:
      arr = handle.get_tensor(name)
    except SafetensorError as e:
      raise CheckpointError(f"tensor {name!r} in {os.path.basename(fn)}: {e}") from None
    self.check_finite(name, arr)
    self.used.add(name)
    return arr

  def header(self, fn: str) -> tuple[dict, int]:
    """A safetensors file's header (validated) and the offset of its data."""
    if fn not in self.headers:
      self.headers[fn] = read_header(fn)
    return self.headers[fn]

  def check_finite(self, name: str, arr: np.ndarray) -> None:
    """NaN / Inf in a float tensor: an error, a warning or nothing (`nonfinite`)."""
    if self.nonfinite == "ignore":
      return
    bad = int(arr.size - np.count_nonzero(np.isfinite(arr.astype(np.float32))))
    if not bad:
      return
    msg = f"tensor {name!r} has {bad} non-finite (NaN or Inf) values of {arr.size}"
    if self.nonfinite == "error":
      raise CheckpointError(msg + " (load_hf(..., nonfinite='warn') loads it anyway)")
    warnings.warn(msg, stacklevel=4)

  def read_raw(self, name: str, shapes, dtypes, what: str) -> np.ndarray:
    """A tensor of any storage dtype (fp8, uint8 included), memory-mapped."""
    fn = self.index.get(name)
    if fn is None:
      raise CheckpointError(f"missing tensor {name!r} ({what})")
    meta, start = self.header(fn)
    info = meta.get(name) or {}
    dtype, shape = info.get("dtype"), tuple(info.get("shape", ()))
    if dtype not in dtypes:
      raise CheckpointError(f"tensor {name!r} ({what}) has dtype {dtype}; expected {list(dtypes)}")
    if shape not in [tuple(s) for s in shapes]:
      raise CheckpointError(f"tensor {name!r} ({what}) has shape {list(shape)}, expected "
                            + " or ".join(str(list(s)) for s in shapes))
    lo, hi = info["data_offsets"]
    np_dtype = np.dtype(_NP_DTYPES[dtype])
    if hi - lo != int(np.prod(shape)) * np_dtype.itemsize or start + hi > os.path.getsize(fn):
      raise CheckpointError(f"tensor {name!r} in {os.path.basename(fn)}: data is truncated")
    self.used.add(name)
    raw = np.memmap(fn, np.uint8, "r", offset=start + lo, shape=(hi - lo,))
    return np.array(raw.view(np_dtype).reshape(shape))

  def build(self, src: hf_names.Source) -> np.ndarray:
    arrays = [self.read(n, s) for n, s in zip(src.names, src.shapes)]
    return src.convert(*arrays)


def _is_leaf(x) -> bool:
  return is_spec(x) or isinstance(x, QuantizedWeight)


def _quantized_parts(spec: QuantizedWeight, src, reader: _Reader, q: QuantConfig, stacked: bool):
  """One layer's (values, scale, scale2): read as stored, or quantized from
  the float weight on the host when the checkpoint is float (`quantize=`)."""
  if q.layout == "jaxinfer":
    lead = len(spec.values.shape) - 2 - int(stacked)
    w = quant_lib.quantize(reader.build(src), spec.method, spec.block, len(spec.in_shape), lead)
    return w.values, w.scale, w.scale2
  if src.ref is None:
    raise CheckpointError(f"{src.names[0]}: no quantized layout known for this tensor")
  parts = hf_quant.read_quantized(reader.read_raw, src.ref, q)
  reader.used.update(n for n in hf_quant.extra_names(q, src.ref) if reader.has(n))
  return parts


def _quantized_leaf(spec: QuantizedWeight, srcs, reader: _Reader, q: QuantConfig):
  """Host arrays of a quantized leaf, filled layer by layer."""
  host = jax.tree.map(lambda s: np.empty(s.shape, s.dtype), spec, is_leaf=is_spec)
  stacked = isinstance(srcs, list)
  for j, src in enumerate(srcs if stacked else [srcs]):
    parts = _quantized_parts(spec, src, reader, q, stacked)
    for field, part in zip(("values", "scale", "scale2"), parts):
      dst = getattr(host, field)
      if dst is None:
        continue
      want = dst.shape[1:] if stacked else dst.shape
      if tuple(part.shape) != want:
        raise CheckpointError(f"{src.names[0]}: quantized {field} has shape {list(part.shape)}, "
                              f"expected {list(want)}")
      dst[j if stacked else ...] = part
  return host


def _place(host, sharding):
  return jax.device_put(host, sharding) if sharding is not None else jax.tree.map(jnp.asarray, host)


def _load_tree(specs, sources: dict, reader: _Reader, shardings, dtype, q: QuantConfig | None):
  """Fills every spec leaf from sources[leaf path]: a Source or [Source per layer]."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_leaf)
  leaves = []
  for i, (kp, spec) in enumerate(flat):
    srcs = sources[hf_names.path_key(kp)]
    sharding = shardings[i] if isinstance(shardings, list) else shardings
    if isinstance(spec, QuantizedWeight):
      leaves.append(_place(_quantized_leaf(spec, srcs, reader, q), sharding))
      continue
    host = np.empty(spec.shape, dtype)
    if isinstance(srcs, list):  # stacked: one source per layer
      for j, src in enumerate(srcs):
        host[j] = reader.build(src)
    else:
      host[...] = reader.build(srcs)
    leaves.append(_place(host, sharding))
    del host
  return jax.tree_util.tree_unflatten(treedef, leaves)


_QUANTIZE_BLOCKS = {"fp8": (1, 0), "int8": (1, 0), "int4": (1, 32), "mxfp4": (1, 32),
                    "nvfp4": (1, 16)}


def _read_config(path: str) -> dict:
  """config.json, with a ModelOpt `hf_quant_config.json` folded into its
  quantization_config."""
  cfg_file = os.path.join(path, "config.json")
  if not os.path.exists(cfg_file):
    raise FileNotFoundError(f"load_hf: {path} has no config.json")
  files = [cfg_file] + [f for f in [os.path.join(path, "hf_quant_config.json")] if os.path.exists(f)]
  loaded = []
  for fn in files:
    try:
      with open(fn) as f:
        loaded.append(json.load(f))
    except json.JSONDecodeError as e:
      raise CheckpointError(f"{fn}: invalid JSON ({e})") from None
  hf = loaded[0]
  if len(loaded) > 1 and "quantization_config" not in hf:
    hf = dict(hf, quantization_config=dict(loaded[1], quant_method="modelopt"))
  return hf


def _quantize_config(cfg: ModelConfig, quantize, block) -> ModelConfig:
  if quantize is None:
    return cfg
  if quantize not in _QUANTIZE_BLOCKS:
    raise ValueError(f"load_hf: quantize must be one of {sorted(_QUANTIZE_BLOCKS)} or None, "
                     f"got {quantize!r}")
  if cfg.quant is not None:
    raise ValueError(f"load_hf: quantize={quantize!r}, but the checkpoint is already quantized "
                     f"({cfg.quant.method}, layout {cfg.quant.layout})")
  block = tuple(block) if block is not None else _QUANTIZE_BLOCKS[quantize]
  return dataclasses.replace(cfg, quant=QuantConfig(method=quantize, block=block))


NONFINITE = ("error", "warn", "ignore")


def load_hf(path: str, dtype=None, *, shardings=None, quantize: str | None = None,
            quantize_block: tuple[int, int] | None = None, nonfinite: str = "error"):
  """Loads an HF checkpoint directory (config.json + *.safetensors).

  dtype: param dtype (default: float32 on CPU, bfloat16 on GPU/TPU).
  shardings: a Sharding for every leaf, or a tree of them matching the params.
  Quantized checkpoints (`quantization_config`: DeepSeek block FP8, fbgemm
  FP8, GPT-OSS MXFP4, ModelOpt NVFP4 / FP8, compressed-tensors FP8 / NVFP4)
  load kept quantized (`models.quant.QuantizedWeight` leaves; cfg.quant).
  quantize: "fp8" | "int8" | "int4" (or "mxfp4" / "nvfp4") quantizes a float
  checkpoint's projections on load, weight-only, per output channel (int4:
  groups of 32 inputs) unless quantize_block = (rows, cols) says otherwise.
  Returns (cfg, params). DeepSeek MTP layers (`model.layers.{num_layers}.*`)
  load into params["mtp"] when present (else cfg.num_mtp_layers = 0); Qwen3-VL's
  vision tower (`model.visual.*`) into params["vision"]. Every file's header is
  checked before any tensor is read (`safetensors_header`); a float tensor
  with NaN or Inf raises (nonfinite="error"), warns ("warn") or loads ("ignore").
  """
  if nonfinite not in NONFINITE:
    raise ValueError(f"load_hf: nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
  if not os.path.isdir(path):
    raise FileNotFoundError(f"load_hf: {path} is not a directory")
  cfg = _quantize_config(ModelConfig.from_hf(_read_config(path)), quantize, quantize_block)
  dtype = jnp.dtype(dtype) if dtype is not None else cfg.compute_dtype()
  cfg = dataclasses.replace(cfg, dtype=dtype.name)
  with ExitStack() as stack:
    reader = _Reader(path, stack, nonfinite)
    if cfg.num_mtp_layers and not reader.has(f"model.layers.{cfg.num_layers}.eh_proj.weight"):
      cfg = dataclasses.replace(cfg, num_mtp_layers=0)  # checkpoint without MTP weights
    specs = param_specs(cfg, dtype)
    sources = hf_names.model_sources(cfg, reader.has, reader.shape)
    reader.used.update(n for n in hf_names.mtp_duplicates(cfg) if reader.has(n))
    flat_shardings = shardings
    if shardings is not None and not isinstance(shardings, jax.sharding.Sharding):
      flat_shardings = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    params = _load_tree(specs, sources, reader, flat_shardings, dtype, cfg.quant)
    unexpected = sorted(n for n in reader.index if n not in reader.used
                        and not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
      more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
      raise CheckpointError(f"unexpected tensors in checkpoint: {unexpected[:5]}{more}")
  return cfg, params


def load_declared(path: str, decl: dict, dtype, *, shardings=None, nonfinite: str = "error",
                  unread: tuple[str, ...] = ()):
  """The params of a declaration tree (`models.weights.Weight` / `Stacked`
  leaves) from the safetensors files of directory `path`, with `load_hf`'s
  checks: a missing, misshapen, non-float or non-finite tensor, and a tensor
  no leaf reads (unless its name starts with one of `unread`: parts of the
  checkpoint this model does not run, e.g. a VAE's encoder), raise
  CheckpointError naming it. A model family other than the decoder LLMs
  (e.g. `diffusion.wan_weights`) loads through this."""
  if nonfinite not in NONFINITE:
    raise ValueError(f"load_declared: nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
  if not os.path.isdir(path):
    raise FileNotFoundError(f"load_declared: {path} is not a directory")
  dtype = jnp.dtype(dtype)
  with ExitStack() as stack:
    reader = _Reader(path, stack, nonfinite)
    specs = declared_specs(decl, dtype)
    sources = hf_names.declared_sources(decl, reader.has)
    flat_shardings = shardings
    if shardings is not None and not isinstance(shardings, jax.sharding.Sharding):
      flat_shardings = jax.tree.leaves(shardings)
    params = _load_tree(specs, sources, reader, flat_shardings, dtype, None)
    unexpected = sorted(n for n in reader.index if n not in reader.used
                        and not n.endswith(_IGNORED_SUFFIXES) and not n.startswith(unread))
    if unexpected:
      more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
      raise CheckpointError(f"unexpected tensors in checkpoint: {unexpected[:5]}{more}")
  return params
