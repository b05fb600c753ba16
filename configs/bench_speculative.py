"""MTP speculative decoding on the bundled default model: K = 0..3 drafts at
batches 1, 4, 16 (held-out stdlib prompts), one device unless `mesh` is set.

`experiments/bench_speculative.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/bench_speculative.py --config=configs/bench_speculative.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/bench_speculative.py"
  c.lock()
  return c
