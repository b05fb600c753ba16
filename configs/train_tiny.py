"""Training of the bundled default model: the byte-level tiny_moe (8 layers,
MLA + MoE + 3 MTP depths) on the stdlib sources, 1500 steps then 400 MTP
distillation steps, saved (bfloat16) to jaxinfer/default_model.

`experiments/train_tiny.py`'s default config (its fields are the flags' defaults):

  python experiments/train_tiny.py --config=configs/train_tiny.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/train_tiny.py"
  c.steps = 1500  # optimizer steps
  c.batch = 16  # sequences per step
  c.seq_len = 256  # bytes per sequence
  c.lr = 0.003  # peak learning rate (AdamW, warmup + cosine)
  c.warmup = 100  # warmup steps
  c.mtp_depths = 3  # MTP depths trained (the chain the speculative step drafts)
  c.mtp_weight = 0.5  # weight of the mean MTP loss (DeepSeek's lambda)
  c.max_minutes = 50.0  # stop early (cosine cut short) after this long
  c.eval_windows = 256  # held-out windows of seq_len for the final evaluation
  c.log_every = 25  # steps between log lines
  c.seed = 0  # init and data order
  c.num_layers = 8
  c.mtp_dense = True  # a dense FFN in the MTP block (cheaper drafts) instead of MoE
  c.distill_steps = 400
  c.distill_lr = 0.001  # peak learning rate of the distillation steps
  c.init_from = config_dict.placeholder(str)
  c.save_dtype = "bfloat16"
  c.out = config_dict.placeholder(str)  # None: jaxinfer/default_model
  c.log = config_dict.placeholder(str)  # None: experiments/results/train_tiny.json
  c.lock()
  return c
