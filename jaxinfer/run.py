"""Library entry points the experiment scripts and notebooks call.

  load_model(preset=..., hf_dir=..., checkpoint_dir=...) -> (cfg, params)
  run_generate(cfg, params, prompts=..., sampling=...) -> GenerateResult
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import checkpoint, presets
from jaxinfer.config import ModelConfig
from jaxinfer.engine import contiguous
from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.models import init_params


def load_model(*, preset: str | None = None, hf_dir: str | None = None,
               checkpoint_dir: str | None = None, seed: int = 0, dtype=None):
  """Exactly one source: a preset (random weights), an HF directory, or an
  orbax checkpoint written by `checkpoint.save`."""
  given = [s for s in (preset, hf_dir, checkpoint_dir) if s]
  if len(given) != 1:
    raise ValueError("load_model: pass exactly one of preset, hf_dir, checkpoint_dir")
  if hf_dir:
    return checkpoint.load_hf(hf_dir, dtype=dtype)
  if checkpoint_dir:
    return checkpoint.restore(checkpoint_dir, dtype=dtype)
  cfg = presets.get(preset)
  if dtype is not None:
    cfg = dataclasses.replace(cfg, dtype=jnp.dtype(dtype).name)
  return cfg, init_params(cfg, jax.random.key(seed))


def encode_bytes(cfg: ModelConfig, text: str) -> list[int]:
  """Byte-level encoding, for the byte-vocabulary (256) presets."""
  if cfg.vocab_size != 256:
    raise ValueError(f"text prompts need a byte-level model (vocab 256); this one has "
                     f"{cfg.vocab_size}: pass token ids instead")
  return list(text.encode("utf-8"))


def decode_bytes(ids) -> str:
  return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@dataclasses.dataclass
class GenerateResult:
  tokens: np.ndarray  # [B, max_tokens]
  prefill_s: float  # median time of a 1-token generate (prefill + first token)
  decode_tokens_per_s: float  # B * (max_tokens - 1) / (generate time - prefill time)


def run_generate(cfg: ModelConfig, params, *, prompts, sampling: SamplingParams,
                 repeats: int = 3) -> GenerateResult:
  """Generates (compiling first), and times prefill and decode: medians of
  `repeats` runs, decode as the difference of a full and a 1-token run."""
  prompts = np.asarray(prompts, np.int32)

  def timed(sp):
    contiguous.generate(cfg, params, prompts, sp).block_until_ready()  # compile
    times, out = [], None
    for _ in range(repeats):
      t0 = time.perf_counter()
      out = contiguous.generate(cfg, params, prompts, sp).block_until_ready()
      times.append(time.perf_counter() - t0)
    return float(np.median(times)), np.asarray(out)

  t_full, tokens = timed(sampling)
  t_first, _ = timed(dataclasses.replace(sampling, max_tokens=1))
  n_decode = prompts.shape[0] * (sampling.max_tokens - 1)
  rate = n_decode / max(t_full - t_first, 1e-9) if n_decode else 0.0
  return GenerateResult(tokens=tokens, prefill_s=t_first, decode_tokens_per_s=rate)
