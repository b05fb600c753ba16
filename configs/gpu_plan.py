"""Llama-3-8B's Engine step programs compiled for one H100 (mesh data=1,
layout tp) from this CPU machine: memory per device and a roofline step
time at batch 32, 4096 tokens of context.

`experiments/gpu_plan.py`'s default config (its fields are the flags' defaults):

  python experiments/gpu_plan.py --config=configs/gpu_plan.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/gpu_plan.py"
  c.model = "llama3_8b"  # a preset name of jaxinfer.presets
  c.mesh = "data=1"  # mesh axes, e.g. data=4,expert=8
  c.layout = "tp"  # sharding layout
  c.hosts = 1  # hosts the mesh's devices are spread over
  c.gpu = "h100"  # GPU model
  c.dtype = "bfloat16"  # param, activation and KV dtype
  c.batch = 32  # sequences per step (per attention-DP rank)
  c.context = 4096  # tokens of context per sequence
  c.prefill_tokens = 512  # prefill chunk of the mixed step
  c.page_size = 16  # tokens per KV page
  c.kv_pages = 0  # KV pages per rank (0: what batch x context needs)
  c.speculative = 3  # MTP draft tokens of the speculative step (MTP models; 0: none)
  # compile the preset with this many layers (its dense-first layers as the preset has them)
  c.num_layers = config_dict.placeholder(int)
  # how the steps hold the weights: per_layer (a GPU Engine's default) or stacked (scanned)
  c.weights = "per_layer"
  c.hlo_dir = config_dict.placeholder(str)  # write each program's optimized HLO text here
  c.json_out = config_dict.placeholder(str)
  c.lock()
  return c
