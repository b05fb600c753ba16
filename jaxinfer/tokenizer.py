"""Tokenizers: byte-level for the tiny presets (vocab 256), and HF
`tokenizer.json` through the `tokenizers` package for checkpoint directories."""

from __future__ import annotations

import os

from jaxinfer.config import ModelConfig


class ByteTokenizer:
  """UTF-8 bytes as token ids (vocab 256); decoding replaces invalid bytes."""

  vocab_size = 256

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
  """An HF fast tokenizer loaded from `tokenizer.json`."""

  def __init__(self, path: str):
    from tokenizers import Tokenizer  # an optional dependency at import time
    if os.path.isdir(path):
      path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(path):
      raise FileNotFoundError(f"no tokenizer.json at {path}")
    self._tok = Tokenizer.from_file(path)
    self.vocab_size = self._tok.get_vocab_size()

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def load_tokenizer(cfg: ModelConfig, hf_dir: str | None = None):
  """HF tokenizer.json from hf_dir if present; bytes for vocab-256 models."""
  if hf_dir and os.path.exists(os.path.join(hf_dir, "tokenizer.json")):
    tok = HFTokenizer(hf_dir)
    if tok.vocab_size > cfg.vocab_size:
      raise ValueError(f"tokenizer.json has {tok.vocab_size} tokens, the model only {cfg.vocab_size}")
    return tok
  if cfg.vocab_size == 256:
    return ByteTokenizer()
  raise ValueError(f"no tokenizer for this model (vocab {cfg.vocab_size}): give a checkpoint "
                   "directory with tokenizer.json, or token ids")
