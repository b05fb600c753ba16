"""The preset `experiments/bench_decode.py` benchmarks: the argument names it
(`bench_moe`; without one the flag's default, `bench_dense`;
`jaxinfer.presets`, equal to the HF configs in
`tests/fixtures/bench_configs/`). Decode batches, prompt and prefill lengths
and repeats are the script's flags, each a field to override.

  python experiments/bench_decode.py --config=configs/bench_decode.py:bench_moe
  python experiments/bench_decode.py --config=configs/bench_decode.py --config.batches=1 --config.repeats=1
"""

from ml_collections import config_dict


def get_config(model: str | None = None) -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/bench_decode.py"
  if model is not None:  # else the flag's default, bench_dense
    c.model = model
  c.lock()
  return c
