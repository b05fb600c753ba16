"""DLRMv3 under LoadGen on a random tiny model (DLRMv3 as MLPerf runs it):
Server (80 ms p99) and Offline, then an accuracy run (NE / GAUC / accuracy /
AUC on the synthetic labels).

`experiments/dlrm_loadgen.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/dlrm_loadgen.py --config=configs/dlrm_loadgen.py
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/dlrm_loadgen.py"
  c.lock()
  return c
