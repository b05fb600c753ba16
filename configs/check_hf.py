"""HF parity: tiny random Llama and DeepSeek-V3 checkpoints (or `hf_dir`, a
checkpoint of one's own) loaded with `checkpoint.load_hf`, logits against
transformers.

`experiments/check_hf.py`'s default config (its fields are the flags' defaults):

  python experiments/check_hf.py --config=configs/check_hf.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/check_hf.py"
  c.hf_dir = config_dict.placeholder(str)
  c.archs = ("llama", "deepseek_v3")
  c.seq_len = 16  # tokens per sequence
  c.batch = 2  # sequences
  c.seed = 0  # weights and tokens seed
  c.tolerance = 0.0001  # largest relative error accepted (float32 parity measures ~1e-6)
  c.lock()
  return c
