"""A DLRMv3 submitter's path on a tiny model: the reference's checkpoint folder
and MLPerf's data set files (both written by the tests in the reference's
layouts) go through LoadGen's Offline and accuracy runs, and the accuracy
log's predictions are the loaded model's scores of the data set's requests."""

import dlrm_checkpoint_fixture as ckpt_fixture
import jax
import mlperf_loadgen  # noqa: F401  (the test-core extra installs mlcommons-loadgen)
import numpy as np
import pytest
import streaming_fixture

from jaxinfer.recsys import dlrm_batch, dlrm_config, dlrm_state, dlrm_v3, family, streaming
from jaxinfer.serving import dlrm

TRAIN_TS, TOTAL_TS = 2, 4


def _user(rng, cfg):
  """total_ts + 2 slots of (candidates, their ratings, history, its ratings):
  5 history events and 4 candidates in every slot, so every request at an
  inference timestamp has the same lengths (and its batch the same 1/n)."""
  top = cfg.category_rows * (cfg.item_rows // cfg.category_rows)  # categories in range
  slot = lambda h, c: ([int(i) for i in rng.integers(0, top, c)],
                       [float(r) for r in rng.uniform(1, 5, c)],
                       [int(i) for i in rng.integers(0, top, h)],
                       [float(r) for r in rng.uniform(1, 5, h)])
  return [slot(5, 4) for _ in range(TOTAL_TS + 2)]


@pytest.mark.usefixtures("optimized")
def test_checkpoint_and_data_set_files_through_loadgen(tmp_path):
  cfg = family.get("tiny_dlrm_v3")
  params = dlrm_config.init_params(cfg, jax.random.key(7))
  state = dlrm_state.to_reference_state(cfg, params)
  sparse = {k: v for k, v in state.items() if "_embedding_collection" in k}
  ckpt_fixture.write_reference_checkpoint(tmp_path / "ckpt" / "89", {
      k: v for k, v in state.items() if k not in sparse}, sparse)
  rng = np.random.default_rng(0)
  streaming_fixture.write_tiny_dataset(tmp_path / "data", [_user(rng, cfg) for _ in range(8)],
                                       train_ts=TRAIN_TS, total_ts=TOTAL_TS)
  ds = streaming.StreamingDataset(
      tmp_path / "data", num_users=8, num_files=1, num_items=cfg.item_rows,
      num_categories=cfg.category_rows, train_ts=TRAIN_TS, total_ts=TOTAL_TS,
      max_uih_len=cfg.max_seq_len - cfg.max_num_candidates - 1,
      max_candidates=cfg.max_num_candidates)
  ds.set_ts(TRAIN_TS)
  n = len(ds)
  assert n >= 4
  loaded = dlrm_state.load_reference_checkpoint(cfg, tmp_path / "ckpt" / "89")
  rows = dlrm.run_benchmark(cfg, loaded, outdir=str(tmp_path / "lg"), num_samples=n,
                            scenarios=("Offline",), offline_qps=100.0, token_budget=256,
                            max_users=4, min_duration_ms=0, min_query_count=n, dataset=ds)
  perf, acc = rows
  assert perf["valid"] and acc["samples"] == n
  recs = dlrm.parse_accuracy_log(str(tmp_path / "lg" / "accuracy" / "mlperf_log_accuracy.json"))
  assert sorted(r["qsl_idx"] for r in recs) == list(range(n))
  score = jax.jit(lambda p, b: dlrm_v3.score(cfg, p, b))
  for r in recs:
    req = ds.request(r["qsl_idx"])
    assert len(req.item_ids) == 15 and len(req.candidate_ids) == 4  # base + 2 train slots
    np.testing.assert_array_equal(r["labels"], req.labels)
    z = np.asarray(score(params, dlrm_batch.pack(cfg, [req])), np.float64)
    np.testing.assert_allclose(r["preds"], 1 / (1 + np.exp(-z)), rtol=1e-5, atol=1e-6)
