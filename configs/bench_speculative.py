"""MTP speculative decoding on the bundled default model: K = 0..3 drafts at
batches 1, 4, 16 (held-out stdlib prompts), one device unless `mesh` is set.

`experiments/bench_speculative.py`'s default config (its fields are the flags' defaults):

  python experiments/bench_speculative.py --config=configs/bench_speculative.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/bench_speculative.py"
  c.model = "default"  # 'default' (the bundled trained tiny_moe) or a preset (random weights)
  c.hf_dir = config_dict.placeholder(str)  # an HF checkpoint directory (overrides --model)
  c.checkpoint_dir = config_dict.placeholder(str)  # an orbax checkpoint (overrides --model)
  c.batches = ("1", "4", "16")  # concurrent requests
  c.draft_tokens = ("0", "1", "2", "3")  # K values (0 = plain decoding)
  c.max_tokens = 128  # tokens generated per request
  c.prompt_bytes = 96  # bytes of each held-out file used as a prompt
  c.num_prompts = 16  # held-out prompts per cell, run `batch` at a time
  c.repeats = 2  # timed runs per cell (best kept)
  c.mesh = config_dict.placeholder(str)
  c.layout = "dp_attn_ep"  # sharding layout (with --mesh)
  c.cpu_devices = 0  # simulate this many CPU devices for --mesh
  c.out = config_dict.placeholder(str)  # None: experiments/results/bench_speculative
  c.lock()
  return c
