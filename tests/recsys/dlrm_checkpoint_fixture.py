"""A checkpoint folder in the layout of MLPerf DLRMv3's `save_dmp_checkpoint` (test-only).

`write_reference_checkpoint(path, dense, sparse)` writes, at `path` (the
`{save path}/{batch_idx}` folder a run's --model-path names):

  non_sparse.ckpt  torch.save of {"dense_dict", "optimizer_dict",
                   "class_metrics", "reg_metrics", "global_step",
                   "sparse_tensor_keys"}, as the reference's rank 0 does
  sparse/          torch.distributed.checkpoint.save of {"sparse_dict": a
                   Stateful whose state_dict() is the tables}

Without a process group (no_dist). With row_shards > 1 the tables are saved
as row-sharded ShardedTensors, as training's embedding tables are: that
needs a process group, so a one-process gloo group is started on a
FileStore for the save and destroyed after it.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards


def as_tensor(x) -> torch.Tensor:
  """A numpy array (bf16 from ml_dtypes too) or tensor as a torch tensor."""
  if isinstance(x, torch.Tensor):
    return x
  x = np.ascontiguousarray(x)
  if x.dtype == ml_dtypes.bfloat16:
    return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
  return torch.from_numpy(x)


class _SparseState:
  """checkpoint.py's SparseState: a Stateful over the tables (saving only)."""

  def __init__(self, tables: dict):
    self.tables = tables

  def state_dict(self) -> dict:
    return self.tables

  def load_state_dict(self, state_dict: dict) -> None:
    self.tables.update(state_dict)


def _row_sharded(t: torch.Tensor, shards: int):
  """t as a ShardedTensor of `shards` row blocks, all on this rank."""
  bounds = np.linspace(0, t.shape[0], shards + 1).astype(int)
  local = [Shard(t[a:b].clone(), ShardMetadata([int(a)] + [0] * (t.dim() - 1),
                                                 [int(b - a)] + list(t.shape[1:]), "rank:0/cpu"))
           for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
  return init_from_local_shards(local, list(t.shape))


def _save_sparse(folder: str, tables: dict, row_shards: int) -> None:
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
    if row_shards == 1:
      dcp.save({"sparse_dict": _SparseState(tables)},
               storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
      return
    with tempfile.TemporaryDirectory() as tmp:
      dist.init_process_group("gloo", rank=0, world_size=1,
                              store=dist.FileStore(os.path.join(tmp, "store"), 1))
      try:
        sharded = {k: _row_sharded(t, row_shards) for k, t in tables.items()}
        dcp.save({"sparse_dict": _SparseState(sharded)},
                 storage_writer=dcp.FileSystemWriter(folder))
      finally:
        dist.destroy_process_group()


def _optimizer_state(dense: dict) -> dict:
  """An Adam state dict after one step over the float32 params (tensors in
  nested dicts, as the reference's optimizer_dict holds)."""
  params = [torch.nn.Parameter(as_tensor(v).clone()) for v in dense.values()
            if as_tensor(v).dtype == torch.float32]
  if not params:
    return {"state": {}, "param_groups": []}
  opt = torch.optim.Adam(params)
  for p in params:
    p.grad = torch.ones_like(p)
  opt.step()
  return opt.state_dict()


def write_reference_checkpoint(path: str | os.PathLike, dense: dict, sparse: dict, *,
                               row_shards: int = 1) -> None:
  """Write `dense` and `sparse` ({state_dict key: array}) in the reference's layout."""
  path = os.fspath(path)
  os.makedirs(os.path.join(path, "sparse"), exist_ok=True)
  torch.save({
      "dense_dict": {k: as_tensor(v) for k, v in dense.items()},
      "optimizer_dict": _optimizer_state(dense),
      "class_metrics": {"train": [], "eval": []},
      "reg_metrics": {"train": [], "eval": []},
      "global_step": 0,
      "sparse_tensor_keys": set(sparse),
  }, os.path.join(path, "non_sparse.ckpt"))
  _save_sparse(os.path.join(path, "sparse"), {k: as_tensor(v) for k, v in sparse.items()},
               row_shards)
