"""HF `config.json` <-> `ModelConfig` fields: `model_config_fields` (what
`ModelConfig.from_hf` builds its config from) and `to_hf`, its inverse for the
llama and deepseek_v3 families. Plain dicts on this side: the module imports
nothing from jaxinfer, so `config.py` imports it without a cycle.

Every key of the dict is either read, checked to hold a value we honour, or on
a short list of keys that do not change inference (training-only settings and
PretrainedConfig bookkeeping). Anything else raises, naming the key: a field we
would silently ignore is a numerics bug waiting to happen.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxinfer.hf_quant_config import quant_fields

SUPPORTED_MODEL_TYPES = ("llama", "mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_vl",
                         "qwen3_vl_moe")
VL_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")

# Keys that carry no inference semantics (PretrainedConfig bookkeeping,
# generation defaults, training-only losses and dropouts).
_IGNORED = frozenset("""
_name_or_path architectures attention_dropout bos_token_id pad_token_id
chunk_size_feed_forward dtype torch_dtype id2label label2id initializer_range
is_encoder_decoder output_attentions output_hidden_states problem_type return_dict
transformers_version use_cache pretraining_tp output_router_logits
router_aux_loss_coef router_jitter_noise aux_loss_alpha seq_aux tie_encoder_decoder
torchscript add_cross_attention is_decoder cross_attention_hidden_size
finetuning_task prefix sep_token_id decoder_start_token_id task_specific_params
tokenizer_class pruned_heads use_bfloat16 tf_legacy_loss bad_words_ids
begin_suppress_tokens diversity_penalty do_sample early_stopping
encoder_no_repeat_ngram_size exponential_decay_length_penalty forced_bos_token_id
forced_eos_token_id length_penalty max_length min_length no_repeat_ngram_size
num_beam_groups num_beams num_return_sequences output_scores
remove_invalid_values repetition_penalty return_dict_in_generate suppress_tokens
temperature top_k top_p typical_p auto_map num_labels initializer_factor
model_type attention_implementation _attn_implementation
""".split())

_ROPE_KEYS = {"rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor"}


class _Reader:
  """Tracks which keys of an HF config were consumed."""

  def __init__(self, hf: dict):
    self.hf = hf
    self.used: set[str] = set()

  def get(self, key: str, default: Any = None) -> Any:
    self.used.add(key)
    value = self.hf.get(key, default)
    return default if value is None else value

  def req(self, key: str) -> Any:
    self.used.add(key)
    if self.hf.get(key) is None:
      raise ValueError(f"config.json: required key {key!r} is missing")
    return self.hf[key]

  def expect(self, key: str, allowed: tuple, default: Any = None) -> Any:
    value = self.get(key, default)
    if value not in allowed:
      raise ValueError(f"config.json: {key}={value!r} is not supported (allowed: {allowed})")
    return value

  def leftover(self) -> list[str]:
    return sorted(k for k in self.hf if k not in self.used and k not in _IGNORED)


def model_config_fields(hf: dict) -> dict[str, Any]:
  """`ModelConfig` keyword arguments of an HF `config.json` dict (`rope_scaling`
  as a dict of `RopeScaling` fields); raises on any key it cannot honour."""
  if not isinstance(hf, dict):
    raise TypeError(f"from_hf expects a config.json dict, got {type(hf).__name__}")
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(
        f"config.json: model_type {model_type!r} is not supported "
        f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
  vl = None
  if model_type in VL_MODEL_TYPES:
    hf, vl = _split_vl(hf)
  r = _Reader(hf)
  kw: dict[str, Any] = dict(model_type=model_type)
  if vl is not None:
    kw.update(vl)
  d_model = r.req("hidden_size")
  num_heads = r.req("num_attention_heads")
  kw.update(
      vocab_size=r.req("vocab_size"),
      d_model=d_model,
      num_layers=r.req("num_hidden_layers"),
      num_heads=num_heads,
      num_kv_heads=r.get("num_key_value_heads", num_heads),
      norm_eps=float(r.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(r.get("tie_word_embeddings", False)),
      max_position_embeddings=r.get("max_position_embeddings", 4096),
      ffn_dim=r.get("intermediate_size", 0),
  )
  eos = r.get("eos_token_id")
  kw["eos_token_ids"] = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
  r.expect("hidden_act", ("silu",), "silu")
  r.expect("mlp_bias", (False,), False)
  kw.update(_rope(r))

  build = {"llama": _llama, "mixtral": _mixtral, "qwen3_moe": _qwen3_moe,
           "deepseek_v3": _deepseek_v3, "gpt_oss": _gpt_oss, "qwen3_vl": _qwen3_dense,
           "qwen3_vl_moe": _qwen3_vl_moe}[model_type]
  build(r, kw)
  if r.get("quantization_config") is not None:
    kw["quant"] = quant_fields(r.hf)
  leftover = r.leftover()
  if leftover:
    raise ValueError(
        f"config.json ({model_type}): unsupported keys {leftover}; jaxinfer would "
        "silently ignore them")
  return kw


def _head_dim(r: _Reader, kw: dict) -> int:
  return r.get("head_dim", kw["d_model"] // kw["num_heads"])


def _llama(r: _Reader, kw: dict) -> None:
  kw["head_dim"] = _head_dim(r, kw)
  bias = bool(r.get("attention_bias", False))
  kw.update(qkv_bias=bias, o_bias=bias)


def _mixtral(r: _Reader, kw: dict) -> None:
  _llama(r, kw)
  r.expect("sliding_window", (None,))
  kw.update(num_experts=r.req("num_local_experts"), num_experts_per_tok=r.req("num_experts_per_tok"),
            moe_ffn_dim=kw["ffn_dim"], router="softmax_topk", norm_topk_prob=True)


def _qwen3_moe(r: _Reader, kw: dict) -> None:
  _llama(r, kw)
  if r.get("use_sliding_window", False):
    raise ValueError("config.json: use_sliding_window=True is not supported for qwen3_moe")
  r.get("sliding_window"), r.get("max_window_layers")  # inert without use_sliding_window
  n = kw["num_layers"]
  step = r.get("decoder_sparse_step", 1)
  if not isinstance(step, int) or isinstance(step, bool) or step < 1:
    raise ValueError(f"config.json: decoder_sparse_step must be an integer >= 1, got {step!r}")
  mlp_only = set(r.get("mlp_only_layers", []))
  num_experts = r.get("num_experts", r.get("num_local_experts"))
  # HF Qwen3MoeDecoderLayer: sparse iff not mlp-only and (i + 1) % step == 0.
  dense = tuple(i for i in range(n) if i in mlp_only or num_experts == 0 or (i + 1) % step)
  kw.update(qk_norm=True, num_experts=num_experts, num_experts_per_tok=r.req("num_experts_per_tok"),
            moe_ffn_dim=r.req("moe_intermediate_size"), router="softmax_topk",
            norm_topk_prob=bool(r.get("norm_topk_prob", False)), dense_layers=dense)


def _qwen3_dense(r: _Reader, kw: dict) -> None:
  _llama(r, kw)
  kw["qk_norm"] = True


def _qwen3_vl_moe(r: _Reader, kw: dict) -> None:
  _qwen3_moe(r, kw)
  kw["norm_topk_prob"] = True  # HF's Qwen3-VL-MoE router always renormalises the top-k


def _split_vl(hf: dict) -> tuple[dict, dict]:
  """A Qwen3-VL config -> (its text_config as a flat config for the text
  builders, the `vision` / `mrope_section` fields). The text config's own
  tie_word_embeddings is HF's default, not what the model does: the
  top-level one decides (transformers ties lm_head by it)."""
  text = dict(hf.get("text_config") or {})
  if not text:
    raise ValueError(f"config.json ({hf['model_type']}): text_config is missing")
  text.update(model_type=hf["model_type"], tie_word_embeddings=hf.get("tie_word_embeddings", False))
  rope = {**(text.pop("rope_scaling", None) or {}), **(text.pop("rope_parameters", None) or {})}
  mrope = tuple(rope.pop("mrope_section", (24, 20, 20)))
  if not rope.pop("mrope_interleaved", True):
    raise ValueError("config.json: text_config mrope_interleaved=False is not supported")
  text["rope_parameters"] = rope
  r = _Reader(dict(hf.get("vision_config") or {}))
  vision = dict(depth=r.req("depth"), hidden_size=r.req("hidden_size"),
                intermediate_size=r.req("intermediate_size"), num_heads=r.req("num_heads"),
                out_hidden_size=r.req("out_hidden_size"), in_channels=r.get("in_channels", 3),
                patch_size=r.get("patch_size", 16), temporal_patch_size=r.get("temporal_patch_size", 2),
                spatial_merge_size=r.get("spatial_merge_size", 2),
                num_position_embeddings=r.get("num_position_embeddings", 2304),
                deepstack_indexes=tuple(r.get("deepstack_visual_indexes", ())))
  r.expect("hidden_act", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh")
  vrope = dict(r.get("rope_parameters", {}))
  if vrope.pop("rope_type", "axial") != "axial" or set(vrope) - {"rope_theta"}:
    raise ValueError(f"config.json: vision rope_parameters {r.hf['rope_parameters']} not supported")
  vision["rope_theta"] = float(vrope.get("rope_theta", 10000.0))
  for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
    if hf.get(key) is not None:
      vision[key] = hf[key]
  if r.leftover():
    raise ValueError(f"config.json: unsupported vision_config keys {r.leftover()}")
  return text, dict(vision=vision, mrope_section=mrope)


def _deepseek_v3(r: _Reader, kw: dict) -> None:
  if r.get("attention_bias", False):
    raise ValueError("config.json: attention_bias=True is not supported for deepseek_v3")
  r.expect("topk_method", ("noaux_tc",), "noaux_tc")
  r.expect("scoring_func", ("sigmoid",), "sigmoid")
  r.expect("moe_layer_freq", (1,), 1)
  r.get("ep_size")  # a deployment hint of the original code, not numerics
  r.get("head_dim"), r.get("qk_head_dim")  # derived from the MLA dims below
  n = kw["num_layers"]
  first_dense = r.get("first_k_dense_replace", 0)
  kw.update(
      attention="mla", head_dim=0,
      q_lora_rank=r.get("q_lora_rank", 0),
      kv_lora_rank=r.req("kv_lora_rank"),
      qk_nope_head_dim=r.req("qk_nope_head_dim"),
      qk_rope_head_dim=r.req("qk_rope_head_dim"),
      v_head_dim=r.req("v_head_dim"),
      rope_interleave=bool(r.get("rope_interleave", True)),
      num_experts=r.req("n_routed_experts"),
      num_experts_per_tok=r.req("num_experts_per_tok"),
      moe_ffn_dim=r.req("moe_intermediate_size"),
      num_shared_experts=r.get("n_shared_experts", 0),
      router="sigmoid_grouped",
      norm_topk_prob=bool(r.get("norm_topk_prob", True)),
      n_group=r.get("n_group", 1),
      topk_group=r.get("topk_group", 1),
      routed_scaling_factor=float(r.get("routed_scaling_factor", 1.0)),
      dense_layers=tuple(range(min(first_dense, n))),
      num_mtp_layers=r.get("num_nextn_predict_layers", 0),
  )


def _gpt_oss(r: _Reader, kw: dict) -> None:
  kw["head_dim"] = _head_dim(r, kw)
  bias = bool(r.get("attention_bias", True))
  n = kw["num_layers"]
  layer_types = tuple(r.get("layer_types", ()))
  window = r.get("sliding_window", 0)
  kw.update(
      qkv_bias=bias, o_bias=bias, attention_sinks=True,
      sliding_window=window if layer_types != ("full_attention",) * n else 0,
      layer_types=layer_types,
      num_experts=r.req("num_local_experts"),
      num_experts_per_tok=r.get("num_experts_per_tok", r.get("experts_per_token")),
      moe_ffn_dim=kw["ffn_dim"], router="topk_softmax", router_bias=True, expert_bias=True,
      activation="clamped_swiglu", swiglu_limit=float(r.get("swiglu_limit", 7.0)),
      swiglu_alpha=float(r.get("swiglu_alpha", 1.702)),
  )
  r.get("initial_context_length")  # informational (== rope original_max_position_embeddings)


def _rope(r: _Reader) -> dict:
  """Reads both `rope_theta` + `rope_scaling` (published checkpoints, old
  `type` key included) and transformers 5's `rope_parameters`."""
  params = r.get("rope_parameters")
  if params and all(isinstance(v, dict) for v in params.values()):
    # Per-layer-type parameters (transformers 5): accept only if all equal.
    values = list(params.values())
    if any(v != values[0] for v in values):
      raise ValueError("config.json: per-layer-type rope_parameters that differ are not supported")
    params = values[0]
  params = dict(params or {})
  scaling = r.get("rope_scaling")
  if scaling:
    params = {**scaling, **params}
  theta = params.pop("rope_theta", None) or r.get("rope_theta", 10000.0)
  if r.get("partial_rotary_factor", 1.0) != 1.0 or params.pop("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError("config.json: partial_rotary_factor != 1 is not supported")
  kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
  params.pop("type", None)
  out: dict[str, Any] = dict(rope_theta=float(theta))
  if kind == "default":
    _no_more(params, kind)
    return out
  if kind not in ("linear", "llama3", "yarn"):
    raise ValueError(f"config.json: rope type {kind!r} is not supported (default, linear, llama3, yarn)")
  fields = dict(kind=kind, factor=float(params.pop("factor")))
  for key in ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
              "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"):
    if params.get(key) is not None:
      fields[key] = params.pop(key)
    else:
      params.pop(key, None)
  _no_more(params, kind)
  out["rope_scaling"] = fields  # `RopeScaling` fields
  return out


def _no_more(params: dict, kind: str) -> None:
  if params:
    raise ValueError(f"config.json: rope parameters {sorted(params)} are not supported for rope type {kind!r}")


# ------------------------------------------------- ModelConfig -> HF

def to_hf(cfg) -> dict:
  """The HF `config.json` dict of a llama- or deepseek_v3-family config: the
  inverse of `ModelConfig.from_hf`, checked by mapping it back (runtime-only
  fields dtype / backend / moe_impl aside). Raises ValueError for
  other families or configs HF cannot express."""
  if cfg.model_type not in ("llama", "deepseek_v3"):
    raise ValueError(f"to_hf: model_type {cfg.model_type!r} is not supported "
                     "(llama, deepseek_v3)")
  eos = list(cfg.eos_token_ids)
  hf = dict(model_type=cfg.model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads, intermediate_size=cfg.ffn_dim,
            rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
            max_position_embeddings=cfg.max_position_embeddings, hidden_act="silu",
            eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
            rope_parameters=_rope_parameters(cfg))
  if cfg.model_type == "llama":
    hf.update(head_dim=cfg.head_dim, attention_bias=cfg.qkv_bias, mlp_bias=False)
  else:
    first_dense = len(cfg.dense_layers)
    if cfg.dense_layers != tuple(range(first_dense)):
      raise ValueError(f"to_hf: deepseek_v3 dense layers must be a prefix, got "
                       f"{cfg.dense_layers}")
    hf.update(
        attention_bias=False, q_lora_rank=cfg.q_lora_rank or None,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        qk_head_dim=cfg.qk_head_dim, head_dim=cfg.qk_rope_head_dim,  # HF's convention
        rope_interleave=cfg.rope_interleave, n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_ffn_dim,
        n_shared_experts=cfg.num_shared_experts, norm_topk_prob=cfg.norm_topk_prob,
        n_group=cfg.n_group, topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor, first_k_dense_replace=first_dense,
        num_nextn_predict_layers=cfg.num_mtp_layers)
  back = type(cfg).from_hf(hf)
  back = dataclasses.replace(back, dtype=cfg.dtype, backend=cfg.backend, moe_impl=cfg.moe_impl)
  if back != cfg:
    diff = [f.name for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != getattr(back, f.name)]
    raise ValueError(f"to_hf: HF's {cfg.model_type} config cannot express fields {diff}")
  return hf


_ROPE_FIELDS = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings"),
                "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                         "mscale", "mscale_all_dim", "attention_factor", "truncate")}


def _rope_parameters(cfg) -> dict:
  """transformers 5's `rope_parameters` for cfg's RoPE."""
  rs = cfg.rope_scaling
  if rs is None:
    return dict(rope_theta=cfg.rope_theta, rope_type="default")
  out = dict(rope_theta=cfg.rope_theta, rope_type=rs.kind)
  out.update({k: getattr(rs, k) for k in _ROPE_FIELDS[rs.kind] if getattr(rs, k) is not None})
  return out
