"""Prompts -> the UMT5 token ids, masks and embeddings WanPipeline makes of them.

diffusers' `WanPipeline._get_t5_prompt_embeds` over the `tokenizers`
library: each prompt cleaned (`clean`), tokenized with its special tokens
(UMT5's closing </s>), truncated to the text length (512 in the benchmark;
the </s> kept) and padded to it with the pad token; the mask marks the
tokens, and the encoder's output is zeroed past them
(`umt5.prompt_embeddings`). The tokenizer is the pipeline's
tokenizer/tokenizer.json (google/umt5-xxl's), its pad token the one
tokenizer/tokenizer_config.json names ("<pad>" without one).
`PromptEncoder` holds the tokenizer and the encoder and takes each prompt
as a string or as token ids.
"""

from __future__ import annotations

import dataclasses
import html
import os
import re

import jax.numpy as jnp
import numpy as np

from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.diffusion import files, umt5


def clean(text: str) -> str:
  """diffusers' `prompt_clean`: ftfy's fix_text where ftfy is installed, HTML
  entities unescaped twice, every run of whitespace one space, stripped."""
  try:
    import ftfy  # optional, as in diffusers
    text = ftfy.fix_text(text)
  except ImportError:
    pass
  return re.sub(r"\s+", " ", html.unescape(html.unescape(text)).strip()).strip()


def is_prompt(text) -> bool:
  """A prompt string or its token ids (1-D), not embeddings [L, D]."""
  return isinstance(text, str) or np.ndim(text) == 1


def _pad_token(directory: str) -> str:
  config = os.path.join(directory, "tokenizer_config.json")
  if not os.path.exists(config):
    return "<pad>"
  pad = files.read_json(config, "the tokenizer's settings").get("pad_token", "<pad>")
  return pad.get("content") if isinstance(pad, dict) else pad


class PromptTokenizer:
  """A tokenizer.json (path: the file, or the tokenizer/ directory holding it)."""

  def __init__(self, path: str):
    import tokenizers  # an optional dependency at import time
    self.file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.exists(self.file):
      raise CheckpointError(f"{self.file} does not exist (WAN's tokenizer: google/umt5-xxl's "
                            "tokenizer.json)")
    try:
      self._tok = tokenizers.Tokenizer.from_file(self.file)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
      raise CheckpointError(f"{self.file}: not a tokenizer.json ({e})") from None
    self.pad_token = _pad_token(os.path.dirname(self.file))
    pad = self.pad_token
    self.pad_id = self._tok.token_to_id(pad) if isinstance(pad, str) else None
    if self.pad_id is None:
      raise CheckpointError(f"{self.file}: the pad token {pad!r} (tokenizer_config.json's "
                            "pad_token) is not in the vocabulary")

  def encode(self, prompts: list[str], length: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask), int32 [B, length] each: each prompt `clean`ed, its special
    tokens added, truncated to length and padded on the right."""
    self._tok.enable_truncation(max_length=length)
    self._tok.enable_padding(length=length, pad_id=self.pad_id, pad_token=self.pad_token)
    out = self._tok.encode_batch([clean(p) for p in prompts], add_special_tokens=True)
    return (np.array([e.ids for e in out], np.int32),
            np.array([e.attention_mask for e in out], np.int32))


@dataclasses.dataclass(frozen=True, eq=False)
class PromptEncoder:
  """The UMT5 encoder and its tokenizer. tokenizer_file: where a pipeline's
  tokenizer was looked for (a string prompt's error names it when absent)."""
  cfg: umt5.UMT5Config
  params: dict
  tokenizer: PromptTokenizer | None = None
  tokenizer_file: str | None = None

  def check(self, text, length: int) -> None:
    """ValueError (CheckpointError: no tokenizer) unless `embed` takes text."""
    if isinstance(text, str):
      if self.tokenizer is None:
        where = (f"{self.tokenizer_file} does not exist" if self.tokenizer_file else
                 "none given (PromptEncoder(tokenizer=PromptTokenizer(path)))")
        raise CheckpointError(f"a prompt string needs WAN's tokenizer (google/umt5-xxl's "
                              f"tokenizer.json): {where}; or give token ids or embeddings")
      return
    ids = np.asarray(text)
    if ids.ndim != 1 or not 1 <= ids.size <= length or not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"token ids must be 1 to {length} ints, got {ids.dtype} {list(ids.shape)}")
    if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
      raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size}) (the text encoder's "
                       f"vocab_size), got {ids.min()} to {ids.max()}")

  def tokens(self, texts: list, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask), int32 [B, length] each: strings tokenized as WanPipeline
    does, token ids as given, padded with 0 (mask 0)."""
    for t in texts:
      self.check(t, length)
    ids, mask = np.zeros((2, len(texts), length), np.int32)
    strings = [i for i, t in enumerate(texts) if isinstance(t, str)]
    if strings:
      ids[strings], mask[strings] = self.tokenizer.encode([texts[i] for i in strings], length)
      if ids.max() >= self.cfg.vocab_size:
        raise ValueError(f"{self.tokenizer.file} gives token id {ids.max()}, past the text "
                         f"encoder's vocab_size {self.cfg.vocab_size}")
    for i, t in enumerate(texts):
      if not isinstance(t, str):
        ids[i, :len(t)], mask[i, :len(t)] = t, 1
    return ids, mask

  def embed(self, texts: list, length: int):
    """[B, length, d_model]: WanPipeline's prompt embeddings of each prompt
    (a string or token ids), zeros past its tokens."""
    ids, mask = self.tokens(texts, length)
    return umt5.prompt_embeddings(self.cfg, self.params, jnp.asarray(ids), jnp.asarray(mask))
