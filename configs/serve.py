"""The bundled default model served on 127.0.0.1:8000 (OpenAI-compatible), one
in-process Engine, warmed up before serving.

`experiments/serve.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/serve.py --config=configs/serve.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/serve.py"
  c.lock()
  return c
