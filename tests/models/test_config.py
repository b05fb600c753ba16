"""ModelConfig and from_hf: every architecture's fields, both rope forms, rejections."""

import dataclasses
import json

import pytest

from conftest import FIXTURES, HF_FIXTURES
from jaxinfer import ModelConfig, RopeScaling, presets
from jaxinfer.config import Attention


def _hf(name):
  return json.loads((FIXTURES / "hf" / name / "config.json").read_text())


def test_config_is_frozen_kw_only_and_hashable():
  cfg = presets.get("tiny_moe")
  assert hash(cfg) == hash(dataclasses.replace(cfg))
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.d_model = 3
  with pytest.raises(TypeError):
    ModelConfig(256, 128)  # keyword-only


@pytest.mark.parametrize("name", HF_FIXTURES)
def test_from_hf_reads_fixture_configs(name):
  cfg = ModelConfig.from_hf(_hf(name))
  assert cfg.model_type == _hf(name)["model_type"]
  assert cfg.num_layers == _hf(name)["num_hidden_layers"]


def test_llama3_rope_both_forms():
  new = _hf("llama")
  rope = new["rope_parameters"]
  old = {k: v for k, v in new.items() if k != "rope_parameters"}
  old["rope_theta"] = rope["rope_theta"]
  old["rope_scaling"] = {"type": "llama3", **{k: v for k, v in rope.items()
                                              if k not in ("rope_theta", "rope_type")}}
  a, b = ModelConfig.from_hf(new), ModelConfig.from_hf(old)
  assert a == b
  assert a.rope_scaling.kind == "llama3" and a.rope_scaling.factor == rope["factor"]


def test_deepseek_fields():
  hf = _hf("deepseek_v3")
  cfg = ModelConfig.from_hf(hf)
  assert cfg.attention is Attention.MLA and cfg.q_lora_rank == hf["q_lora_rank"]
  assert cfg.router == "sigmoid_grouped" and cfg.n_group == hf["n_group"]
  assert cfg.topk_group == hf["topk_group"] and cfg.routed_scaling_factor == hf["routed_scaling_factor"]
  assert cfg.dense_layers == tuple(range(hf["first_k_dense_replace"]))
  assert cfg.rope_scaling.kind == "yarn" and cfg.rope_interleave
  assert cfg.num_shared_experts == hf["n_shared_experts"]
  lite = ModelConfig.from_hf(_hf("deepseek_v2lite"))
  assert lite.q_lora_rank == 0
  # mscale_all_dim puts mscale^2 on the softmax scale.
  assert lite.softmax_scale() != lite.qk_head_dim ** -0.5


def test_qwen3_sparse_layers():
  hf = dict(_hf("qwen3_moe"), num_hidden_layers=6, mlp_only_layers=[4], decoder_sparse_step=2)
  cfg = ModelConfig.from_hf(hf)
  # HF: sparse iff not mlp-only and (i + 1) % step == 0 -> layers 1, 3, 5.
  assert [cfg.layer_is_moe(i) for i in range(6)] == [False, True, False, True, False, True]
  assert cfg.qk_norm


def test_gpt_oss_fields():
  hf = _hf("gpt_oss")
  cfg = ModelConfig.from_hf(hf)
  assert cfg.attention_sinks and cfg.qkv_bias and cfg.o_bias and cfg.expert_bias
  assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == [
      hf["sliding_window"] if t == "sliding_attention" else 0 for t in hf["layer_types"]]
  assert cfg.swiglu_limit == hf["swiglu_limit"] and cfg.rope_scaling.truncate is False


@pytest.mark.parametrize("bench", ["bench_dense", "bench_moe"])
def test_bench_presets_equal_reference_hf_configs(bench):
  hf = json.loads((FIXTURES / "bench_configs" / f"{bench}.json").read_text())
  assert ModelConfig.from_hf(hf) == presets.get(bench)


def test_rejects_unsupported_model_type():
  with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
    ModelConfig.from_hf(dict(_hf("llama"), model_type="bert"))


def test_rejects_unknown_field_by_name():
  with pytest.raises(ValueError, match="fancy_new_thing"):
    ModelConfig.from_hf(dict(_hf("llama"), fancy_new_thing=3))


@pytest.mark.parametrize("key,value,match", [
    ("hidden_act", "gelu", "hidden_act"),
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, "longrope"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4, "wiggle": 1},
     "wiggle"),
    ("mlp_bias", True, "mlp_bias"),
])
def test_rejects_values_it_cannot_honour(key, value, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_hf(dict(_hf("llama"), **{key: value}))


def test_rejects_unknown_quantization_and_sliding_qwen():
  with pytest.raises(ValueError, match="quant_method='gptq'"):
    ModelConfig.from_hf(dict(_hf("gpt_oss"), quantization_config={"quant_method": "gptq"}))
  with pytest.raises(ValueError, match="use_sliding_window"):
    ModelConfig.from_hf(dict(_hf("qwen3_moe"), use_sliding_window=True))


def test_missing_required_key_is_named():
  hf = _hf("llama")
  del hf["hidden_size"]
  with pytest.raises(ValueError, match="hidden_size"):
    ModelConfig.from_hf(hf)


@pytest.mark.parametrize("field,value,match", [
    ("num_kv_heads", 3, "multiple of num_kv_heads"),
    ("vocab_size", 0, "vocab_size"),
    ("dtype", "int8", "dtype"),
])
def test_invalid_config_values(field, value, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(presets.get("tiny_dense"), **{field: value})


def test_invalid_moe_config():
  with pytest.raises(ValueError, match="num_experts_per_tok"):
    dataclasses.replace(presets.get("tiny_moe"), num_experts_per_tok=99)
  with pytest.raises(ValueError, match="rope scaling"):
    dataclasses.replace(presets.get("tiny_dense"), rope_scaling=RopeScaling(kind="yarn", factor=-1))


def test_unknown_preset():
  with pytest.raises(ValueError, match="unknown preset"):
    presets.get("gpt5")
