"""A 10-minute serving soak on the bundled default model (plain, then MTP with
2 drafts): random arrivals, aborts, worker stops, stalled KV transfers.

`experiments/soak.py`'s default config (its fields are the flags' defaults):

  python experiments/soak.py --config=configs/soak.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/soak.py"
  c.model = "default"  # 'default' (the bundled trained tiny_moe) or a preset (random weights)
  c.hf_dir = config_dict.placeholder(str)  # an HF checkpoint directory (overrides --model)
  c.checkpoint_dir = config_dict.placeholder(str)  # an orbax checkpoint (overrides --model)
  c.minutes = 10.0  # traffic time, split between plain and speculative
  c.seed = 0  # traffic and fault seed
  c.num_draft_tokens = 2  # MTP drafts in the speculative half
  c.out = config_dict.placeholder(str)  # None: experiments/results/soak
  c.lock()
  return c
