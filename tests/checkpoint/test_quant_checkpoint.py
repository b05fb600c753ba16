"""Quantized HF checkpoints (`load_hf`): every published layout, built by our
own exporter from the float fixtures, loads kept quantized and runs exactly
the float model its tensors encode (dequantized here by the numpy reference
of test_quant); device bytes, host memory, quantize-on-load and bad input."""

import json
import os
import shutil
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES
from jaxinfer import checkpoint, models
from jaxinfer.checkpoint import hf_load, hf_names
from jaxinfer.checkpoint.hf_quant import tensor_names
from jaxinfer.checkpoint.quant_export import FORMATS as QFORMATS
from jaxinfer.checkpoint.quant_export import _weights, export_quantized, save_safetensors
from jaxinfer.config import ModelConfig
from jaxinfer.models import quant
from quant_reference import reference

HF = FIXTURES / "hf"


def _raw(d):
  """Every tensor of d/model.safetensors as numpy, fp8 included."""
  reader = hf_load._Reader(str(d), None)
  out = {}
  for name in reader.index:
    meta, _ = reader.header(reader.index[name])
    out[name] = reader.read_raw(name, [meta[name]["shape"]], [meta[name]["dtype"]], "test")
  return out


def _dequantized_checkpoint(qdir, out_dir):
  """qdir's quantized tensors dequantized by the numpy reference -> a float
  checkpoint with the original names (the model the quantized one encodes)."""
  hf = json.loads((qdir / "config.json").read_text())
  hf.pop("quantization_config", None)
  cfg = ModelConfig.from_hf(hf)
  q = ModelConfig.from_hf(hf_load._read_config(str(qdir))).quant
  tensors = _raw(qdir)
  refs = _weights(cfg, q.targets, lambda n: tensor_names(q, n)["values"] in tensors)
  out, used = {}, set()
  for name, ref in refs.items():
    names = tensor_names(q, name)
    values, scale = tensors[names["values"]], tensors[names["scale"]]
    scale2 = tensors[names["scale2"]] if names["scale2"] else None
    if scale2 is not None and q.layout == "compressed_tensors":
      scale2 = 1.0 / scale2
    lead = ref.lead
    block = quant.FIXED_BLOCKS.get(q.method, q.block)
    values = values.reshape(*lead, ref.out, -1)
    scale = scale.reshape(*lead, *quant.scale_shape(block, ref.out, ref.d_in))
    w = reference(values, scale, None if scale2 is None else scale2.reshape(lead), q.method, block)
    out[name] = np.swapaxes(w, -1, -2).copy() if cfg.model_type == "gpt_oss" and lead else w
    used.update(n for n in (names["values"], names["scale"], names["scale2"], *names["extra"]) if n)
  out.update({k: v for k, v in tensors.items() if k not in used})
  os.makedirs(out_dir, exist_ok=True)
  save_safetensors(out, os.path.join(out_dir, "model.safetensors"))
  (out_dir / "config.json").write_text(json.dumps(hf))


def _random_float_checkpoint(hf: dict, out_dir, seed=0):
  """A float checkpoint of config `hf` with random tensors named by hf_names."""
  cfg = ModelConfig.from_hf(hf)
  rng = np.random.default_rng(seed)
  sources = dict(hf_names.top_sources(cfg))
  for is_moe, first, n in cfg.segments():
    for i in range(first, first + n):
      sources.update({(i, *k): v for k, v in
                      hf_names.block_sources(cfg, f"model.layers.{i}", is_moe, lambda _: False).items()})
  tensors = {}
  for key, src in sources.items():
    for name, shape in zip(src.names, src.shapes):
      norm = "norm" in name
      scale = 0.1 if norm or "bias" in name or "sinks" in name else shape[-1] ** -0.5
      tensors[name] = ((1.0 if norm else 0.0) + scale * rng.normal(size=shape)).astype(np.float32)
  os.makedirs(out_dir, exist_ok=True)
  save_safetensors(tensors, os.path.join(out_dir, "model.safetensors"))
  (out_dir / "config.json").write_text(json.dumps(hf))


def _gpt_oss_32(tmp_path):
  """GPT-OSS with MXFP4-able experts (inputs a multiple of 32)."""
  hf = json.loads((HF / "gpt_oss" / "config.json").read_text())
  hf["intermediate_size"] = 32
  _random_float_checkpoint(hf, tmp_path / "gpt_oss32")
  shutil.copy(HF / "gpt_oss" / "tokens.npy", tmp_path / "gpt_oss32")
  return tmp_path / "gpt_oss32"


FORMATS = [("deepseek_v3", "deepseek_fp8", (128, 128)),  # partial blocks: tiny dims < 128
           ("llama", "fbgemm_fp8", None), ("mixtral", "modelopt_nvfp4", None),
           ("qwen3_moe", "modelopt_fp8", None), ("deepseek_v2lite", "ct_fp8_tensor", None),
           ("llama", "ct_fp8_channel", None), ("deepseek_v3", "ct_nvfp4", None),
           ("gpt_oss32", "mxfp4", None)]


@pytest.mark.parametrize("name,fmt,block", FORMATS)
def test_quantized_checkpoint_equals_the_float_model_it_encodes(tmp_path, name, fmt, block):
  src = _gpt_oss_32(tmp_path) if name == "gpt_oss32" else HF / name
  qdir, fdir = tmp_path / "q", tmp_path / "f"
  export_quantized(str(src), str(qdir), fmt, block=block)
  cfg, params = checkpoint.load_hf(str(qdir), dtype=jnp.float32)
  assert cfg.quant is not None and cfg.quant.method == QFORMATS[fmt][0]
  leaves = [w for w in _quantized_leaves(params)]
  assert leaves and all(w.values.dtype == quant.VALUE_DTYPES[cfg.quant.method] for w in leaves)
  _dequantized_checkpoint(qdir, fdir)
  fcfg, fparams = checkpoint.load_hf(str(fdir), dtype=jnp.float32)
  tokens = np.load(src / "tokens.npy")
  got, want = models.logits(cfg, params, tokens), models.logits(fcfg, fparams, tokens)
  assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) <= 1e-5
  # Device bytes are the checkpoint's bytes (quantized values, scales, float tensors).
  file_bytes = sum(a.nbytes for k, a in _raw(qdir).items() if not k.endswith("input_scale"))
  assert abs(quant.nbytes(params) - file_bytes) <= 0.05 * file_bytes


def _quantized_leaves(tree):
  import jax
  return [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))
          if isinstance(x, quant.QuantizedWeight)]


def test_load_peak_host_memory_is_under_1_5x_of_the_quantized_bytes(tmp_path):
  # A checkpoint big enough that per-leaf buffers dominate the allocator's noise.
  hf = json.loads((HF / "llama" / "config.json").read_text())
  hf.update(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, head_dim=64)
  _random_float_checkpoint(hf, tmp_path / "f")
  export_quantized(str(tmp_path / "f"), str(tmp_path / "q"), "deepseek_fp8", block=(128, 128))
  checkpoint.load_hf(str(tmp_path / "q"), dtype=jnp.float32)  # warm caches and compiles
  tracemalloc.start()
  _, params = checkpoint.load_hf(str(tmp_path / "q"), dtype=jnp.float32)
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert peak < 1.5 * quant.nbytes(params), (peak, quant.nbytes(params))


@pytest.mark.parametrize("method,bound", [("int8", 0.02), ("fp8", 0.1), ("int4", 0.25)])
def test_quantize_on_load_logits_error(method, bound):
  d = HF / "llama"
  cfg, params = checkpoint.load_hf(str(d), dtype=jnp.float32, quantize=method)
  assert cfg.quant.method == method and cfg.quant.layout == "jaxinfer"
  tokens, ref = np.load(d / "tokens.npy"), np.load(d / "logits.npy")
  err = float(np.max(np.abs(np.asarray(models.logits(cfg, params, tokens)) - ref)) / np.abs(ref).max())
  assert 0 < err <= bound


def _edit(qdir, name, fn):
  tensors = _raw(qdir)
  tensors = fn(tensors, name)
  save_safetensors(tensors, os.path.join(qdir, "model.safetensors"))


W = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("fmt,edit,match", [
    ("deepseek_fp8", lambda t, n: {k: v for k, v in t.items() if k != n + "_scale_inv"},
     "missing tensor 'model.layers.0.self_attn.q_proj.weight_scale_inv' \\(the scale of"),
    ("deepseek_fp8", lambda t, n: dict(t, **{n + "_scale_inv": np.ones((3, 3), np.float32)}),
     "weight_scale_inv.*has shape \\[3, 3\\]"),
    ("deepseek_fp8", lambda t, n: dict(t, **{n: t[n].astype(np.float32)}), "q_proj.weight.*dtype F32"),
    ("deepseek_fp8", lambda t, n: dict(t, **{n: np.full(t[n].shape, 0x7F, np.uint8).view(t[n].dtype)}),
     "q_proj.weight.*corrupt values"),
    ("deepseek_fp8", lambda t, n: dict(t, **{n + "_scale_inv": -t[n + "_scale_inv"]}), "corrupt scale"),
    ("fbgemm_fp8", lambda t, n: dict(t, **{n[:-7] + ".weight_scale": np.ones((5, 1), np.float32)}),
     "weight_scale.*has shape \\[5, 1\\]"),
])
def test_bad_quantized_tensors_get_named_errors(tmp_path, fmt, edit, match):
  qdir = tmp_path / "q"
  export_quantized(str(HF / "llama"), str(qdir), fmt, block=(16, 16) if fmt == "deepseek_fp8" else None)
  _edit(qdir, W, edit)
  with pytest.raises(checkpoint.hf_load.CheckpointError, match=match):
    checkpoint.load_hf(str(qdir), dtype=jnp.float32)


def test_corrupt_mxfp4_scale_and_bad_configs(tmp_path):
  src = _gpt_oss_32(tmp_path)
  qdir = tmp_path / "q"
  export_quantized(str(src), str(qdir), "mxfp4")
  name = "model.layers.1.mlp.experts.down_proj_scales"
  _edit(qdir, name, lambda t, n: dict(t, **{n: np.full_like(t[n], 255)}))
  with pytest.raises(checkpoint.hf_load.CheckpointError, match="down_proj_scales.*corrupt scale"):
    checkpoint.load_hf(str(qdir), dtype=jnp.float32)
  hf = json.loads((HF / "deepseek_v3" / "config.json").read_text())
  with pytest.raises(ValueError, match="quantized in some layers only"):
    ModelConfig.from_hf(dict(hf, quantization_config=dict(
        quant_method="fp8", weight_block_size=[128, 128],
        modules_to_not_convert=["model.layers.0.self_attn.q_a_proj"])))
  with pytest.raises(ValueError, match="already quantized"):
    checkpoint.load_hf(str(qdir), quantize="int8")
  with pytest.raises(ValueError, match="quantize must be one of"):
    checkpoint.load_hf(str(HF / "llama"), quantize="fp6")


def test_orbax_round_trip_keeps_weights_quantized(tmp_path):
  cfg, params = checkpoint.load_hf(str(FIXTURES / "hf_quant" / "deepseek_v3_fp8"), dtype=jnp.float32)
  checkpoint.save(str(tmp_path / "ck"), cfg, params)
  cfg2, params2 = checkpoint.restore(str(tmp_path / "ck"))
  assert cfg2 == cfg and cfg2.quant.layout == "deepseek_fp8"
  assert params2["layers"][1]["mlp"]["w_gate"].values.dtype == jnp.float8_e4m3fn
  assert quant.nbytes(params2) == quant.nbytes(params)
  tokens = np.load(FIXTURES / "hf_quant" / "deepseek_v3_fp8" / "tokens.npy")
  np.testing.assert_array_equal(models.logits(cfg2, params2, tokens), models.logits(cfg, params, tokens))


@pytest.mark.parametrize("fmt", ["modelopt_fp8", "ct_fp8_channel"])
def test_kv_cache_scales_load_per_layer(tmp_path, fmt):
  export_quantized(str(HF / "llama"), str(tmp_path / "q"), fmt, kv_scales=True)
  cfg, params = checkpoint.load_hf(str(tmp_path / "q"), dtype=jnp.float32)
  assert cfg.quant.kv_cache == "fp8"
  attn = params["layers"][0]["attn"]
  np.testing.assert_allclose(attn["k_scale"], [0.01, 0.02])  # [L]: layer i holds 0.01 (i + 1)
  np.testing.assert_allclose(attn["v_scale"], [0.02, 0.04])
  tokens = np.load(HF / "llama" / "tokens.npy")
  assert np.isfinite(np.asarray(models.logits(cfg, params, tokens))).all()


def test_checkpoint_kv_scales_drive_the_engines_fp8_cache(tmp_path):
  import jaxinfer
  from jaxinfer import sharding
  export_quantized(str(HF / "llama"), str(tmp_path / "q"), "modelopt_fp8", kv_scales=True)
  cfg, params = checkpoint.load_hf(str(tmp_path / "q"), dtype=jnp.float32)
  config = jaxinfer.EngineConfig(kv_cache_dtype="fp8", page_size=8, num_pages=32, max_num_seqs=2)
  sampling = jaxinfer.SamplingParams(max_tokens=5, temperature=0.0)
  prompts = [[3, 17, 5, 9], [8, 1, 2]]
  engine = jaxinfer.Engine(cfg, params, config)
  assert engine.kv_scales_source == "params"
  np.testing.assert_allclose(engine.kv_scales[0]["k_scale"], [0.01, 0.02])
  np.testing.assert_allclose(engine.kv_scales[0]["v_scale"], [0.02, 0.04])
  single = [o.token_ids for o in engine.generate(prompts, sampling)]
  mesh = sharding.make_mesh({"tensor": 2}, jax.devices()[:2])
  sharded = jaxinfer.Engine(cfg, params, config, mesh=mesh, layout="tp")
  assert sharded.kv_scales_source == "params"
  assert [o.token_ids for o in sharded.generate(prompts, sampling)] == single


@pytest.mark.parametrize("fmt", ["modelopt_fp8", "ct_fp8_channel"])
def test_mla_checkpoint_kv_scales_drive_the_latent_cache(tmp_path, monkeypatch, fmt):
  """DeepSeek (MLA) KV scales as ModelOpt (k_scale / v_scale on
  kv_a_proj_with_mqa) and compressed-tensors (on self_attn) write them: the
  latent cache's one scale per layer is the larger of the two (the cached
  row is read as both K and V); with k_scale alone, k_scale."""
  import jaxinfer
  from jaxinfer.checkpoint import quant_export
  export_quantized(str(HF / "deepseek_v3"), str(tmp_path / "q"), fmt, kv_scales=True)
  cfg, params = checkpoint.load_hf(str(tmp_path / "q"), dtype=jnp.float32)
  config = jaxinfer.EngineConfig(kv_cache_dtype="fp8", page_size=8, num_pages=32, max_num_seqs=2)
  engine = jaxinfer.Engine(cfg, params, config)
  assert engine.kv_scales_source == "params"
  got = np.concatenate([seg["kv_scale"] for seg in engine.kv_scales])
  np.testing.assert_allclose(got, 0.02 * np.arange(1, cfg.num_layers + 1), rtol=1e-6)
  # A checkpoint with k scales only.
  k_only = quant_export._kv_scales
  monkeypatch.setattr(quant_export, "_kv_scales", lambda *a: {
      k: v for k, v in k_only(*a).items() if not k.endswith("v_scale")})
  export_quantized(str(HF / "deepseek_v3"), str(tmp_path / "k"), fmt, kv_scales=True)
  _, params = checkpoint.load_hf(str(tmp_path / "k"), dtype=jnp.float32)
  got = np.concatenate([np.atleast_1d(np.asarray(layer["attn"]["kv_scale"]))
                        for layer in params["layers"]])
  np.testing.assert_allclose(got, 0.01 * np.arange(1, cfg.num_layers + 1), rtol=1e-6)
