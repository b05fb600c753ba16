"""MLPerf LoadGen run of the bundled tiny model, as `experiments/mlperf_harness.py`
runs it without a config: Offline, Server and Interactive under DeepSeek-R1's
latency limits x 2 (a small model on a 2-core CPU), held-out stdlib prompts.

  python experiments/mlperf_harness.py --config=configs/mlperf_default_model.py
  python experiments/mlperf_harness.py --config=configs/mlperf_default_model.py \
      --config.scenarios=Server --config.search=True
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/mlperf_harness.py"
  # LoadGen
  c.scenarios = ("Offline", "Server", "Interactive")
  c.mode = "performance"
  c.min_duration_ms = 20_000
  c.min_query_count = 500  # fewer failed LoadGen's early-stopping test of the p99s here
  # Latency limits: the workload's published p99 TTFT / TPOT x latency_scale.
  c.limits = "deepseek-r1"
  c.latency_scale = 2.0
  # Offered load (QPS)
  c.offline_qps = 15.0
  c.server_qps = 6.0
  c.interactive_qps = 4.0
  # Server QPS search (search=True): bisection between a valid lo and an invalid hi.
  c.search = False
  c.search_lo = 4.0
  c.search_hi = 32.0
  c.search_steps = 4
  c.search_min_duration_ms = 20_000
  # Dataset: "" -> num_samples held-out prompts of prompt_bytes bytes.
  c.dataset = ""
  c.num_samples = 32
  c.prompt_bytes = 96
  c.max_tokens = 32
  # Model: the bundled trained tiny_moe (--hf_dir / --checkpoint_dir: placeholders, unset)
  c.model = "default"
  # Engine
  c.max_num_seqs = 8
  c.max_num_batched_tokens = 64
  c.speculative = 0  # MTP draft tokens
  c.mesh = ""  # "": one device; e.g. "data=2,expert=4" shards the engine over all devices
  c.layout = "dp_attn_ep"  # with mesh
  c.cpu_devices = 0  # simulated CPU devices for mesh (0: the machine's)
  c.lock()
  return c
