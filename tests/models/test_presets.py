"""Full-size presets: parameter counts from shapes alone (no allocation)."""

import dataclasses
import pytest

from jaxinfer import models, presets

# Published totals.
PUBLISHED = {
    "llama3_1_405b": 405.9e9,
    "mixtral_8x7b": 46.7e9,
    "qwen3_moe_235b_a22b": 235e9,
    "gpt_oss_120b": 116.8e9,
    "llama3_8b": 8.03e9,
    "bench_dense": 155.7e6,
}


@pytest.mark.parametrize("name,published", PUBLISHED.items())
def test_param_count(name, published):
  n = models.count_params(presets.get(name))
  assert abs(n - published) / published < 0.01, (name, n)


def test_deepseek_v3_counts():
  cfg = presets.get("deepseek_v3")
  specs = models.abstract_params(cfg)
  mtp = sum(x.size for x in __import__("jax").tree.leaves(specs["mtp"]))
  total = models.count_params(cfg)
  main = total - mtp
  assert abs(main - 671e9) / 671e9 < 0.01, main
  # HF's published 685B total counts the MTP layer's own copies of the
  # embedding and output head, which jaxinfer shares with the main model.
  embed_and_head = 2 * cfg.vocab_size * cfg.d_model
  assert abs(total + embed_and_head - 685e9) / 685e9 < 0.01, total + embed_and_head
  assert 11e9 < mtp < 12e9  # one MoE block + eh_proj; 13.5B with the copies ("14B")


def test_bench_moe_main_model_count():
  cfg = presets.get("bench_moe")
  specs = models.abstract_params(cfg)
  mtp = sum(x.size for x in __import__("jax").tree.leaves(specs["mtp"]))
  main = models.count_params(cfg) - mtp
  assert abs(main - 813.1e6) / 813.1e6 < 0.01, main


def test_counting_does_not_allocate():
  import jax
  specs = models.abstract_params(presets.get("llama3_1_405b"))
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(specs))


PUBLISHED_CONFIGS = ["llama3_8b", "mixtral_8x7b", "qwen3_moe_235b_a22b", "deepseek_v3",
                     "gpt_oss_120b"]


@pytest.mark.parametrize("name", PUBLISHED_CONFIGS)
def test_published_config_maps_to_preset(name):
  import json
  from conftest import FIXTURES
  from jaxinfer import ModelConfig
  hf = json.loads((FIXTURES / "published_configs" / f"{name}.json").read_text())
  cfg = ModelConfig.from_hf(hf)
  if "quantization_config" in hf:  # the published weights' quantization, kept quantized
    want = {"deepseek_v3": ("fp8", (128, 128), 15), "gpt_oss_120b": ("mxfp4", (1, 32), 3)}[name]
    assert (cfg.quant.method, cfg.quant.block, len(cfg.quant.targets)) == want
    cfg = dataclasses.replace(cfg, quant=None)
  assert cfg == presets.get(name)
