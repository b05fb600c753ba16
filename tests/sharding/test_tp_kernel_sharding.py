"""Paged attention under head-splitting layouts (tp, tp_attn_ep) runs per
device in shard_map (`PagedContext.mesh` / `head_axis`): compiled for H100s,
the step holds the Triton kernel and no all-gather of the page pool (GSPMD
cannot split the kernel's custom call, so without shard_map XLA gathers the
whole pool around it in every layer); on the 8-CPU-device mesh the Pallas
kernel (interpret mode) gives the single-device XLA engine's greedy tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchlib import gpu_plan
from jaxinfer import (Backend, Engine, EngineConfig, SamplingParams, gpu_compile, models, presets,
                      sharding)
from jaxinfer.engine import steps
from jaxinfer.models.moe_ep import plan_from_params


def _compiled_step(name, axes, layout, split_heads):
  """steps.step for 4 decode sequences compiled for compile-only H100s ->
  (HLO text, the pool's full shapes)."""
  cfg = gpu_plan.gpu_config(presets.get(name), "bfloat16")
  mesh = gpu_compile.mesh(axes)
  params = gpu_plan.abstract_params(cfg, mesh, layout)
  pool = gpu_plan.abstract_pool(cfg, mesh, layout, pages_per_rank=65, page_size=16)
  batch, shapes = gpu_plan.host_batch([(1, 64)] * 4, 16, 4, 4)
  prev = jax.ShapeDtypeStruct((1, shapes.seqs), jnp.int32)  # one rank
  heads = dict(mesh=mesh, head_axis=sharding.head_axis(mesh, layout)) if split_heads else {}
  with gpu_compile.lowering(mesh):
    lowered = steps.step.lower(
        steps.StepModel(cfg, params, plan_from_params(params), heads=heads),
        steps.StepState(pool, gpu_plan._load(cfg, mesh)),
        steps.StepInputs(gpu_plan._replicated(mesh, steps.stack_batches([batch])),
                         gpu_plan._replicated(mesh, prev)),
        steps.Program(steps.Plain(), max_q=shapes.max_q, greedy=True))
  return lowered.compile().as_text(), {a.shape for a in jax.tree.leaves(pool)}


def _pool_gathers(hlo, pool_shapes):
  """All-gathers in HLO text that produce a whole (layer-stacked) pool."""
  dims = ["[" + ",".join(map(str, s)) + "]" for s in pool_shapes]
  return sum(1 for line in hlo.splitlines()
             if ("all-gather-start(" in line or " all-gather(" in line)
             and any(d in line for d in dims))


CASES = [("tiny_dense", {"data": 2, "tensor": 2}, "tp"),  # GQA: pool split over KV heads
         ("tiny_moe", {"tensor": 2}, "tp"),  # MLA: q heads split, latent pool replicated
         ("tiny_dense", {"tensor": 2, "expert": 2}, "tp_attn_ep")]


@pytest.mark.parametrize("name,axes,layout", CASES)
def test_tp_step_runs_the_kernel_without_gathering_the_pool(name, axes, layout):
  hlo, pool_shapes = _compiled_step(name, axes, layout, split_heads=True)
  assert gpu_plan.TRITON_CALL in hlo
  assert gpu_plan.kernel_gathers(hlo, pool_shapes) == 0
  assert _pool_gathers(hlo, pool_shapes) == 0


def test_without_the_head_split_xla_gathers_the_pool():
  # The check above sees the gather this change removes.
  hlo, pool_shapes = _compiled_step("tiny_dense", {"data": 2, "tensor": 2}, "tp",
                                    split_heads=False)
  assert gpu_plan.kernel_gathers(hlo, pool_shapes) > 0 and _pool_gathers(hlo, pool_shapes) > 0


def test_head_axis_follows_the_layout():
  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  assert sharding.head_axis(mesh, "tp") == "tensor"
  mesh = sharding.make_mesh({"tensor": 4, "expert": 2})
  assert sharding.head_axis(mesh, "tp_attn_ep") == "tensor"
  assert sharding.head_axis(sharding.make_mesh({"data": 2, "expert": 4}), "dp_attn_ep") is None
  assert sharding.head_axis(sharding.make_mesh({"data": 8, "tensor": 1}), "tp") is None


@pytest.mark.parametrize("cfg,axes", [
    # GQA (2 q heads per KV head on each of 4 devices) with sinks and a
    # sliding-window layer (prompts run past the window).
    (presets.get("tiny_dense", num_heads=8, num_kv_heads=4, head_dim=16, num_layers=2,
                 attention_sinks=True, sliding_window=8,
                 layer_types=("sliding_attention", "full_attention")),
     {"data": 2, "tensor": 4}),
    (presets.get("tiny_moe", num_heads=8, num_kv_heads=8, num_layers=2), {"data": 2,
                                                                         "tensor": 4}),
], ids=["gqa_sinks_window", "mla"])
def test_tp_pallas_engine_greedy_equals_single_device_xla(cfg, axes):
  cfg = dataclasses.replace(cfg, dtype="float32")
  params = models.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (3, 11)]
  config = EngineConfig(page_size=8, num_pages=32, max_num_batched_tokens=32)
  sp = SamplingParams(max_tokens=4)
  ref = [o.token_ids for o in Engine(cfg, params, config).generate(prompts, sp)]
  pallas = dataclasses.replace(cfg, backend=Backend(attention="pallas"))
  eng = Engine(pallas, params, config, mesh=sharding.make_mesh(axes), layout="tp")
  assert eng._model.head_kw["head_axis"] == "tensor"
  assert [o.token_ids for o in eng.generate(prompts, sp)] == ref
