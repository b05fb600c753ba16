"""jaxinfer against vLLM's CPU build on bench_dense: offline batch 32 and
batch 1, and served at concurrency 8, float32.

`experiments/bench_vs_vllm.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/bench_vs_vllm.py --vllm_python=... --config=configs/bench_vs_vllm.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/bench_vs_vllm.py"
  c.lock()
  return c
