"""Quantized checkpoints against transformers (committed references from
tests/fixtures/make_quant_fixtures.py): our dequantized weights equal
transformers' own CPU dequantization, and our logits match transformers
running the dequantized model, for DeepSeek-V3 block FP8, GPT-OSS MXFP4 and
compressed-tensors FP8 (per channel) and NVFP4."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import FIXTURES
from jaxinfer import checkpoint, models
from jaxinfer.models import quant

HFQ = FIXTURES / "hf_quant"

# fixture -> (logits tolerance, {HF tensor: (segment, layer in segment, leaf path)}).
# transformers dequantizes compressed-tensors NVFP4 to bfloat16: we compare our
# weights rounded to bfloat16 there, and the logits at the bfloat16 tolerance.
CASES = {
    "deepseek_v3_fp8": (1e-5, {
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (0, 0, ("attn", "wkv_a")),
        "model.layers.1.self_attn.q_b_proj.weight": (1, 0, ("attn", "wq_b"))}),
    "gpt_oss_mxfp4": (1e-5, {
        "model.layers.0.mlp.experts.gate_up_proj": (0, 0, ("mlp", "w_gate")),
        "model.layers.1.mlp.experts.down_proj": (0, 1, ("mlp", "w_down"))}),
    "llama_ct_fp8": (1e-5, {
        "model.layers.0.self_attn.q_proj.weight": (0, 0, ("attn", "wq")),
        "model.layers.1.mlp.down_proj.weight": (0, 1, ("mlp", "w_down"))}),
    "llama_ct_nvfp4": (2e-2, {
        "model.layers.0.self_attn.q_proj.weight": (0, 0, ("attn", "wq")),
        "model.layers.1.mlp.down_proj.weight": (0, 1, ("mlp", "w_down"))}),
}


def _ours(params, seg, layer, path):
  leaf = params["layers"][seg]
  for k in path:
    leaf = leaf[k]
  assert isinstance(leaf, quant.QuantizedWeight)
  return np.asarray(quant.matmul_weight(leaf, jnp.float32))[layer]  # HF layout [.., out, in]


@pytest.mark.parametrize("name", sorted(CASES))
def test_quantized_logits_match_transformers(name):
  d = HFQ / name
  cfg, params = checkpoint.load_hf(str(d), dtype=jnp.float32)
  tokens, ref = np.load(d / "tokens.npy"), np.load(d / "logits.npy")
  err = float(np.max(np.abs(np.asarray(models.logits(cfg, params, tokens)) - ref)) / np.abs(ref).max())
  assert err <= CASES[name][0], err


@pytest.mark.parametrize("name", sorted(CASES))
def test_dequantized_weights_equal_transformers(name):
  d = HFQ / name
  _, params = checkpoint.load_hf(str(d), dtype=jnp.float32)
  refs = np.load(d / "dequant.npz")
  for hf_name, (seg, layer, path) in CASES[name][1].items():
    ours, theirs = _ours(params, seg, layer, path), refs[hf_name]
    if name == "gpt_oss_mxfp4":  # transformers holds experts [E, in, out], gate/up interleaved
      theirs = np.swapaxes(theirs[..., 0::2] if path[-1] == "w_gate" else theirs, -1, -2)
    if name == "llama_ct_nvfp4":
      ours = ours.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(ours, theirs, err_msg=hf_name)
