"""KV transfer bytes/s between two Ray worker processes of the bundled
default model, 1..256 pages, by the jax and object-store transports.

`experiments/kv_transfer_bench.py`'s default config (its fields are the flags' defaults):

  python experiments/kv_transfer_bench.py --config=configs/kv_transfer_bench.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/kv_transfer_bench.py"
  c.model = "default"  # 'default' (the bundled trained tiny_moe) or a preset (random weights)
  c.hf_dir = config_dict.placeholder(str)  # an HF checkpoint directory (overrides --model)
  c.checkpoint_dir = config_dict.placeholder(str)  # an orbax checkpoint (overrides --model)
  c.num_pages = ("1", "4", "16", "64", "256")  # pages per transfer
  c.repeats = 5  # timed transfers per size (best reported)
  c.page_size = 16  # KV page size
  c.kv_transport = ("jax", "object_store")  # transports to measure
  c.ray_cpus = 2  # CPUs of the local Ray
  c.out = config_dict.placeholder(str)  # None: experiments/results/kv_transfer_bench
  c.lock()
  return c
