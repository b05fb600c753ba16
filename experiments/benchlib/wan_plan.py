"""A WAN-2.2-T2V-A14B denoising step compiled for GPUs from a CPU process.

`wan_step_plan(...)` lowers and compiles `wan_pipeline.denoise_step` (one
expert's guided DiT pass on [cond; uncond] plus the UniPC update) for a
(data, seq, tensor) mesh of compile-only GPUs (`jaxinfer.gpu_compile`) from
abstract params only (the `wan_weights` spec tree as ShapeDtypeStructs,
placed by `wan_parallel.param_shardings`: block heads / FFN columns over
the tensor axis, the rest replicated), with the DiT's kernel target "gpu" (the Pallas flash kernel
through Triton for self- and cross-attention). Nothing is allocated. The
report: video tokens, parameters (from shapes), per-device memory from
`memory_analysis()` against the GPU's memory, and whether the compiled
HLO holds the Triton kernels and the Ulysses all-to-alls.

The MLPerf shape: 720 x 1280 pixels, 81 frames -> a latent of 21 x 90 x 160,
21 x 45 x 80 = 75,600 tokens per DiT pass (patches 1 x 2 x 2), batch 2 (CFG),
text 512 UMT5 tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from benchlib.hlo_report import TRITON_CALL
from jaxinfer import gpu_compile
from jaxinfer.diffusion import wan_parallel, wan_pipeline, wan_weights
from jaxinfer.diffusion.wan_config import WanConfig, a14b_expert
from jaxinfer.models.specs import is_spec

_GB = 1e9


def latent_shape(frames: int, height: int, width: int, channels: int = 16) -> tuple:
  """The VAE latent of a video: time / 4 (+1: the first frame), space / 8."""
  return (1, channels, (frames - 1) // 4 + 1, height // 8, width // 8)


def _abstract(cfg: WanConfig, mesh, latent, text_len: int):
  rep = NamedSharding(mesh, P())
  S = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
  params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        wan_weights.param_specs(cfg), wan_parallel.param_shardings(cfg, mesh),
                        is_leaf=is_spec)
  state = tuple(S(latent, jnp.float32) for _ in range(4))
  text2 = S((2 * latent[0], text_len, cfg.text_dim), cfg.compute_dtype())
  row = (S((), jnp.float32), S((), jnp.float32), S((5,), jnp.float32), S((3,), jnp.float32))
  return params, state, text2, row


def wan_step_plan(*, seq: int = 4, cfg_parallel: int = 2, tensor: int = 1, frames: int = 81,
                  height: int = 720, width: int = 1280, text_len: int = 512, gpu: str = "h100",
                  cfg: WanConfig | None = None) -> dict:
  """Compile one denoising step for cfg_parallel x seq x tensor GPUs (module
  docstring); cfg's Backend choices are kept, its target set to "gpu"."""
  cfg = cfg or a14b_expert()
  cfg = dataclasses.replace(cfg, backend=dataclasses.replace(cfg.backend, target="gpu"))
  devices = gpu_compile.devices(gpu, devices_per_host=seq * cfg_parallel * tensor)
  mesh = wan_parallel.make_mesh(seq=seq, cfg=cfg_parallel, tensor=tensor, devices=devices)
  latent = latent_shape(frames, height, width, cfg.in_channels)
  wan_parallel.check_mesh(cfg, mesh, latent, batch=2 * latent[0])
  args = _abstract(cfg, mesh, latent, text_len)
  step = jax.jit(functools.partial(wan_pipeline.denoise_step, cfg, guidance=4.0, mesh=mesh),
                 donate_argnums=(1,))
  with gpu_compile.lowering(mesh):
    compiled = step.lower(*args).compile()
  mem = gpu_compile.MemoryReport.of(compiled)
  hlo = compiled.as_text()
  hbm = gpu_compile.target(gpu).hbm_bytes
  n_params = wan_weights.count_params(cfg)
  return dict(gpu=gpu, mesh=dict(data=cfg_parallel, seq=seq, tensor=tensor), latent=latent,
              tokens=cfg.tokens(*latent[2:]), params=n_params,
              param_gb=n_params * cfg.compute_dtype().itemsize / _GB,
              memory=dataclasses.asdict(mem), peak_gb=mem.peak_bytes / _GB, hbm_gb=hbm / _GB,
              fits=mem.peak_bytes <= hbm, triton=TRITON_CALL in hlo,
              all_to_all=hlo.count("all-to-all"), all_reduce=hlo.count("all-reduce"))


def format_plan(plan: dict) -> str:
  m = plan["memory"]
  return (f"WAN-2.2-T2V-A14B denoising step on {plan['mesh']} x {plan['gpu']}: "
          f"latent {plan['latent']}, {plan['tokens']} tokens, {plan['params'] / 1e9:.2f} B "
          f"params ({plan['param_gb']:.1f} GB) per expert; per device: args "
          f"{m['argument_bytes'] / _GB:.1f} GB, temp {m['temp_bytes'] / _GB:.1f} GB, peak "
          f"{plan['peak_gb']:.1f} of {plan['hbm_gb']:.0f} GB ({'fits' if plan['fits'] else 'OVER'})")
