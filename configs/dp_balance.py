"""Attention-DP step balance ("none" vs "split") in the Engine on a
data=2,expert=4 mesh of 8 simulated CPU devices, on a stream of mixed
long/short prompts.

`experiments/dp_balance.py`'s default config (its fields are the flags' defaults):

  python experiments/dp_balance.py --config=configs/dp_balance.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/dp_balance.py"
  c.model = "default"  # 'default' (the bundled trained tiny_moe) or a preset (random weights)
  c.hf_dir = config_dict.placeholder(str)  # an HF checkpoint directory (overrides --model)
  c.checkpoint_dir = config_dict.placeholder(str)  # an orbax checkpoint (overrides --model)
  c.cpu_devices = 8  # simulated CPU devices
  c.mesh = "data=2,expert=4"  # the dp_attn_ep mesh
  c.rounds = 3  # alternating timed runs per policy
  c.num_requests = 32  # requests in the stream
  c.long_every = 8  # one long prompt in this many
  c.long_len = 384  # long prompt tokens
  c.short_len = 24  # short prompt tokens
  c.max_tokens = 24  # tokens generated per request
  c.arrival_s = 0.05  # seconds between arrivals
  c.max_num_batched_tokens = 128  # engine: token budget per rank and step
  c.max_num_seqs = 8  # engine: sequences per rank
  c.out = config_dict.placeholder(str)  # None: experiments/results/dp_balance
  c.lock()
  return c
