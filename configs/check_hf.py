"""HF parity: tiny random Llama and DeepSeek-V3 checkpoints (or `hf_dir`, a
checkpoint of one's own) loaded with `checkpoint.load_hf`, logits against
transformers.

`experiments/check_hf.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/check_hf.py --config=configs/check_hf.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/check_hf.py"
  c.lock()
  return c
