"""Benchmark shapes of `experiments/bench_decode.py`: decode batches, prompt
and prefill lengths, repeats. The argument picks the preset (`bench_dense`,
the default, or `bench_moe`; `jaxinfer.presets`, equal to the HF configs in
`tests/fixtures/bench_configs/`).

  python experiments/bench_decode.py --config=configs/bench_decode.py:bench_moe
  python experiments/bench_decode.py --config=configs/bench_decode.py --config.batches=1 --config.repeats=1
"""

from ml_collections import config_dict


def get_config(model: str = "bench_dense") -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/bench_decode.py"
  c.model = model
  c.batches = (1, 8, 32)  # decode batch sizes
  c.prompt_len = 128  # prompt tokens before decoding
  c.prefill_len = 512  # prompt tokens of the prefill rows (batch 1)
  c.new_tokens = 64
  c.repeats = 5  # timed runs per cell: median, min, max
  c.peer = config_dict.placeholder(str)  # None: HF transformers when installed, else none
  c.threads = config_dict.placeholder(int)  # torch threads; None: os.cpu_count()
  c.bandwidth_bytes = 1 << 30  # array size of the bandwidth measurement
  c.seed = 0
  c.lock()
  return c
