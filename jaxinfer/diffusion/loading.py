"""A whole diffusers WanPipeline directory -> (`WanModel`, `WanParams`).

Reads what `WanPipeline.save_pretrained` (or the published
Wan-AI/Wan2.2-T2V-A14B-Diffusers layout) holds: model_index.json (the
boundary ratio), scheduler/scheduler_config.json (flow_shift and the UniPC
settings, `unipc.FlowUniPC.from_diffusers`), transformer/ and
transformer_2/ (the experts, `wan_weights`), vae/ (`wan_vae`) and, when
present, text_encoder/ (`umt5`). Errors name the file or field.
"""

from __future__ import annotations

import dataclasses
import json
import os

from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.diffusion import umt5, unipc, wan_parallel, wan_vae, wan_weights
from jaxinfer.diffusion.presets import WanModel
from jaxinfer.diffusion.wan_pipeline import SamplerConfig


@dataclasses.dataclass(frozen=True)
class WanParams:
  high: dict  # transformer/: timesteps >= boundary_ratio * T
  low: dict  # transformer_2/
  vae: dict  # the VAE decoder
  text: dict | None = None  # the UMT5 encoder, when the directory has one
  text_cfg: umt5.UMT5Config | None = None


def _json(path: str) -> dict:
  if not os.path.exists(path):
    raise CheckpointError(f"{path} does not exist (a diffusers WanPipeline directory)")
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise CheckpointError(f"{path}: invalid JSON ({e})") from None


def load_pipeline(root: str, dtype="float32", *, mesh=None,
                  **model_fields) -> tuple[WanModel, WanParams]:
  """model_fields: the run's settings (height, width, frames, text_len) and
  sampler fields (num_steps, guidance_high, guidance_low) over the defaults.
  mesh: a `wan_parallel.make_mesh` mesh the experts load onto, each leaf
  placed by `wan_parallel.param_shardings` (TP slices read as such)."""
  index = _json(os.path.join(root, "model_index.json"))
  if index.get("_class_name") != "WanPipeline":
    raise CheckpointError(f"{root}/model_index.json: _class_name {index.get('_class_name')!r} "
                          "is not WanPipeline")
  if index.get("boundary_ratio") is None or index.get("expand_timesteps"):
    raise CheckpointError(f"{root}/model_index.json: a two-expert text-to-video pipeline needs "
                          "boundary_ratio set and expand_timesteps false")
  solver = unipc.FlowUniPC.from_diffusers(
      _json(os.path.join(root, "scheduler", "scheduler_config.json")))
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
    raise CheckpointError(f"{root}: transformer/ and transformer_2/ configs differ")
  vae_cfg, vae = wan_vae.load_vae(os.path.join(root, "vae"), dtype)
  text_cfg = text = None
  if os.path.isdir(os.path.join(root, "text_encoder")):
    text_cfg, text = umt5.load_encoder(os.path.join(root, "text_encoder"), dtype)
  rest = {k: v for k, v in model_fields.items() if k not in sampler_keys}
  model = WanModel(dit=dit, sampler=sampler, vae=vae_cfg, **rest)
  return model, WanParams(high=high, low=low, vae=vae, text=text, text_cfg=text_cfg)
