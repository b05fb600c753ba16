"""Attention-DP step balance: today's per-rank budgets ("none") against the
"split" policy (`EngineConfig.dp_balance`), in the real Engine on a
dp_attn_ep mesh of simulated CPU devices, on a stream of mixed long/short
prompts. Writes <out>.json.

  python experiments/dp_balance.py                       # data=2 x expert=4, default model
  python experiments/dp_balance.py --rounds=1 --num_requests=16
"""

from __future__ import annotations

import os

from absl import flags
import jax

from benchlib import cli, dp_balance, flag_config, model_flags, results
from benchlib.sharding_report import parse_mesh
from jaxinfer import EngineConfig, sharding

FLAGS = flags.FLAGS
flags.DEFINE_integer("cpu_devices", 8, "simulated CPU devices")
flags.DEFINE_string("mesh", "data=2,expert=4", "the dp_attn_ep mesh")
flags.DEFINE_integer("rounds", 3, "alternating timed runs per policy")
flags.DEFINE_integer("num_requests", 32, "requests in the stream")
flags.DEFINE_integer("long_every", 8, "one long prompt in this many")
flags.DEFINE_integer("long_len", 384, "long prompt tokens")
flags.DEFINE_integer("short_len", 24, "short prompt tokens")
flags.DEFINE_integer("max_tokens", 24, "tokens generated per request")
flags.DEFINE_float("arrival_s", 0.05, "seconds between arrivals")
flags.DEFINE_integer("max_num_batched_tokens", 128, "engine: token budget per rank and step")
flags.DEFINE_integer("max_num_seqs", 8, "engine: sequences per rank")
flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results", "dp_balance"),
                    "output prefix (.json)")
_MODEL = model_flags.define()
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices)
  mesh = sharding.make_mesh(parse_mesh(FLAGS.mesh))
  model = _MODEL.load()
  cfg, params = model.cfg, model.params
  config = EngineConfig(page_size=16, num_pages=256, max_num_seqs=FLAGS.max_num_seqs,
                        max_num_batched_tokens=FLAGS.max_num_batched_tokens)
  w = dp_balance.Workload(num_requests=FLAGS.num_requests, long_every=FLAGS.long_every,
                          long_len=FLAGS.long_len, short_len=FLAGS.short_len,
                          max_tokens=FLAGS.max_tokens, arrival_s=FLAGS.arrival_s)
  out = dp_balance.compare(cfg, params, mesh=mesh, config=config, workload=w,
                           rounds=FLAGS.rounds)
  base = {r["policy"]: r for r in out["rows"]}
  print(f"\noutputs identical across policies: {out['outputs_identical']}")
  print("| policy | tokens/s | TTFT mean ms | TTFT p90 ms | TTFT long | TTFT short | TPOT ms | steps |")
  print("|---|---|---|---|---|---|---|---|")
  for r in out["rows"]:
    print(f"| {r['policy']} | {r['tokens_per_s']:.1f} | {r['mean_ttft_ms']:.1f} | "
          f"{r['p90_ttft_ms']:.1f} | {r['mean_ttft_long_ms']:.1f} | {r['mean_ttft_short_ms']:.1f} | "
          f"{r['mean_tpot_ms']:.1f} | {r['steps']:.0f} |")
  if "none" in base and "split" in base:
    s, n = base["split"], base["none"]
    print(f"split / none: tokens/s x{s['tokens_per_s'] / n['tokens_per_s']:.2f}, mean TTFT "
          f"x{s['mean_ttft_ms'] / n['mean_ttft_ms']:.2f}, p90 TTFT "
          f"x{s['p90_ttft_ms'] / n['p90_ttft_ms']:.2f}")
  results.write(FLAGS.out, out.pop("rows"), None, mesh=FLAGS.mesh, layout="dp_attn_ep",
                model="default (tiny_moe trained)", **out)


if __name__ == "__main__":
  cli.run(main)
