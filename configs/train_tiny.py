"""Training of the bundled default model: the byte-level tiny_moe (8 layers,
MLA + MoE + 3 MTP depths) on the stdlib sources, 1500 steps then 400 MTP
distillation steps, saved (bfloat16) to jaxinfer/default_model.

`experiments/train_tiny.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/train_tiny.py --config=configs/train_tiny.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/train_tiny.py"
  c.lock()
  return c
