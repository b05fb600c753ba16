"""The cluster simulator's scale study: DeepSeek-V3 simulated on 8..288 GPUs
(GB300, B200, H200, H100): EP sizes, co-located vs disaggregated, MTP,
routing, $/M tokens. `mode="calibrate_check"` instead fits this machine's
step times on the tiny_dense preset and checks the real engine.

`experiments/simulate_cluster.py`'s default config (its fields are the flags' defaults):

  python experiments/simulate_cluster.py --config=configs/simulate_cluster.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/simulate_cluster.py"
  c.mode = "scale"  # what to run
  c.out = ""  # output prefix (default results/sim_calibration, results/sim_scale or results/mlperf_sim)
  c.seed = 0  # seed of workloads and MTP acceptance draws
  c.model = "tiny_dense"
  c.hf_dir = config_dict.placeholder(str)  # an HF checkpoint directory (overrides --model)
  c.checkpoint_dir = config_dict.placeholder(str)  # an orbax checkpoint (overrides --model)
  c.max_num_seqs = 8  # calibrate_check: engine sequences
  c.max_num_batched_tokens = 32  # calibrate_check: token budget
  c.num_pages = 512  # calibrate_check: KV pages
  c.tolerance = 0.25  # calibrate_check: allowed relative error
  c.check_rounds = 3
  c.sim_model = "deepseek_v3"  # scale: preset simulated
  c.devices = ("gb300", "b200", "h200", "h100")  # scale: ep table
  c.gpus = ("8", "16", "32", "72", "144", "288")  # scale: ep table sizes
  c.pareto_device = "gb300"  # scale: pareto/routing device
  c.pareto_gpus = 72  # scale: GPUs of the pareto cluster
  c.isl = 1024  # scale: mean prompt tokens (uniform +-50%)
  c.osl = 1024  # scale: mean output tokens (uniform +-50%)
  c.weight_dtype = "auto"  # scale: auto = fp4 on Blackwell, fp8 on Hopper
  c.kv_dtype = "bf16"  # scale: K/V cache dtype
  c.concurrency = ("8", "16", "32", "64", "128", "192", "256")
  c.mtp = ("0", "1", "2", "3")  # scale: co-located MTP drafts K
  c.disagg_mtp = ("0", "3")  # scale: disaggregated MTP drafts K
  c.colo_budgets = ("512", "2048")
  c.disagg_splits = ("1:1", "1:2")  # scale: simulated prefill:decode ranks (the GPU split)
  c.prefill_ep = 8  # scale: EP size of prefill instances
  c.acceptance = "trtllm"
  c.compare_measured_acceptance = True
  c.price_per_gpu_hour = 3.0  # scale: $ per GPU-hour
  c.rounds = 2.0  # scale: requests per point = rounds x concurrency
  c.routing_gpus = 64  # scale: GPUs of the routing study
  c.slowdown = 1.0
  c.experiments = ("anchors", "ep", "pareto", "routing", "balance")  # scale: which studies
  c.mlperf_device = "gb300"  # mlperf: device of the records' systems (8 or 72 GPUs)
  c.lock()
  return c
