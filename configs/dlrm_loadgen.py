"""DLRMv3 under LoadGen on a random tiny model (DLRMv3 as MLPerf runs it):
Server (80 ms p99) and Offline, then an accuracy run (NE / GAUC / accuracy /
AUC on the synthetic labels).

`experiments/dlrm_loadgen.py`'s default config (its fields are the flags' defaults):

  python experiments/dlrm_loadgen.py --config=configs/dlrm_loadgen.py
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/dlrm_loadgen.py"
  c.recsys_preset = "tiny_dlrm_v3"  # recsys preset
  c.dataset_dir = config_dict.placeholder(str)  # None: requests drawn on demand
  c.dataset_ts = 90  # the data set's timestamp
  c.scenarios = ("Server", "Offline")  # performance-mode scenarios
  c.num_samples = 256  # synthetic users in the QSL
  c.server_qps = 200.0  # Server target QPS
  c.offline_qps = 4000.0  # Offline expected QPS
  c.latency_ms = 80.0  # Server p99 limit
  c.token_budget = 256  # tokens per packed batch
  c.max_users = 16  # users per packed batch
  c.min_duration_ms = 1000  # LoadGen minimum duration
  c.out = config_dict.placeholder(str)  # None: experiments/results/dlrm_loadgen
  c.lock()
  return c
