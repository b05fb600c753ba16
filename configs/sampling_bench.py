"""Top-k / top-p sampling over Llama 3's vocabulary size (128256): the full
sort against the `lax.top_k` path at 1, 8, 32 rows.

`experiments/sampling_bench.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/sampling_bench.py --config=configs/sampling_bench.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/sampling_bench.py"
  c.lock()
  return c
