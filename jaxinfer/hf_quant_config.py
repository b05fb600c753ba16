"""An HF `quantization_config` -> `QuantConfig` fields (plain dicts, like
`hf_config`, which calls `quant_fields`; imports nothing from jaxinfer).

Formats (shared reference `quant_formats.md`): DeepSeek block FP8
(`quant_method: fp8`), fbgemm FP8 per channel, GPT-OSS MXFP4 experts,
ModelOpt NVFP4 / FP8 (`quant_method: modelopt`; `load_hf` folds a separate
`hf_quant_config.json` in), compressed-tensors FP8 (tensor, channel, block)
and NVFP4. Exclude lists (`modules_to_not_convert`, `exclude_modules`,
`ignore`) are matched against each target's HF module in every layer: a
target is quantized in all layers or in none (layers are stacked), else the
error names the target.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

QUANT_METHODS = ("fp8", "fbgemm_fp8", "mxfp4", "modelopt", "compressed-tensors")

# target -> HF module under model.layers.{i} (experts: expert 0's).
_MODULES = {
    "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj", "attn.wq_a": "self_attn.q_a_proj",
    "attn.wq_b": "self_attn.q_b_proj", "attn.wkv_a": "self_attn.kv_a_proj_with_mqa",
    "attn.wkv_b": "self_attn.kv_b_proj",
    "mlp.w_gate": "mlp.gate_proj", "mlp.w_up": "mlp.up_proj", "mlp.w_down": "mlp.down_proj",
    "shared.w_gate": "mlp.shared_experts.gate_proj", "shared.w_up": "mlp.shared_experts.up_proj",
    "shared.w_down": "mlp.shared_experts.down_proj",
    "experts.w_gate": "mlp.experts.0.gate_proj", "experts.w_up": "mlp.experts.0.up_proj",
    "experts.w_down": "mlp.experts.0.down_proj", "mtp.eh_proj": "eh_proj",
}
_EXPERT_MODULES = {"mixtral": {"experts.w_gate": "block_sparse_moe.experts.0.w1",
                               "experts.w_up": "block_sparse_moe.experts.0.w3",
                               "experts.w_down": "block_sparse_moe.experts.0.w2"},
                   "gpt_oss": {"experts.w_gate": "mlp.experts", "experts.w_up": "mlp.experts",
                               "experts.w_down": "mlp.experts"}}


def _excluded(module: str, patterns) -> bool:
  for p in patterns:
    if p.startswith("re:"):
      if re.match(p[3:], module):
        return True
    elif module == p or module.startswith(p + ".") or fnmatch.fnmatchcase(module, p) \
        or fnmatch.fnmatchcase(module, p + ".*"):
      return True
  return False


def _layer_targets(hf: dict, i: int) -> list[str]:
  """Targets present in layer i (num_layers + m: MTP module m)."""
  n = hf["num_hidden_layers"]
  mla = bool(hf.get("kv_lora_rank"))
  if mla:
    q = ["attn.wq_a", "attn.wq_b"] if hf.get("q_lora_rank") else ["attn.wq"]
    attn = q + ["attn.wkv_a", "attn.wkv_b", "attn.wo"]
  else:
    attn = ["attn.wq", "attn.wk", "attn.wv", "attn.wo"]
  experts = hf.get("n_routed_experts") or hf.get("num_local_experts") or hf.get("num_experts")
  dense = not experts or i < hf.get("first_k_dense_replace", 0) or i in hf.get("mlp_only_layers", ())
  out = attn + ([f"mlp.{w}" for w in ("w_gate", "w_up", "w_down")] if dense else
                [f"experts.{w}" for w in ("w_gate", "w_up", "w_down")])
  if not dense and hf.get("n_shared_experts"):
    out += [f"shared.{w}" for w in ("w_gate", "w_up", "w_down")]
  if i >= n:
    out.append("mtp.eh_proj")
  return out


def _targets(hf: dict, patterns, only: tuple[str, ...] | None = None) -> tuple[str, ...]:
  """Targets quantized in every layer; raises for one quantized in some only."""
  n = hf["num_hidden_layers"] + int(hf.get("num_nextn_predict_layers") or 0) \
      if hf.get("model_type") == "deepseek_v3" else hf["num_hidden_layers"]
  modules = {**_MODULES, **_EXPERT_MODULES.get(hf.get("model_type"), {})}
  seen: dict[str, list[bool]] = {}
  for i in range(n):
    for t in _layer_targets(hf, i):
      if only is not None and t not in only:
        continue
      seen.setdefault(t, []).append(not _excluded(f"model.layers.{i}.{modules[t]}", patterns))
  mixed = sorted(t for t, q in seen.items() if any(q) and not all(q))
  if mixed:
    raise ValueError(f"quantization_config: {mixed} are quantized in some layers only; jaxinfer "
                     "stacks layers and needs each target quantized in all layers or none")
  return tuple(t for t, q in seen.items() if all(q))


def _require(qc: dict, key: str, allowed) -> Any:
  value = qc.get(key)
  if value not in allowed:
    raise ValueError(f"config.json: quantization_config.{key}={value!r} is not supported "
                     f"(allowed: {allowed})")
  return value


def _compressed_tensors(qc: dict) -> dict:
  groups = qc.get("config_groups") or {}
  if len(groups) != 1:
    raise ValueError(f"config.json: compressed-tensors with {len(groups)} config_groups; "
                     "jaxinfer loads exactly one")
  (group,) = groups.values()
  if group.get("targets") != ["Linear"]:
    raise ValueError(f"config.json: compressed-tensors targets {group.get('targets')}; "
                     "expected ['Linear']")
  w = group.get("weights") or {}
  kind = (w.get("type"), w.get("num_bits"), w.get("strategy"))
  if kind == ("float", 8, "tensor"):
    out = dict(method="fp8", block=(0, 0))
  elif kind == ("float", 8, "channel"):
    out = dict(method="fp8", block=(1, 0))
  elif kind == ("float", 8, "block"):
    out = dict(method="fp8", block=tuple(w.get("block_structure") or (128, 128)))
  elif kind == ("float", 4, "tensor_group") and w.get("group_size") == 16:
    out = dict(method="nvfp4", block=(1, 16))
  else:
    raise ValueError(f"config.json: compressed-tensors weights {w} are not supported (float 8-bit "
                     "tensor/channel/block, or float 4-bit tensor_group 16 = NVFP4)")
  kv = qc.get("kv_cache_scheme")
  out["kv_cache"] = "fp8" if kv and kv.get("type") == "float" and kv.get("num_bits") == 8 else None
  return dict(out, layout="compressed_tensors", exclude=qc.get("ignore") or [])


def _modelopt(qc: dict) -> dict:
  q = qc.get("quantization", qc)
  algo = q.get("quant_algo")
  if algo == "NVFP4":
    if q.get("group_size", 16) != 16:
      raise ValueError(f"config.json: ModelOpt NVFP4 group_size {q.get('group_size')}; expected 16")
    out = dict(method="nvfp4", block=(1, 16))
  elif algo == "FP8":
    out = dict(method="fp8", block=(0, 0))
  else:
    raise ValueError(f"config.json: ModelOpt quant_algo {algo!r} is not supported (NVFP4, FP8)")
  kv = q.get("kv_cache_quant_algo")
  if kv not in (None, "FP8"):
    raise ValueError(f"config.json: ModelOpt kv_cache_quant_algo {kv!r} is not supported (FP8)")
  return dict(out, layout="modelopt", kv_cache="fp8" if kv else None,
              exclude=q.get("exclude_modules") or [])


def quant_fields(hf: dict) -> dict:
  """`QuantConfig` keyword arguments of config.json's `quantization_config`."""
  qc = hf["quantization_config"]
  if not isinstance(qc, dict):
    raise ValueError("config.json: quantization_config must be a dict")
  method = _require(qc, "quant_method", QUANT_METHODS)
  only = None
  if method == "fp8":
    _require(qc, "fmt", ("e4m3", None))
    block = tuple(qc.get("weight_block_size") or (128, 128))
    f = dict(method="fp8", block=block, layout="deepseek_fp8",
             exclude=qc.get("modules_to_not_convert") or [])
  elif method == "fbgemm_fp8":
    f = dict(method="fp8", block=(1, 0), layout="fbgemm_fp8",
             exclude=qc.get("modules_to_not_convert") or [])
  elif method == "mxfp4":
    f = dict(method="mxfp4", block=(1, 32), layout="mxfp4",
             exclude=qc.get("modules_to_not_convert") or [])
    only = ("experts.w_gate", "experts.w_up", "experts.w_down")
  elif method == "modelopt":
    f = _modelopt(qc)
  else:
    f = _compressed_tensors(qc)
  exclude = f.pop("exclude")
  f["targets"] = _targets(hf, exclude, only)
  if not f["targets"]:
    raise ValueError("quantization_config excludes every weight jaxinfer would quantize")
  return f
