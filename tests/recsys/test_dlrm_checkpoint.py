"""jaxinfer.recsys.dlrm_checkpoint reads MLPerf DLRMv3's checkpoint layout.

Checkpoints are written as the reference's save_dmp_checkpoint writes them
(dlrm_checkpoint_fixture): torch.save for the dense part, torch.distributed.
checkpoint for the tables, also as row-sharded ShardedTensors.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from jaxinfer.recsys import dlrm_checkpoint
from dlrm_checkpoint_fixture import write_reference_checkpoint

TABLE = "_embedding_collection.embeddings.{}.weight"


def _params(seed: int = 0):
  rng = np.random.default_rng(seed)
  dense = {
      "_hstu_transducer._stu_module._stu_layers.0._uvqk_weight":
          rng.standard_normal((16, 24)).astype(np.float32),
      "_hstu_transducer._stu_module._stu_layers.0._output_weight":
          rng.standard_normal((8, 16)).astype(np.float32),
      "_item_embedding_mlp.0.bias": rng.standard_normal(8).astype(ml_dtypes.bfloat16),
      "_multitask_module._prediction_module.0.weight":
          rng.standard_normal((1, 8)).astype(np.float32),
  }
  sparse = {TABLE.format(name): rng.standard_normal(shape).astype(np.float16)
            for name, shape in (("item_id", (50, 8)), ("item_category_id", (4, 8)),
                                ("user_id", (10, 8)))}
  return dense, sparse


def _assert_same(got: dict, want: dict):
  assert sorted(got) == sorted(want)
  for k, v in want.items():
    assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
    np.testing.assert_array_equal(got[k], v, err_msg=k)


@pytest.mark.parametrize("row_shards", [1, 3])
def test_round_trip(tmp_path, row_shards):
  dense, sparse = _params()
  path = tmp_path / "ckpts" / "streaming_100b" / "89"
  write_reference_checkpoint(path, dense, sparse, row_shards=row_shards)
  chunks = dcp.FileSystemReader(str(path / "sparse")).read_metadata().state_dict_metadata
  assert len(chunks["sparse_dict." + TABLE.format("item_id")].chunks) == row_shards
  got = dlrm_checkpoint.read_reference_checkpoint(path)
  _assert_same(got, {**dense, **sparse})
  assert got[TABLE.format("user_id")].dtype == np.float16
  assert got["_item_embedding_mlp.0.bias"].dtype == ml_dtypes.bfloat16


def test_a_subset_of_keys(tmp_path):
  dense, sparse = _params(1)
  write_reference_checkpoint(tmp_path, dense, sparse)
  want = [TABLE.format("item_category_id"), "_item_embedding_mlp.0.bias"]
  got = dlrm_checkpoint.read_reference_checkpoint(tmp_path, keys=want)
  _assert_same(got, {k: {**dense, **sparse}[k] for k in want})
  with pytest.raises(KeyError, match=r"has no \['nope'\]"):
    dlrm_checkpoint.read_reference_checkpoint(tmp_path, keys=want + ["nope"])


def test_dense_tables_are_skipped_as_the_reference_does(tmp_path):
  """load_dense_state_dict skips keys with "embedding_collection": sparse/ wins."""
  dense, sparse = _params(2)
  stale = {TABLE.format("user_id"): np.zeros((10, 8), np.float16)}
  write_reference_checkpoint(tmp_path, {**dense, **stale}, sparse)
  got = dlrm_checkpoint.read_reference_checkpoint(tmp_path)
  np.testing.assert_array_equal(got[TABLE.format("user_id")], sparse[TABLE.format("user_id")])


def test_missing_pieces_are_named(tmp_path):
  dense, sparse = _params()
  write_reference_checkpoint(tmp_path / "a", dense, sparse)
  os.remove(tmp_path / "a" / "non_sparse.ckpt")
  with pytest.raises(FileNotFoundError, match=r"checkpoint .*a: non_sparse\.ckpt is missing"):
    dlrm_checkpoint.read_reference_checkpoint(tmp_path / "a")
  write_reference_checkpoint(tmp_path / "b", dense, sparse)
  os.remove(tmp_path / "b" / "sparse" / ".metadata")
  with pytest.raises(FileNotFoundError, match=r"b.sparse.\.metadata is missing"):
    dlrm_checkpoint.read_reference_checkpoint(tmp_path / "b")
  for f in os.listdir(tmp_path / "b" / "sparse"):
    os.remove(tmp_path / "b" / "sparse" / f)
  os.rmdir(tmp_path / "b" / "sparse")
  with pytest.raises(FileNotFoundError, match=r"the sparse folder .*b.sparse is missing"):
    dlrm_checkpoint.read_reference_checkpoint(tmp_path / "b")


def test_bad_non_sparse_files_are_named(tmp_path):
  dense, sparse = _params()
  write_reference_checkpoint(tmp_path, dense, sparse)
  ckpt = tmp_path / "non_sparse.ckpt"
  for content in (b"not a checkpoint", b""):
    ckpt.write_bytes(content)
    with pytest.raises(ValueError, match=r"non_sparse\.ckpt is not a torch checkpoint"):
      dlrm_checkpoint.read_reference_checkpoint(tmp_path)
  torch.save({"optimizer_dict": {}}, ckpt)
  with pytest.raises(ValueError, match=r"ckpt has no dense_dict .*\['optimizer_dict'\]"):
    dlrm_checkpoint.read_reference_checkpoint(tmp_path)
  torch.save({"dense_dict": {"w": torch.ones(2)}, "x": ValueError("pickled")}, ckpt)
  with pytest.raises(ValueError, match=r"refuses to unpickle .*ValueError"):
    dlrm_checkpoint.read_reference_checkpoint(tmp_path)
  torch.save({"dense_dict": {"w": [1.0]}}, ckpt)
  with pytest.raises(ValueError, match=r"dense_dict\['w'\] is a list, not a tensor"):
    dlrm_checkpoint.read_reference_checkpoint(tmp_path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sparse_folder_without_the_tables(tmp_path):
  write_reference_checkpoint(tmp_path, *_params())
  for f in os.listdir(tmp_path / "sparse"):
    os.remove(tmp_path / "sparse" / f)
  dcp.save({"other": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "sparse")),
           no_dist=True)
  with pytest.raises(ValueError, match=r"sparse holds no sparse_dict\.\* tensors; found \['other"):
    dlrm_checkpoint.read_reference_checkpoint(tmp_path)
