"""Engine layer: the paged-cache Engine, its scheduler and jitted step, sampling,
and the contiguous-cache reference generation."""

from jaxinfer.engine.contiguous import generate, greedy_reference
from jaxinfer.engine.engine import Engine, EngineConfig, RequestMetrics, RequestOutput
from jaxinfer.engine.sampling import SamplingParams, TokenLogprobs, sample
from jaxinfer.engine.speculative import MTPConfig

__all__ = ["Engine", "EngineConfig", "MTPConfig", "RequestMetrics", "RequestOutput", "SamplingParams",
           "TokenLogprobs", "generate", "greedy_reference", "sample"]
