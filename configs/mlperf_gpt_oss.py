"""MLPerf GPT-OSS-120B scenario settings, on the bundled tiny model (the
harness serves it in place of GPT-OSS): Server TTFT 3000 ms / TPOT 80 ms and
Interactive 2000 / 15 ms (p99, LoadGen mlperf.conf) x 2; plain decoding
(GPT-OSS has no MTP head).

  python experiments/mlperf_harness.py --config=configs/mlperf_gpt_oss.py
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/mlperf_harness.py"
  c.scenarios = ("Offline", "Server", "Interactive")
  c.mode = "performance"
  c.min_duration_ms = 20_000
  c.min_query_count = 500
  c.limits = "gpt-oss-120b"
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
  c.speculative = 0
  c.lock()
  return c
