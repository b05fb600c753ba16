"""The spec tree and the HF name map are read off one declaration
(`models.weights`): for every preset and every fixture architecture (vision,
MTP, quantized with KV cache scales included) each param leaf has HF
tensors and each HF source is a param leaf, one tensor source per layer of a
stacked leaf, of the shapes the declaration gives."""

import dataclasses
import json

import jax
import pytest

from conftest import FIXTURES
from jaxinfer import models, presets
from jaxinfer.checkpoint import hf_load, hf_names
from jaxinfer.config import ModelConfig, QuantConfig
from jaxinfer.models.quant import QuantizedWeight

_FIXTURE_CONFIGS = sorted(p.parent for p in FIXTURES.glob("hf*/*/config.json"))
_KV_SCALES = {"modelopt": QuantConfig(method="fp8", layout="modelopt", kv_cache="fp8"),
              "ct": QuantConfig(method="nvfp4", block=(1, 16), layout="compressed_tensors",
                                kv_cache="fp8")}


def _configs():
  for name in presets.names():
    yield pytest.param(presets.get(name), id=f"preset-{name}")
  for d in _FIXTURE_CONFIGS:
    cfg = ModelConfig.from_hf(hf_load._read_config(str(d)))
    yield pytest.param(cfg, id=f"{d.parent.name}-{d.name}")
  for name in ("tiny_dense", "tiny_moe"):
    for q, quant in _KV_SCALES.items():
      yield pytest.param(presets.get(name, quant=quant), id=f"{name}-{q}-kv-scales")


def _spec_leaves(cfg) -> dict:
  is_leaf = lambda x: models.specs.is_spec(x) or isinstance(x, QuantizedWeight)
  flat, _ = jax.tree_util.tree_flatten_with_path(models.param_specs(cfg), is_leaf=is_leaf)
  return {hf_names.path_key(kp): leaf for kp, leaf in flat}


@pytest.mark.parametrize("cfg", list(_configs()))
def test_every_param_has_hf_tensors_and_every_hf_tensor_a_param(cfg):
  specs = _spec_leaves(cfg)
  sources = hf_names.model_sources(cfg, lambda name: False)
  assert set(sources) == set(specs)
  for key, srcs in sources.items():
    stacked = isinstance(srcs, list)
    assert stacked == ("layers" in key or "mtp" in key or key[:2] in (("vision", "blocks"),
                                                                      ("vision", "deepstack")))
    leaf = specs[key]
    shape = (leaf.values if isinstance(leaf, QuantizedWeight) else leaf).shape
    assert not stacked or len(srcs) == shape[0], key
    for src in srcs if stacked else [srcs]:
      assert src.names and len(src.names) == len(src.shapes), key
      if isinstance(leaf, QuantizedWeight):  # read quantized through its [out, in] matrix
        assert src.ref is not None and src.ref.names, key


def test_quantized_and_float_configs_name_the_same_tensors():
  """Quantizing changes how a leaf is held, never which HF tensors it reads."""
  hf = json.loads((FIXTURES / "hf" / "deepseek_v3" / "config.json").read_text())
  cfg = ModelConfig.from_hf(hf)
  names = lambda c: {k: v[0].names if isinstance(v, list) else v.names
                     for k, v in hf_names.model_sources(c, lambda n: False).items()}
  assert names(dataclasses.replace(cfg, quant=presets.quant("fp8"))) == names(cfg)
