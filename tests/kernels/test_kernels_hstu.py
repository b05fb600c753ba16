"""Jagged HSTU attention: kernel (interpret mode) == fp32 reference == independent numpy."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ON_GPU
from pallas_kernels.hstu_attention import BlockSizes, hstu_attention, hstu_attention_reference


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _case(lengths, targets, N, A, H, pad=0, dtype=jnp.float32, seed=0, P=64, Bt=33):
  """Packed users of `lengths` tokens, the last targets[u] of each candidates;
  `pad` padding tokens (each its own segment) at the end."""
  r = np.random.default_rng(seed)
  T = sum(lengths) + pad
  seg = np.concatenate([np.repeat(np.arange(len(lengths)), lengths), -1 - np.arange(pad)])
  pos = np.concatenate([np.minimum(np.arange(n), n - c) for n, c in zip(lengths, targets)]
                       + [np.zeros(pad, int)])
  ts = np.concatenate([np.sort(r.integers(0, 10**7, n)) for n in lengths] + [np.zeros(pad, int)])
  q, k, v = (jnp.asarray(r.standard_normal(s), dtype) for s in ((T, N, A), (T, N, A), (T, N, H)))
  kw = dict(segment_ids=jnp.asarray(seg, jnp.int32), positions=jnp.asarray(pos, jnp.int32),
            timestamps=jnp.asarray(ts, jnp.int32),
            pos_bias=jnp.asarray(r.standard_normal(P), jnp.float32),
            time_bias=jnp.asarray(r.standard_normal(Bt), jnp.float32),
            alpha=1 / math.sqrt(A), n=float(P))
  return q, k, v, kw


# (lengths, targets per user, N, A, H, pad, dtype, blocks): a one-token user, a user
# longer than several blocks, users straddling block edges, odd head dims, bf16.
CASES = {
    "mixed_lengths_targets": ((1, 5, 40, 3, 17), (0, 2, 4, 1, 3), 2, 16, 24, 3, "float32",
                              (16, 16)),
    "one_long_user_blocks_16_32": ((70,), (6,), 2, 32, 32, 0, "float32", (16, 32)),
    "many_short_users_h72": ((2, 3, 1, 4, 6, 2, 9, 5), (1, 1, 0, 2, 0, 1, 3, 1), 4, 72, 72, 7,
                             "float32", (32, 16)),
    "default_blocks": ((100, 37, 1), (8, 0, 0), 2, 16, 16, 0, "float32", (None, None)),
    "bf16": ((33, 20, 11), (4, 0, 2), 2, 64, 64, 0, "bfloat16", (16, 16)),
}


class TestHstuAttention:
  """The kernel against its reference, in interpret mode on CPU;
  `TestHstuAttentionGpu` (collected only where a GPU is present) runs them compiled."""

  interpret = True

  @pytest.mark.parametrize("name", sorted(CASES))
  def test_kernel_matches_reference(self, name):
    lengths, targets, N, A, H, pad, dtype, (bq, bk) = CASES[name]
    q, k, v, kw = _case(lengths, targets, N, A, H, pad, jnp.dtype(dtype))
    out = hstu_attention(q, k, v, block_q=bq, block_k=bk, interpret=self.interpret, **kw)
    ref = hstu_attention_reference(q, k, v, **kw)
    assert out.shape == ref.shape == (sum(lengths) + pad, N, H) and out.dtype == q.dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert _rel(out, ref) <= (1e-5 if dtype == "float32" else 2e-2)

  def test_other_users_key_blocks_are_never_read(self):
    # NaN keys/values of user 0 (tokens 0..31, two whole key blocks) would reach
    # user 1's rows through 0 * NaN if their blocks were visited.
    q, k, v, kw = _case((32, 30), (0, 3), 2, 16, 16)
    v_bad = v.at[:32].set(jnp.nan)
    out = hstu_attention(q, k.at[:32].set(jnp.nan), v_bad, block_q=16, block_k=16,
                         interpret=self.interpret, **kw)
    ref = hstu_attention_reference(q, k, v, **kw)
    assert np.all(np.isfinite(np.asarray(out)[32:]))
    assert _rel(out[32:], ref[32:]) <= 1e-5

  @pytest.mark.parametrize("change,exc,match", [
      (dict(q=jnp.zeros((8, 2, 16, 1))), ValueError, "q must be rank 3"),
      (dict(k=jnp.zeros((8, 2, 8))), ValueError, "k must be"),
      (dict(v=jnp.zeros((8, 2, 16), jnp.bfloat16)), TypeError, "share a dtype"),
      (dict(segment_ids=jnp.zeros((7,), jnp.int32)), ValueError, "segment_ids must have shape"),
      (dict(positions=jnp.zeros((8,))), TypeError, "positions must be an integer"),
      (dict(pos_bias=jnp.zeros((0,))), ValueError, "pos_bias must be a non-empty"),
      (dict(alpha=0.0), ValueError, "alpha must be"),
      (dict(n=float("inf")), ValueError, "n must be"),
      (dict(block_q=24), ValueError, "block_q"),
  ])
  def test_bad_inputs_raise(self, change, exc, match):
    args = dict(q=jnp.zeros((8, 2, 16)), k=jnp.zeros((8, 2, 16)), v=jnp.zeros((8, 2, 16)),
                segment_ids=jnp.zeros((8,), jnp.int32), positions=jnp.arange(8),
                timestamps=jnp.zeros((8,), jnp.int32), pos_bias=jnp.zeros((8,)),
                time_bias=jnp.zeros((4,)), alpha=0.25, n=8.0)
    args.update(change)
    with pytest.raises(exc, match=match):
      hstu_attention(**args, interpret=self.interpret)


def _numpy_hstu(q, k, v, kw):
  """float64, token pair by token pair, from the module docstring's equations."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  seg, pos, ts = (np.asarray(kw[n]) for n in ("segment_ids", "positions", "timestamps"))
  pb, tb = np.asarray(kw["pos_bias"], np.float64), np.asarray(kw["time_bias"], np.float64)
  T, N, _ = q.shape
  out = np.zeros((T, N, v.shape[-1]))
  for i in range(T):
    for j in range(T):
      if seg[i] != seg[j] or not (pos[i] > pos[j] or i == j):
        continue
      dt = max(abs(float(ts[i]) - float(ts[j])), 1.0)
      b = min(max(math.floor(math.log(dt) / 0.301), 0), len(tb) - 1)
      rab = pb[min(max(pos[i] - pos[j], 0), len(pb) - 1)] + tb[b]
      s = kw["alpha"] * np.einsum("na,na->n", q[i], k[j]) + rab
      out[i] += (s / (1 + np.exp(-s)) / kw["n"])[:, None] * v[j]
  return out


def test_reference_matches_numpy():
  q, k, v, kw = _case((1, 6, 9), (0, 2, 3), 2, 8, 4, pad=2, P=4, Bt=5)  # clipped biases too
  ref = hstu_attention_reference(q, k, v, **kw)
  np.testing.assert_allclose(np.asarray(ref), _numpy_hstu(q, k, v, kw), rtol=1e-5, atol=1e-6)


def test_block_sizes_are_validated():
  assert BlockSizes() == BlockSizes(block_q=64, block_k=64)
  with pytest.raises(ValueError, match="block_k"):
    BlockSizes(block_k=48)


if ON_GPU:
  @pytest.mark.usefixtures("exact_xla_matmuls")
  class TestHstuAttentionGpu(TestHstuAttention):
    """The same tests, compiled for the GPU this process runs on."""

    interpret = False
