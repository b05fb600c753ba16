"""Serving topologies of `experiments/serve_bench.py`: how many workers, the
devices of each one's sub-mesh and its layout (8 simulated CPU devices; the
disaggregation experiment always runs 2 prefill + 2 decode workers, so
workers x devices_per_worker stays <= 8). The argument names the topology:

  shared     4 workers on the default device, sharing compiled programs
             (serve_bench's defaults)
  tp2        4 workers, each tensor-parallel over 2 devices
  dp_ep2     4 workers of the MoE preset, each attention-data-parallel +
             expert-parallel over 2 devices (the WideEP layout, small)

  python experiments/serve_bench.py --config=configs/serving_topologies.py:tp2
"""

from ml_collections import config_dict

# What each topology changes of serve_bench's flags (their defaults, `shared`:
# 4 workers of tiny_dense on the default device, layout tp).
TOPOLOGIES = {
    "shared": dict(),
    "tp2": dict(devices_per_worker=2),
    "dp_ep2": dict(model="tiny_moe", devices_per_worker=2, layout="dp_attn_ep"),
}


def get_config(topology: str = "shared") -> config_dict.ConfigDict:
  if topology not in TOPOLOGIES:
    raise ValueError(f"serving_topologies: unknown topology {topology!r}; "
                     f"choose from {sorted(TOPOLOGIES)}")
  c = config_dict.ConfigDict(dict(script="experiments/serve_bench.py", **TOPOLOGIES[topology]))
  c.lock()
  return c
