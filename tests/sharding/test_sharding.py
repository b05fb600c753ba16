"""Sharded models on 8 simulated CPU devices equal the single-device results."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxinfer import Engine, EngineConfig, SamplingParams, models, presets, sharding
from jaxinfer.models import moe_ep

# A dense GQA model, a GQA-MoE (8 experts), and MLA-MoE models with 16 and 64
# experts: several experts per rank, uneven routing. 8 KV heads divide every
# tensor axis used below.
MODELS = {
    "dense": presets.get("tiny_dense", num_heads=8, num_kv_heads=8, head_dim=16),
    "gqa_moe8": dataclasses.replace(
        presets.get("tiny_dense", num_heads=16, num_kv_heads=8, head_dim=16, model_type="qwen3_moe"),
        qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_ffn_dim=64, dense_layers=(1,)),
    "mla_moe16": presets.get("tiny_moe", num_experts=16, n_group=4, topk_group=2, num_heads=8,
                             num_kv_heads=8, num_layers=3),
    "mla_moe64": presets.get("tiny_moe", num_experts=64, num_experts_per_tok=6, n_group=8,
                             topk_group=4, moe_ffn_dim=32, num_layers=2, num_heads=8,
                             num_kv_heads=8),
}
MESHES = {  # "AxB" shapes per layout's axis pair
    "tp": [{"data": 8, "tensor": 1}, {"data": 2, "tensor": 4}, {"data": 1, "tensor": 8}],
    "dp_attn_ep": [{"data": 2, "expert": 4}, {"data": 4, "expert": 2}, {"data": 1, "expert": 8}],
    "tp_attn_ep": [{"tensor": 2, "expert": 4}, {"tensor": 4, "expert": 2}],
}


def _rel(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def models_and_refs():
  out = {}
  for name, cfg in MODELS.items():
    cfg = dataclasses.replace(cfg, dtype="float32")
    params = models.init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 13)).astype(np.int32)
    out[name] = (cfg, params, tokens, np.asarray(models.logits(cfg, params, tokens)))
  return out


@pytest.mark.parametrize("layout", sorted(MESHES))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_equal_single_device(models_and_refs, name, layout):
  cfg, params, tokens, ref = models_and_refs[name]
  for axes in MESHES[layout]:
    mesh = sharding.make_mesh(axes)
    sharded = sharding.shard_params(cfg, params, mesh, layout)
    assert _rel(models.logits(cfg, sharded, tokens), ref) < 1e-5, axes


@pytest.mark.parametrize("strategy", ["all_to_all", "replicated"])
def test_both_ep_strategies_match(models_and_refs, strategy, monkeypatch):
  cfg, params, tokens, ref = models_and_refs["mla_moe64"]
  mesh = sharding.make_mesh({"data": 2, "expert": 4})
  sharded = sharding.shard_params(cfg, params, mesh, "dp_attn_ep")
  plan = dataclasses.replace(moe_ep.plan_from_params(sharded), strategy=strategy)
  assert plan.axes == ("data", "expert") and plan.size == 8
  out = models.transformer._logits(cfg, sharded, tokens, plan)
  assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("strategy", ["all_to_all", "ragged"])
def test_all_to_all_drops_no_token_when_all_route_to_one_expert(models_and_refs, strategy):
  cfg, params, tokens, _ = models_and_refs["mla_moe16"]
  # A huge selection bias on expert 5: every token sends a copy to rank 2
  # (capacity: the most rounds; ragged: the fullest receive buffer).
  seg = params["layers"][1]
  biased = dict(params, layers=(params["layers"][0], dict(seg, mlp=dict(
      seg["mlp"], score_bias=seg["mlp"]["score_bias"].at[:, 5].set(100.0)))))
  ref = models.logits(dataclasses.replace(cfg, moe_impl="dense"), biased, tokens)
  mesh = sharding.make_mesh({"expert": 8})
  sharded = sharding.shard_params(cfg, biased, mesh, "dp_attn_ep")
  plan = dataclasses.replace(moe_ep.plan_from_params(sharded), strategy=strategy)
  assert _rel(models.transformer._logits(cfg, sharded, tokens, plan), ref) < 1e-5


@pytest.mark.parametrize("name,layout,axes", [
    ("dense", "tp", {"data": 2, "tensor": 4}),
    ("mla_moe16", "dp_attn_ep", {"data": 2, "expert": 4}),
    ("gqa_moe8", "tp_attn_ep", {"tensor": 4, "expert": 2}),
])
def test_engine_greedy_identical_on_mesh(models_and_refs, name, layout, axes):
  cfg, params, _, _ = models_and_refs[name]
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (1, 20)]
  config = EngineConfig(page_size=8, num_pages=64, max_num_batched_tokens=64)
  ref = [o.token_ids for o in Engine(cfg, params, config).generate(prompts, SamplingParams(max_tokens=6))]
  eng = Engine(cfg, params, config, mesh=sharding.make_mesh(axes), layout=layout)
  assert [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=6))] == ref


def test_params_are_created_sharded():
  cfg = MODELS["mla_moe64"]
  mesh = sharding.make_mesh({"data": 2, "expert": 4})
  params = sharding.init_params(cfg, jax.random.key(0), mesh, "dp_attn_ep")
  w = params["layers"][1]["mlp"]["w_gate"]  # [L, E=64, D, F]
  assert w.sharding.spec[1] == ("data", "expert")
  assert w.addressable_shards[0].data.shape[1] == 8  # 64 experts / 8 ranks


def test_layout_values_give_each_named_layouts_rules():
  """The named layouts' tables, written out per mesh (what the string branches
  gave), and a Layout value of one's own placed the same way."""
  mesh = sharding.make_mesh({"expert": 2, "data": 2, "tensor": 2})
  every = ("expert", "data", "tensor")  # the mesh's order
  assert sharding.rules("tp", mesh) == dict(q_heads="tensor", kv_heads="tensor", mlp="tensor",
                                            vocab="tensor", expert=None, batch="data")
  assert sharding.rules("dp_attn_ep", mesh) == dict(q_heads=None, kv_heads=None, mlp=None,
                                                    vocab=None, expert=every, batch=every)
  assert sharding.rules(sharding.TP_ATTN_EP, mesh) == dict(
      q_heads="tensor", kv_heads="tensor", mlp=None, vocab=None, expert=every, batch="data")
  two = sharding.make_mesh({"data": 8})
  assert sharding.rules("dp_attn_ep", two)["expert"] == "data"  # one axis: not a tuple
  assert sharding.rules("tp", two)["q_heads"] is None  # no tensor axis: replicated
  assert sharding.dp_axes(mesh, "dp_attn_ep") == every and sharding.dp_axes(mesh, "tp") == ()
  # A layout of one's own: experts over "expert" only, batch over data, no attention DP.
  mine = sharding.Layout("ep_only", expert=("expert",), batch=("data",))
  assert sharding.rules(mine, mesh)["expert"] == "expert" and not sharding.dp_axes(mesh, mine)
  assert sharding.as_layout("tp") is sharding.TP and sharding.as_layout(mine) is mine
  assert str(sharding.DP_ATTN_EP) == "dp_attn_ep"
  cfg = presets.get("tiny_moe")
  spec = sharding.param_shardings(cfg, mesh, mine)["layers"][-1]["mlp"]["w_gate"].spec
  assert spec[1] == "expert" and "tensor" not in jax.tree.leaves(tuple(spec))


def test_bad_meshes_name_axis_and_dimension():
  with pytest.raises(ValueError, match=r"multiply to 6, but there are 8 devices"):
    sharding.make_mesh({"data": 2, "tensor": 3})
  with pytest.raises(ValueError, match="unknown axis names"):
    sharding.make_mesh({"pipeline": 8})
  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  with pytest.raises(ValueError, match=r"kv_heads=2\) is not divisible by mesh axis tensor \(size 4\)"):
    sharding.shard_params(presets.get("tiny_dense"), None, mesh, "tp")
  mesh = sharding.make_mesh({"expert": 8})
  with pytest.raises(ValueError, match=r"expert=4\) is not divisible by mesh axis expert \(size 8\)"):
    sharding.param_shardings(presets.get("tiny_moe", num_experts=4, n_group=1, topk_group=1),
                             mesh, "dp_attn_ep")
  with pytest.raises(ValueError, match="unknown layout"):
    sharding.rules("pp", mesh)
  with pytest.raises(ValueError, match="mesh and layout together"):
    Engine(MODELS["dense"], None, mesh=mesh)


def test_attention_dp_engine_balances_by_tokens_and_matches(models_and_refs):
  cfg, params, _, _ = models_and_refs["mla_moe16"]
  mesh = sharding.make_mesh({"data": 2, "expert": 4})
  rng = np.random.default_rng(3)
  # One long prompt first, then short ones: balancing by tokens keeps the long
  # one's rank free of others (counting requests would not).
  prompts = [rng.integers(0, cfg.vocab_size, 120).tolist()] + [
      rng.integers(0, cfg.vocab_size, 4).tolist() for _ in range(10)]
  config = EngineConfig(page_size=8, num_pages=40, max_num_batched_tokens=64)
  eng = Engine(cfg, params, config, mesh=mesh, layout="dp_attn_ep")
  assert eng.num_ranks == 8
  outs = eng.generate(prompts, SamplingParams(max_tokens=4))
  stats = eng.stats()
  long_rank = eng.core.requests[outs[0].request_id].rank
  counts = stats["requests_per_rank"]
  others = [c for r, c in enumerate(counts) if r != long_rank]
  assert counts[long_rank] == 1  # by request count it would have taken a second
  assert sum(others) == 10 and max(others) - min(others) <= 1
  ref = Engine(cfg, params, config).generate(prompts, SamplingParams(max_tokens=4))
  assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
  for a in eng.allocators:
    a.check_consistency()
  assert stats["kv_pages_used"] == 0


def test_attention_dp_idle_ranks_step_without_hanging(models_and_refs):
  cfg, params, _, _ = models_and_refs["dense"]
  eng = Engine(cfg, params, EngineConfig(page_size=8, num_pages=16),
               mesh=sharding.make_mesh({"data": 8}), layout="dp_attn_ep")
  prompt = [1, 2, 3, 4, 5]
  out = eng.generate([prompt], SamplingParams(max_tokens=5))[0]  # 7 of 8 ranks idle
  ref = Engine(cfg, params, EngineConfig(page_size=8, num_pages=16)).generate(
      [prompt], SamplingParams(max_tokens=5))[0]
  assert out.token_ids == ref.token_ids and eng.stats()["steps"] == 5


@pytest.mark.parametrize("strategy", ["all_to_all", "replicated", "ragged"])
def test_padded_rows_are_never_dispatched(models_and_refs, strategy):
  import jax.numpy as jnp
  cfg, params, _, _ = models_and_refs["mla_moe16"]
  mesh = sharding.make_mesh({"expert": 8})
  sharded = sharding.shard_params(cfg, params, mesh, "dp_attn_ep")
  plan = dataclasses.replace(moe_ep.plan_from_params(sharded), strategy=strategy)
  p = sharded["layers"][1]["mlp"]
  p0 = jax.tree.map(lambda a: a[0], p)  # first MoE layer
  x = jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model))
  valid = jnp.arange(32).reshape(2, 16) % 3 != 0
  from jaxinfer.models import moe as moe_lib
  moe = jax.jit(moe_lib.moe, static_argnums=(0, 3), static_argnames="count")  # eager ragged: minutes
  out = moe(cfg, p0, x, plan, valid=valid)[0]
  full = moe(cfg, p0, x, plan)[0]
  shared = moe_lib.mlp(cfg, p0["shared"], x)
  # Valid rows are unaffected; padded rows get nothing from the routed experts.
  assert _rel(out[valid], full[valid]) < 1e-5
  assert _rel(out[~valid], shared[~valid]) < 1e-5
  # Expert counts come from the layer's own routing and skip padded rows,
  # the same summed over expert-parallel ranks as unsharded.
  _, counts = moe(cfg, p0, x, plan, valid=valid, count="logical")
  p_host = jax.tree.map(lambda a: a[0], params["layers"][1]["mlp"])
  _, ref = moe_lib.moe(cfg, p_host, x, None, valid=valid, count="logical")
  assert int(counts.sum()) == int(valid.sum()) * cfg.num_experts_per_tok
  np.testing.assert_array_equal(np.asarray(counts), np.asarray(ref))


def test_attention_dp_split_balance_keeps_tokens(models_and_refs):
  # dp_balance="split": the lone long prompt prefills in steps the size of the
  # other ranks' (16 tokens, not 64); the tokens do not change.
  cfg, params, _, _ = models_and_refs["mla_moe16"]
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, cfg.vocab_size, 120).tolist()] + [
      rng.integers(0, cfg.vocab_size, 4).tolist() for _ in range(3)]
  base = EngineConfig(page_size=8, num_pages=40, max_num_batched_tokens=64)
  split = dataclasses.replace(base, dp_balance="split", dp_min_step_tokens=16)
  eng = Engine(cfg, params, split, mesh=sharding.make_mesh({"data": 2, "expert": 4}),
               layout="dp_attn_ep")
  outs = eng.generate(prompts, SamplingParams(max_tokens=4))
  ref = Engine(cfg, params, base).generate(prompts, SamplingParams(max_tokens=4))
  assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
  assert eng.stats()["steps"] >= 120 // 16 + 3  # chunks of at most 16, then decodes


@pytest.mark.parametrize("dispatch_dtype", ["bfloat16"])
def test_ep_dispatch_in_a_narrower_dtype(models_and_refs, dispatch_dtype):
  # float32 activations sent as bf16 rows: close to the float32 result, not
  # equal to it (the rows really were narrowed on the way). (fp8 works the
  # same way; left out of CI for time.)
  cfg, params, tokens, ref = models_and_refs["mla_moe64"]
  mesh = sharding.make_mesh({"data": 2, "expert": 4})
  sharded = sharding.shard_params(cfg, params, mesh, "dp_attn_ep")
  plan = dataclasses.replace(moe_ep.plan_from_params(sharded), strategy="all_to_all",
                             dispatch_dtype=dispatch_dtype)
  err = _rel(models.transformer._logits(cfg, sharded, tokens, plan), ref)
  assert 1e-6 < err < (1e-2 if dispatch_dtype == "bfloat16" else 1e-1), err
