"""EPLB: placement properties, imbalance, and placed params giving the same
logits unsharded and expert-parallel on 8 simulated CPU devices."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxinfer import eplb, models, presets, sharding
from jaxinfer.models import moe_ep

# 16 experts in 4 groups; 3 MoE layers (layer 0 is dense).
CFG = dataclasses.replace(presets.get("tiny_moe", num_experts=16, n_group=4, topk_group=2),
                          dtype="float32")
RANKS, REDUNDANT = 8, 8  # 24 slots, 3 per rank


def _rel(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _zipf(E, layers=None, seed=0):
  # Zipf(1.2) over a random expert order, so the hot experts are not contiguous.
  rng = np.random.default_rng(seed)
  rows = [rng.permutation(1.0 / np.arange(1, E + 1) ** 1.2) * 1000 for _ in range(layers or 1)]
  return np.stack(rows) if layers else rows[0]


def _bias_experts(params, experts, value):
  """Adds a selection bias on `experts` in every MoE layer: skewed routing."""
  layers = []
  for seg in params["layers"]:
    if "score_bias" in seg["mlp"]:
      mlp = dict(seg["mlp"], score_bias=seg["mlp"]["score_bias"].at[:, experts].add(value))
      seg = dict(seg, mlp=mlp)
    layers.append(seg)
  return dict(params, layers=tuple(layers))


@pytest.fixture(scope="module")
def setup():
  params = models.init_params(CFG, jax.random.key(0))
  tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 13)).astype(np.int32)
  return params, tokens, np.asarray(models.logits(CFG, params, tokens))


def test_placement_properties_on_zipf_load():
  load = _zipf(16)
  pl = eplb.plan_placement(load, RANKS, REDUNDANT)
  assert pl.num_slots == 24 and pl.slots_per_rank == 3 and pl.num_ranks == RANKS
  # Every slot holds a valid expert, every expert has >= 1 slot, and the
  # tables agree with the slots.
  assert pl.phys_to_logical.min() >= 0 and pl.phys_to_logical.max() < 16
  np.testing.assert_array_equal(np.bincount(pl.phys_to_logical, minlength=16), pl.num_replicas)
  assert pl.num_replicas.min() >= 1 and pl.num_replicas.sum() == 24
  for e in range(16):
    slots = pl.replicas[e, :pl.num_replicas[e]]
    assert len(set(slots.tolist())) == pl.num_replicas[e]
    assert np.all(pl.phys_to_logical[pl.replicas[e]] == e)  # padding repeats a real slot
  # The hottest experts get the replicas; the coldest keep one.
  order = np.argsort(-load)
  assert pl.num_replicas[order[0]] == pl.num_replicas.max() >= 3
  assert np.all(pl.num_replicas[order[-8:]] == 1)
  assert np.all(np.diff(pl.num_replicas[order]) <= 0)  # more load, never fewer copies


def test_greedy_replicates_then_packs_longest_first():
  # Expert 0 takes 3 copies (10 -> 5 -> 3.33 per copy beats 1). Packing onto
  # 2 ranks x 3 slots: 3.33, 3.33, 3.33 | 1, 1, 0 -> ranks 6.67 and 5.33.
  pl = eplb.plan_placement([10, 1, 1, 0], num_ranks=2, num_redundant=2)
  np.testing.assert_array_equal(pl.num_replicas, [3, 1, 1, 1])
  np.testing.assert_array_equal(pl.phys_to_logical, [0, 0, 3, 0, 1, 2])
  assert eplb.imbalance([10, 1, 1, 0], pl) == pytest.approx(2 / 3 / 6)
  assert eplb.imbalance([10, 1, 1, 0], num_ranks=2) == pytest.approx(5 / 6)
  # No load: replicas spread one per expert, slots stay contiguous.
  zero = eplb.plan_placement(np.zeros(4), num_ranks=2, num_redundant=2)
  np.testing.assert_array_equal(zero.num_replicas, [2, 2, 1, 1])
  assert eplb.imbalance(np.zeros(4), zero) == 0.0


def test_imbalance_drops_after_per_layer_placement():
  load = _zipf(16, layers=3)
  placements = eplb.plan_placement(load, RANKS, REDUNDANT)
  assert isinstance(placements, tuple) and len(placements) == 3
  before, after = eplb.imbalance(load, num_ranks=RANKS), eplb.imbalance(load, placements)
  assert before > 0.5 and after < 0.15 and after < before / 4, (before, after)
  # Per layer too, and a uniform load is perfectly balanced.
  for row, pl in zip(load, placements):
    assert eplb.imbalance(row, pl) < eplb.imbalance(row, num_ranks=RANKS)
  assert eplb.imbalance(np.ones(16), num_ranks=RANKS) == 0.0


@pytest.mark.parametrize("impl", ["grouped", "dense"])
def test_placed_params_give_same_logits_unsharded(setup, impl):
  params, tokens, ref = setup
  cfg = dataclasses.replace(CFG, moe_impl=impl)
  placements = eplb.plan_placement(_zipf(16, layers=3), RANKS, REDUNDANT)
  placed = eplb.apply_placement(cfg, params, placements)
  mlp = placed["layers"][1]["mlp"]
  assert mlp["w_gate"].shape == (3, 24, CFG.d_model, CFG.moe_ffn_dim)
  assert mlp["w_down"].shape == (3, 24, CFG.moe_ffn_dim, CFG.d_model)
  assert mlp["eplb_num_replicas"].shape == (3, 16)
  # Slot s of layer l holds logical expert phys_to_logical[s] of that layer.
  w = np.asarray(params["layers"][1]["mlp"]["w_up"])
  for l, pl in enumerate(placements):
    np.testing.assert_array_equal(np.asarray(mlp["w_up"][l]), w[l, pl.phys_to_logical])
  assert _rel(models.logits(cfg, placed, tokens), ref) < 1e-5


@pytest.mark.parametrize("strategy", ["all_to_all", "replicated"])
def test_placed_params_give_same_logits_expert_parallel(setup, strategy):
  params, tokens, ref = setup
  mesh = sharding.make_mesh({"expert": 8})
  placed = eplb.apply_placement(CFG, params, eplb.plan_placement(_zipf(16, layers=3), 8, 8))
  sharded = eplb.shard_placed_params(placed, mesh, "expert")
  w = sharded["layers"][1]["mlp"]["w_gate"]
  assert w.addressable_shards[0].data.shape[1] == 3  # 24 slots / 8 ranks
  assert sharded["layers"][1]["mlp"]["eplb_replicas"].sharding.is_fully_replicated
  plan = dataclasses.replace(moe_ep.plan_from_params(sharded), strategy=strategy)
  assert plan.axes == ("expert",) and plan.size == 8
  assert _rel(models.transformer._logits(CFG, sharded, tokens, plan), ref) < 1e-5
  assert _rel(models.logits(CFG, sharded, tokens), ref) < 1e-5  # auto strategy


def test_forward_with_load_is_the_model_forward(setup):
  # Guards the forward `expert_load` replicates against drifting from the model's.
  params, tokens, ref = setup
  out, load = eplb._logits_and_load(CFG, params, jax.numpy.asarray(tokens), None, False)
  assert _rel(out, ref) < 1e-6
  assert load.shape == (3, 16)
  np.testing.assert_array_equal(np.asarray(load).sum(-1), [tokens.size * 2] * 3)  # k = 2


def test_measured_imbalance_drops_on_skewed_routing(setup):
  params, tokens, _ = setup
  # Experts 0, 1 (rank 0) and 9 (rank 4) take most tokens.
  skewed = _bias_experts(params, [0, 1, 9], 0.3)
  load = eplb.expert_load(CFG, skewed, tokens)
  assert load.shape == (3, 16) and np.all(load.sum(-1) == tokens.size * 2)
  before = eplb.imbalance(load, num_ranks=8)
  placed = eplb.apply_placement(CFG, skewed, eplb.plan_placement(load, 8, 8))
  # Physical slot counts: what each rank's experts actually compute.
  slot_load = eplb.expert_load(CFG, placed, tokens, physical=True)
  assert slot_load.shape == (3, 24)
  after = eplb.imbalance(slot_load, num_ranks=8)
  print(f"measured imbalance: contiguous {before:.3f} -> placed {after:.3f}")
  assert before > 1.0 and after < before / 2, (before, after)
  # The logical load is the same through placed params, sharded or not.
  sharded = eplb.shard_placed_params(placed, sharding.make_mesh({"expert": 8}), ("expert",))
  np.testing.assert_array_equal(eplb.expert_load(CFG, placed, tokens), load)
  np.testing.assert_array_equal(eplb.expert_load(CFG, sharded, tokens, physical=True), slot_load)


def test_bad_inputs_raise_naming_the_argument(setup):
  params, tokens, _ = setup
  with pytest.raises(ValueError, match="load must be"):
    eplb.plan_placement(np.ones((2, 2, 2)), 2, 0)
  with pytest.raises(ValueError, match="load must be finite and >= 0"):
    eplb.plan_placement([1.0, -1.0], 2, 0)
  with pytest.raises(ValueError, match="load must be finite"):
    eplb.plan_placement([1.0, np.nan], 2, 0)
  with pytest.raises(ValueError, match="num_ranks must be an int >= 1"):
    eplb.plan_placement(np.ones(4), 0, 0)
  with pytest.raises(ValueError, match="num_redundant must be an int >= 0"):
    eplb.plan_placement(np.ones(4), 2, -1)
  with pytest.raises(ValueError, match=r"num_ranks \(8\) must divide num_experts \+ num_redundant"):
    eplb.plan_placement(np.ones(16), 8, 4)
  with pytest.raises(ValueError, match="num_ranks must be an int"):
    eplb.imbalance(np.ones(16))
  with pytest.raises(ValueError, match=r"num_ranks \(3\) must divide"):
    eplb.imbalance(np.ones(16), num_ranks=3)
  with pytest.raises(ValueError, match="placement is for 8 experts"):
    eplb.imbalance(np.ones(16), eplb.plan_placement(np.ones(8), 8, 0))
  with pytest.raises(ValueError, match="placements: a placement is for 8 experts"):
    eplb.apply_placement(CFG, params, eplb.plan_placement(np.ones(8), 8, 0))
  with pytest.raises(ValueError, match=r"placements must be a Placement or 3 Placements"):
    eplb.apply_placement(CFG, params, eplb.plan_placement(np.ones((2, 16)), 8, 8))
  placed = eplb.apply_placement(CFG, params, eplb.plan_placement(np.ones(16), 4, 4))
  with pytest.raises(ValueError, match="params already carry a placement"):
    eplb.apply_placement(CFG, placed, eplb.plan_placement(np.ones(16), 4, 4))
  mesh = sharding.make_mesh({"expert": 8})
  with pytest.raises(ValueError, match=r"w_gate: 20 slots are not divisible by axes"):
    eplb.shard_placed_params(placed, mesh, "expert")
  with pytest.raises(ValueError, match="axes: .* must be non-empty names of mesh axes"):
    eplb.shard_placed_params(placed, mesh, "tensor")
  with pytest.raises(ValueError, match="physical=True needs params from apply_placement"):
    eplb.expert_load(CFG, params, tokens, physical=True)
  with pytest.raises(ValueError, match="cfg has no MoE layers"):
    eplb.expert_load(presets.get("tiny_dense"), params, tokens)


# ---------------------------------------------------------------- in the engine

def _engine_cfg():
  from jaxinfer.engine import EngineConfig
  return EngineConfig(page_size=4, num_pages=64, max_num_seqs=4, max_num_batched_tokens=32,
                      enable_prefix_caching=False)


def test_engine_records_the_routing_it_serves(setup):
  from jaxinfer.engine import Engine, SamplingParams
  params, tokens, _ = setup
  skewed = _bias_experts(params, [0, 1, 9], 0.3)
  engine = Engine(CFG, skewed, _engine_cfg())
  outs = engine.generate([list(t[:9]) for t in tokens], SamplingParams(max_tokens=5))
  # Every token the engine ran: prompt + all outputs but the last (never fed back).
  ran = [o.prompt_token_ids + o.token_ids[:-1] for o in outs]
  ref = sum(eplb.expert_load(CFG, skewed, np.asarray([r], np.int32)) for r in ran)
  load = engine.expert_load()
  assert load.shape == (3, 16)
  np.testing.assert_array_equal(load.sum(-1), [sum(map(len, ran)) * 2] * 3)  # no padding rows
  np.testing.assert_array_equal(load, ref)


def test_engine_rebalance_keeps_outputs_and_evens_ranks(setup):
  from jaxinfer.engine import Engine, SamplingParams
  params, tokens, _ = setup
  skewed = _bias_experts(params, [0, 1, 9], 0.3)
  mesh = sharding.make_mesh({"expert": 8})
  prompts = [list(t) for t in tokens]
  engine = Engine(CFG, skewed, _engine_cfg(), mesh=mesh, layout="dp_attn_ep")
  first = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=6))]
  report = engine.rebalance(num_redundant=8)
  print(f"engine rebalance: {report}")
  assert report["imbalance_before"] > 1.0
  assert report["imbalance_after"] < report["imbalance_before"] / 2
  assert engine.params["layers"][1]["mlp"]["w_gate"].shape[1] == 24  # 16 experts + 8 copies
  assert not engine.expert_load().any()  # recording restarts
  again = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=6))]
  assert again == first
  # Placed params go straight into a new sharded engine, with the same outputs.
  placed = eplb.remove_placement(engine.params)
  np.testing.assert_array_equal(np.asarray(placed["layers"][1]["mlp"]["w_up"]),
                                np.asarray(skewed["layers"][1]["mlp"]["w_up"]))
  other = Engine(CFG, jax.device_get(engine.params), _engine_cfg(), mesh=mesh, layout="tp_attn_ep")
  with pytest.raises(ValueError, match="no routed tokens"):
    other.rebalance()
  assert [o.token_ids for o in other.generate(prompts, SamplingParams(max_tokens=6))] == first


def test_engine_rebalance_places_the_mtp_experts_too(setup):
  # A speculating engine records the MTP module's routing as the last load
  # row, and rebalance places its MoE block with the trunk's.
  from jaxinfer.engine import Engine, MTPConfig, SamplingParams
  params, tokens, _ = setup
  assert CFG.num_mtp_layers == 1
  skewed = _bias_experts(params, [0, 1, 9], 0.3)
  config = dataclasses.replace(_engine_cfg(), speculative=MTPConfig(num_draft_tokens=2))
  mesh = sharding.make_mesh({"expert": 8})
  prompts = [list(t) for t in tokens]
  engine = Engine(CFG, skewed, config, mesh=mesh, layout="dp_attn_ep")
  first = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=6))]
  load = engine.expert_load()
  assert load.shape == (4, 16) and load[3].sum() > 0  # 3 trunk MoE layers, then the MTP block
  report = engine.rebalance(num_redundant=8)
  assert report["imbalance_after"] < report["imbalance_before"]
  mtp_mlp = engine.params["mtp"]["block"]["mlp"]
  assert mtp_mlp["w_gate"].shape[1] == 24 and "eplb_replicas" in mtp_mlp
  assert len(eplb.placements_of(engine.params, 8)) == 4
  again = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=6))]
  assert again == first
  logical = eplb.remove_placement(engine.params)
  np.testing.assert_array_equal(np.asarray(logical["mtp"]["block"]["mlp"]["w_up"]),
                                np.asarray(skewed["mtp"]["block"]["mlp"]["w_up"]))
