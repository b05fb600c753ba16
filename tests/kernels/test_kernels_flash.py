"""Flash attention: kernel (interpret mode) == fp32 reference == independent numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ON_GPU
from pallas_kernels.flash_attention import BlockSizes, flash_attention, flash_attention_reference


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _qkv(B, T, S, N, K, H, Hv=None, dtype=jnp.float32, seed=0):
  r = np.random.default_rng(seed)
  shapes = [(B, T, N, H), (B, S, K, H), (B, S, K, Hv or H)]
  return [jnp.asarray(r.standard_normal(s), dtype) for s in shapes]


def _segments(lengths, B=1, shift=0):
  """[B, sum(lengths)] int32 packed-sequence ids 0, 1, 2, ... (+ shift)."""
  ids = np.repeat(np.arange(len(lengths)) + shift, lengths)
  return jnp.asarray(np.tile(ids, (B, 1)), jnp.int32)


# (B, T, S, N, K, Hqk, Hv, dtype, kwargs): odd T/S, head dims 64/72/128/192,
# GQA ratios 1/4/8, causal T < S, windows < T, sinks, segments, Hv != Hqk.
CASES = {
    "causal_T<S_gqa4_h64": (1, 37, 53, 4, 1, 64, 64, "float32", dict(block_q=16, block_k=32)),
    "noncausal_gqa1_h72": (2, 37, 53, 2, 2, 72, 72, "float32", dict(causal=False)),
    "causal_window_gqa8_h128": (1, 48, 48, 8, 1, 128, 128, "float32", dict(window=20)),
    "mla_192_128_sinks_T<S": (1, 37, 53, 4, 2, 192, 128, "float32", dict(sinks=True)),
    "segments_sinks_causal": (2, 40, 40, 4, 1, 64, 64, "float32", dict(segments=(13, 20, 7),
                                                                       sinks=True)),
    "noncausal_window_T>S": (1, 53, 37, 2, 1, 64, 64, "float32", dict(causal=False, window=8)),
    "default_blocks_window_sinks": (1, 96, 96, 2, 1, 72, 72, "float32", dict(
        window=40, sinks=True, block_q=None, block_k=None)),
    "bf16_causal_window_sinks_gqa4": (1, 37, 53, 4, 1, 128, 128, "bfloat16", dict(
        window=11, sinks=True)),
    "bf16_mla_segments_noncausal": (1, 37, 37, 2, 2, 192, 128, "bfloat16", dict(
        causal=False, segments=(17, 20))),
}


def _run_case(B, T, S, N, K, H, Hv, dtype, kw, seed=0, interpret=True):
  kw = dict(kw)
  q, k, v = _qkv(B, T, S, N, K, H, Hv, jnp.dtype(dtype), seed)
  if kw.pop("sinks", False):
    kw["sinks"] = jnp.linspace(-1.0, 2.0, N, dtype=jnp.float32)
  if "segments" in kw:
    ids = _segments(kw.pop("segments"), B)
    kw["segment_ids"] = (ids, ids)
  blocks = dict(block_q=kw.pop("block_q", 16), block_k=kw.pop("block_k", 16))
  out = flash_attention(q, k, v, interpret=interpret, **blocks, **kw)
  ref = flash_attention_reference(q, k, v, **kw)
  return out, ref


def _bad(**changes):
  args = dict(q=jnp.zeros((1, 8, 4, 16)), k=jnp.zeros((1, 8, 2, 16)), v=jnp.zeros((1, 8, 2, 16)))
  args.update(changes)
  return args


class TestFlashAttention:
  """The kernel against its reference, in interpret mode on CPU;
  `TestFlashAttentionGpu` (collected only where a GPU is present) runs the
  same tests compiled."""

  interpret = True

  @pytest.mark.parametrize("name", sorted(CASES))
  def test_kernel_matches_reference(self, name):
    B, T, S, N, K, H, Hv, dtype, kw = CASES[name]
    out, ref = _run_case(B, T, S, N, K, H, Hv, dtype, kw, interpret=self.interpret)
    assert out.shape == ref.shape == (B, T, N, Hv) and out.dtype == ref.dtype == jnp.dtype(dtype)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert _rel(out, ref) <= (1e-5 if dtype == "float32" else 2e-2)

  def test_every_output_element_is_written(self):
    # Interpret mode starts outputs as NaN: an element no program writes stays NaN.
    q, k, v = _qkv(1, 37, 53, 4, 1, 64)
    kw = dict(window=9, sinks=jnp.ones((4,)))
    out = flash_attention(q, k, v, block_q=16, block_k=16, interpret=self.interpret, **kw)
    assert np.all(np.isfinite(np.asarray(out)))
    assert _rel(out, flash_attention_reference(q, k, v, **kw)) <= 1e-5

  def test_rows_with_no_visible_key_are_zero(self):
    # Query segment 9 has no keys; the other rows still match the reference.
    q, k, v = _qkv(1, 33, 33, 2, 1, 64)
    q_ids = _segments((11, 22)).at[0, 5:9].set(9)
    kw = dict(causal=False, window=6, segment_ids=(q_ids, _segments((11, 22))))
    for sinks in (None, jnp.array([0.5, -3.0])):
      out = flash_attention(q, k, v, block_q=16, block_k=16, interpret=self.interpret,
                            sinks=sinks, **kw)
      ref = flash_attention_reference(q, k, v, sinks=sinks, **kw)
      assert np.all(np.isfinite(np.asarray(out))) and np.all(np.asarray(out)[0, 5:9] == 0)
      assert np.all(np.asarray(ref)[0, 5:9] == 0)
      assert _rel(out, ref) <= 1e-5

  def test_invisible_key_blocks_are_skipped(self):
    # A NaN value in a visited-but-masked key would leak as 0 * NaN; a finite
    # output therefore proves those key blocks were never loaded.
    q, k, v = _qkv(1, 64, 64, 2, 1, 64)
    v_bad = v.at[:, 48:].set(jnp.nan)  # key block 3: visible only to query block 3
    out = flash_attention(q, k, v_bad, block_q=16, block_k=16, interpret=self.interpret)
    assert np.all(np.isfinite(np.asarray(out)[:, :48]))
    ref = flash_attention_reference(q, k, v)
    assert _rel(out[:, :48], ref[:, :48]) <= 1e-5
    # Window: queries at 80..95 see keys >= 73, so key blocks 0..3 are skipped.
    q, k, v = _qkv(1, 16, 96, 2, 1, 64, seed=1)
    out = flash_attention(q, k, v.at[:, :64].set(jnp.nan), window=8, block_q=16, block_k=16,
                          interpret=self.interpret)
    assert _rel(out, flash_attention_reference(q, k, v, window=8)) <= 1e-5

  @pytest.mark.parametrize("args,exc,match", [
      (_bad(q=jnp.zeros((8, 4, 16))), ValueError, "q must be rank 4"),
      (_bad(v=jnp.zeros((1, 8, 2))), ValueError, "v must be rank 4"),
      (_bad(k=jnp.zeros((2, 8, 2, 16)), v=jnp.zeros((2, 8, 2, 16))), ValueError, "batch B"),
      (_bad(k=jnp.zeros((1, 8, 2, 32))), ValueError, "k head dim"),
      (_bad(v=jnp.zeros((1, 9, 2, 16))), ValueError, "v must be"),
      (_bad(k=jnp.zeros((1, 8, 3, 16)), v=jnp.zeros((1, 8, 3, 16))), ValueError,
       "multiple of kv heads"),
      (_bad(k=jnp.zeros((1, 4, 2, 16)), v=jnp.zeros((1, 4, 2, 16))), ValueError, "causal needs"),
      (_bad(window=-1), ValueError, "window"),
      (_bad(window=2.5), ValueError, "window"),
      (_bad(sm_scale=0.0), ValueError, "sm_scale"),
      (_bad(sinks=jnp.zeros((2,))), ValueError, "sinks must have shape"),
      (_bad(sinks=jnp.zeros((4,), jnp.int32)), TypeError, "sinks must have a floating"),
      (_bad(segment_ids=jnp.zeros((1, 8), jnp.int32)), ValueError, "segment_ids must be a pair"),
      (_bad(segment_ids=(jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 7), jnp.int32))),
       ValueError, "kv_segment_ids"),
      (_bad(segment_ids=(jnp.zeros((1, 8)), jnp.zeros((1, 8), jnp.int32))), TypeError,
       "q_segment_ids"),
      (_bad(q=jnp.zeros((1, 8, 4, 16), jnp.int32)), TypeError, "q must have a floating"),
      (_bad(k=jnp.zeros((1, 8, 2, 16), jnp.bfloat16)), TypeError, "q and k must share"),
      (_bad(block_q=24), ValueError, "block_q"),
      (_bad(block_k=8), ValueError, "block_k"),
  ])
  def test_bad_inputs_raise(self, args, exc, match):
    with pytest.raises(exc, match=match):
      flash_attention(**args, interpret=self.interpret)
    ref_args = {k: a for k, a in args.items() if k not in ("block_q", "block_k")}
    if len(ref_args) == len(args):
      with pytest.raises(exc, match=match):
        flash_attention_reference(**ref_args)

def _numpy_attention(q, k, v, causal, window, sinks, q_ids, kv_ids):
  """float64 per-(b, t, n) softmax over visible keys plus an optional sink column."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1:3]
  out = np.zeros((B, T, N, v.shape[-1]))
  for b in range(B):
    for t in range(T):
      p = S - T + t
      keys = [j for j in range(S) if (not causal or j <= p) and (window == 0 or p - j < window)
              and (q_ids is None or q_ids[b, t] == kv_ids[b, j])]
      for n in range(N):
        kh = n // (N // K)
        logits = [q[b, t, n] @ k[b, j, kh] / np.sqrt(H) for j in keys]
        values = [v[b, j, kh] for j in keys]
        if sinks is not None:
          logits.append(float(sinks[n]))
          values.append(np.zeros(v.shape[-1]))
        if logits:
          w = np.exp(np.array(logits) - max(logits))
          out[b, t, n] = (w / w.sum()) @ np.array(values)
  return out


@pytest.mark.parametrize("causal,window,use_sinks,use_segments", [
    (True, 0, False, False), (True, 5, True, False), (False, 4, True, True),
    (False, 0, False, True)])
def test_reference_matches_numpy(causal, window, use_sinks, use_segments):
  q, k, v = _qkv(2, 9, 13, 4, 2, 8, 6)
  sinks = jnp.array([0.3, -1.0, 2.0, 0.0]) if use_sinks else None
  q_ids = jnp.array([[0] * 4 + [1] * 5, [0] * 9]) if use_segments else None
  kv_ids = jnp.array([[0] * 6 + [1] * 7, [2] * 4 + [0] * 9]) if use_segments else None
  ref = flash_attention_reference(q, k, v, causal=causal, window=window, sinks=sinks,
                                  segment_ids=None if q_ids is None else (q_ids, kv_ids))
  want = _numpy_attention(q, k, v, causal, window, sinks, q_ids, kv_ids)
  np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-5)


def test_reference_matches_jax_dot_product_attention():
  q, k, v = _qkv(2, 7, 12, 4, 2, 16)
  t, s = np.arange(7)[:, None] + 5, np.arange(12)[None]
  mask = jnp.asarray((s <= t) & (t - s < 4))[None, None]  # causal, end-aligned, window 4
  want = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
  ref = flash_attention_reference(q, k, v, window=4)
  np.testing.assert_allclose(np.asarray(ref), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_block_sizes_are_validated_and_fit_short_sequences():
  assert BlockSizes() == BlockSizes(block_q=64, block_k=64)
  assert BlockSizes().fit(5, 40) == BlockSizes(block_q=16, block_k=64)
  with pytest.raises(ValueError, match="block_k"):
    BlockSizes(block_k=48)


if ON_GPU:
  @pytest.mark.usefixtures("exact_xla_matmuls")
  class TestFlashAttentionGpu(TestFlashAttention):
    """The same tests, compiled for the GPU this process runs on."""

    interpret = False
