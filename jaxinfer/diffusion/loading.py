"""A whole diffusers WanPipeline directory -> (`WanModel`, `WanParams`).

Reads what `WanPipeline.save_pretrained` (or the published
Wan-AI/Wan2.2-T2V-A14B-Diffusers layout) holds: model_index.json (the
boundary ratio), scheduler/scheduler_config.json (flow_shift and the UniPC
settings, `unipc.FlowUniPC.from_diffusers`), transformer/ and
transformer_2/ (the experts, `wan_weights`), vae/ (`wan_vae`) and, when
present, text_encoder/ (`umt5`) and tokenizer/tokenizer.json (`wan_text`).
Errors name the file (the expert's directory for a tensor) and the field or
tensor (`files`).
"""

from __future__ import annotations

import dataclasses
import os

from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.diffusion import files, umt5, unipc, wan_parallel, wan_text, wan_vae, wan_weights
from jaxinfer.diffusion.presets import WanModel
from jaxinfer.diffusion.wan_pipeline import SamplerConfig


@dataclasses.dataclass(frozen=True)
class WanParams:
  high: dict  # transformer/: timesteps >= boundary_ratio * T
  low: dict  # transformer_2/
  vae: dict  # the VAE decoder
  # The UMT5 encoder (text_encoder/) and the tokenizer when the directory has them:
  # `VideoEngine(..., text=params.text)` takes prompts as strings or token ids.
  text: wan_text.PromptEncoder | None = None


def load_pipeline(root: str, dtype="float32", *, mesh=None,
                  **model_fields) -> tuple[WanModel, WanParams]:
  """model_fields: the run's settings (height, width, frames, text_len) and
  sampler fields (num_steps, guidance_high, guidance_low) over the defaults.
  mesh: a `wan_parallel.make_mesh` mesh the experts load onto, each leaf
  placed by `wan_parallel.param_shardings` (TP slices read as such)."""
  index = files.read_json(os.path.join(root, "model_index.json"),
                          "a diffusers WanPipeline directory")
  if index.get("_class_name") != "WanPipeline":
    raise CheckpointError(f"{root}/model_index.json: _class_name {index.get('_class_name')!r} "
                          "is not WanPipeline")
  if index.get("boundary_ratio") is None or index.get("expand_timesteps"):
    raise CheckpointError(f"{root}/model_index.json: a two-expert text-to-video pipeline needs "
                          "boundary_ratio set and expand_timesteps false")
  scheduler = os.path.join(root, "scheduler", "scheduler_config.json")
  solver = files.build(scheduler, unipc.FlowUniPC.from_diffusers,
                       files.read_json(scheduler, "the pipeline's scheduler"))
  sampler_keys = {f.name for f in dataclasses.fields(SamplerConfig)}
  sampler = SamplerConfig(boundary_ratio=index["boundary_ratio"], solver=solver,
                          **{k: v for k, v in model_fields.items() if k in sampler_keys})
  shardings = None
  if mesh is not None:
    cfg = wan_weights.read_config(os.path.join(root, "transformer"), dtype)
    shardings = wan_parallel.param_shardings(cfg, mesh)
  load = lambda d: wan_weights.load_transformer(os.path.join(root, d), dtype, shardings=shardings)
  dit, high = load("transformer")
  dit_2, low = load("transformer_2")
  if dit_2 != dit:
    differ = [f.name for f in dataclasses.fields(dit)
              if getattr(dit, f.name) != getattr(dit_2, f.name)]
    raise CheckpointError(f"{root}: transformer/ and transformer_2/ configs differ in {differ}")
  vae_cfg, vae = wan_vae.load_vae(os.path.join(root, "vae"), dtype)
  text = _text_encoder(root, dtype)
  rest = {k: v for k, v in model_fields.items() if k not in sampler_keys}
  model = WanModel(dit=dit, sampler=sampler, vae=vae_cfg, **rest)
  return model, WanParams(high=high, low=low, vae=vae, text=text)


def _text_encoder(root: str, dtype) -> wan_text.PromptEncoder | None:
  """text_encoder/ and, when present, tokenizer/tokenizer.json (None: no text_encoder/)."""
  if not os.path.isdir(os.path.join(root, "text_encoder")):
    return None
  cfg, params = umt5.load_encoder(os.path.join(root, "text_encoder"), dtype)
  tokenizer_file = os.path.join(root, "tokenizer", "tokenizer.json")
  tokenizer = wan_text.PromptTokenizer(tokenizer_file) if os.path.exists(tokenizer_file) else None
  return wan_text.PromptEncoder(cfg, params, tokenizer, tokenizer_file)
