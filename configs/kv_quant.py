"""fp8 / int8 KV cache against the full-precision cache on the bundled
default model: 32 stdlib prompts, 32 greedy tokens each, XLA attention.

`experiments/kv_quant.py`'s default config (its fields are the flags' defaults):

  python experiments/kv_quant.py --config=configs/kv_quant.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/kv_quant.py"
  c.model = "default"  # 'default' (the bundled trained tiny_moe) or a preset (random weights)
  c.hf_dir = config_dict.placeholder(str)  # an HF checkpoint directory (overrides --model)
  c.checkpoint_dir = config_dict.placeholder(str)  # an orbax checkpoint (overrides --model)
  c.max_tokens = 32  # greedy tokens per prompt
  c.num_prompts = 32  # prompts cut from stdlib sources
  c.teacher = True  # also next-token agreement on the reference text
  c.impl = "xla"  # attention implementation
  c.out = config_dict.placeholder(str)  # None: experiments/results/kv_quant
  c.lock()
  return c
