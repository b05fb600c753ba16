"""jaxinfer: a JAX research library for sharded LLM inference."""

from jaxinfer import checkpoint, engine, models, presets
from jaxinfer.backend import Backend
from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.engine import Engine, EngineConfig, MTPConfig, RequestOutput, SamplingParams
from jaxinfer.run import load_default_model

__version__ = "0.1.0"
__all__ = ["Backend", "Engine", "EngineConfig", "MTPConfig", "ModelConfig", "load_default_model", "RequestOutput", "RopeScaling", "SamplingParams", "checkpoint", "engine", "models",
           "presets"]
