"""DLRMv3 under MLPerf LoadGen (`jaxinfer.serving.dlrm.run_benchmark`): a
random model of a recsys preset (default the tiny DLRMv3 as MLPerf runs it)
scoring requests drawn from the reference generator's distributions, or
MLPerf's own streaming data set files (--dataset_dir, at --dataset_ts), with
the reference's trained checkpoint (--reference_checkpoint) or random weights;
Server (80 ms p99) and Offline in performance mode, then an accuracy run with
NE / GAUC / accuracy / AUC from LoadGen's log (the MLPerf reference's
records). Writes <out>.json.

  python experiments/dlrm_loadgen.py
"""

from __future__ import annotations

import os
import tempfile

from absl import flags
import jax

from benchlib import cli, flag_config, results
from jaxinfer.recsys import dlrm_state, family, streaming
from jaxinfer.serving import dlrm

FLAGS = flags.FLAGS
flags.DEFINE_string("recsys_preset", "tiny_dlrm_v3",
                    "recsys preset (jaxinfer.recsys.family.PRESETS)")
flags.DEFINE_string("dataset_dir", None, "MLPerf's streaming synthetic data set folder "
                    "(recsys.streaming; its reference layout); None: drawn requests")
flags.DEFINE_integer("dataset_ts", 90, "the data set's (inference) timestamp to read")
flags.DEFINE_string("reference_checkpoint", None, "the reference's checkpoint folder (its "
                    "--model-path: non_sparse.ckpt and sparse/); None: random weights")
flags.DEFINE_list("scenarios", ["Server", "Offline"], "LoadGen scenarios (performance mode)")
flags.DEFINE_integer("num_samples", 256, "synthetic users in the QSL")
flags.DEFINE_float("server_qps", 200.0, "Server target QPS")
flags.DEFINE_float("offline_qps", 4000.0, "Offline expected QPS")
flags.DEFINE_float("latency_ms", 80.0, "Server p99 latency limit (MLPerf v6.0 DLRMv3: 80 ms)")
flags.DEFINE_integer("token_budget", 256, "tokens per packed batch")
flags.DEFINE_integer("max_users", 16, "users per packed batch")
flags.DEFINE_integer("min_duration_ms", 1000, "LoadGen minimum duration")
flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results", "dlrm_loadgen"),
                    "output prefix (.json)")
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  cfg = family.get(FLAGS.recsys_preset)
  if FLAGS.reference_checkpoint:
    if family.of(cfg) is not family.DLRM_V3:
      raise ValueError(f"--reference_checkpoint: the reference's checkpoints hold DLRMv3 "
                       f"(dlrm_v3, tiny_dlrm_v3), not {FLAGS.recsys_preset}")
    params = dlrm_state.load_reference_checkpoint(cfg, FLAGS.reference_checkpoint)
  else:
    params = family.of(cfg).init_params(cfg, jax.random.key(0))
  dataset = None
  if FLAGS.dataset_dir:
    dataset = streaming.StreamingDataset(FLAGS.dataset_dir)
    dataset.set_ts(FLAGS.dataset_ts)
  with tempfile.TemporaryDirectory() as outdir:
    rows = dlrm.run_benchmark(
        cfg, params, outdir=outdir, num_samples=FLAGS.num_samples, scenarios=FLAGS.scenarios,
        server_qps=FLAGS.server_qps, offline_qps=FLAGS.offline_qps, latency_ms=FLAGS.latency_ms,
        token_budget=FLAGS.token_budget, max_users=FLAGS.max_users,
        min_duration_ms=FLAGS.min_duration_ms, dataset=dataset)
  for r in rows:
    print(r)
  results.write(FLAGS.out, rows, preset=FLAGS.recsys_preset)


if __name__ == "__main__":
  cli.run(main)
