"""Serving benchmark: workers x layout x router x workload x offered load,
on the default model, replayed in real time through `serving.Cluster`.

  python experiments/serve_bench.py                              # every experiment
  python experiments/serve_bench.py --experiments=routing --rates=4,8
  python experiments/serve_bench.py --experiments=disagg,faults
  python experiments/serve_bench.py --config=configs/serving_topologies.py:tp2
      # a worker topology from configs/ (a flag on the command line wins over it)

Experiments:
  routing  multi-turn conversations on shared prefixes, and independent
           random-length requests, over --workers mixed workers, per router
           policy and offered load: throughput, TTFT / TPOT percentiles,
           prefix-hit rate, requests per worker (max/mean), and whether the
           tokens equal the first policy's (greedy).
  disagg   2 prefill + 2 decode workers; a mix of short and long prompts at
           several long fractions; prefill always local, always remote, or
           conditional (remote only when the uncached prompt is longer than
           --max_local_prefill_length): TTFT and TPOT.
  faults   the multi-turn workload with one of the workers stopped part-way
           (the first time it holds requests after --stop_at of the workload):
           completed, failed (with their errors), lost and duplicated
           requests, and whether the tokens equal a fault-free run's.

--backend=ray runs the workers as Ray actors, a process each (a local Ray
with --ray_cpus CPUs; every run on fresh engines in the same processes);
--backend=local,ray runs both, side by side in one run. In-process workers
share this process and, on CPU, the same cores: offered loads compare
policies on equal footing; they do not model separate machines.
Results: a table on stdout, JSON and plots under experiments/results/.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import sys  # noqa: E402
import time  # noqa: E402

from absl import flags  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchlib import cli, flag_config, model_flags, results  # noqa: E402
from jaxinfer import EngineConfig, sharding  # noqa: E402
from jaxinfer.serving import workloads  # noqa: E402
from jaxinfer.serving.cluster import Cluster, percentiles  # noqa: E402
from jaxinfer.serving.disagg import DisaggConfig  # noqa: E402
from jaxinfer.serving.ray_worker import WorkerSpec, host_tree  # noqa: E402
from jaxinfer.serving.worker import Worker  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("experiments", ["routing", "disagg", "faults"], "which experiments to run")
# A preset (random weights, float32) by default, small and fast, so that four
# workers sharing two CPU cores can be driven near saturation.
_MODEL = model_flags.define(default="tiny_dense")
flags.DEFINE_list("backend", ["local"], "local (workers in this process), ray (Ray actors, "
                  "a process each) or local,ray (both, in one run)")
flags.DEFINE_integer("ray_cpus", 2, "--backend=ray: CPUs of the local Ray")
flags.DEFINE_enum("kv_transport", "jax", ["jax", "object_store"], "--backend=ray: KV transport")
flags.DEFINE_list("disagg_roles", ["prefill", "prefill", "decode", "decode"], "disagg: workers")
flags.DEFINE_integer("workers", 4, "workers (routing, faults)")
flags.DEFINE_integer("devices_per_worker", 0,
                     "devices of each worker's sub-mesh (0: every worker on the default device, "
                     "sharing compiled programs; on CPU all devices share the same cores anyway)")
flags.DEFINE_string("layout", "tp", "each worker's layout on its sub-mesh")
flags.DEFINE_list("routers", ["kv", "round_robin", "random", "least_loaded"], "router policies")
flags.DEFINE_list("rates", ["1", "2", "3"], "offered loads, conversations (or requests) started per second")
flags.DEFINE_integer("sessions", 15, "multi-turn conversations")
flags.DEFINE_integer("turns", 8, "turns per conversation")
flags.DEFINE_float("think_s", 3.0, "seconds between a conversation's turns")
flags.DEFINE_integer("system_len", 64, "shared system prompt tokens")
flags.DEFINE_integer("user_len", 32, "new user tokens per turn")
flags.DEFINE_integer("reply_len", 96, "previous reply tokens carried into the next turn")
flags.DEFINE_integer("max_tokens", 8, "generated tokens per request")
flags.DEFINE_integer("independent", 48, "requests of the independent workload")
flags.DEFINE_list("long_fractions", ["0.25", "0.5"], "disagg: fraction of long prompts")
flags.DEFINE_integer("short_len", 24, "disagg: short prompt tokens")
flags.DEFINE_integer("long_len", 384, "disagg: long prompt tokens")
flags.DEFINE_integer("disagg_requests", 48, "disagg: requests per run")
flags.DEFINE_float("disagg_rate", 8.0, "disagg: requests per second")
flags.DEFINE_integer("max_local_prefill_length", 128, "disagg: conditional threshold")
flags.DEFINE_float("stop_at", 0.4, "faults: stop a worker after this fraction of the workload")
flags.DEFINE_integer("page_size", 16, "KV page size")
flags.DEFINE_integer("num_pages", 512, "KV pages per worker")
flags.DEFINE_integer("max_num_batched_tokens", 32, "token budget per step (chunked prefill)")
flags.DEFINE_integer("max_num_seqs", 8, "sequences per step")
flags.DEFINE_bool("warmup", True, "run every experiment once untimed first (compiles the "
                  "step programs the workloads need)")
flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results", "serve_bench"),
                    "output prefix (.json, .png)")
_CONFIG = flag_config.define_config(__file__, "serving_topologies.py")  # [:shared|tp2|dp_ep2]


def _engine_config():
  # Fixed step shapes: a handful of programs, all compiled by the warm-up, so
  # no timed run pays a compile (they would swamp millisecond TTFTs).
  return EngineConfig(page_size=FLAGS.page_size, num_pages=FLAGS.num_pages, max_num_seqs=FLAGS.max_num_seqs,
                      max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                      fixed_step_shapes=True)


_RAY: dict = {}  # roles -> the latest Ray cluster over those worker processes


def _cluster(backend, cfg, params, roles, **options):
  """A cluster on fresh engines: in this process, or in Ray worker processes
  started once per set of roles (each later run resets their engines)."""
  if backend == "local":
    return Cluster(_workers(cfg, params, roles), **options)
  import ray  # noqa: PLC0415 - only --backend=ray needs it
  if not ray.is_initialized():
    ray.init(num_cpus=FLAGS.ray_cpus, include_dashboard=False, log_to_driver=False)
  key = tuple(roles)
  if key not in _RAY:
    ref = ray.put(host_tree(params))
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    specs = [WorkerSpec(model=cfg, params=ref, config=_engine_config(), role=r, name=f"{r}{i}",
                         num_cpus=0.1, env=env)  # every topology's processes stay up
             for i, r in enumerate(roles)]
    _RAY[key] = Cluster(specs, backend="ray", kv_transport=FLAGS.kv_transport, **options)
    return _RAY[key]
  _RAY[key] = _RAY[key].fresh(**options)
  return _RAY[key]


def _workers(cfg, params, roles):
  n = FLAGS.devices_per_worker
  devices = jax.devices()
  out = []
  for i, role in enumerate(roles):
    kw = {}
    if n:
      if (i + 1) * n > len(devices):
        raise ValueError(f"{len(roles)} workers x {n} devices need {(i + 1) * n} devices, "
                         f"have {len(devices)}")
      kw = dict(devices=devices[i * n:(i + 1) * n], layout=FLAGS.layout,
                mesh_axes={"data" if sharding.as_layout(FLAGS.layout).attention_dp else "tensor": n})
    out.append(Worker(cfg, params, _engine_config(), role=role, name=f"{role}{i}", **kw))
  return out


def _metrics(outs, wall_s, cluster) -> dict:
  done = [o for o in outs if o.finish_reason in ("stop", "length")]
  per_worker = np.asarray(cluster.stats()["requests_per_worker"], np.float64)
  alive = per_worker[[w.role != "prefill" for w in cluster.workers]]
  return dict(
      requests=len(outs), completed=len(done),
      errors=sum(o.finish_reason == "error" for o in outs),
      throughput_tok_s=sum(len(o.token_ids) for o in outs) / wall_s, wall_s=wall_s,
      ttft_ms={k: v * 1e3 for k, v in percentiles([o.ttft_s for o in done]).items()},
      tpot_ms={k: v * 1e3 for k, v in percentiles([o.tpot_s for o in done]).items()},
      prefix_hit_rate=cluster.stats()["prefix_hit_rate"],
      requests_per_worker=per_worker.astype(int).tolist(),
      load_max_over_mean=float(alive.max() / max(alive.mean(), 1e-9)),
      remote_prefills=cluster.stats()["remote_prefills"])


def _serve(make_cluster, items, on_step=None):
  """Runs the workload on a fresh cluster -> (outputs, wall seconds, cluster)."""
  cluster = make_cluster()
  t0 = time.perf_counter()
  outs = cluster.run(items, on_step=on_step)
  return outs, time.perf_counter() - t0, cluster


def routing(cfg, params):
  rows = []
  for rate in [float(r) for r in FLAGS.rates]:
    loads = {
        "multi_turn": workloads.multi_turn(
            FLAGS.sessions, FLAGS.turns, rate, vocab_size=cfg.vocab_size,
            system_len=FLAGS.system_len, user_len=FLAGS.user_len, reply_len=FLAGS.reply_len,
            think_s=FLAGS.think_s, max_tokens=FLAGS.max_tokens, seed=0),
        "independent": workloads.independent(
            FLAGS.independent, rate * FLAGS.turns, vocab_size=cfg.vocab_size, min_len=16,
            max_len=256, max_tokens=FLAGS.max_tokens, seed=1),
    }
    for name, items in loads.items():
      first = None
      for backend, policy in [(b, p) for p in FLAGS.routers for b in FLAGS.backend]:
        outs, wall, cluster = _serve(
            lambda: _cluster(backend, cfg, params, ["mixed"] * FLAGS.workers, router=policy),
            items)
        tokens = [o.token_ids for o in outs]
        first = first or tokens
        row = dict(experiment="routing", backend=backend, workload=name, router=policy, rate=rate,
                   offered_req_s=workloads.summary(items)["offered_rate"],
                   workers=FLAGS.workers, layout=FLAGS.layout,
                   same_tokens_as_first_router=tokens == first, **_metrics(outs, wall, cluster))
        rows.append(row)
  return rows


def disagg(cfg, params):
  rows = []
  rng = np.random.default_rng(0)
  for frac in [float(f) for f in FLAGS.long_fractions]:
    times = workloads.poisson_times(FLAGS.disagg_requests, FLAGS.disagg_rate, seed=2)
    items = []
    for t in times:
      n = FLAGS.long_len if rng.random() < frac else FLAGS.short_len
      items.append(workloads.Item(arrival_s=float(t), max_tokens=FLAGS.max_tokens,
                                  prompt=tuple(rng.integers(0, cfg.vocab_size, n).tolist())))
    first = None
    for backend, mode in [(b, m) for m in ("never", "always", "conditional")
                          for b in FLAGS.backend]:
      config = DisaggConfig(mode=mode, max_local_prefill_length=FLAGS.max_local_prefill_length,
                            max_prefill_queue_size=4)
      outs, wall, cluster = _serve(
          lambda: _cluster(backend, cfg, params, FLAGS.disagg_roles, router="kv",
                           disagg=config), items)
      tokens = [o.token_ids for o in outs]
      first = first or tokens
      row = dict(experiment="disagg", backend=backend, mode=mode, long_fraction=frac,
                 short_len=FLAGS.short_len, long_len=FLAGS.long_len, rate=FLAGS.disagg_rate,
                 same_tokens_as_first_mode=tokens == first, **_metrics(outs, wall, cluster))
      rows.append(row)
  return rows


def faults(cfg, params):
  rate = float(FLAGS.rates[0])
  items = workloads.multi_turn(FLAGS.sessions, FLAGS.turns, rate, vocab_size=cfg.vocab_size,
                               system_len=FLAGS.system_len, user_len=FLAGS.user_len,
                               reply_len=FLAGS.reply_len, think_s=FLAGS.think_s,
                               max_tokens=FLAGS.max_tokens, seed=0)
  make = lambda: _cluster(FLAGS.backend[0], cfg, params, ["mixed"] * FLAGS.workers, router="kv")
  ref, _, _ = _serve(make, items)
  stop_s = FLAGS.stop_at * max(it.arrival_s for it in items)

  def stop(c, elapsed):
    # Stopped while it holds requests, so that they must move.
    if elapsed >= stop_s and c.workers[1].alive and c.workers[1].has_work():
      c.stop_worker(1, f"stopped by the benchmark at {elapsed:.2f} s")

  outs, wall, cluster = _serve(make, items, on_step=stop)
  lost = sum(o.finish_reason is None for o in outs)
  duplicated = sum(len(o.token_ids) > it.max_tokens for o, it in zip(outs, items))
  row = dict(experiment="faults", backend=FLAGS.backend[0], stopped_worker=1, stop_at_s=stop_s,
             rerouted=sum(o.reroutes > 0 for o in outs), lost=lost, duplicated=duplicated,
             same_tokens_as_fault_free=[o.token_ids for o in outs] == [o.token_ids for o in ref],
             error_reasons=sorted({o.error for o in outs if o.error}),
             **_metrics(outs, wall, cluster))
  return [row]


def _print(r):
  t, p = r["ttft_ms"], r["tpot_ms"]
  what = " ".join(f"{k}={r[k]}" for k in ("backend", "workload", "router", "rate", "mode", "long_fraction",
                                           "stopped_worker") if k in r)
  print(f"{r['experiment']:8s} {what:45s} {r['completed']:4d}/{r['requests']:<4d} "
        f"{r['throughput_tok_s']:7.1f} tok/s  TTFT mean {t['mean']:8.1f} p90 {t['p90']:8.1f} ms"
        f"  TPOT p50 {p['p50']:6.1f} ms  hit {r['prefix_hit_rate']:.2f}"
        f"  per-worker {r['requests_per_worker']}", flush=True)


def _plot(rows, path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  rows = [r for r in rows if r["backend"] == FLAGS.backend[0]]
  routing_rows = [r for r in rows if r["experiment"] == "routing"]
  disagg_rows = [r for r in rows if r["experiment"] == "disagg"]
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  for wl, ax in zip(("multi_turn", "independent"), axes[:2]):
    for policy in FLAGS.routers:
      sel = sorted((r for r in routing_rows if r["workload"] == wl and r["router"] == policy),
                   key=lambda r: r["rate"])
      if sel:
        ax.plot([r["rate"] for r in sel], [r["ttft_ms"]["mean"] for r in sel], "o-", label=policy)
    ax.set(xlabel="offered load (conversations or requests started / s)", ylabel="mean TTFT (ms)",
           title=f"routing: {wl}", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  for mode in ("never", "always", "conditional"):
    sel = sorted((r for r in disagg_rows if r["mode"] == mode), key=lambda r: r["long_fraction"])
    if sel:
      axes[2].plot([r["long_fraction"] for r in sel], [r["ttft_ms"]["mean"] for r in sel], "o-",
                   label=f"prefill {mode if mode != 'never' else 'local'}")
  axes[2].set(xlabel="fraction of long prompts", ylabel="mean TTFT (ms)", title="disaggregation")
  axes[2].grid(alpha=0.3)
  axes[2].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, FLAGS, __file__)
  model = _MODEL.load(dtype="float32")
  cfg, params = model.cfg, model.params
  if set(FLAGS.backend) - {"local", "ray"} or not FLAGS.backend:
    raise ValueError(f"--backend: choose from local, ray; got {FLAGS.backend}")
  known = {"routing": routing, "disagg": disagg, "faults": faults}
  unknown = set(FLAGS.experiments) - set(known)
  if unknown:
    raise ValueError(f"--experiments: unknown {sorted(unknown)}; choose from {sorted(known)}")
  if FLAGS.warmup:
    print("warm-up pass (untimed: compiles the step programs)", file=sys.stderr, flush=True)
    for name in FLAGS.experiments:
      known[name](cfg, params)
  rows = []
  for name in FLAGS.experiments:
    new = known[name](cfg, params)
    for row in new:
      _print(row)
    rows += new
  results.write(FLAGS.out, rows, _plot, flags={f: FLAGS[f].value for f in (
      "experiments", "routers", "rates", "workers", "devices_per_worker", "layout", "sessions",
      "turns", "think_s", "long_fractions", "disagg_rate", "system_len", "user_len",
      "reply_len", "max_tokens", "page_size", "max_num_batched_tokens", "max_num_seqs",
      "max_local_prefill_length", "model", "hf_dir", "checkpoint_dir", "backend", "disagg_roles",
      "ray_cpus", "kv_transport")},
      note="--backend=ray: a local Ray; on the 2-core dev machine all worker processes and "
      "the driver share 2 cores with other jobs" if "ray" in FLAGS.backend else None)
  for cluster in _RAY.values():
    cluster.shutdown()
  _summary(rows)


def _summary(all_rows):
  """The comparisons the benchmark exists for, as ratios measured in this run."""
  for r in all_rows:
    if r["backend"] == "ray" and r["experiment"] != "faults":
      twin = next((t for t in all_rows if t["backend"] == "local" and all(
          t.get(k) == r.get(k) for k in ("experiment", "workload", "router", "rate", "mode",
                                          "long_fraction"))), None)
      if twin:
        print(f"{r['experiment']} {r.get('workload', r.get('mode'))} ray / local: tokens/s "
              f"{r['throughput_tok_s'] / twin['throughput_tok_s']:.2f}x, TTFT mean "
              f"{r['ttft_ms']['mean'] / twin['ttft_ms']['mean']:.2f}x")
  rows = [r for r in all_rows if r["backend"] == FLAGS.backend[0]]
  for wl in ("multi_turn",):
    for rate in sorted({r["rate"] for r in rows if r["experiment"] == "routing"}):
      by = {r["router"]: r for r in rows if r["experiment"] == "routing"
            and r["workload"] == wl and r["rate"] == rate}
      if "kv" in by and "round_robin" in by:
        kv, rr = by["kv"]["ttft_ms"], by["round_robin"]["ttft_ms"]
        print(f"{wl} rate {rate}: round_robin / kv TTFT mean {rr['mean'] / kv['mean']:.1f}x, "
              f"p90 {rr['p90'] / kv['p90']:.1f}x")
  for r in rows:
    if r["experiment"] == "routing" and r["workload"] == "independent":
      print(f"independent rate {r['rate']} {r['router']}: requests per worker max/mean "
            f"{r['load_max_over_mean']:.2f}")
  for frac in sorted({r["long_fraction"] for r in rows if r["experiment"] == "disagg"}):
    by = {r["mode"]: r["ttft_ms"]["mean"] for r in rows
          if r["experiment"] == "disagg" and r["long_fraction"] == frac}
    best = min(by, key=by.get)
    print(f"disagg long fraction {frac}: mean TTFT " +
          ", ".join(f"{m} {v:.1f} ms" for m, v in by.items()) + f" -> best: {best}")


if __name__ == "__main__":
  cli.run(main)
