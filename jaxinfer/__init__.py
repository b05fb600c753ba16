"""jaxinfer: a JAX research library for sharded LLM inference."""

from jaxinfer import checkpoint, models, presets
from jaxinfer.config import ModelConfig, RopeScaling

__version__ = "0.1.0"
__all__ = ["ModelConfig", "RopeScaling", "checkpoint", "models", "presets"]
