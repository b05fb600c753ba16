"""MLPerf DeepSeek-R1 scenario settings, on the bundled tiny model (a
stand-in with R1's architecture: MLA, MoE, an MTP head): Server TTFT 2000 ms /
TPOT 80 ms and Interactive 1500 / 15 ms (p99, LoadGen mlperf.conf) x 2, with
MTP speculation (3 draft tokens) as the DeepSeek-R1 records serve it.

  python experiments/mlperf_harness.py --config=configs/mlperf_deepseek_r1.py
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/mlperf_harness.py"
  c.scenarios = ("Offline", "Server", "Interactive")
  c.mode = "performance"
  c.min_duration_ms = 20_000
  c.min_query_count = 500
  c.limits = "deepseek-r1"
  c.latency_scale = 2.0  # a small model on a 2-core CPU
  c.offline_qps = 15.0
  c.server_qps = 6.0
  c.interactive_qps = 4.0
  c.search = False
  c.search_lo = 4.0
  c.search_hi = 32.0
  c.search_steps = 4
  c.search_min_duration_ms = 20_000
  c.dataset = ""
  c.num_samples = 32
  c.prompt_bytes = 96
  c.max_tokens = 32
  c.max_num_seqs = 8
  c.max_num_batched_tokens = 64
  c.speculative = 3
  c.lock()
  return c
