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
from contextlib import ExitStack

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxinfer.checkpoint import hf_names
from jaxinfer.config import ModelConfig
from jaxinfer.models.specs import is_spec, param_specs

_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# Non-parameter buffers some checkpoints carry.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
  """A checkpoint that does not match its config or cannot be read."""


def _index(path: str) -> dict[str, str]:
  """Tensor name -> file holding it."""
  index_file = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index_file):
    with open(index_file) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index_file}: no 'weight_map'")
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
    for name in _open(fn).keys():
      index[name] = fn
  return index


def _open(fn: str):
  try:
    return safe_open(fn, framework="numpy")
  except (SafetensorError, OSError) as e:
    raise CheckpointError(f"cannot read {os.path.basename(fn)}: {e}") from None


class _Reader:
  def __init__(self, path: str, stack: ExitStack):
    self.index = _index(path)
    self.stack = stack
    self.handles: dict[str, object] = {}
    self.used: set[str] = set()

  def has(self, name: str) -> bool:
    return name in self.index

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
                            f"{_FLOAT_DTYPES} (quantized checkpoints are not supported)")
    if got != tuple(shape):
      raise CheckpointError(f"tensor {name!r} has shape {list(got)}, expected {list(shape)}")
    try:
      arr = handle.get_tensor(name)
    except SafetensorError as e:
      raise CheckpointError(f"tensor {name!r} in {os.path.basename(fn)}: {e}") from None
    self.used.add(name)
    return arr

  def build(self, src: hf_names.Source) -> np.ndarray:
    arrays = [self.read(n, s) for n, s in zip(src.names, src.shapes)]
    return src.convert(*arrays)


def _path_key(kp) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "idx", None)) for k in kp)


def _load_tree(specs, sources_for, reader: _Reader, shardings, dtype):
  """Fills every spec leaf from sources_for(leaf path) -> Source or [Source per layer]."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
  leaves = []
  for i, (kp, spec) in enumerate(flat):
    srcs = sources_for(_path_key(kp))
    host = np.empty(spec.shape, dtype)
    if isinstance(srcs, list):  # stacked: one source per layer
      for j, src in enumerate(srcs):
        host[j] = reader.build(src)
    else:
      host[...] = reader.build(srcs)
    sharding = shardings[i] if isinstance(shardings, list) else shardings
    leaves.append(jax.device_put(host, sharding) if sharding is not None else jnp.asarray(host))
    del host
  return jax.tree_util.tree_unflatten(treedef, leaves)


def load_hf(path: str, dtype=None, *, shardings=None):
  """Loads an HF checkpoint directory (config.json + *.safetensors).

  dtype: param dtype (default: float32 on CPU, bfloat16 on GPU/TPU).
  shardings: a Sharding for every leaf, or a tree of them matching the params.
  Returns (cfg, params). DeepSeek MTP layers (`model.layers.{num_layers}.*`)
  load into params["mtp"] when present; when absent, cfg.num_mtp_layers = 0.
  """
  if not os.path.isdir(path):
    raise FileNotFoundError(f"load_hf: {path} is not a directory")
  cfg_file = os.path.join(path, "config.json")
  if not os.path.exists(cfg_file):
    raise FileNotFoundError(f"load_hf: {path} has no config.json")
  try:
    with open(cfg_file) as f:
      hf_cfg = json.load(f)
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{cfg_file}: invalid JSON ({e})") from None
  cfg = ModelConfig.from_hf(hf_cfg)
  dtype = jnp.dtype(dtype) if dtype is not None else cfg.compute_dtype()
  cfg = dataclasses.replace(cfg, dtype=dtype.name)

  with ExitStack() as stack:
    reader = _Reader(path, stack)
    if cfg.num_mtp_layers and not reader.has(f"model.layers.{cfg.num_layers}.eh_proj.weight"):
      cfg = dataclasses.replace(cfg, num_mtp_layers=0)  # checkpoint without MTP weights
    specs = param_specs(cfg, dtype)
    top = hf_names.top_sources(cfg)
    seg_sources = [
        [hf_names.block_sources(cfg, f"model.layers.{i}", is_moe, reader.has)
         for i in range(first, first + n)]
        for is_moe, first, n in cfg.segments()]
    mtp = [hf_names.mtp_sources(cfg, d, reader.has) for d in range(cfg.num_mtp_layers)]
    for _, dup in mtp:
      reader.used.update(n for n in dup if reader.has(n))

    def sources_for(key):
      if key[0] == "layers":
        return [layer[key[2:]] for layer in seg_sources[key[1]]]
      if key[0] == "mtp":
        return [m[0][key[1:]] for m in mtp]
      return top[key]

    flat_shardings = shardings
    if shardings is not None and not isinstance(shardings, jax.sharding.Sharding):
      flat_shardings = jax.tree.leaves(shardings)
    params = _load_tree(specs, sources_for, reader, flat_shardings, dtype)
    unexpected = sorted(n for n in reader.index if n not in reader.used
                        and not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
      more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
      raise CheckpointError(f"unexpected tensors in checkpoint: {unexpected[:5]}{more}")
  return cfg, params
