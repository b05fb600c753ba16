"""guidellm and aiperf against the default model with local files only:
serve.py started and warmed up, a synchronous and a concurrent load per tool.

`experiments/tool_runs.py`'s default config (its fields are the flags' defaults):

  python experiments/tool_runs.py --config=configs/tool_runs.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/tool_runs.py"
  c.guidellm = config_dict.placeholder(str)  # the guidellm executable (None: skipped)
  c.aiperf = config_dict.placeholder(str)  # the aiperf executable (None: skipped)
  c.requests = 32  # requests per tool and load
  c.concurrency = 4  # requests at once in the concurrent load (1: synchronous only)
  c.prompt_tokens = 64  # tokens per synthetic prompt
  c.output_tokens = 32  # tokens generated per request (ignore_eos)
  c.tokenizer_dir = "jaxinfer/default_model"  # the tools' tokenizer files
  c.serve_flags = ()  # flags passed on to serve.py
  c.server_url = config_dict.placeholder(str)  # a running server instead of serve.py
  c.wait_warm = True  # start the tools once /health says ok
  c.start_timeout_s = 1800.0  # longest wait for the server's port and warm-up
  c.timeout_s = 600.0  # longest run of one tool at one load
  c.guidellm_continuous_usage = True  # let guidellm send stream_options.continuous_usage_stats
  c.artifacts_dir = config_dict.placeholder(str)  # keep the tools' files here
  c.machine = "epyc2c"  # short machine name for the output file
  c.out = config_dict.placeholder(str)
  c.lock()
  return c
