"""Engine layer: sampling and generation (the paged engine arrives with the engine issue)."""

from jaxinfer.engine.contiguous import generate, greedy_reference
from jaxinfer.engine.sampling import SamplingParams, sample

__all__ = ["SamplingParams", "generate", "greedy_reference", "sample"]
