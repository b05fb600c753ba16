"""Checkpoints: HF safetensors import and orbax save/restore."""
