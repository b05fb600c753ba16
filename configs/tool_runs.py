"""guidellm and aiperf against the default model with local files only:
serve.py started and warmed up, a synchronous and a concurrent load per tool.

`experiments/tool_runs.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/tool_runs.py --config=configs/tool_runs.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/tool_runs.py"
  c.lock()
  return c
