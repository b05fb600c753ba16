"""The vision encoder cache on the tiny Qwen3-VL test fixture: 32 image
requests drawing on 4 images, with and without the cache.

`experiments/vl_encoder_cache.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/vl_encoder_cache.py --config=configs/vl_encoder_cache.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/vl_encoder_cache.py"
  c.lock()
  return c
