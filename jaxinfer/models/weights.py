"""Every weight declared once: its place in our tree, shape, logical axes,
initializer, and the Hugging Face tensor it is read from.

`model_weights(cfg)` is the declaration tree: nested dicts of `Weight`
leaves, with a `Stacked` node for each run of identical blocks (decoder
segments, MTP modules, vision blocks, DeepStack mergers). Two readers derive
everything else from it, so neither branches on the architecture again:
`specs.param_specs` (the `ParamSpec` tree: init, shardings, restore) and
`checkpoint.hf_names` (the HF tensors of every leaf).

A weight's `hf` names its tensor relative to the enclosing `Stacked` prefix
(`model.layers.{i}`), absolute outside one; `stored` says how HF stores it:
  same    as ours; with `part`, ours is that slice of the last axis of a
          tensor twice as wide (a fused gate/up projection)
  flat    ours flattened ([N, H] head biases; a scalar scale stored as [1])
  linear  nn.Linear [out, in]: ours is [*lead, *in, *out] with `in_dims` in
          dims after the `lead` expert dim; experts one tensor per expert
          where `hf` holds "{e}", else [E, out, in] (`part`: rows of a fused
          [E, 2F, in]); `hf_shape` where the tensor is not the flat [out, in]
          (a conv kernel)
  max     a scalar: the largest of the tensors `hf` lists that the
          checkpoint holds (the first must be there)
Projections name their `QuantConfig` target (`quant`): they are held
quantized when cfg.quant targets them, and read so from quantized checkpoints.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.config import ModelConfig, VisionConfig


@dataclasses.dataclass(frozen=True)
class Weight:
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]
  init: str = "normal"  # normal (fan-in scaled) | ones | zeros
  hf: str | tuple[str, ...] = ""
  stored: str = "same"  # same | flat | linear | max (module docstring)
  in_dims: int = 1
  part: slice | None = None
  hf_shape: tuple[int, ...] | None = None
  quant: str | None = None  # the QUANT_TARGETS entry of a projection
  dtype: str | None = None  # a fixed dtype (KV cache scales: float32), else the model's

  def __post_init__(self):
    if len(self.shape) != len(self.axes):
      raise ValueError(f"Weight {self.hf}: shape {self.shape} vs axes {self.axes}")

  @property
  def lead(self) -> int:
    """Leading expert dims (the stacked routed experts)."""
    return 1 if self.axes[:1] == ("expert",) else 0


@dataclasses.dataclass(frozen=True)
class Stacked:
  """`count` copies of `tree` stacked on a leading `layers` axis; copy j's
  HF tensors live under prefix.format(i=first + j)."""
  count: int
  prefix: str
  tree: dict
  first: int = 0


def _linear(module: str, shape, axes, quant: str | None = None, in_dims: int = 1) -> Weight:
  return Weight(tuple(shape), axes, hf=f"{module}.weight", stored="linear", in_dims=in_dims,
                quant=quant)


def _ones(hf: str, shape, axes) -> Weight:
  return Weight(tuple(shape), axes, "ones", hf=hf)


def _zeros(hf: str, shape, axes, stored: str = "same", part: slice | None = None) -> Weight:
  return Weight(tuple(shape), axes, "zeros", hf=hf, stored=stored, part=part)


def _kv_scales(cfg: ModelConfig, a: str) -> dict:
  """The checkpoint's per-layer KV cache scales (float32 whatever the dtype):
  the Engine's quantized cache reads them (`kv.scales`); the forward does
  not. ModelOpt puts scalars on the k / v projections (MLA: both on
  kv_a_proj_with_mqa), compressed-tensors [1] on the attention module. MLA's
  one latent cache row is read as K and V, so its scale is the larger."""
  modelopt = cfg.quant.layout == "modelopt"
  scale = lambda hf, stored="same": Weight((), (), "ones", hf=hf, stored=stored,
                                           hf_shape=() if modelopt else (1,), dtype="float32")
  if cfg.attention.latent:
    base = f"{a}.kv_a_proj_with_mqa" if modelopt else a
    return dict(kv_scale=scale((f"{base}.k_scale", f"{base}.v_scale"), "max"))
  if modelopt:
    return dict(k_scale=scale(f"{a}.k_proj.k_scale"), v_scale=scale(f"{a}.v_proj.v_scale"))
  return dict(k_scale=scale(f"{a}.k_scale", "flat"), v_scale=scale(f"{a}.v_scale", "flat"))


def _mla(cfg: ModelConfig, a: str) -> dict:
  D, N = cfg.d_model, cfg.num_heads
  R, Hr, Hn, Hv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
  heads = ("q_heads", "head_dim")
  p = {}
  if cfg.q_lora_rank:
    Rq = cfg.q_lora_rank
    p.update(wq_a=_linear(f"{a}.q_a_proj", (D, Rq), ("embed", "q_lora"), "attn.wq_a"),
             q_norm=_ones(f"{a}.q_a_layernorm.weight", (Rq,), ("q_lora",)),
             wq_b=_linear(f"{a}.q_b_proj", (Rq, N, Hn + Hr), ("q_lora", *heads), "attn.wq_b"))
  else:
    p["wq"] = _linear(f"{a}.q_proj", (D, N, Hn + Hr), ("embed", *heads), "attn.wq")
  p.update(wkv_a=_linear(f"{a}.kv_a_proj_with_mqa", (D, R + Hr), ("embed", "kv_lora"),
                         "attn.wkv_a"),
           kv_norm=_ones(f"{a}.kv_a_layernorm.weight", (R,), ("kv_lora",)),
           wkv_b=_linear(f"{a}.kv_b_proj", (R, N, Hn + Hv), ("kv_lora", *heads), "attn.wkv_b"),
           wo=_linear(f"{a}.o_proj", (N, Hv, D), (*heads, "embed"), "attn.wo", in_dims=2))
  return p


def _gqa(cfg: ModelConfig, a: str) -> dict:
  D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  q, kv = ("q_heads", "head_dim"), ("kv_heads", "head_dim")
  p = dict(wq=_linear(f"{a}.q_proj", (D, N, H), ("embed", *q), "attn.wq"),
           wk=_linear(f"{a}.k_proj", (D, K, H), ("embed", *kv), "attn.wk"),
           wv=_linear(f"{a}.v_proj", (D, K, H), ("embed", *kv), "attn.wv"),
           wo=_linear(f"{a}.o_proj", (N, H, D), (*q, "embed"), "attn.wo", in_dims=2))
  if cfg.qkv_bias:
    p.update(bq=_zeros(f"{a}.q_proj.bias", (N, H), q, "flat"),
             bk=_zeros(f"{a}.k_proj.bias", (K, H), kv, "flat"),
             bv=_zeros(f"{a}.v_proj.bias", (K, H), kv, "flat"))
  if cfg.o_bias:
    p["bo"] = _zeros(f"{a}.o_proj.bias", (D,), ("embed",))
  if cfg.qk_norm:
    p.update(q_norm=_ones(f"{a}.q_norm.weight", (H,), ("head_dim",)),
             k_norm=_ones(f"{a}.k_norm.weight", (H,), ("head_dim",)))
  if cfg.attention_sinks:
    p["sinks"] = _zeros(f"{a}.sinks", (N,), ("q_heads",))
  return p


def _attention(cfg: ModelConfig) -> dict:
  a = "self_attn"
  p = _mla(cfg, a) if cfg.attention.latent else _gqa(cfg, a)
  if cfg.quant is not None and cfg.quant.kv_cache:
    p.update(_kv_scales(cfg, a))
  return p


def _dense_mlp(m: str, D: int, F: int, group: str) -> dict:
  """A gated MLP at module m; `group`: its quantization targets' prefix (mlp | shared)."""
  return dict(w_gate=_linear(f"{m}.gate_proj", (D, F), ("embed", "mlp"), f"{group}.w_gate"),
              w_up=_linear(f"{m}.up_proj", (D, F), ("embed", "mlp"), f"{group}.w_up"),
              w_down=_linear(f"{m}.down_proj", (F, D), ("mlp", "embed"), f"{group}.w_down"))


def _experts(cfg: ModelConfig, x: str) -> dict:
  """The routed experts at module x: one tensor per expert (Mixtral's
  w1 / w3 / w2), or GPT-OSS's one layout: `gate_up_proj` [E, D, 2F], gate /
  up interleaved on the last axis, `down_proj` [E, F, D], and their biases."""
  D, E, F = cfg.d_model, cfg.num_experts, cfg.moe_ffn_dim
  ax_in, ax_out = ("expert", "embed", "mlp"), ("expert", "mlp", "embed")
  if cfg.model_type == "gpt_oss":
    fused = lambda name, part, tgt: Weight((E, D, F), ax_in, hf=f"{x}.{name}", part=part, quant=tgt)
    p = dict(w_gate=fused("gate_up_proj", slice(0, None, 2), "experts.w_gate"),
             w_up=fused("gate_up_proj", slice(1, None, 2), "experts.w_up"),
             w_down=Weight((E, F, D), ax_out, hf=f"{x}.down_proj", quant="experts.w_down"))
  else:
    g, u, d = ("w1", "w3", "w2") if cfg.model_type == "mixtral" else ("gate_proj", "up_proj",
                                                                      "down_proj")
    one = lambda name, shape, ax, tgt: _linear(f"{x}.{{e}}.{name}", shape, ax, tgt)
    p = dict(w_gate=one(g, (E, D, F), ax_in, "experts.w_gate"),
             w_up=one(u, (E, D, F), ax_in, "experts.w_up"),
             w_down=one(d, (E, F, D), ax_out, "experts.w_down"))
  if cfg.expert_bias:
    gu = lambda part: _zeros(f"{x}.gate_up_proj_bias", (E, F), ("expert", "mlp"), part=part)
    p.update(b_gate=gu(slice(0, None, 2)), b_up=gu(slice(1, None, 2)),
             b_down=_zeros(f"{x}.down_proj_bias", (E, D), ("expert", "embed")))
  return p


def _moe(cfg: ModelConfig) -> dict:
  m, D, E = "mlp", cfg.d_model, cfg.num_experts
  router = f"{m}.router" if cfg.model_type == "gpt_oss" else f"{m}.gate"
  p = dict(router=_linear(router, (D, E), ("embed", None)), **_experts(cfg, f"{m}.experts"))
  if cfg.router_bias:
    p["router_bias"] = _zeros(f"{router}.bias", (E,), (None,))
  if cfg.router == "sigmoid_grouped":
    p["score_bias"] = _zeros(f"{router}.e_score_correction_bias", (E,), (None,))
  if cfg.num_shared_experts:
    Fs = cfg.moe_ffn_dim * cfg.num_shared_experts
    p["shared"] = _dense_mlp(f"{m}.shared_experts", D, Fs, "shared")
  return p


def block_weights(cfg: ModelConfig, is_moe: bool) -> dict:
  """One transformer block, names relative to its module (model.layers.{i})."""
  D = cfg.d_model
  return dict(attn_norm=_ones("input_layernorm.weight", (D,), ("embed",)),
              mlp_norm=_ones("post_attention_layernorm.weight", (D,), ("embed",)),
              attn=_attention(cfg),
              mlp=_moe(cfg) if is_moe else _dense_mlp("mlp", D, cfg.ffn_dim, "mlp"))


def _mtp(cfg: ModelConfig) -> dict:
  """One DeepSeek MTP module (at model.layers.{num_layers + depth}); the block
  after the last main layer is MoE."""
  D = cfg.d_model
  norm = lambda hf: _ones(hf, (D,), ("embed",))
  return dict(enorm=norm("enorm.weight"), hnorm=norm("hnorm.weight"),
              eh_proj=_linear("eh_proj", (2 * D, D), (None, "embed"), "mtp.eh_proj"),
              norm=norm("shared_head.norm.weight"),
              block=block_weights(cfg, cfg.layer_is_moe(cfg.num_layers)))


def _lm_prefix(cfg: ModelConfig) -> str:
  """Where the language model's tensors live ('model', or Qwen3-VL's 'model.language_model')."""
  return "model.language_model" if cfg.vision is not None else "model"


def model_weights(cfg: ModelConfig) -> dict:
  """The declaration tree of `cfg` (the layout of `specs.param_specs`)."""
  D, V, lm = cfg.d_model, cfg.vocab_size, _lm_prefix(cfg)
  tree = dict(embed=Weight((V, D), ("vocab", "embed"), hf=f"{lm}.embed_tokens.weight"),
              final_norm=_ones(f"{lm}.norm.weight", (D,), ("embed",)),
              layers=tuple(Stacked(n, f"{lm}.layers.{{i}}", block_weights(cfg, moe), first)
                           for moe, first, n in cfg.segments()))
  if not cfg.tie_embeddings:
    tree["lm_head"] = _linear("lm_head", (D, V), ("embed", "vocab"))
  if cfg.num_mtp_layers:
    tree["mtp"] = Stacked(cfg.num_mtp_layers, "model.layers.{i}", _mtp(cfg), cfg.num_layers)
  if cfg.vision is not None:
    tree["vision"] = vision_weights(cfg.vision, D)
  return tree


def _merger(vc: VisionConfig, D: int, p: str, postshuffle: bool) -> dict:
  """A patch merger; p: its module's name and a dot ('' in a DeepStack tap:
  its `Stacked` prefix names it)."""
  C4 = vc.hidden_size * vc.spatial_merge_size ** 2
  norm = C4 if postshuffle else vc.hidden_size
  return dict(norm_w=_ones(f"{p}norm.weight", (norm,), (None,)),
              norm_b=_zeros(f"{p}norm.bias", (norm,), (None,)),
              fc1=_linear(f"{p}linear_fc1", (C4, C4), (None, None)),
              b1=_zeros(f"{p}linear_fc1.bias", (C4,), (None,)),
              fc2=_linear(f"{p}linear_fc2", (C4, D), (None, "embed")),
              b2=_zeros(f"{p}linear_fc2.bias", (D,), ("embed",)))


def _vision_block(vc: VisionConfig) -> dict:
  """qkv [3Cv, Cv] splits as [Cv, 3, Nv, Hv]."""
  C, F, N, H = vc.hidden_size, vc.intermediate_size, vc.num_heads, vc.head_dim
  c = (None,)
  return dict(norm1_w=_ones("norm1.weight", (C,), c), norm1_b=_zeros("norm1.bias", (C,), c),
              norm2_w=_ones("norm2.weight", (C,), c), norm2_b=_zeros("norm2.bias", (C,), c),
              wqkv=_linear("attn.qkv", (C, 3, N, H), c * 4),
              bqkv=_zeros("attn.qkv.bias", (3, N, H), c * 3, "flat"),
              wo=_linear("attn.proj", (N, H, C), c * 3, in_dims=2),
              bo=_zeros("attn.proj.bias", (C,), c),
              fc1=_linear("mlp.linear_fc1", (C, F), c * 2),
              b1=_zeros("mlp.linear_fc1.bias", (F,), c),
              fc2=_linear("mlp.linear_fc2", (F, C), c * 2),
              b2=_zeros("mlp.linear_fc2.bias", (C,), c))


def vision_weights(vc: VisionConfig, D: int) -> dict:
  """Qwen3-VL's vision tower (small: replicated). The Conv3d patch embedding
  [Cv, C, Tp, P, P] is one [C*Tp*P*P, Cv] matrix (the processor's patch order)."""
  C, p = vc.hidden_size, "model.visual"
  patch = (C, vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size)
  tree = dict(patch_w=Weight((vc.patch_dim, C), (None, None), hf=f"{p}.patch_embed.proj.weight",
                             stored="linear", hf_shape=patch),
              patch_b=_zeros(f"{p}.patch_embed.proj.bias", (C,), (None,)),
              pos_embed=Weight((vc.num_position_embeddings, C), (None, None),
                               hf=f"{p}.pos_embed.weight"),
              blocks=Stacked(vc.depth, f"{p}.blocks.{{i}}", _vision_block(vc)),
              merger=_merger(vc, D, f"{p}.merger.", False))
  if vc.deepstack_indexes:
    tree["deepstack"] = Stacked(len(vc.deepstack_indexes), f"{p}.deepstack_merger_list.{{i}}",
                                _merger(vc, D, "", True))
  return tree
