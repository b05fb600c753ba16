"""A checkpoint folder in MLPerf DLRMv3's reference layout (non_sparse.ckpt and
sparse/, written with torch by the test writer) loads into the JAX model and
scores as the params it was written from; a tensor missing or misshapen in it
raises naming the folder and the key."""

import dlrm_checkpoint_fixture as fixture
import jax
import numpy as np
import pytest

from jaxinfer.recsys import dlrm_batch, dlrm_config, dlrm_state, dlrm_v3
from jaxinfer.recsys.request import DlrmRequest

CFG = dlrm_config.tiny()


def _write(path, state):
  sparse = {k: v for k, v in state.items() if "_embedding_collection" in k}
  dense = {k: v for k, v in state.items() if k not in sparse}
  fixture.write_reference_checkpoint(path, dense, sparse)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  params = dlrm_config.init_params(CFG, jax.random.key(3))
  state = dlrm_state.to_reference_state(CFG, params)
  path = tmp_path_factory.mktemp("ckpt") / "89"
  _write(path, state)
  return params, state, path


def test_reference_checkpoint_loads_and_scores(written):
  params, _, path = written
  loaded = dlrm_state.load_reference_checkpoint(CFG, path)
  rng = np.random.default_rng(0)
  reqs = [DlrmRequest(user_id=u, item_ids=rng.integers(0, CFG.item_rows, h),
                      ratings=rng.uniform(1, 5.9, h), timestamps=np.ones(h, np.int64),
                      category_ids=rng.integers(0, CFG.category_rows, h),
                      candidate_ids=rng.integers(0, CFG.item_rows, 3),
                      candidate_category_ids=rng.integers(0, CFG.category_rows, 3), query_time=1)
          for u, h in [(1, 5), (2, 25)]]
  batch = dlrm_batch.pack(CFG, reqs)
  score = jax.jit(lambda p, b: dlrm_v3.score(CFG, p, b))
  want, got = np.asarray(score(params, batch)), np.asarray(score(loaded, batch))
  np.testing.assert_array_equal(got, want)
  assert np.abs(want).max() > 0


def test_missing_and_misshapen_tensors_name_folder_and_key(written, tmp_path):
  _, state, _ = written
  key = next(k for k in state if k.endswith("_uvqk_weight"))
  bad = {k: v for k, v in state.items() if k != key}
  _write(tmp_path / "missing", bad)
  with pytest.raises(ValueError, match=f"missing.*{key}"):
    dlrm_state.load_reference_checkpoint(CFG, tmp_path / "missing")
  table = next(k for k in state if k.endswith("item_category_id.weight"))
  bad = {**state, table: state[table][:-1]}
  _write(tmp_path / "shape", bad)
  with pytest.raises(ValueError, match=f"shape.*{table}.*expected"):
    dlrm_state.load_reference_checkpoint(CFG, tmp_path / "shape")
