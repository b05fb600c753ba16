"""KV transfer between worker processes: bytes/s of the disaggregated
prefill -> decode hand-over on the Ray backend (pages read on one worker
process, written into pages of another), by each KV transport: jax's
transfer library (device to device through transfer servers) and Ray's
object store (through host memory).

  python experiments/kv_transfer_bench.py                     # default model, 1..256 pages
  python experiments/kv_transfer_bench.py --num_pages=1,64 --repeats=5

Each size is timed end to end (device -> host -> object store -> the other
process -> device), best of --repeats; an empty round trip to the decode
process is reported next to it (the per-transfer overhead). A local Ray
with --ray_cpus CPUs. Results: a table on stdout, JSON under
experiments/results/.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import flags  # noqa: E402
import ray  # noqa: E402

from benchlib import cli, flag_config, model_flags, results  # noqa: E402
from jaxinfer import EngineConfig  # noqa: E402
from jaxinfer.serving.cluster import Cluster  # noqa: E402
from jaxinfer.serving.ray_cluster import measure_transfer  # noqa: E402
from jaxinfer.serving.ray_worker import WorkerSpec, host_tree  # noqa: E402

_MODEL = model_flags.define()
_PAGES = flags.DEFINE_list("num_pages", ["1", "4", "16", "64", "256"], "pages per transfer")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed transfers per size (best reported)")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "KV page size")
_TRANSPORTS = flags.DEFINE_list("kv_transport", ["jax", "object_store"], "transports to measure")
_RAY_CPUS = flags.DEFINE_integer("ray_cpus", 2, "CPUs of the local Ray")
_OUT = flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results",
                                               "kv_transfer_bench"), "output prefix (.json)")
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  model = _MODEL.load(dtype="float32")
  cfg, params = model.cfg, model.params
  sizes = [int(n) for n in _PAGES.value]
  config = EngineConfig(page_size=_PAGE_SIZE.value, num_pages=max(sizes) + 8)
  ray.init(num_cpus=_RAY_CPUS.value, include_dashboard=False, log_to_driver=False)
  ref = ray.put(host_tree(params))
  specs = [WorkerSpec(model=cfg, params=ref, config=config, role=role, name=role,
                      num_cpus=_RAY_CPUS.value / 2, env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
           for role in ("prefill", "decode")]
  rows = []
  for transport in _TRANSPORTS.value:
    cluster = Cluster(specs, backend="ray", kv_transport=transport)
    measure_transfer(cluster, src=0, dst=1, num_pages=sizes, repeats=1)  # compiles the gathers
    new = measure_transfer(cluster, src=0, dst=1, num_pages=sizes, repeats=_REPEATS.value)
    rows += [dict(r, kv_transport=transport) for r in new]
    cluster.shutdown()
  ray.shutdown()
  print(f"{'transport':>12} {'pages':>6} {'bytes':>10} {'ms':>8} {'MB/s':>8}  (empty round "
        f"trip {rows[0]['call_overhead_s'] * 1e3:.2f} ms)")
  for r in rows:
    print(f"{r['kv_transport']:>12} {r['pages']:6d} {r['bytes']:10d} {r['seconds'] * 1e3:8.2f} "
          f"{r['bytes_per_s'] / 1e6:8.1f}")
  results.write(_OUT.value, rows, model=model.name, page_size=_PAGE_SIZE.value,
                path="jax: offer on the prefill process's transfer server, pull + scatter in "
                "the decode process; object_store: device_get, Ray object, device_put + scatter",
                note="2-core dev machine shared with other jobs; both processes and the "
                "driver on the same 2 cores")


if __name__ == "__main__":
  cli.run(main)
