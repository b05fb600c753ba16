"""The bundled default model served on 127.0.0.1:8000 (OpenAI-compatible), one
in-process Engine, warmed up before serving.

`experiments/serve.py`'s default config (its fields are the flags' defaults):

  python experiments/serve.py --config=configs/serve.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/serve.py"
  c.host = "127.0.0.1"  # address to listen on
  c.port = 8000  # port to listen on
  c.model = "default"  # 'default' (the bundled trained tiny_moe) or a preset (random weights)
  c.hf_dir = config_dict.placeholder(str)  # an HF checkpoint directory (overrides --model)
  c.checkpoint_dir = config_dict.placeholder(str)  # an orbax checkpoint (overrides --model)
  c.model_name = config_dict.placeholder(str)
  c.max_queue = 256  # requests held at once (queued or generating); beyond it a request gets 429
  c.max_body_bytes = 1048576  # largest request body
  c.max_tokens_cap = config_dict.placeholder(int)
  c.max_num_seqs = 32  # engine: sequences per step
  c.max_num_batched_tokens = 520  # engine: tokens per step (512 prompt tokens + 8 decode rows)
  c.gather_ms = 15.0  # a request waking an idle engine waits for a burst's others (0: off)
  c.kv_cache_mb = config_dict.placeholder(int)  # None: a share of the free memory (EngineConfig)
  c.num_draft_tokens = 0  # MTP speculative drafts per step (0: off)
  c.decode_steps = 1
  c.fixed_step_shapes = False  # engine: pad every step to the budgets (decode steps too)
  c.fixed_prefill_shapes = True
  c.warmup_top_k = False
  c.compilation_cache_dir = config_dict.placeholder(str)  # None: ~/.cache/jaxinfer/xla
  c.image_root = config_dict.placeholder(str)
  c.dtype = config_dict.placeholder(str)  # None: the model's (float32 on CPU); or bfloat16
  c.warmup = True  # compile the step programs plain requests can need (background while idle)
  c.warmup_before_serving = False  # --warmup compiles every program before the port opens
  c.backend = "engine"  # engine: one Engine in this process; ray: a Cluster of Ray worker processes
  c.workers = 2  # --backend=ray: worker processes
  c.worker_cpus = 1.0  # --backend=ray: Ray CPUs per worker
  c.worker_processes = 1
  c.worker_cpu_devices = config_dict.placeholder(int)
  c.ray_address = config_dict.placeholder(str)
  c.lock()
  return c
