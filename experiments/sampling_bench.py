"""Top-k / top-p sampling over a real vocabulary: the full-vocabulary sort
against the `lax.top_k` fast path (`sampling.filter_logits(k_cap=...)`), in
one run, alternated. The two give the same tokens (tests/engine/test_generate.py);
this measures the time per call and the ratio. Greedy rows the same way:
`jnp.argmax` against `sampling.argmax` (a max, then a min over the indices
that reach it). Writes <out>.json.

  python experiments/sampling_bench.py                  # Llama 3 vocabulary, batch 1/8/32
  python experiments/sampling_bench.py --vocab=32000 --batches=8 --top_k=40
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from benchlib import cli, flag_config, results
from jaxinfer.engine import sampling

FLAGS = flags.FLAGS
flags.DEFINE_integer("vocab", 128256, "vocabulary size (Llama 3)")
flags.DEFINE_list("batches", ["1", "8", "32"], "rows sampled per call")
flags.DEFINE_integer("top_k", 50, "every row's top_k")
flags.DEFINE_float("top_p", 0.9, "every row's top_p")
flags.DEFINE_integer("repeats", 30, "timed calls per variant (alternated)")
flags.DEFINE_string("out", "experiments/results/sampling_bench", "output prefix (.json)")
_CONFIG = flag_config.define_config(__file__)


def _time(fn, *args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  cap = sampling.top_k_cap([sampling.SamplingParams(temperature=1.0, top_k=FLAGS.top_k)])
  rows = []
  for B in map(int, FLAGS.batches):
    logits = jax.random.normal(jax.random.key(0), (B, FLAGS.vocab)) * 3.0
    args = (logits, jax.random.split(jax.random.key(1), B), jnp.full((B,), 0.8),
            jnp.full((B,), FLAGS.top_k, jnp.int32), jnp.full((B,), FLAGS.top_p))
    variants = {"sort": jax.jit(sampling.sample),
                "top_k": jax.jit(lambda *a: sampling.sample(*a, k_cap=cap)),
                "jnp_argmax": jax.jit(lambda x, *_: jnp.argmax(x, axis=-1).astype(jnp.int32)),
                "argmax": jax.jit(lambda x, *_: sampling.argmax(x))}
    equal = bool(np.array_equal(variants["sort"](*args), variants["top_k"](*args)))
    same_argmax = bool(np.array_equal(variants["jnp_argmax"](*args), variants["argmax"](*args)))
    times = {k: [] for k in variants}
    for _ in range(FLAGS.repeats):
      for name, fn in variants.items():
        times[name].append(_time(fn, *args))
    med = {k: float(np.median(v)) for k, v in times.items()}
    rows.append(dict(batch=B, k_cap=cap, same_tokens=equal, sort_ms=med["sort"] * 1e3,
                     top_k_ms=med["top_k"] * 1e3, speedup=med["sort"] / med["top_k"],
                     same_argmax=same_argmax, jnp_argmax_ms=med["jnp_argmax"] * 1e3,
                     argmax_ms=med["argmax"] * 1e3,
                     argmax_speedup=med["jnp_argmax"] / med["argmax"]))
    print(f"batch {B}: sort {med['sort'] * 1e3:.2f} ms, top_k (cap {cap}) "
          f"{med['top_k'] * 1e3:.2f} ms: {med['sort'] / med['top_k']:.1f}x, same tokens {equal}; "
          f"greedy: jnp.argmax {med['jnp_argmax'] * 1e3:.3f} ms, sampling.argmax "
          f"{med['argmax'] * 1e3:.3f} ms: {med['jnp_argmax'] / med['argmax']:.1f}x, "
          f"same {same_argmax}")
  results.write(FLAGS.out, rows, None, vocab=FLAGS.vocab, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                note="median per call (jitted, alternated): engine.sample with the sort vs "
                     "lax.top_k; greedy: jnp.argmax vs sampling.argmax")


if __name__ == "__main__":
  cli.run(main)
