"""Weight-only quantization error (fp8, int8, int4, MXFP4, NVFP4) on the
bundled default model against float32.

`experiments/quant_error.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/quant_error.py --config=configs/quant_error.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/quant_error.py"
  c.lock()
  return c
