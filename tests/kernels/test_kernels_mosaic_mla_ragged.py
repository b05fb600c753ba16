"""DeepSeek MLA's mixed steps on the Mosaic GPU MLA kernel
(`mosaic_mla_ragged`): parity with the float32 reference in Mosaic GPU's
interpret mode on CPU (jax >= 0.11; `TestMosaicMlaRaggedGpu` runs the same
cases compiled where a GPU is present), named errors, the H100 compile of
the gate's MLA mixed case with ptxas's registers and spills, and its
planned HBM bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchlib import gpu_cases, kernel_report, traffic
from conftest import (ON_GPU, assert_greedy_is_f32_argmax, kernel_rel_err as _rel,
                      mosaic_kernels_for_h100)
from jaxinfer import Backend, Engine, EngineConfig, SamplingParams, models, ops, presets
from pallas_kernels import mosaic_mla_attention as mma
from pallas_kernels import mosaic_mla_ragged as mmr
from pallas_kernels import mosaic_paged_attention as mpa

CASES = [  # N, R, Hr, ps, pps, q_lens, kv_lens, pad tokens, cluster, splits(, kernel kwargs)
    # 16 heads (DeepSeek under TP 8): items of 4 tokens, one 64-row block each; a 40-token
    # chunk beside decodes, a fresh 5-token prompt and padding tokens
    (16, 64, 32, 16, 8, [40, 1, 5, 1], [100, 33, 5, 64], 2, False, 1),
    # the same step clustered: the 40-token chunk on items of 32 tokens (8 blocks, one
    # cluster each), the 5-token prompt (two items of 4) and decodes on their own; split-K
    (16, 64, 32, 16, 8, [40, 1, 5, 1], [100, 33, 5, 64], 2, True, 2),
    # 128 heads: a decode token is 2 blocks (one cluster), the 6-token chunk items of 4
    # tokens (8 blocks); pages of 32 are one 32-key step
    (128, 64, 32, 32, 4, [6, 1], [70, 40], 1, True, 1),
    # 64 keys a step (4 pages of 16): items' causal ends inside a step, split-K
    (16, 128, 64, 16, 8, [40, 1, 5, 1], [100, 33, 5, 64], 2, False, 2, dict(block_keys=64)),
    # each warpgroup half of S's dot (`mosaic_mla_attention`'s split_scores)
    (16, 64, 32, 16, 8, [40, 1, 5, 1], [100, 33, 5, 64], 2, False, 2, dict(split_scores=True)),
]


def _inputs(rng, N, R, Hr, ps, pps, q_lens, kv_lens, pad):
  B, T, P = len(q_lens), sum(q_lens) + pad, len(q_lens) * pps + 1
  q = jnp.asarray(rng.normal(size=(T, N, R + Hr)), jnp.bfloat16)
  pages = jnp.asarray(rng.normal(size=(P, ps, R + Hr)), jnp.bfloat16)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
  table = jnp.asarray(rng.permutation(P)[:B * pps].reshape(B, pps), jnp.int32)
  return q, pages, jnp.asarray(kv_lens, jnp.int32), table, cu


def test_items_and_blocks():
  """Items of whole tokens fill one 64-row block (cluster: 8); a token of
  more than 64 heads spans several blocks."""
  assert [mmr.tokens_per_item(n) for n in (16, 40, 128)] == [4, 1, 1]
  assert [mmr.row_blocks(n) for n in (16, 40, 128)] == [1, 1, 2]
  assert [mmr.tokens_per_item(n, True) for n in (16, 40, 128)] == [32, 12, 4]
  assert [mmr.row_blocks(n, True) for n in (16, 40, 128)] == [8, 8, 8]


def test_a_launch_of_kept_sequences_holds_their_items_only():
  """keep: the clustered step's launch of short sequences enumerates only
  theirs (one item each, so B items suffice), each at its own first token;
  the long sequences' tokens get none (not a row gathered for them)."""
  from pallas_kernels import mosaic_ragged_attention as mra
  cu = jnp.asarray([0, 40, 41, 46, 47], jnp.int32)  # a 40-token chunk, a decode, 5, a decode
  kv_lens = jnp.asarray([100, 33, 5, 64], jnp.int32)
  keep = (cu[1:] - cu[:-1]) <= 4
  items, first, item_cu = mra.work_items(cu, kv_lens, per_item=4, num_items=4, keep=keep)
  np.testing.assert_array_equal(items, [[1, 32, 33], [3, 63, 64], [0, 0, 0], [0, 0, 0]])
  np.testing.assert_array_equal(first[:2], [40, 46])
  np.testing.assert_array_equal(item_cu, [0, 0, 1, 1, 2])
  # Without keep, the chunk's 10 items and the 5-token prompt's 2 come first.
  items, _, item_cu = mra.work_items(cu, kv_lens, per_item=4, num_items=14)
  np.testing.assert_array_equal(item_cu, [0, 10, 11, 13, 14])
  assert items[10].tolist() == [1, 32, 33] and items[13].tolist() == [3, 63, 64]


def test_gate_case_planned_bytes():
  """The gate's MLA mixed case (a 512-token chunk at the end of 8k keys
  beside 31 decodes, 128 heads): every decode reads its latent once (2
  blocks, one cluster), the chunk's 128 items of 4 tokens each read up to
  their last token, so 4.85x the minimum latent bytes (22x on the padded
  verify layout), at 744 flops a planned byte: compute-bound on Hopper
  (989 dense bf16 TFLOP/s over 3.35 TB/s: 295)."""
  row = kernel_report.mosaic_report(gpu_cases.get("dsv3_mla_mixed_512p_31d"))
  items = row["items"]
  seqs = kernel_report.case_sequences(gpu_cases.get("dsv3_mla_mixed_512p_31d"))
  keys = 31 * 8192 + sum(-(-(7680 + 4 * (j + 1)) // 32) * 32 for j in range(128))
  assert items["kv_over_minimum"] == keys / (32 * 8192)
  assert 4.8 < items["kv_over_minimum"] < 4.9 and items["programs"] == 31 * 2 + 128 * 8
  padded = traffic.mosaic_traffic(seqs, N=128, K=1, D=576, Dv=512, ps=64, latent=True,
                                  cluster=True)
  assert padded.planned["kv"] > 4 * items["kv_over_minimum"] * padded.minimum["kv"]
  assert items["flops_per_byte"] > 700 and items["smem_bytes"] <= mpa.SMEM_BYTES


if mpa.available() is None:

  class TestMosaicMlaRagged:
    interpret = True

    @pytest.mark.parametrize("case", range(len(CASES)))
    def test_matches_reference(self, case):
      N, R, Hr, ps, pps, q_lens, kv_lens, pad, cluster, splits, *kw = CASES[case]
      q, pages, kl, table, cu = _inputs(np.random.default_rng(case), N, R, Hr, ps, pps, q_lens,
                                        kv_lens, pad)
      scale, max_q = (R + Hr) ** -0.5, max(q_lens)
      # Eagerly: interpreted inside a jitted program the clustered launches stall
      # (`mosaic_mla_ragged`'s docstring); compiled, jit.
      call = lambda q, pages, kl, table, cu: mmr.mosaic_mla_ragged_attention(
          q[..., :R], q[..., R:], pages, kl, table, cu, max_q=max_q, sm_scale=scale,
          num_splits=splits, cluster=cluster, interpret=self.interpret, **(kw or [{}])[0])
      out = (call if self.interpret else jax.jit(call))(q, pages, kl, table, cu)
      ref = mmr.mosaic_mla_ragged_attention_reference(q[..., :R], q[..., R:], pages, kl, table,
                                                      cu, max_q=max_q, sm_scale=scale)
      assert out.shape == (q.shape[0], N, R) and out.dtype == q.dtype
      assert _rel(out, ref) <= 2e-2
      if pad:
        assert not np.asarray(out[-pad:], np.float32).any()

    @pytest.mark.parametrize("change,exc,match", [
        (dict(ndim=4), ValueError, r"q_latent must be \[T, N, R\]"),
        (dict(R=96), ValueError, "multiple of 64"),
        (dict(cu=3), ValueError, "cu_q_lens"),
        (dict(max_q=0), ValueError, "max_q"),
        (dict(num_splits=0), ValueError, "num_splits"),
        (dict(cluster=1), TypeError, "cluster must be a bool"),
    ])
    def test_bad_inputs_are_named(self, change, exc, match):
      dims = dict(N=4, R=64, ndim=3, cu=2, max_q=2, num_splits=1, cluster=False)
      dims.update(change)
      q = jnp.zeros((3, dims["N"], dims["R"] + 32), jnp.bfloat16)
      if dims["ndim"] == 4:
        q = q[None]
      pages = jnp.zeros((4, 16, dims["R"] + 32), jnp.bfloat16)
      with pytest.raises(exc, match=f"mosaic_mla_ragged_attention: .*({match})"):
        mmr.mosaic_mla_ragged_attention(
            q[..., :dims["R"]], q[..., dims["R"]:], pages, jnp.full((1,), 3, jnp.int32),
            jnp.zeros((1, 4), jnp.int32), jnp.asarray([0, 3, 3][:dims["cu"]], jnp.int32),
            max_q=dims["max_q"], sm_scale=0.1, num_splits=dims["num_splits"],
            cluster=dims["cluster"], interpret=True)

  if ON_GPU:

    class TestMosaicMlaRaggedGpu(TestMosaicMlaRagged):
      interpret = False

  def test_engine_prompt_steps_run_on_the_items(monkeypatch):
    """Backend(attention="mosaic", trials=("mla_items",)) (CPU: interpreted):
    the DeepSeek-style model's prompt steps (a 21-token prompt beside a
    3-token one: one cluster of 8 blocks, and a short item) reach the items
    kernel (interpreted: its unclustered items, `ops._ragged_mosaic_mla_items`)
    and `Engine.stats()` names it; every greedy token is the argmax of a
    float32 full forward up to bfloat16 rounding of the logits."""
    max_qs = []
    real = ops._ragged_mosaic_mla_items
    monkeypatch.setattr(ops, "_ragged_mosaic_mla_items",
                        lambda *a: max_qs.append(a[-1]) or real(*a))
    cfg = presets.get("tiny_moe", dtype="bfloat16", num_layers=2, qk_rope_head_dim=32,
                      backend=Backend(attention="mosaic", trials=("mla_items",)))
    params = models.init_params(cfg, jax.random.key(0))
    prompts = [[5, 17, 99], list(range(40, 61))]
    eng = Engine(cfg, params, EngineConfig(page_size=16, num_pages=16, max_num_seqs=2,
                                           max_num_batched_tokens=32))
    assert eng.stats()["kernels"]["mixed"] == "mosaic_mla_items"
    outs = eng.generate(prompts, SamplingParams(max_tokens=4))
    assert max_qs and max(max_qs) >= 21, max_qs
    assert_greedy_is_f32_argmax(cfg, params, prompts, outs)

  def test_gate_mixed_step_compiles_for_h100():
    """The gate's MLA mixed case compiles for H100 on the items, plain and
    clustered (two launches: decodes, then the chunk's clusters of 8
    blocks), within shared memory; ptxas: every kernel built fits the
    registers (255 a thread) without spilling."""
    case = gpu_cases.get("dsv3_mla_mixed_512p_31d")
    build = lambda sharding, **v: gpu_cases.build_mosaic_mla_ragged(case, sharding, **v)
    kernels = {c: mosaic_kernels_for_h100(build, cluster=c) for c in (False, True)}
    assert kernels[False] and kernels[True], kernels
    # Measured (jax 0.12): 238 registers, no spills. A warpgroup's [64, 256] float32
    # accumulator is 128 registers; before P V accumulated in place (a second one for
    # the product), 255 registers and 908-1000 bytes of spill stores a thread.
    for k in sum(kernels.values(), []):
      assert 0 < k["registers"] <= 255 and k["spill_store_bytes"] == 0, kernels
    assert mma.smem_bytes(case.D, case.Dv, 2) <= mpa.SMEM_BYTES

else:

  def test_older_jax_gets_a_named_error():
    q = jnp.zeros((2, 4, 96), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=r"jax >= 0.11 needed"):
      mmr.mosaic_mla_ragged_attention(q[..., :64], q[..., 64:], jnp.zeros((4, 16, 96), q.dtype),
                                      jnp.full((1,), 2, jnp.int32), jnp.zeros((1, 4), jnp.int32),
                                      jnp.asarray([0, 2], jnp.int32), max_q=2, sm_scale=0.1)
