"""MLPerf DLRMv3's trained checkpoint, read into one flat dict of numpy arrays.

The reference (`recommendation/dlrm_v3/checkpoint.py`) saves a training
checkpoint at `{path}/{batch_idx}/`, and a benchmark run's `--model-path`
names that folder (its README: `.../ckpts/streaming_100b/89/`):

  non_sparse.ckpt  torch.save of {"dense_dict": the model's state_dict less its
                   ShardedTensors, "optimizer_dict", "class_metrics",
                   "reg_metrics", "global_step", "sparse_tensor_keys"}
  sparse/          torch.distributed.checkpoint of {"sparse_dict":
                   SparseState(model, keys)}: the embedding tables (row-sharded
                   ShardedTensors in training), a `.metadata` file and
                   `__{rank}_{i}.distcp` shards. The checkpoint flattens the
                   nested dict, so a table's key is "sparse_dict." + its
                   state_dict key, e.g. "sparse_dict._embedding_collection.
                   embeddings.item_id.weight" (tables item_id [1e9, 512],
                   item_category_id [128, 512], user_id [1e7, 512], fp16)

`load_nonsparse_checkpoint` copies every dense_dict entry whose key does not
hold "embedding_collection" (`is_sparse_key`) into the model;
`load_sparse_checkpoint` fills the embedding tables from sparse/.
`read_reference_checkpoint` returns the same tensors by the model's
state_dict keys, the sparse ones with "sparse_dict." taken off, dtypes kept
(fp16 as float16, bf16 as ml_dtypes' bfloat16). Another module maps these
keys to our params.

torch is imported when called (pip install -e '.[hf]'); non_sparse.ckpt is
read with weights_only=True (what the reference's torch 2.8 `torch.load`
does by default) and memory-mapped, so its optimizer state is never read
into memory. The tables are read without a process group, into tensors
allocated from the checkpoint's metadata: all of them by default (the
benchmark's item table alone is 1 TB), or only those named in `keys`.
"""

from __future__ import annotations

import os
import pickle
import warnings
import zipfile
from collections.abc import Iterable, Mapping

import ml_dtypes
import numpy as np

NON_SPARSE = "non_sparse.ckpt"
SPARSE = "sparse"
SPARSE_PREFIX = "sparse_dict."
# checkpoint.py's is_sparse_key: dense_dict entries the dense load skips.
SPARSE_KEY_MARK = "embedding_collection"


def import_torch():
  """torch, or an ImportError that says how to install it."""
  try:
    import torch
    import torch.distributed.checkpoint  # noqa: F401
  except ImportError as e:
    raise ImportError(f"jaxinfer.recsys.dlrm_checkpoint needs torch ({e}): "
                      "pip install -e '.[hf]' (the jaxinfer[hf] extra)") from e
  return torch


def to_numpy(tensor) -> np.ndarray:
  """A CPU tensor as numpy, dtype kept (bf16 and fp8 through ml_dtypes)."""
  torch = import_torch()
  extra = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
           torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
           torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2)}
  tensor = tensor.detach().cpu().contiguous()
  if tensor.dtype in extra:
    as_int, np_dtype = extra[tensor.dtype]
    return tensor.view(as_int).numpy().view(np_dtype)
  return tensor.numpy()


def _load_non_sparse(file: str) -> dict:
  """torch.load of non_sparse.ckpt, its errors named."""
  torch = import_torch()
  try:
    return torch.load(file, map_location="cpu", weights_only=True,
                      mmap=zipfile.is_zipfile(file))
  except pickle.UnpicklingError as e:
    # The weights-only unpickler also fails on garbage ("Unsupported operand").
    detail = next((ln.strip() for ln in str(e).splitlines() if "Unsupported global" in ln), "")
    if detail:
      raise ValueError(f"{file} holds objects torch.load(weights_only=True) refuses to "
                       f"unpickle ({detail})") from e
    raise ValueError(f"{file} is not a torch checkpoint ({str(e).splitlines()[-1]})") from e
  except Exception as e:  # torch.load raises KeyError, EOFError, RuntimeError on garbage
    raise ValueError(f"{file} is not a torch checkpoint ({type(e).__name__}: {e})") from e


def read_dense(path: str | os.PathLike, keys: set[str] | None = None) -> dict[str, np.ndarray]:
  """The dense_dict of {path}/non_sparse.ckpt that the reference loads (the
  entries without "embedding_collection"), copied out of the memory map."""
  torch = import_torch()
  file = os.path.join(os.fspath(path), NON_SPARSE)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"DLRMv3 checkpoint {path}: {NON_SPARSE} is missing ({file}; the "
                            "dense params, written by torch.save)")
  ckpt = _load_non_sparse(file)
  dense = ckpt.get("dense_dict") if isinstance(ckpt, Mapping) else None
  if not isinstance(dense, Mapping):
    found = sorted(ckpt) if isinstance(ckpt, Mapping) else type(ckpt).__name__
    raise ValueError(f"{file} has no dense_dict (the reference's dense params); found {found}")
  out = {}
  for k, v in dense.items():
    if SPARSE_KEY_MARK in k or (keys is not None and k not in keys):
      continue
    if not isinstance(v, torch.Tensor):
      raise ValueError(f"{file}: dense_dict[{k!r}] is a {type(v).__name__}, not a tensor")
    out[k] = np.array(to_numpy(v), copy=True)
  return out


def _sparse_metadata(folder: str):
  """The sparse checkpoint's metadata (FileSystemReader), its errors named."""
  torch = import_torch()
  dcp = torch.distributed.checkpoint
  if not os.path.isdir(folder):
    raise FileNotFoundError(f"DLRMv3 checkpoint: the sparse folder {folder} is missing (the "
                            "embedding tables, written by torch.distributed.checkpoint.save)")
  if not os.path.isfile(os.path.join(folder, ".metadata")):
    raise FileNotFoundError(f"DLRMv3 checkpoint: {os.path.join(folder, '.metadata')} is missing "
                            "(the sparse folder holds no torch.distributed.checkpoint)")
  try:
    return dcp.FileSystemReader(folder).read_metadata()
  except Exception as e:
    raise ValueError(f"{folder}/.metadata is not a torch.distributed.checkpoint's metadata "
                     f"({type(e).__name__}: {e})") from e


def read_sparse(path: str | os.PathLike, keys: set[str] | None = None) -> dict[str, np.ndarray]:
  """The tables of {path}/sparse/ by model key ("sparse_dict." taken off),
  assembled from their shards without a process group."""
  torch = import_torch()
  dcp = torch.distributed.checkpoint
  folder = os.path.join(os.fspath(path), SPARSE)
  metadata = _sparse_metadata(folder)
  state = {}
  for fqn, meta in metadata.state_dict_metadata.items():
    if not fqn.startswith(SPARSE_PREFIX):
      continue  # the reference loads only {"sparse_dict": ...}
    key = fqn[len(SPARSE_PREFIX):]
    if keys is not None and key not in keys:
      continue
    if not isinstance(meta, dcp.metadata.TensorStorageMetadata):
      raise ValueError(f"{folder}: {fqn} is a {type(meta).__name__}, not a tensor")
    state[fqn] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
  if keys is None and not state:
    raise ValueError(f"{folder} holds no {SPARSE_PREFIX}* tensors; found "
                     f"{sorted(metadata.state_dict_metadata)[:8]}")
  if state:
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
      warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
      try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
      except Exception as e:
        raise ValueError(f"{folder}: reading the tables failed ({type(e).__name__}: {e})") from e
  return {fqn[len(SPARSE_PREFIX):]: to_numpy(t) for fqn, t in state.items()}


def read_reference_checkpoint(path: str | os.PathLike,
                              keys: Iterable[str] | None = None) -> dict[str, np.ndarray]:
  """{state_dict key: array} of the reference's checkpoint folder `path`
  (the `--model-path`, `{save path}/{batch_idx}`): dense and sparse together.

  keys: only these state_dict keys (all when None); a named key found in
  neither part raises KeyError.
  """
  wanted = None if keys is None else set(keys)
  out = read_dense(path, wanted)
  sparse = read_sparse(path, wanted)
  both = sorted(set(out) & set(sparse))
  if both:
    raise ValueError(f"DLRMv3 checkpoint {path}: {both} are in both {NON_SPARSE} and {SPARSE}/")
  out.update(sparse)
  if wanted is not None and wanted - set(out):
    raise KeyError(f"DLRMv3 checkpoint {path} has no {sorted(wanted - set(out))}")
  return out
