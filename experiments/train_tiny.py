"""Trains the byte-level `tiny_moe` preset (MLA + MoE + MTP) on the Python
standard library's source and its documentation topics, offline.

  python experiments/train_tiny.py                       # the shipped default model
  python experiments/train_tiny.py --steps=50 --out=/tmp/tiny --max_minutes=2

Writes an orbax checkpoint (config.json + params/) to --out, a JSON log of
the loss curves and the held-out evaluation to --log, and a plot beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

from absl import flags
import jax
import numpy as np

from benchlib import cli, flag_config
from jaxinfer import models, presets, training
from jaxinfer.checkpoint import orbax_io

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 1500, "optimizer steps")
flags.DEFINE_integer("batch", 16, "sequences per step")
flags.DEFINE_integer("seq_len", 256, "bytes per sequence")
flags.DEFINE_float("lr", 3e-3, "peak learning rate (AdamW, warmup + cosine)")
flags.DEFINE_integer("warmup", 100, "warmup steps")
flags.DEFINE_integer("mtp_depths", 3, "MTP depths trained (the chain the speculative step drafts)")
flags.DEFINE_float("mtp_weight", 0.5, "weight of the mean MTP loss (DeepSeek's lambda)")
flags.DEFINE_float("max_minutes", 50.0, "stop early (cosine cut short) after this long")
flags.DEFINE_integer("eval_windows", 256, "held-out windows of seq_len for the final evaluation")
flags.DEFINE_integer("log_every", 25, "steps between log lines")
flags.DEFINE_integer("seed", 0, "init and data order")
flags.DEFINE_integer("num_layers", 8, "main layers (tiny_moe has 4; deeper makes a drafted "
                     "token cheap relative to a verified one)")
flags.DEFINE_bool("mtp_dense", True, "a dense FFN in the MTP block (cheaper drafts) instead of MoE")
flags.DEFINE_integer("distill_steps", 400, "then MTP-only steps learning the frozen target's "
                     "next-token distribution (raises acceptance)")
flags.DEFINE_float("distill_lr", 1e-3, "peak learning rate of the distillation steps")
flags.DEFINE_string("init_from", None, "start from this checkpoint instead of random weights "
                    "(with --steps=0: distillation only)")
flags.DEFINE_string("save_dtype", "bfloat16", "dtype of the saved weights (the package ships "
                    "them; the model still computes in float32)")
flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "..", "jaxinfer", "default_model"),
                    "checkpoint directory (replaced)")
flags.DEFINE_string("log", os.path.join(os.path.dirname(__file__), "results", "train_tiny.json"),
                    "JSON log (a .png plot is written beside it)")
_CONFIG = flag_config.define_config(__file__)


def model_config():
  """The tiny_moe preset in float32 (the CPU's fast dtype), with --num_layers
  main layers (layer 0 dense, as in tiny_moe) and, with --mtp_dense, a dense
  MTP block (the config's dense_layers lists index num_layers)."""
  L = FLAGS.num_layers
  return dataclasses.replace(presets.get("tiny_moe"), dtype="float32", num_layers=L,
                             dense_layers=(0, L) if FLAGS.mtp_dense else (0,))


def _flush(window: list, curve: list, step: int, t0: float) -> dict:
  """Mean of the window's metrics -> a curve row (the window is emptied)."""
  row = {k: float(np.mean([float(w[k]) for w in window])) for k in window[0]}
  row.update(step=step, minutes=(time.perf_counter() - t0) / 60)
  curve.append(row)
  window.clear()
  return row


def _plot(log: dict, path: str) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot")
    return
  steps = [r["step"] for r in log["curve"]]
  fig, ax = plt.subplots(figsize=(7, 4))
  for key in sorted(log["curve"][0]):
    if key.startswith("loss"):
      ax.plot(steps, [r[key] for r in log["curve"]], label=key)
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats / byte)")
  ax.set_title("tiny_moe on the Python stdlib (training batches)")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"plot: {path}")


def _start(cfg):
  """-> (cfg, params, the prior run's log): fresh, or from --init_from."""
  if not FLAGS.init_from:
    return cfg, models.init_params(cfg, jax.random.key(FLAGS.seed)), {}
  cfg, params = orbax_io.restore(FLAGS.init_from)
  params = jax.tree.map(lambda a: a.astype(cfg.compute_dtype()), params)
  prior = os.path.abspath(FLAGS.log)
  return cfg, params, json.load(open(prior)) if os.path.exists(prior) else {}


def _pretrain(cfg, params, data, log_prior):
  """Main + MTP training for --steps. -> (params, last step, curve, minutes)."""
  curve, window, t0 = list(log_prior.get("curve", [])), [], time.perf_counter()
  step = int(log_prior.get("steps_run", 0))
  if FLAGS.steps:
    opt = training.make_optimizer(FLAGS.lr, FLAGS.steps, FLAGS.warmup)
    opt_state = opt.init(params)
  for step in range(step + 1, step + FLAGS.steps + 1):
    params, opt_state, m = training.train_step(cfg, opt, params, opt_state, next(data),
                                               depths=FLAGS.mtp_depths,
                                               mtp_weight=FLAGS.mtp_weight)
    window.append(m)
    if step % FLAGS.log_every == 0 or step == FLAGS.steps:
      row = _flush(window, curve, step, t0)
      print(f"step {step}: loss {row['loss']:.3f} main {row['loss_main']:.3f} acc "
            f"{row['acc_main']:.3f} | " + " ".join(
                f"mtp{k} {row[f'acc_mtp{k}']:.3f}" for k in range(1, FLAGS.mtp_depths + 1))
            + f" | {row['minutes']:.1f} min", flush=True)
      if row["minutes"] > FLAGS.max_minutes:
        print(f"time budget of {FLAGS.max_minutes} min reached at step {step}")
        break
  minutes = (time.perf_counter() - t0) / 60 + float(log_prior.get("train_minutes", 0))
  return params, step, curve, minutes


def _distill(cfg, params, data):
  """The MTP modules distilled on the frozen trunk for --distill_steps.
  -> (params, curve, minutes)."""
  curve, window = [], []
  if not FLAGS.distill_steps:
    return params, curve, 0.0
  opt = training.make_optimizer(FLAGS.distill_lr, FLAGS.distill_steps, FLAGS.distill_steps // 10,
                                weight_decay=0.0)
  mtp_params = params.pop("mtp")
  opt_state = opt.init(mtp_params)
  t1 = time.perf_counter()
  for d in range(1, FLAGS.distill_steps + 1):
    mtp_params, opt_state, m = training.distill_step(cfg, opt, mtp_params, params, opt_state,
                                                     next(data), depths=FLAGS.mtp_depths)
    window.append(m)
    if d % FLAGS.log_every == 0 or d == FLAGS.distill_steps:
      row = _flush(window, curve, d, t1)
      print(f"distill {d}: " + " ".join(f"agree{k} {row[f'agree_mtp{k}']:.3f}"
                                        for k in range(1, FLAGS.mtp_depths + 1))
            + f" | {row['minutes']:.1f} min", flush=True)
  params["mtp"] = mtp_params
  return params, curve, (time.perf_counter() - t1) / 60


def _evaluate(cfg, params, held):
  """Evaluates what ships: the weights rounded to --save_dtype, computed in float32."""
  params = jax.tree.map(lambda a: a.astype(FLAGS.save_dtype).astype(a.dtype), params)
  ev = training.evaluate(cfg, params, held, seq_len=FLAGS.seq_len, batch=FLAGS.batch,
                         depths=FLAGS.mtp_depths, max_windows=FLAGS.eval_windows)
  print("held-out: perplexity {perplexity:.3f} ({bits_per_byte:.3f} bits/byte), next-byte "
        "accuracy {acc_main:.3f}".format(**ev))
  for k in range(1, FLAGS.mtp_depths + 1):
    print(f"held-out MTP depth {k}: accuracy {ev[f'acc_mtp{k}']:.3f}, CE {ev[f'loss_mtp{k}']:.3f}")
  return params, ev


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  cfg = model_config()
  train, train_files = training.load_corpus(held_out=False)
  held, held_files = training.load_corpus(held_out=True)
  print(f"corpus: {len(train_files)} train files ({len(train) / 1e6:.1f} MB), "
        f"{len(held_files)} held-out files ({len(held) / 1e6:.2f} MB)")
  print(f"model: tiny_moe with {cfg.num_layers} layers, {models.count_params(cfg) / 1e6:.2f}M params, "
        f"MTP modules {cfg.num_mtp_layers}, trained depths {FLAGS.mtp_depths}")
  cfg, params, log_prior = _start(cfg)
  data = training.batches(train, FLAGS.batch, FLAGS.seq_len, FLAGS.seed)
  params, step, curve, train_minutes = _pretrain(cfg, params, data, log_prior)
  params, distill_curve, distill_minutes = _distill(cfg, params, data)
  train_minutes += distill_minutes
  params, ev = _evaluate(cfg, params, held)
  out = os.path.abspath(FLAGS.out)
  if os.path.exists(out):
    shutil.rmtree(out)
  orbax_io.save(out, cfg, jax.tree.map(lambda a: a.astype(FLAGS.save_dtype), params))
  log = dict(flags={k: FLAGS[k].value for k in ("steps", "batch", "seq_len", "lr", "warmup",
                                                "mtp_depths", "mtp_weight", "seed", "num_layers",
                                                "mtp_dense", "save_dtype", "max_minutes", "distill_steps",
                                                "distill_lr", "init_from")},
             steps_run=step, train_minutes=train_minutes, params=models.count_params(cfg),
             train_files=len(train_files), held_out_files=len(held_files),
             train_bytes=int(len(train)), held_out_bytes=int(len(held)),
             tokens_seen=step * FLAGS.batch * FLAGS.seq_len, held_out=ev, curve=curve,
             distill_steps=FLAGS.distill_steps, distill_curve=distill_curve,
             device=str(jax.devices()[0].device_kind), jax=jax.__version__)
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.log)), exist_ok=True)
  with open(FLAGS.log, "w") as f:
    json.dump(log, f, indent=1)
  print(f"checkpoint: {out}\nlog: {FLAGS.log}")
  _plot(log, os.path.splitext(FLAGS.log)[0] + ".png")


if __name__ == "__main__":
  cli.run(main)
