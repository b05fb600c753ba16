"""Generation with the bundled trained model (MTP speculation, K = 3) on one
device: two code prompts, 96 greedy tokens each.

`experiments/generate.py`'s default config (its fields are the flags' defaults):

  python experiments/generate.py --config=configs/generate.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/generate.py"
  c.model = "default"  # 'default' (the bundled trained tiny_moe) or a preset name (random weights)
  c.hf_dir = config_dict.placeholder(str)  # HF checkpoint directory (overrides --model)
  c.checkpoint_dir = config_dict.placeholder(str)  # orbax checkpoint from checkpoint.save
  # None: the script's two code prompts; a string: one prompt (commas and all)
  c.prompt = config_dict.placeholder(str)
  c.prompts_file = config_dict.placeholder(str)  # a file with one prompt per line
  c.prompt_ids = config_dict.placeholder(str)  # one prompt as comma-separated token ids
  c.max_tokens = 96  # tokens to generate per prompt
  c.num_draft_tokens = 3
  c.decode_steps = 1  # decode steps per dispatch when not speculating (EngineConfig.decode_steps)
  c.temperature = 0.0  # 0 = greedy
  c.top_k = 0  # 0 = off
  c.top_p = 1.0  # 1 = off
  c.seed = 0  # sampling seed of the first prompt (+i for prompt i)
  c.page_size = 16  # KV page size (tokens)
  c.num_pages = config_dict.placeholder(int)  # KV pool pages (default: from memory)
  c.max_num_seqs = 32  # sequences per step
  c.max_num_batched_tokens = 256  # tokens per step
  c.mesh = config_dict.placeholder(str)
  c.layout = "tp"  # sharding layout (with --mesh)
  c.cpu_devices = 0
  c.lock()
  return c
