"""Paged, MLA and ragged Pallas kernels (interpret mode) vs their references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_kernels as pk
from conftest import ON_GPU


def _rel(out, ref):
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  assert np.isfinite(out).all(), "NaN/inf in kernel output"
  return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def _inputs(rng, *, B, Q, N, K, D, ps, P, pps, dtype, lengths=None, dv=None):
  q = jnp.asarray(rng.normal(size=(B, Q, N, D)), dtype)
  kp = jnp.asarray(rng.normal(size=(K, P, ps, D)), dtype)
  vp = jnp.asarray(rng.normal(size=(K, P, ps, dv or D)), dtype)
  if lengths is None:
    lengths = rng.integers(Q, pps * ps + 1, B)
  lengths = jnp.asarray(lengths, jnp.int32)
  tables = rng.integers(1, P, (B, pps))
  for b in range(B):  # slots past the sequence's pages point at the null page 0
    tables[b, -(-int(lengths[b]) // ps):] = 0
  return q, kp, vp, lengths, jnp.asarray(tables, jnp.int32)


def _quantize(x, kind):
  """x -> (pages in float8_e4m3fn / int8, float32 scale): amax scaling as the engine stores."""
  top = {"fp8": 448.0, "int8": 127.0}[kind]
  scale = jnp.max(jnp.abs(x.astype(jnp.float32))) / top
  y = jnp.clip(x.astype(jnp.float32) / scale, -top, top)
  return (y.astype(jnp.float8_e4m3fn) if kind == "fp8" else jnp.round(y).astype(jnp.int8)), scale


CASES = [  # B, Q, N, K, D, ps, pps, extra
    (3, 1, 4, 4, 64, 8, 5, {}),                   # GQA 1
    (2, 1, 8, 2, 72, 16, 4, {}),                  # GQA 4, odd head dim
    (2, 2, 8, 1, 128, 32, 3, dict(window=9)),     # GQA 8, window
    (2, 4, 4, 2, 192, 64, 2, dict(sinks=True)),   # Q 4, head dim 192, sinks
    (4, 3, 6, 3, 64, 8, 7, dict(num_splits=3, pages_per_compute_block=2)),
    (1, 1, 2, 1, 64, 16, 9, dict(num_splits=4, sinks=True, window=20)),
]


def refused_on_gpu(D, page_size, ppcb=1, Dv=None):
  """The compiled kernel's tiling rule, restated: it needs >= 16 keys per step
  (page_size x pages_per_compute_block) and head dims that split into
  power-of-two parts of >= 16 (multiples of 16). jaxinfer.ops sends other
  shapes to XLA."""
  return page_size * ppcb < 16 or D % 16 != 0 or (Dv or D) % 16 != 0


class TestPagedKernels:
  """Paged, MLA and ragged kernels against their references, in interpret mode
  on CPU; `TestPagedKernelsGpu` (collected only where a GPU is present) runs
  the same tests compiled."""

  interpret = True

  def run(self, kernel, *args, tile, **kw):
    """kernel(*args, **kw), interpreted or compiled. Compiled, shapes the GPU
    kernel cannot tile (tile = (D, page_size, ppcb[, Dv]); `refused_on_gpu`)
    must raise its named error -> None then."""
    if not self.interpret and refused_on_gpu(*tile):
      with pytest.raises(ValueError, match="cannot tile"):
        kernel(*args, interpret=False, **kw)
      return None
    return kernel(*args, interpret=self.interpret, **kw)

  @pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
  @pytest.mark.parametrize("case", range(len(CASES)))
  def test_paged_attention_matches_reference(self, case, dtype, tol):
    B, Q, N, K, D, ps, pps, extra = CASES[case]
    rng = np.random.default_rng(case)
    q, kp, vp, lengths, tables = _inputs(rng, B=B, Q=Q, N=N, K=K, D=D, ps=ps, P=3 * pps + 2,
                                         pps=pps, dtype=dtype)
    extra = dict(extra)
    sinks = jnp.asarray(rng.normal(size=N), jnp.float32) if extra.pop("sinks", False) else None
    window = extra.pop("window", 0)
    out = self.run(pk.paged_attention, q, kp, vp, lengths, tables, window=window, sinks=sinks,
                   tile=(D, ps, extra.get("pages_per_compute_block", 1)), **extra)
    if out is None:
      return
    ref = pk.paged_attention_reference(q.astype(jnp.float32), kp.astype(jnp.float32),
                                       vp.astype(jnp.float32), lengths, tables, window=window,
                                       sinks=sinks)
    assert _rel(out, ref) <= tol

  def test_lengths_edge_cases_and_decode_form(self):
    # length 1, exactly one page, a last page with one token, several pages.
    rng = np.random.default_rng(7)
    ps = 16
    q, kp, vp, lengths, tables = _inputs(rng, B=5, Q=1, N=4, K=2, D=64, ps=ps, P=30, pps=6,
                                         dtype=jnp.float32, lengths=[1, 16, 17, 33, 96])
    out = pk.paged_attention(q[:, 0], kp, vp, lengths, tables,  # the [B, N, D] form
                             interpret=self.interpret)
    assert out.shape == (5, 4, 64)
    ref = pk.paged_attention_reference(q[:, 0], kp, vp, lengths, tables)
    assert _rel(out, ref) <= 1e-5

  def test_every_output_element_is_written(self):
    # Interpret mode starts every kernel output as NaN, so an element a program
    # never writes shows up as NaN (and `_rel` rejects non-finite outputs).
    unwritten = pl.pallas_call(lambda o_ref: None, interpret=True,
                               out_shape=jax.ShapeDtypeStruct((4,), jnp.float32))()
    assert np.isnan(np.asarray(unwritten)).all()
    rng = np.random.default_rng(8)
    q, kp, vp, lengths, tables = _inputs(rng, B=2, Q=2, N=4, K=2, D=64, ps=16, P=10, pps=3,
                                         dtype=jnp.float32)
    out = pk.paged_attention(q, kp, vp, lengths, tables, num_splits=2, interpret=self.interpret)
    ref = pk.paged_attention_reference(q, kp, vp, lengths, tables)
    assert _rel(out, ref) <= 1e-5

  @pytest.mark.parametrize("Q,splits", [(1, 1), (3, 2)])
  def test_mla_paged_attention(self, Q, splits):
    rng = np.random.default_rng(10 + Q)
    B, N, R, Hr, ps, P, pps = 3, 4, 64, 16, 16, 12, 4
    q_lat = jnp.asarray(rng.normal(size=(B, Q, N, R)), jnp.float32)
    q_rope = jnp.asarray(rng.normal(size=(B, Q, N, Hr)), jnp.float32)
    pages = jnp.asarray(rng.normal(size=(P, ps, R + Hr)), jnp.float32)
    lengths = jnp.asarray([Q, 17, 64], jnp.int32)
    tables = jnp.asarray(rng.integers(1, P, (B, pps)), jnp.int32)
    scale = 1 / math.sqrt(48)
    out = pk.mla_paged_attention(q_lat, q_rope, pages, lengths, tables, sm_scale=scale,
                                 num_splits=splits, interpret=self.interpret)
    ref = pk.mla_paged_attention_reference(q_lat, q_rope, pages, lengths, tables, sm_scale=scale)
    assert out.shape == (B, Q, N, R)
    assert _rel(out, ref) <= 1e-5
    # Cross-check against expanded dense math for sequence 2.
    L = 64
    lat = pages[tables[2]].reshape(-1, R + Hr)[:L]
    s = (jnp.einsum("qnr,sr->nqs", q_lat[2], lat[:, :R]) +
         jnp.einsum("qnh,sh->nqs", q_rope[2], lat[:, R:])) * scale
    s = jnp.where(jnp.arange(L)[None, None] <= (L - Q + jnp.arange(Q))[None, :, None], s, -jnp.inf)
    dense = jnp.einsum("nqs,sr->qnr", jax.nn.softmax(s, axis=-1), lat[:, :R])
    assert _rel(out[2], dense) <= 1e-5

  @pytest.mark.parametrize("mla", [False, True])
  def test_ragged_paged_attention_mixed_batch(self, mla):
    rng = np.random.default_rng(11)
    ps, P, pps = 16, 40, 6
    q_lens = [5, 1, 1, 8, 0, 0]  # prefill chunks, decodes, and 2 padded sequences
    kv_lens = [20, 9, 44, 8, 0, 0]
    B = len(q_lens)
    K, N, D = (1, 4, 40) if mla else (2, 4, 64)
    T = 24  # 15 real tokens + padding
    q = jnp.asarray(rng.normal(size=(T, N, D)), jnp.float32)
    kp = jnp.asarray(rng.normal(size=(K, P, ps, D)), jnp.float32)
    vp = None if mla else jnp.asarray(rng.normal(size=(K, P, ps, D)), jnp.float32)
    tables = rng.integers(1, P, (B, pps))
    tables[4:] = 0  # padded sequences point at the null page
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    kw = dict(max_q=8, v_head_dim=32 if mla else None, window=0 if mla else 6)
    out = self.run(pk.ragged_paged_attention, q, kp, vp, jnp.asarray(kv_lens, jnp.int32),
                   jnp.asarray(tables, jnp.int32), cu, tile=(D, ps, 1, kw["v_head_dim"]), **kw)
    if out is None:
      return
    ref = pk.ragged_paged_attention_reference(q, kp, vp, jnp.asarray(kv_lens, jnp.int32),
                                              jnp.asarray(tables, jnp.int32), cu, **kw)
    assert out.shape == (T, N, 32 if mla else D)
    assert _rel(out, ref) <= 1e-5
    assert np.all(np.asarray(out[15:]) == 0)  # padding rows

  @pytest.mark.parametrize("qdtype,dtype,tol", [
      ("fp8", jnp.float32, 1e-5), ("int8", jnp.float32, 1e-5), ("fp8", jnp.bfloat16, 2e-2)])
  @pytest.mark.parametrize("case", [1, 4, 5])
  def test_quantized_pages_match_the_dequantizing_reference(self, case, qdtype, dtype, tol):
    # Quantized KV (fp8 e4m3 / int8 + per-pool scalar scales), dequantized per
    # tile in the kernel, against the reference that dequantizes the pool first.
    B, Q, N, K, D, ps, pps, extra = CASES[case]
    rng = np.random.default_rng(20 + case)
    q, kp, vp, lengths, tables = _inputs(rng, B=B, Q=Q, N=N, K=K, D=D, ps=ps, P=3 * pps + 2,
                                         pps=pps, dtype=dtype)
    (kq, k_scale), (vq, v_scale) = _quantize(kp, qdtype), _quantize(3 * vp, qdtype)
    extra = dict(extra)
    sinks = jnp.asarray(rng.normal(size=N), jnp.float32) if extra.pop("sinks", False) else None
    kw = dict(window=extra.pop("window", 0), sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    out = self.run(pk.paged_attention, q, kq, vq, lengths, tables,
                   tile=(D, ps, extra.get("pages_per_compute_block", 1)), **extra, **kw)
    if out is None:
      return
    ref = pk.paged_attention_reference(q.astype(jnp.float32), kq, vq, lengths, tables, **kw)
    assert _rel(out, ref) <= tol
    # The quantized cache stays close to the full-precision one (fp8: 3 mantissa bits).
    full = pk.paged_attention_reference(q.astype(jnp.float32), kp.astype(jnp.float32),
                                        3 * vp.astype(jnp.float32), lengths, tables,
                                        window=kw["window"], sinks=sinks)
    assert _rel(ref, full) <= 0.15

  @pytest.mark.parametrize("qdtype", ["fp8", "int8"])
  def test_quantized_latent_pages_mla_and_ragged(self, qdtype):
    rng = np.random.default_rng(31)
    B, Q, N, R, Hr, ps, P, pps = 3, 2, 4, 64, 16, 16, 12, 4
    q_lat = jnp.asarray(rng.normal(size=(B, Q, N, R)), jnp.float32)
    q_rope = jnp.asarray(rng.normal(size=(B, Q, N, Hr)), jnp.float32)
    pages, kv_scale = _quantize(jnp.asarray(rng.normal(size=(P, ps, R + Hr)), jnp.float32),
                                qdtype)
    lengths = jnp.asarray([Q, 17, 64], jnp.int32)
    tables = jnp.asarray(rng.integers(1, P, (B, pps)), jnp.int32)
    kw = dict(sm_scale=1 / math.sqrt(48), kv_scale=kv_scale)
    out = pk.mla_paged_attention(q_lat, q_rope, pages, lengths, tables, num_splits=2,
                                 interpret=self.interpret, **kw)
    ref = pk.mla_paged_attention_reference(q_lat, q_rope, pages, lengths, tables, **kw)
    assert _rel(out, ref) <= 1e-5
    # The ragged form over a stacked [L, 1, P, ps, C] latent pool, layer 1.
    q = jnp.concatenate([q_lat, q_rope], -1).reshape(B * Q, N, R + Hr)
    cu = jnp.arange(B + 1, dtype=jnp.int32) * Q
    stacked = jnp.stack([jnp.zeros_like(pages), pages])[:, None]
    rag = pk.ragged_paged_attention(q, stacked, None, lengths, tables, cu, max_q=Q,
                                    sm_scale=kw["sm_scale"], v_head_dim=R, layer=1,
                                    k_scale=kv_scale, interpret=self.interpret)
    assert _rel(rag.reshape(B, Q, N, R), ref) <= 1e-5

  @pytest.mark.parametrize("kwargs,exc,match", [
      (dict(q=np.zeros((2, 1, 5, 64), np.float32)), ValueError, "multiple of KV heads"),
      (dict(lengths=np.zeros((3,), np.int32)), ValueError, "lengths must be"),
      (dict(page_indices=np.zeros((2, 3), np.float32)), TypeError, "page_indices must be integer"),
      (dict(lengths=np.array([100, 1], np.int32)), ValueError, "exceeds pages_per_seq"),
      (dict(q=np.zeros((2, 1, 4, 32), np.float32)), ValueError, "head dim"),
      (dict(num_splits=0), ValueError, "num_splits"),
      (dict(window=-1), ValueError, "window"),
      (dict(k_pages=np.zeros((2, 5, 8, 64), np.int8)), TypeError, "k_scale"),
      (dict(k_scale=np.ones((2,), np.float32), v_scale=1.0), ValueError, "k_scale must be a scalar"),
      (dict(k_scale=1.0), ValueError, "k_scale and v_scale together"),
  ])
  def test_paged_bad_inputs(self, kwargs, exc, match):
    args = dict(q=np.zeros((2, 1, 4, 64), np.float32), k_pages=np.zeros((2, 5, 8, 64), np.float32),
                v_pages=np.zeros((2, 5, 8, 64), np.float32), lengths=np.array([3, 9], np.int32),
                page_indices=np.zeros((2, 3), np.int32))
    args.update(kwargs)
    args = {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    with pytest.raises(exc, match=match):
      pk.paged_attention(**args, interpret=self.interpret)

  @pytest.mark.parametrize("N,K,D,dv,q_lens,max_q", [
      (8, 1, 64, None, [20, 1, 13, 1], 32),     # G 8: 8-token items, a chunk over 3 items
      (4, 2, 32, None, [1, 1, 1, 40, 1], 64),   # many decodes around one long chunk
      (128, 1, 40, 32, [1, 2, 1], 2),           # MLA-like G 128: two 64-row blocks per item
      (6, 2, 48, None, [9, 3], 16),             # G 3 (not a power of two), D 48 = 32 + 16
  ])
  def test_ragged_items_tile_chunks_and_rows(self, N, K, D, dv, q_lens, max_q):
    rng = np.random.default_rng(sum(q_lens) + N)
    ps, P = 16, 64
    B = len(q_lens)
    kv_lens = [q + int(rng.integers(0, 30)) for q in q_lens]
    pps = max(-(-k // ps) for k in kv_lens)
    T = sum(q_lens) + 3
    q = jnp.asarray(rng.normal(size=(T, N, D)), jnp.float32)
    kp = jnp.asarray(rng.normal(size=(K, P, ps, D)), jnp.float32)
    vp = None if dv else jnp.asarray(rng.normal(size=(K, P, ps, D)), jnp.float32)
    tables = jnp.asarray(rng.integers(1, P, (B, pps)), jnp.int32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    args = (q, kp, vp, jnp.asarray(kv_lens, jnp.int32), tables, cu)
    kw = dict(max_q=max_q, v_head_dim=dv, window=0 if dv else 11)
    out = self.run(pk.ragged_paged_attention, *args, num_splits=2, tile=(D, ps, 1, dv), **kw)
    if out is None:
      return
    ref = pk.ragged_paged_attention_reference(*args, **kw)
    assert _rel(out, ref) <= 1e-5
    assert np.all(np.asarray(out[sum(q_lens):]) == 0)

  def test_items_cover_every_token_once(self):
    from pallas_kernels.paged_attention import item_sizes, plan_items
    q_lens = np.array([5, 1, 0, 17, 1, 8])
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    block_q, rows, W = item_sizes(2, 16, 17, int(cu[-1]), len(q_lens))  # G 8, Dv 128
    assert (block_q, rows) == (16, 128)
    assert item_sizes(2, 16, 17, int(cu[-1]), len(q_lens), 512)[:2] == (8, 64)  # MLA-wide
    it = plan_items(cu, W, block_q)
    covered = np.concatenate([np.arange(s, s + n) for s, n in
                              zip(np.asarray(it.start), np.asarray(it.n_tok))])
    assert sorted(covered.tolist()) == list(range(int(cu[-1])))
    assert np.asarray(it.n_tok).max() <= block_q


def test_reference_matches_dense_attention():
  """The reference itself, against jax.nn.dot_product_attention on gathered K/V."""
  rng = np.random.default_rng(9)
  B, Q, N, K, D, ps, pps = 2, 3, 4, 2, 32, 8, 3
  q, kp, vp, lengths, tables = _inputs(rng, B=B, Q=Q, N=N, K=K, D=D, ps=ps, P=8, pps=pps,
                                       dtype=jnp.float32, lengths=[20, 24])
  ref = pk.paged_attention_reference(q, kp, vp, lengths, tables)
  for b in range(B):
    L = int(lengths[b])
    k = kp[:, tables[b]].reshape(K, -1, D)[:, :L].transpose(1, 0, 2)[None]
    v = vp[:, tables[b]].reshape(K, -1, D)[:, :L].transpose(1, 0, 2)[None]
    mask = jnp.arange(L)[None, :] <= (L - Q + jnp.arange(Q))[:, None]
    dense = jax.nn.dot_product_attention(q[b:b + 1], k, v, mask=mask[None, None])
    assert _rel(ref[b], dense[0]) <= 1e-5



@pytest.mark.parametrize("D,ps,ppcb,match", [
    (72, 16, 1, "parts below 16"),       # 72 = 64 + 8
    (64, 24, 1, "powers of two"),
    (64, 8, 1, "must be >= 16"),         # 8 keys per loop step
])
def test_untileable_gpu_shapes_get_a_named_error(D, ps, ppcb, match):
  # Checked before lowering, so a CPU process sees what a GPU compile would meet.
  q, kp, vp, lengths, tables = _inputs(np.random.default_rng(0), B=1, Q=1, N=2, K=1, D=D, ps=ps,
                                       P=4, pps=2, dtype=jnp.float32)
  with pytest.raises(ValueError, match=f"cannot tile.*{match}"):
    pk.paged_attention(q, kp, vp, lengths, tables, pages_per_compute_block=ppcb)
  out = pk.paged_attention(q, kp, vp, lengths, tables, interpret=True)  # interpret: any shape
  assert _rel(out, pk.paged_attention_reference(q, kp, vp, lengths, tables)) <= 1e-5

if ON_GPU:
  @pytest.mark.usefixtures("exact_xla_matmuls")
  class TestPagedKernelsGpu(TestPagedKernels):
    """The same tests, compiled for the GPU this process runs on. Shapes the
    GPU kernel cannot tile (see `refused_on_gpu`) must raise its named error."""

    interpret = False
