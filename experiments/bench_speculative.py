"""MTP speculative decoding on the default model: tokens/s and TPOT for K = 0..3
drafts at several batch sizes, with measured acceptance, the speedup predicted
from acceptance and measured step costs, and the measured speedup.

  python experiments/bench_speculative.py                    # K = 0..3 at batch 1, 4, 16
  python experiments/bench_speculative.py --batches=1 --max_tokens=64 --repeats=1
  python experiments/bench_speculative.py --cpu_devices=8 --mesh=data=2,expert=4 \
      --layout=dp_attn_ep --out=experiments/results/bench_speculative_dp8
      # attention data parallel + expert parallel on 8 simulated CPU devices

Prompts come from held-out stdlib files (`training.held_out_prompts`), which
the model never saw in training. Each (batch, K) cell runs warm (its programs
compiled by an identical throwaway run), `--repeats` times; the best wall
time is kept. `--num_prompts` different prompts run in every cell, at most
`batch` at a time (batch 1: one after another). predicted = accepted length x (plain step time / speculative
step time); measured = tokens/s over the K = 0 tokens/s of the same batch.
"""

from __future__ import annotations

import os

from absl import flags
import jax

from benchlib import cli, flag_config, model_flags, results
from benchlib.sharding_report import parse_mesh
from jaxinfer import EngineConfig, MTPConfig, SamplingParams, run, sharding, training

FLAGS = flags.FLAGS
_MODEL = model_flags.define()  # a model with MTP modules (the bundled one has one)
flags.DEFINE_list("batches", ["1", "4", "16"], "concurrent requests")
flags.DEFINE_list("draft_tokens", ["0", "1", "2", "3"], "K values (0 = plain decoding)")
flags.DEFINE_integer("max_tokens", 128, "tokens generated per request")
flags.DEFINE_integer("prompt_bytes", 96, "bytes of each held-out file used as a prompt")
flags.DEFINE_integer("num_prompts", 16, "held-out prompts per cell, run `batch` at a time")
flags.DEFINE_integer("repeats", 2, "timed runs per cell (best kept)")
flags.DEFINE_string("mesh", None, "run sharded on a mesh of all devices, e.g. data=2,expert=4")
flags.DEFINE_enum("layout", "dp_attn_ep", list(sharding.LAYOUTS), "sharding layout (with --mesh)")
flags.DEFINE_integer("cpu_devices", 0, "simulate this many CPU devices for --mesh")
flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results", "bench_speculative"),
                    "output prefix (.json, .png)")
_CONFIG = flag_config.define_config(__file__)


def cell(cfg, params, prompts, batch: int, K: int, max_tokens: int, repeats: int,
         mesh=None, layout=None) -> dict:
  spec = MTPConfig(num_draft_tokens=K, batch_schedule=()) if K else None
  ec = EngineConfig(page_size=16, max_num_seqs=batch, max_num_batched_tokens=256,
                    speculative=spec, enable_prefix_caching=False)
  sampling = SamplingParams(max_tokens=max_tokens)
  best = None
  for r in range(repeats):
    res = run.run_engine(cfg, params, prompts=prompts, sampling=sampling, engine_config=ec,
                         warmup=(r == 0), progress=False, mesh=mesh, layout=layout)
    if best is None or res.summary["wall_s"] < best.summary["wall_s"]:
      best = res
  s = best.summary
  return dict(K=K, batch=batch, prompts=len(prompts), wall_s=s["wall_s"], tokens=s["generated_tokens"],
              tokens_per_s=s["tokens_per_s"], tpot_p50_ms=s["tpot_p50_s"] * 1e3,
              ttft_p50_ms=s["ttft_p50_s"] * 1e3, steps=s["steps"],
              step_ms=s["wall_s"] / s["steps"] * 1e3,
              accepted_length=s.get("spec_mean_accepted_length", 1.0),
              acceptance_per_position=s.get("spec_acceptance_per_position", []),
              outputs=[o.token_ids for o in best.outputs])


def _plot(rows, path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for b in sorted({r["batch"] for r in rows}):
    sel = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["K"])
    axes[0].plot([r["K"] for r in sel], [r["tokens_per_s"] for r in sel], "o-", label=f"batch {b}")
    axes[1].plot([r["K"] for r in sel], [r["speedup_measured"] for r in sel], "o-",
                 label=f"batch {b} measured")
    axes[1].plot([r["K"] for r in sel], [r["speedup_predicted"] for r in sel], "x--",
                 label=f"batch {b} predicted")
  axes[0].set(xlabel="MTP draft tokens K", ylabel="generated tokens / s", title="throughput")
  axes[1].set(xlabel="MTP draft tokens K", ylabel="speedup over K = 0", title="speedup")
  for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  if FLAGS.cpu_devices:  # before anything initialises JAX's backends
    jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices)
  mesh = sharding.make_mesh(parse_mesh(FLAGS.mesh)) if FLAGS.mesh else None
  layout = FLAGS.layout if mesh is not None else None
  model = _MODEL.load()
  cfg, params = model.cfg, model.params
  batches = [int(b) for b in FLAGS.batches]
  ks = sorted(int(k) for k in FLAGS.draft_tokens)
  if ks[0] != 0:
    raise ValueError("--draft_tokens must include 0 (the baseline)")
  n = max(FLAGS.num_prompts, max(batches))
  prompts = training.held_out_prompts([FLAGS.prompt_bytes] * n)
  rows = []
  for b in batches:
    base = None
    for K in ks:
      r = cell(cfg, params, prompts, b, K, FLAGS.max_tokens, FLAGS.repeats, mesh, layout)
      if K == 0:
        base = r
      r["exact_vs_plain"] = r["outputs"] == base["outputs"]
      r["speedup_measured"] = r["tokens_per_s"] / base["tokens_per_s"]
      r["speedup_predicted"] = r["accepted_length"] * base["step_ms"] / r["step_ms"]
      a = r["acceptance_per_position"]
      # Geometric form (constant per-token acceptance a = first-position rate).
      r["tokens_per_step_formula"] = ((1 - a[0] ** (K + 1)) / (1 - a[0]) if K and a[0] < 1
                                      else float(K + 1))
      r["measured_over_predicted"] = r["speedup_measured"] / r["speedup_predicted"]
      rows.append(r)
      print(f"batch {b:3d} K={K}: {r['tokens_per_s']:8.1f} tok/s  TPOT {r['tpot_p50_ms']:6.2f} ms"
            f"  step {r['step_ms']:6.2f} ms  accepted {r['accepted_length']:.2f}  "
            f"speedup {r['speedup_measured']:.2f}x (predicted {r['speedup_predicted']:.2f}x)"
            f"  exact {r['exact_vs_plain']}", flush=True)
  for r in rows:
    del r["outputs"]
  results.write(FLAGS.out, rows, _plot, max_tokens=FLAGS.max_tokens,
                prompt_bytes=FLAGS.prompt_bytes, repeats=FLAGS.repeats,
                mesh=dict(mesh.shape) if mesh is not None else None, layout=layout,
                model="default (tiny_moe trained, experiments/train_tiny.py)")
  print("\n| batch | K | tokens/s | TPOT p50 ms | accepted length | acceptance per position | "
        "speedup measured | predicted | measured/predicted |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    acc = ", ".join(f"{x:.2f}" for x in r["acceptance_per_position"]) or "-"
    print(f"| {r['batch']} | {r['K']} | {r['tokens_per_s']:.1f} | {r['tpot_p50_ms']:.2f} | "
          f"{r['accepted_length']:.2f} | {acc} | {r['speedup_measured']:.2f}x | "
          f"{r['speedup_predicted']:.2f}x | {r['measured_over_predicted']:.2f} |")


if __name__ == "__main__":
  cli.run(main)
