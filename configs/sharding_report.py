"""DeepSeek-V3 (bfloat16) sharded dp_attn_ep on a data=8,expert=32 mesh: per-device
bytes, collectives and shardings, from shapes alone.

`experiments/sharding_report.py`'s default config (its fields are the flags' defaults):

  python experiments/sharding_report.py --config=configs/sharding_report.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/sharding_report.py"
  c.model = "deepseek_v3"  # preset name (jaxinfer.presets)
  c.mesh = "data=8,expert=32"  # mesh axes, e.g. data=8,expert=36
  c.layout = "dp_attn_ep"  # sharding layout
  c.kv_tokens = 0  # tokens held by the whole KV pool
  c.batch_tokens = 256  # tokens in one forward, over the whole mesh
  c.dtype = "bfloat16"  # param, activation and KV dtype
  c.redundant_experts = 0
  c.json_out = config_dict.placeholder(str)  # write the report as JSON here
  c.quant = config_dict.placeholder(str)
  c.lock()
  return c
