"""XLA:CPU's dot vs multiply-reduce projections for float32, int8, fp8 and int4
weights at 1..512 rows, under the default XLA_FLAGS only (no Engine cells).

`experiments/linear_forms.py`'s default config (its fields are the flags' defaults):

  python experiments/linear_forms.py --config=configs/linear_forms.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/linear_forms.py"
  c.weights = ("float32", "int8", "fp8", "int4")  # float32 and quant methods
  c.rows = ("1", "2", "4", "8", "16", "32", "64", "128", "512")  # row counts
  c.repeats = 5  # timed runs per cell (median)
  c.xla_flags = ""  # ';'-separated XLA_FLAGS settings also measured
  c.out = config_dict.placeholder(str)
  c.engine_batches = ()  # Engine decode batches to measure (bench_dense)
  c.engine_weights = ("float32", "int8")  # weights for --engine_batches
  c.engine_xla_flags = ""
  c.rounds = 2  # interleaved rounds of the engine processes
  c.lock()
  return c
