"""Weight-only quantization error (fp8, int8, int4, MXFP4, NVFP4) on the
bundled default model against float32.

`experiments/quant_error.py`'s default config (its fields are the flags' defaults):

  python experiments/quant_error.py --config=configs/quant_error.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/quant_error.py"
  c.methods = ("fp8", "int8", "int4", "mxfp4", "nvfp4")  # weight formats to measure
  c.out = config_dict.placeholder(str)  # None: experiments/results/quant_error
  c.lock()
  return c
