"""One process of the two-process test (tests/sharding/test_multihost.py).

Usage: python multihost_worker.py PROCESS_ID PORT OUT_JSON
Builds one 8-device mesh over both processes (4 CPU devices each), runs the
sharded forward and greedy decoding, and compares them with a single-process
run of the same params on this process's first device.
"""

import json
import sys

from jaxinfer import sharding

process_id, port, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
sharding.initialize_distributed(f"127.0.0.1:{port}", 2, process_id, local_device_count=4)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxinfer import engine, models, presets  # noqa: E402

cfg = presets.get("tiny_moe", num_heads=8, num_kv_heads=8, num_experts=16, n_group=4,
                  topk_group=2, dtype="float32")
mesh = sharding.make_mesh({"data": 2, "expert": 4})
params = sharding.init_params(cfg, jax.random.key(0), mesh, "dp_attn_ep")
tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 12)).astype(np.int32)

gather = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
sharded_logits = gather(models.logits(cfg, params, tokens))
local_params = jax.device_put(jax.tree.map(gather, params), jax.local_devices()[0])
local_logits = np.asarray(models.logits(cfg, local_params, tokens))

seqs = tokens
for _ in range(5):  # greedy decoding on the global mesh
  nxt = gather(models.logits(cfg, params, seqs))[:, -1].argmax(-1).astype(np.int32)
  seqs = np.concatenate([seqs, nxt[:, None]], axis=1)
local_tokens = engine.greedy_reference(cfg, local_params, tokens.tolist(), 5)

result = dict(
    process_id=process_id, num_devices=len(jax.devices()), local_devices=len(jax.local_devices()),
    max_rel=float(np.max(np.abs(sharded_logits - local_logits)) / np.max(np.abs(local_logits))),
    tokens_equal=seqs[:, 12:].tolist() == local_tokens)
with open(out_path, "w") as f:
  json.dump(result, f)
jax.distributed.shutdown()
