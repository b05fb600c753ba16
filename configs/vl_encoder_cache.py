"""The vision encoder cache on the tiny Qwen3-VL test fixture: 32 image
requests drawing on 4 images, with and without the cache.

`experiments/vl_encoder_cache.py`'s default config (its fields are the flags' defaults):

  python experiments/vl_encoder_cache.py --config=configs/vl_encoder_cache.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/vl_encoder_cache.py"
  c.model = "default"  # --hf_dir, when given, overrides it
  c.hf_dir = config_dict.placeholder(str)  # None: tests/fixtures/hf_vl/qwen3_vl
  c.checkpoint_dir = config_dict.placeholder(str)
  c.processor_json = config_dict.placeholder(str)  # None: tests/fixtures/hf_vl/processor.json
  c.max_pixels = 4096  # resized image area bound
  c.num_requests = 32  # image requests
  c.num_images = 4  # distinct images they draw from
  c.image_size = 64  # image side in pixels
  c.prompt_len = 16  # text tokens per prompt
  c.max_tokens = 8  # greedy tokens per request
  c.out = config_dict.placeholder(str)  # None: experiments/results/vl_encoder_cache
  c.lock()
  return c
