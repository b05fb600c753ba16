"""The Engine's host work per decode step against its device step, on a
model of 32 narrow layers at batch 1, 64 and 256, and with the device part
made slow on purpose.

`experiments/host_overlap.py`'s default config (its fields are the flags' defaults):

  python experiments/host_overlap.py --config=configs/host_overlap.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/host_overlap.py"
  c.batches = ("1", "64", "256")  # decoding sequences, one run each
  c.num_layers = 32  # the model's layers
  c.d_model = 64  # the model's width
  c.vocab_size = 256  # the model's vocabulary
  c.prompt_len = 16  # tokens per prompt
  c.new_tokens = 32  # tokens generated per sequence
  c.unroll_layers = True  # EngineConfig.unroll_layers: per-layer weights, as on a GPU
  c.async_scheduling = True  # EngineConfig.async_scheduling
  c.slow_factor = 2.0  # slow mode: added device time, in multiples of the host's busy time
  c.slow_ms = config_dict.placeholder(float)  # slow mode: added device time in ms
  c.repeats = 10  # runs of the last decode program alone (device time)
  c.tolerance = 0.1  # overlap check: wall <= (1 + tolerance) x max(host, device)
  c.machine = "epyc2c"  # short machine name for the output file
  c.out = config_dict.placeholder(str)
  c.lock()
  return c
