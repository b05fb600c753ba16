"""Fused-expert checkpoints as transformers 5 writes and reads them.

save_pretrained writes the original per-expert tensors for Qwen3-MoE, Mixtral
and DeepSeek, its in-memory fused [E, 2F, D] / [E, D, F] tensors with
`save_original_format=False` (and always for Qwen3-VL-MoE), and GPT-OSS's one
[E, D, 2F] layout. load_hf reads each and matches transformers' logits; the
published Qwen3-VL-MoE layout ([E, D, 2F] / [E, F, D]) loads to the same
params as transformers' own; a shape that fits neither is named. The dev
extra installs torch and transformers.
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import FIXTURES
from jaxinfer import checkpoint, models
from jaxinfer.checkpoint import hf_build

VL_MOE = FIXTURES / "hf_vl" / "qwen3_vl_moe"
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _rewrite(src, dst, fn):
  """A copy of checkpoint `src` in `dst`, every fused expert tensor through fn."""
  shutil.copytree(src, dst)
  tensors = load_file(dst / "model.safetensors")
  for k in tensors:
    if k.endswith(EXPERTS):
      tensors[k] = np.ascontiguousarray(fn(k, tensors[k]))
  save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def _saved_names(d):
  return set(load_file(d / "model.safetensors"))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("original_format", [True, False])
def test_save_pretrained_output_loads_and_matches_transformers(name, original_format, tmp_path):
  import torch
  model = hf_build.build_model(name, seed=3)
  model.save_pretrained(tmp_path, safe_serialization=True, save_original_format=original_format)
  names = _saved_names(tmp_path)
  fused = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
  assert fused == (name == "gpt_oss" or not original_format), sorted(names)[:8]
  tokens = np.random.default_rng(3).integers(0, model.config.vocab_size, (2, 10))
  with torch.no_grad():
    ref = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
  cfg, params = checkpoint.load_hf(str(tmp_path), dtype=jnp.float32)
  out = np.asarray(models.logits(cfg, params, tokens.astype(np.int32)))
  assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) <= 1e-4


def test_vl_moe_fixture_is_transformers_layout_and_published_loads_the_same(tmp_path):
  """The committed fixture is save_pretrained's [E, 2F, D] / [E, D, F]; its
  transpose (the published layout) loads to identical params."""
  cfg = json.loads((VL_MOE / "config.json").read_text())["text_config"]
  D, F = cfg["hidden_size"], cfg["moe_intermediate_size"]
  shapes = {k: v.shape[1:] for k, v in load_file(VL_MOE / "model.safetensors").items()
            if k.endswith(EXPERTS)}
  assert set(shapes.values()) == {(2 * F, D), (D, F)}
  _rewrite(VL_MOE, tmp_path / "published", lambda k, w: np.swapaxes(w, 1, 2))
  _, ours = checkpoint.load_hf(str(VL_MOE), dtype=jnp.float32)
  _, published = checkpoint.load_hf(str(tmp_path / "published"), dtype=jnp.float32)
  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), ours, published)
  assert all(jax.tree.leaves(same))


def test_vl_moe_expert_shape_fitting_neither_layout_is_named(tmp_path):
  _rewrite(VL_MOE, tmp_path / "bad",
           lambda k, w: w[:, :-1] if k.endswith("down_proj") else w)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"down_proj.*expected \[4, 8, 32\] \(as published\) or \[4, 32, 8\]"):
    checkpoint.load_hf(str(tmp_path / "bad"), dtype=jnp.float32)


def test_vl_moe_mixed_layouts_are_refused(tmp_path):
  _rewrite(VL_MOE, tmp_path / "mixed",
           lambda k, w: np.swapaxes(w, 1, 2) if k.endswith("down_proj") else w)
  with pytest.raises(checkpoint.CheckpointError, match="different layouts"):
    checkpoint.load_hf(str(tmp_path / "mixed"), dtype=jnp.float32)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_export_writes_the_published_layout_from_either_save(name, tmp_path):
  """export_quantized of save_pretrained's two layouts: the same tensors,
  per expert, as from the published layout."""
  from jaxinfer.checkpoint.quant_export import export_quantized
  model = hf_build.build_model(name, seed=4)
  out = {}
  for original in (True, False):
    src = tmp_path / f"src_{original}"
    model.save_pretrained(src, safe_serialization=True, save_original_format=original)
    export_quantized(str(src), str(tmp_path / f"q_{original}"), "fbgemm_fp8")
    out[original] = checkpoint_tensors(tmp_path / f"q_{original}")
  names = set(out[True])
  assert names == set(out[False]) and not any(n.endswith("gate_up_proj") for n in names)
  assert all(np.array_equal(out[True][n], out[False][n]) for n in names)
  cfg, params = checkpoint.load_hf(str(tmp_path / "q_False"), dtype=jnp.float32)
  assert cfg.quant is not None and cfg.quant.method == "fp8"


def checkpoint_tensors(d):
  """Every tensor of a checkpoint written by export_quantized, as raw bytes."""
  from jaxinfer.checkpoint.safetensors_header import read_header
  meta, start = read_header(str(d / "model.safetensors"))
  raw = (d / "model.safetensors").read_bytes()
  return {k: np.frombuffer(raw[start + v["data_offsets"][0]:start + v["data_offsets"][1]],
                           np.uint8) for k, v in meta.items()}
