"""Top-k / top-p sampling over Llama 3's vocabulary size (128256): the full
sort against the `lax.top_k` path at 1, 8, 32 rows.

`experiments/sampling_bench.py`'s default config (its fields are the flags' defaults):

  python experiments/sampling_bench.py --config=configs/sampling_bench.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/sampling_bench.py"
  c.vocab = 128256  # vocabulary size (Llama 3)
  c.batches = ("1", "8", "32")  # rows sampled per call
  c.top_k = 50  # every row's top_k
  c.top_p = 0.9  # every row's top_p
  c.repeats = 30  # timed calls per variant (alternated)
  c.out = "experiments/results/sampling_bench"  # output prefix (.json)
  c.lock()
  return c
