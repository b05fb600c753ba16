"""Quantized HF checkpoints built from float ones, in each published layout
(the tiny quantized fixtures of the tests; nothing is downloaded):

  export_quantized(src_dir, out_dir, "deepseek_fp8", block=(128, 128))
  export_quantized(src_dir, out_dir, "mxfp4")        # GPT-OSS experts
  export_quantized(src_dir, out_dir, "modelopt_nvfp4", targets=...)

Formats: deepseek_fp8, fbgemm_fp8, mxfp4, modelopt_nvfp4, modelopt_fp8,
ct_fp8_tensor, ct_fp8_channel, ct_nvfp4 (compressed-tensors). Each writes
the tensor names, dtypes and config entries of `hf_quant` / `quant_formats.md`;
the values come from `models.quant.quantize_matrix`. `save_safetensors`
writes fp8 and uint8 tensors, which safetensors' numpy API cannot.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxinfer.checkpoint import hf_names
from jaxinfer.checkpoint.hf_quant import tensor_names
from jaxinfer.config import QUANT_TARGETS, ModelConfig, QuantConfig
from jaxinfer.hf_quant_config import _MODULES
from jaxinfer.models.quant import quantize_matrix

_ST_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
              np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
              np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8"}

# format -> (QuantConfig method, layout, default block)
FORMATS = {
    "deepseek_fp8": ("fp8", "deepseek_fp8", (128, 128)),
    "fbgemm_fp8": ("fp8", "fbgemm_fp8", (1, 0)),
    "mxfp4": ("mxfp4", "mxfp4", (1, 32)),
    "modelopt_nvfp4": ("nvfp4", "modelopt", (1, 16)),
    "modelopt_fp8": ("fp8", "modelopt", (0, 0)),
    "ct_fp8_tensor": ("fp8", "compressed_tensors", (0, 0)),
    "ct_fp8_channel": ("fp8", "compressed_tensors", (1, 0)),
    "ct_nvfp4": ("nvfp4", "compressed_tensors", (1, 16)),
}


def save_safetensors(tensors: dict[str, np.ndarray], path: str) -> None:
  """Writes a safetensors file of numpy arrays of any `_ST_DTYPES` dtype."""
  header, offset, blobs = {}, 0, []
  for name in sorted(tensors):
    a = np.asarray(tensors[name])  # (ascontiguousarray would make a scalar 1-d)
    data = a.tobytes()
    header[name] = dict(dtype=_ST_DTYPES[a.dtype], shape=list(a.shape),
                        data_offsets=[offset, offset + len(data)])
    blobs.append(data)
    offset += len(data)
  h = json.dumps(header).encode()
  h += b" " * (-len(h) % 8)
  with open(path, "wb") as f:
    f.write(len(h).to_bytes(8, "little"))
    f.write(h)
    for b in blobs:
      f.write(b)


def _weights(cfg: ModelConfig, targets, has) -> dict[str, hf_names.WeightRef]:
  """HF weight name -> its WeightRef, for every targeted projection."""
  out = {}
  for srcs in hf_names.model_sources(cfg, has).values():
    for src in srcs if isinstance(srcs, list) else [srcs]:
      if src.ref is not None and src.ref.target in targets and has(src.ref.names[0]):
        out.update({name: src.ref for name in src.ref.names})
  return out


def _quantized_tensors(q: QuantConfig, name: str, w: np.ndarray) -> dict[str, np.ndarray]:
  """One float weight [*lead, out, in] -> its tensors in q's layout."""
  values, scale, scale2 = quantize_matrix(w, q.method, q.block)
  names = tensor_names(q, name)
  *lead, out, d_in = w.shape
  if q.layout == "mxfp4":
    return {names["values"]: values.reshape(*lead, out, d_in // 32, 16), names["scale"]: scale}
  out_t = {names["values"]: values}
  if q.layout in ("fbgemm_fp8",) or (q.layout == "compressed_tensors" and q.block == (1, 0)):
    out_t[names["scale"]] = scale.reshape(*lead, out, 1)
  elif q.method == "fp8" and q.block == (0, 0):
    out_t[names["scale"]] = scale.reshape(tuple(lead) if q.layout == "modelopt" else (*lead, 1))
  else:
    out_t[names["scale"]] = scale
  if scale2 is not None:
    s2 = 1.0 / scale2 if q.layout == "compressed_tensors" else scale2
    out_t[names["scale2"]] = s2.reshape(*lead, 1) if q.layout == "compressed_tensors" else s2
  if q.layout == "modelopt":
    out_t[names["extra"][0]] = np.ones(tuple(lead), np.float32)  # an activation scale, unused weight-only
  return out_t


def _exclude(targets, model_type: str) -> list[str]:
  """Module patterns of the projections left in float (plus heads and routers)."""
  pats = ["lm_head", "model.embed_tokens", "model.layers.*.mlp.gate", "model.layers.*.mlp.router"]
  for t in sorted(set(QUANT_TARGETS) - set(targets)):
    module = _MODULES[t]
    if t.startswith("experts."):
      module = "block_sparse_moe.experts.*" if model_type == "mixtral" else "mlp.experts*"
    pats.append(f"model.layers.*.{module}")
  return pats


def _config_entry(fmt: str, q: QuantConfig, exclude: list[str]) -> tuple[dict, dict | None]:
  """(quantization_config, hf_quant_config.json or None)."""
  if fmt == "deepseek_fp8":
    return dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                weight_block_size=list(q.block), modules_to_not_convert=exclude), None
  if fmt == "fbgemm_fp8":
    return dict(quant_method="fbgemm_fp8", activation_scale_ub=1200.0,
                modules_to_not_convert=exclude), None
  if fmt == "mxfp4":
    return dict(quant_method="mxfp4", modules_to_not_convert=exclude), None
  if fmt.startswith("modelopt"):
    algo = "NVFP4" if q.method == "nvfp4" else "FP8"
    quant = dict(quant_algo=algo, kv_cache_quant_algo="FP8" if q.kv_cache else None,
                 exclude_modules=exclude,
                 **({"group_size": 16} if algo == "NVFP4" else {}))
    return None, dict(producer=dict(name="modelopt"), quantization=quant)
  weights = dict(num_bits=8, type="float", symmetric=True, dynamic=False,
                 strategy="tensor" if q.block == (0, 0) else "channel")
  if q.method == "nvfp4":
    weights = dict(num_bits=4, type="float", symmetric=True, dynamic=False,
                   strategy="tensor_group", group_size=16)
  kv = dict(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
  return dict(quant_method="compressed-tensors", quantization_status="compressed",
              kv_cache_scheme=kv if q.kv_cache else None,
              format="nvfp4-pack-quantized" if q.method == "nvfp4" else "float-quantized",
              config_groups=dict(group_0=dict(targets=["Linear"], weights=weights,
                                              input_activations=None)),
              ignore=exclude), None


def _kv_scales(cfg: ModelConfig, q: QuantConfig, layers) -> dict[str, np.ndarray]:
  """Per-layer KV cache scales (layer i: k 0.01 (i + 1), v 0.02 (i + 1)),
  named as ModelOpt (on k_proj / v_proj; MLA: both on kv_a_proj_with_mqa) or
  compressed-tensors (on the attention module) write them."""
  out = {}
  for i in layers:
    a = f"model.layers.{i}.self_attn"
    for kv, v in (("k", 0.01 * (i + 1)), ("v", 0.02 * (i + 1))):
      if q.layout != "modelopt":
        name = f"{a}.{kv}_scale"
      elif cfg.attention.latent:
        name = f"{a}.kv_a_proj_with_mqa.{kv}_scale"
      else:
        name = f"{a}.{kv}_proj.{kv}_scale"
      out[name] = np.full(() if q.layout == "modelopt" else (1,), v, np.float32)
  return out


def published_experts(cfg: ModelConfig, tensors: dict) -> dict:
  """Fused experts in transformers 5's in-memory layout (`experts.gate_up_proj`
  [E, 2F, D], `experts.down_proj` [E, D, F], from save_pretrained(
  save_original_format=False)) split into the per-expert tensors that
  published Qwen3-MoE, Mixtral (w1 / w3 / w2 under `block_sparse_moe`) and
  DeepSeek checkpoints hold;
  other tensors (and GPT-OSS's, Qwen3-VL-MoE's fused layouts) unchanged."""
  if cfg.model_type in ("gpt_oss", "qwen3_vl_moe"):
    return tensors
  g, u, d = ("w1", "w3", "w2") if cfg.model_type == "mixtral" else ("gate_proj", "up_proj",
                                                                      "down_proj")
  F, out = cfg.moe_ffn_dim, {}
  for name, w in tensors.items():
    if cfg.model_type == "mixtral" and (".mlp.experts." in name or ".mlp.gate." in name):
      name = name.replace(".mlp.", ".block_sparse_moe.")  # Mixtral's published module name
    if name.endswith(".experts.gate_up_proj"):
      x = name[:-len(".gate_up_proj")]
      for e in range(w.shape[0]):
        out[f"{x}.{e}.{g}.weight"], out[f"{x}.{e}.{u}.weight"] = w[e, :F], w[e, F:]
    elif name.endswith(".experts.down_proj"):
      x = name[:-len(".down_proj")]
      out.update({f"{x}.{e}.{d}.weight": w[e] for e in range(w.shape[0])})
    else:
      out[name] = w
  return out


def export_quantized(src_dir: str, out_dir: str, fmt: str, *, block=None, targets=None,
                     kv_scales: bool = False) -> QuantConfig:
  """Writes src_dir's float checkpoint (one safetensors file) quantized in
  `fmt` to out_dir; returns the QuantConfig it encodes. targets default to
  every projection (MXFP4: the routed experts, as GPT-OSS ships); kv_scales
  (ModelOpt and compressed-tensors) adds per-layer FP8 KV cache
  scales and declares them in the config. Experts are written in the
  published layout (`published_experts`), whichever layout src_dir holds."""
  if fmt not in FORMATS:
    raise ValueError(f"export_quantized: fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
  method, layout, default_block = FORMATS[fmt]
  with open(os.path.join(src_dir, "config.json")) as f:
    hf = json.load(f)
  cfg = ModelConfig.from_hf(hf)
  if targets is None:
    targets = ("experts.w_gate", "experts.w_up", "experts.w_down") if method == "mxfp4" else QUANT_TARGETS
  q = QuantConfig(method=method, block=tuple(block or default_block), targets=tuple(targets),
                  layout=layout, kv_cache="fp8" if kv_scales else None)
  if kv_scales and layout not in ("modelopt", "compressed_tensors"):
    raise ValueError("export_quantized: kv_scales needs a ModelOpt or compressed-tensors format")
  with safe_open(os.path.join(src_dir, "model.safetensors"), "numpy") as f:
    tensors = published_experts(cfg, {k: f.get_tensor(k) for k in f.keys()})
  refs = _weights(cfg, q.targets, tensors.__contains__)
  out: dict[str, np.ndarray] = {}
  for name, w in tensors.items():
    if name not in refs:
      out[name] = w
      continue
    if cfg.model_type == "gpt_oss" and refs[name].lead:  # fused experts stored [E, in, out]
      w = np.swapaxes(w, -1, -2)
    out.update(_quantized_tensors(q, name, w.astype(np.float32)))
  if kv_scales:
    # Every attention layer the checkpoint holds (MTP modules included).
    layers = sorted({int(n.split(".")[2]) for n in tensors
                     if n.startswith("model.layers.") and ".self_attn.o_proj." in n})
    out.update(_kv_scales(cfg, q, layers))
  os.makedirs(out_dir, exist_ok=True)
  save_safetensors(out, os.path.join(out_dir, "model.safetensors"))
  qc, modelopt = _config_entry(fmt, q, _exclude(q.targets, cfg.model_type))
  if qc is not None:
    hf = dict(hf, quantization_config=qc)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf, f, indent=1)
  if modelopt is not None:
    with open(os.path.join(out_dir, "hf_quant_config.json"), "w") as f:
      json.dump(modelopt, f, indent=1)
  return q
