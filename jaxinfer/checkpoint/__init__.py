"""Checkpoints: HF safetensors import and orbax save/restore.

  load_hf(path, dtype=None, *, shardings=None, quantize=None) -> (cfg, params)
  (quantized checkpoints load kept quantized: `models.quant`, `hf_quant`)
  save(path, cfg, params); restore(path, *, shardings=None, dtype=None) -> (cfg, params)
"""

from jaxinfer.checkpoint.hf_load import CheckpointError, load_hf
from jaxinfer.checkpoint.orbax_io import restore, save

__all__ = ["CheckpointError", "load_hf", "restore", "save"]
