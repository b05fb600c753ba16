"""The Mosaic GPU ragged (mixed prefill + decode) kernel: its work items
(plain jnp, every jax line), parity with the float32 reference in Mosaic
GPU's interpret mode on CPU (jax >= 0.11; `TestMosaicRaggedGpu` runs the
same cases compiled where a GPU is present), named errors, and the H100
compile of the gate's mixed-step cases with shared memory, registers and
planned HBM bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchlib import gpu_cases
import pallas_kernels as pk
from conftest import ON_GPU, kernel_rel_err as _rel, mosaic_kernels_for_h100
from pallas_kernels import mosaic_paged_attention as mpa
from pallas_kernels import mosaic_ragged_attention as mra
from pallas_kernels import mosaic_wide_attention as mwa

CASES = [  # N, K, D, ps, pps, q_lens, kv_lens, pad tokens, extra
    (8, 2, 64, 16, 8, [1, 37, 5, 1], [40, 100, 5, 128], 3, {}),        # decode + chunks + padding
    (4, 1, 64, 16, 6, [20, 1], [90, 33], 0, dict(window=24, sinks=True)),  # window hides blocks
    (8, 2, 128, 16, 10, [3, 1, 18], [150, 160, 18], 2, dict(num_splits=3)),  # split-K
    (16, 1, 64, 32, 4, [9, 0, 1], [70, 0, 128], 1, dict(slots=3)),    # GQA 16: 4 tokens an item
    (2, 2, 64, 8, 12, [70, 2], [96, 2], 0, dict(layered=True)),       # MHA: 64 tokens an item
    # GQA 16: clustered items of 16 tokens, the 150-token chunk's 10 in two clusters
    # (8 + 2; interpreted on jax 0.11, 4 + 4 + 2), the 20-token one's 2 in one
    (16, 1, 64, 16, 12, [150, 1, 20], [180, 50, 20], 2, dict(window=40, num_splits=2)),
]
# cluster=True: case 5 clusters, case 3 has no chunk to cluster (its launch is empty).
VARIANTS = ([(c, v) for c in range(len(CASES) - 1) for v in ("plain", "wide")]
            + [(c, "cluster") for c in (3, 5)])


def _inputs(rng, N, K, D, ps, pps, q_lens, kv_lens, pad, layers=0):
  B = len(q_lens)
  T = sum(q_lens) + pad
  P = B * pps + 2
  pool = (layers, K, P, ps, D) if layers else (K, P, ps, D)
  q = jnp.asarray(rng.normal(size=(T, N, D)), jnp.bfloat16)
  kp = jnp.asarray(rng.normal(size=pool), jnp.bfloat16)
  vp = jnp.asarray(rng.normal(size=pool), jnp.bfloat16)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
  table = jnp.asarray(rng.permutation(P)[:B * pps].reshape(B, pps), jnp.int32)
  return q, kp, vp, jnp.asarray(kv_lens, jnp.int32), table, cu


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("group,q_lens,kv_lens,T", [
    (4, [1, 37, 5, 1], [40, 100, 5, 128], 47), (16, [9, 0, 1], [70, 0, 128], 11),
    (1, [130, 1], [200, 1], 140), (64, [1] * 8, [3] * 8, 8)])
def test_work_items_hold_every_token_once(group, q_lens, kv_lens, T, wide):
  """Each real token is in exactly one item, at its own position; the
  static item bound holds; unused items are empty (end 0). Wide items hold
  twice the tokens."""
  per = mra.tokens_per_item(group, wide)
  assert per == max(1, (128 if wide else 64) // group)
  I = mra.max_items(T, len(q_lens), group, wide)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
  items, first, item_cu = map(np.asarray, mra.work_items(
      cu, jnp.asarray(kv_lens, jnp.int32), per_item=per, num_items=I))
  assert int(item_cu[-1]) <= I
  held = {}
  for i, (b, pos0, end) in enumerate(items):
    assert 0 <= end - pos0 <= per if end else True
    for u in range(end - pos0 if end else 0):
      t = int(first[i]) + u
      assert t not in held
      held[t] = (b, pos0 + u)
  want = {int(cu[b]) + r: (b, kv_lens[b] - q_lens[b] + r)
          for b in range(len(q_lens)) for r in range(q_lens[b])}
  assert held == want


@pytest.mark.parametrize("q_lens,T", [([1, 137, 5, 1], 147), ([1200, 1, 129, 256, 1], 1600),
                                       ([1] * 6, 8)])
def test_cluster_items_hold_each_chunk_item_once(q_lens, T):
  """Every item (of CLUSTER_TILES tiles) of a sequence of two or more is one
  member of one cluster of its sequence's consecutive items (at most
  CLUSTER), the spans run from its first member's position to its last
  member's end, and the static cluster bound holds; sequences of one item
  are in none."""
  G, C, tiles = 2, mra.CLUSTER, mwa.CLUSTER_TILES
  per = mra.tokens_per_item(G, tiles=tiles)
  assert per == 128
  kv_lens = jnp.asarray([q + 7 for q in q_lens], jnp.int32)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
  I = mra.max_items(T, len(q_lens), G, tiles=tiles)
  items, _, item_cu = mra.work_items(cu, kv_lens, per_item=per, num_items=I)
  n = mra.max_clusters(T, I, G, C)
  member, spans, idx = map(np.asarray, mra.cluster_items(items, item_cu, cluster=C,
                                                         num_clusters=n))
  items, item_cu = np.asarray(items), np.asarray(item_cu)
  counts = np.diff(item_cu)
  want = [i for b in range(len(q_lens)) if counts[b] >= 2
          for i in range(item_cu[b], item_cu[b + 1])]
  assert sorted(idx[idx >= 0].tolist()) == want
  assert -(-sum(counts[counts >= 2]) // C) <= n
  for c in range(n):
    held = idx[c * C:(c + 1) * C]
    live = held[held >= 0]
    assert (np.diff(live) == 1).all() and (held[:len(live)] == live).all()
    for m, i in enumerate(held):
      assert (member[c * C + m] == items[i]).all() if i >= 0 else member[c * C + m, 2] == 0
    if len(live):
      assert spans[c].tolist() == [items[live[0], 0], items[live[0], 1], items[live[-1], 2]]
    else:
      assert not spans[c].any()


if mpa.available() is None:

  def test_each_launch_of_a_clustered_step_gathers_its_own_items_only(monkeypatch):
    """cluster=True: the wide launch enumerates only the sequences left out
    of clusters (at most 2 wide items each), not the step's every item, and
    the clustered launch gathers each member's rows once, at its item."""
    calls = []

    def launch(rows, k_pages, v_pages, items, *args, num_splits, **kw):
      calls.append((np.asarray(rows, np.float32), np.asarray(items)))
      shape = (num_splits, *rows.shape)
      return jnp.zeros(shape, rows.dtype), jnp.zeros(shape[:-1], jnp.float32)
    monkeypatch.setattr(mwa, "launch", launch)
    N, K, D, ps, pps, q_lens, kv_lens, pad, _ = CASES[5]  # 150 and 20 tokens cluster, 1 not
    q, kp, vp, kl, table, cu = _inputs(np.random.default_rng(0), N, K, D, ps, pps, q_lens,
                                       kv_lens, pad)
    mra.mosaic_ragged_attention(q, kp, vp, kl, table, cu, max_q=150, wide=True, cluster=True,
                                interpret=True)
    (rows, items), (c_rows, members) = calls
    assert len(items) == 3 * 2 < mra.max_items(q.shape[0], 3, N // K, True)
    assert items.tolist() == [[1, 49, 50]] + [[0, 0, 0]] * 5
    assert rows[0, 0, :N // K].any() and not rows[0, 0, N // K:].any() and not rows[1:].any()
    live = members[:, 2] > 0
    assert live.sum() == 10 + 2  # the 150-token chunk's items of 16 tokens, the 20-token one's
    assert all(c_rows[m].any() for m in np.flatnonzero(live)) and not c_rows[~live].any()
    first = int(np.flatnonzero(live)[0])  # the chunk's first item: its first 16 tokens
    np.testing.assert_array_equal(c_rows[first, 0].reshape(16, N // K, D),
                                  np.asarray(q[:16], np.float32).reshape(16, N // K, D))

  class TestMosaicRagged:
    interpret = True

    @pytest.mark.parametrize("case,variant", VARIANTS)
    def test_matches_reference(self, case, variant):
      N, K, D, ps, pps, q_lens, kv_lens, pad, extra = CASES[case]
      extra = dict(extra, wide=variant != "plain", cluster=variant == "cluster")
      rng = np.random.default_rng(case)
      layers = 3 if extra.pop("layered", False) else 0
      q, kp, vp, kl, table, cu = _inputs(rng, N, K, D, ps, pps, q_lens, kv_lens, pad, layers)
      sinks = jnp.asarray(rng.normal(size=(N,)), jnp.float32) if extra.pop("sinks", 0) else None
      max_q = max(q_lens)
      layer = jnp.int32(1) if layers else None
      out = jax.jit(lambda q, kp, vp, kl, table, cu, layer: mra.mosaic_ragged_attention(
          q, kp, vp, kl, table, cu, max_q=max_q, sinks=sinks, layer=layer,
          interpret=self.interpret, **extra))(q, kp, vp, kl, table, cu, layer)
      f32 = lambda x: x.astype(jnp.float32)
      kp1, vp1 = (kp[1], vp[1]) if layers else (kp, vp)
      ref = pk.ragged_paged_attention_reference(f32(q), f32(kp1), f32(vp1), kl, table, cu,
                                                max_q=max_q, sinks=sinks,
                                                window=extra.get("window", 0))
      assert out.shape == q.shape and out.dtype == q.dtype
      assert _rel(out, ref) <= 2e-2
      if pad:
        assert not np.asarray(out[-pad:], np.float32).any()

    @pytest.mark.parametrize("change,exc,match", [
        (dict(dtype=jnp.float32), TypeError, "bfloat16 or float16"),
        (dict(D=80), ValueError, "multiple of 64"),
        (dict(N=130, K=1), ValueError, "130 > 64 rows"),
        (dict(cu=3), ValueError, "cu_q_lens"),
        (dict(max_q=0), ValueError, "max_q"),
        (dict(num_splits=0), ValueError, "num_splits"),
        (dict(wide=1), TypeError, "wide must be a bool"),
        (dict(wide=True, cluster=1), TypeError, "cluster must be a bool"),
        (dict(cluster=True), ValueError, "cluster=True clusters wide items: pass wide=True"),
    ])
    def test_bad_inputs_are_named(self, change, exc, match):
      dims = dict(N=4, K=2, D=64, dtype=jnp.bfloat16, cu=2, max_q=2)
      kw = {k: change.pop(k) for k in ("num_splits", "wide", "cluster", "slots") if k in change}
      dims.update(change)
      q = jnp.zeros((3, dims["N"], dims["D"]), dims["dtype"])
      pages = jnp.zeros((dims["K"], 4, 16, dims["D"]), dims["dtype"])
      with pytest.raises(exc, match=f"mosaic_ragged_attention: .*{match}"):
        mra.mosaic_ragged_attention(q, pages, pages, jnp.ones((1,), jnp.int32),
                                    jnp.zeros((1, 4), jnp.int32),
                                    jnp.arange(dims["cu"], dtype=jnp.int32),
                                    max_q=dims["max_q"], interpret=True, **kw)

  if ON_GPU:

    class TestMosaicRaggedGpu(TestMosaicRagged):
      interpret = False

  GATE = [c for c in gpu_cases.CASES
          if c.kernel == "ragged" and c.D == c.Dv and not c.kv_dtype and "h100" in c.gpus]

  def _planned_keys(case, wide=False, tiles=None, together=1):
    """Keys the kernel's blocks read for the case's step (the prefill chunk
    at the end of its context, the rest decode), and the minimum (each KV
    byte once per KV head); together: items sharing each read (a cluster)."""
    G = case.N // case.K
    per = mra.tokens_per_item(G, wide, tiles=tiles) * together
    keys = case.ps * mpa.pages_per_block(case.ps)
    blocks = lambda end: -(-end // keys) * keys
    chunk = case.prefill_tokens
    start = case.ctx - chunk
    prefill = sum(blocks(start + min(chunk, (j + 1) * per)) for j in range(-(-chunk // per)))
    return (case.B - 1) * blocks(case.ctx) + prefill, case.B * case.ctx

  @pytest.mark.parametrize("case", GATE, ids=lambda c: c.name)
  def test_gate_mixed_steps_compile_on_mosaic(case):
    """Every unquantized GQA mixed-step case of the H100 gate (`gpu_cases`:
    a 512+-token chunk beside decode rows, 32k-page stacked pools) compiles
    on the Mosaic kernel within Hopper's shared memory. Planned HBM bytes:
    decode rows read each KV byte once per KV head; the chunk's items each
    stream the keys up to their last query (FlashAttention's query blocks of
    64 // G tokens), and the test pins that sum. Wide items (128 // G tokens
    on two warpgroups) compile too, within shared memory, and read the
    chunk's KV about half as often; items of 4 tiles in clusters of 8
    (multicast) compile too and read it about a sixteenth as often as wide
    items."""
    c = case
    build = lambda sharding, **v: gpu_cases.build_mosaic_ragged(c, sharding, **v)
    kernels = {name: mosaic_kernels_for_h100(build, **variant)
               for name, variant in (("plain", {}), ("wide", dict(wide=True)),
                                     ("cluster", dict(wide=True, cluster=True)))}
    # ptxas's figures per kernel built: the clustered step is two launches, wide items
    # for the sequences left out of clusters (a grid of their items only: a build of
    # its own, 147 registers at Qwen3-MoE's case) and clustered ones for the chunk, whose
    # 4 warpgroups share the register file (128 a thread), spilling at most a few.
    assert [len(k) for k in kernels.values()][:2] == [1, 1], kernels
    assert 1 <= len(kernels["cluster"]) <= 2, kernels
    for k in sum(kernels.values(), []):
      assert 0 < k["registers"] <= 255 and k["spill_store_bytes"] <= 256, (c.name, kernels)
    assert min(k["registers"] for k in kernels["cluster"]) <= 128, kernels
    assert mpa.smem_bytes(c.D, c.ps, 2) <= mpa.SMEM_BYTES
    planned, minimum = _planned_keys(c)
    decode_only = (c.B - 1) * -(-c.ctx // 64) * 64
    assert decode_only <= 1.1 * (c.B - 1) * c.ctx
    assert minimum < planned <= minimum * (1 + c.prefill_tokens // mra.tokens_per_item(
        c.N // c.K) / c.B), planned / minimum
    assert mwa.smem_bytes(c.D, c.ps, 2) <= mpa.SMEM_BYTES
    wide, _ = _planned_keys(c, wide=True)
    assert minimum < wide and (wide - minimum) <= 0.55 * (planned - minimum), (wide, planned)
    assert mwa.smem_bytes(c.D, c.ps, 2, tiles=mwa.CLUSTER_TILES) <= mpa.SMEM_BYTES
    clustered, _ = _planned_keys(c, tiles=mwa.CLUSTER_TILES, together=mra.CLUSTER)
    assert minimum <= clustered, (clustered, minimum)
    assert clustered - minimum <= (wide - minimum) / 14, (clustered, wide)

else:

  def test_older_jax_gets_a_named_error():
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    pages = jnp.zeros((2, 4, 16, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=r"jax >= 0.11 needed"):
      mra.mosaic_ragged_attention(q, pages, pages, jnp.full((1,), 2, jnp.int32),
                                  jnp.zeros((1, 4), jnp.int32), jnp.asarray([0, 2], jnp.int32),
                                  max_q=2)
