"""Generation with the bundled trained model (MTP speculation, K = 3) on one
device: two code prompts, 96 greedy tokens each.

`experiments/generate.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/generate.py --config=configs/generate.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/generate.py"
  # None: the script's two code prompts; a string: one prompt (commas and all)
  c.lock()
  return c
