"""Every Pallas kernel at the default shapes against its peers and a roofline
measured in the same run (bfloat16 on a GPU, float32 interpreted elsewhere).

`experiments/kernel_bench.py`'s default config (its fields are the flags' defaults):

  python experiments/kernel_bench.py --config=configs/kernel_bench.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/kernel_bench.py"
  c.kernels = ("flash", "paged", "mla", "ragged", "qmatmul", "gmm")
  c.shapes = "default"
  c.dtype = config_dict.placeholder(str)  # input dtype (default: bfloat16 on GPU, else float32)
  c.interpret = config_dict.placeholder(bool)
  c.repeats = 20  # timing samples per implementation (median)
  c.warmup = 3  # untimed calls after the compiling one
  c.peers = True  # also time the peer implementations
  c.out_dir = config_dict.placeholder(str)  # None: experiments/results
  c.lock()
  return c
