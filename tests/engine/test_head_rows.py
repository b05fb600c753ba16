"""A step with many sequence slots and few real sequences runs the head and
the sampler over its first quarter of rows only (`steps._head_and_sample`):
the same tokens as over every row, greedy and seeded sampling alike."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import models, presets
from jaxinfer.engine import steps


def _batch(real: int, B: int = 16, T: int = 24):
  q_lens = [3] * real
  n = sum(q_lens)
  shapes = steps.StepShapes(tokens=T, seqs=B, pages=2, max_q=3)
  rng = np.random.default_rng(real)
  return steps.pad_batch(
      shapes, tokens=list(rng.integers(1, 50, n)), from_prev=[-1] * n,
      positions=[p for _ in range(real) for p in range(3)],
      token_seq=[b for b in range(real) for _ in range(3)], q_lens=q_lens, kv_lens=q_lens,
      page_tables=[[b] for b in range(real)],
      temperature=[0.0, 0.8, 1.3, 0.7, 0.0, 1.0][:real], top_k=[0, 5, 0, 3, 0, 0][:real],
      top_p=[1.0, 1.0, 0.9, 1.0, 1.0, 0.5][:real], seeds=list(range(7, 7 + real)),
      sample_idx=[0, 2, 1, 4, 0, 3][:real])


@pytest.mark.parametrize("real", [1, 4, 5])
def test_few_rows_sample_as_all_rows(real):
  cfg = presets.get("tiny_dense")
  params = models.init_params(cfg, jax.random.key(0))
  batch = jax.tree.map(jnp.asarray, _batch(real))
  x = jax.random.normal(jax.random.key(1), (24, cfg.d_model), jnp.float32).astype(cfg.dtype)
  for greedy in (True, False):
    logits, every = steps._head_and_sample(cfg, params, x, batch, greedy, 0, None, True)
    assert logits.shape == (16, cfg.vocab_size)
    kept, few = steps._head_and_sample(cfg, params, x, batch, greedy, 0, None, False)
    assert kept is None
    np.testing.assert_array_equal(np.asarray(few)[:real], np.asarray(every)[:real])
    if real <= 4:  # the quarter branch: rows past the first quarter sample 0
      assert not np.asarray(few)[4:].any()
    else:
      np.testing.assert_array_equal(np.asarray(few), np.asarray(every))
