"""jaxinfer against vLLM's CPU build on bench_dense: offline batch 32 and
batch 1, and served at concurrency 8, float32.

`experiments/bench_vs_vllm.py`'s default config (its fields are the flags' defaults):

  python experiments/bench_vs_vllm.py --vllm_python=... --config=configs/bench_vs_vllm.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/bench_vs_vllm.py"
  c.model = "bench_dense"  # preset: the random checkpoint's shapes
  c.dtype = "float32"
  c.workloads = ("batch32", "batch1", "served")
  c.vllm_cores = ("default", "all")
  c.repeats = 3
  c.concurrency = 8
  c.max_num_batched_tokens = config_dict.placeholder(int)  # None: EngineConfig's default
  c.serve_flags = ()  # more flags for our server (experiments/serve.py)
  c.vllm_memory_utilization = 0.4
  c.out = config_dict.placeholder(str)
  c.lock()
  return c
