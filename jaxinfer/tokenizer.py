"""Tokenizers: byte-level for the tiny presets (vocab 256), and HF
`tokenizer.json` through the `tokenizers` package for checkpoint directories.

`write_hf_files` writes the byte tokenizer as Hugging Face files (shipped in
jaxinfer/default_model/), so that `tokenizers`, `transformers.AutoTokenizer`
and tools pointed at that directory tokenize as `ByteTokenizer` does."""

from __future__ import annotations

import json
import os

from jaxinfer.config import ModelConfig

# The byte tokenizer's one special token: NUL, a byte text does not hold.
# It is both BOS and EOS (as GPT-2's <|endoftext|> is), so that clients
# that need a document token (lm-eval's loglikelihood_rolling prefix) have
# one. The default model was not trained with it.
DOC_TOKEN = "\x00"

# The default model's chat template (no special tokens): one "role:
# content" line per message, then the assistant's turn.
BYTE_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                      "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


class ByteTokenizer:
  """UTF-8 bytes as token ids (vocab 256); decoding replaces invalid bytes.
  `config`: its tokenizer_config.json fields (`write_hf_files`)."""

  vocab_size = 256

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

  @property
  def config(self) -> dict:
    special = {"content": DOC_TOKEN, "lstrip": False, "normalized": False, "rstrip": False,
               "single_word": False, "special": True}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": DOC_TOKEN,
            "eos_token": DOC_TOKEN, "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": {"0": special}, "chat_template": BYTE_CHAT_TEMPLATE}


def _byte_chars() -> list[str]:
  """GPT-2's printable character for each byte (the ByteLevel pre-tokenizer's map)."""
  keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)}
  spare = iter(range(256, 512))
  return [chr(b) if b in keep else chr(next(spare)) for b in range(256)]


def _byte_tokenizer_json() -> dict:
  """`ByteTokenizer` as a `tokenizers` BPE without merges over the 256
  ByteLevel characters: id = byte. DOC_TOKEN is an added special token
  with id 0, its own text in the vocabulary in place of byte 0's
  character (every NUL in a text matches it before the byte split)."""
  vocab = {(DOC_TOKEN if b == 0 else c): b for b, c in enumerate(_byte_chars())}
  added = ByteTokenizer().config["added_tokens_decoder"]["0"]
  return {"version": "1.0", "truncation": None, "padding": None,
          "added_tokens": [{"id": 0, **added}], "normalizer": None,
          "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                            "trim_offsets": False, "use_regex": False},
          "post_processor": None,
          "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                      "use_regex": False},
          "model": {"type": "BPE", "dropout": None, "unk_token": None,
                    "continuing_subword_prefix": None, "end_of_word_suffix": None,
                    "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                    "vocab": vocab, "merges": []}}


def write_hf_files(directory: str) -> list[str]:
  """Writes `ByteTokenizer` as Hugging Face tokenizer files into directory
  (tokenizer.json, tokenizer_config.json, special_tokens_map.json), as
  shipped in jaxinfer/default_model/. -> the paths written."""
  config = ByteTokenizer().config
  files = {"tokenizer.json": _byte_tokenizer_json(), "tokenizer_config.json": config,
           "special_tokens_map.json": {k: config[k] for k in ("bos_token", "eos_token")}}
  paths = []
  for name, content in files.items():
    paths.append(os.path.join(directory, name))
    with open(paths[-1], "w", encoding="utf-8") as f:
      json.dump(content, f, indent=1, ensure_ascii=False)
      f.write("\n")
  return paths


class HFTokenizer:
  """An HF fast tokenizer loaded from `tokenizer.json`; `config`: the
  tokenizer_config.json beside it ({} if none)."""

  def __init__(self, path: str):
    from tokenizers import Tokenizer  # an optional dependency at import time
    if os.path.isdir(path):
      path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(path):
      raise FileNotFoundError(f"no tokenizer.json at {path}")
    self._tok = Tokenizer.from_file(path)
    # Ids run to the largest (an added token may reuse a vocabulary id).
    self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
    self.config = _tokenizer_config(os.path.dirname(path))

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def _tokenizer_config(directory: str) -> dict:
  """directory's tokenizer_config.json ({} if none), special tokens as their text."""
  path = os.path.join(directory, "tokenizer_config.json")
  if not os.path.exists(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: invalid JSON ({e})") from None
  if not isinstance(config, dict):
    raise ValueError(f"{path}: a JSON object expected, got {type(config).__name__}")
  return {k: v["content"] if k.endswith("_token") and isinstance(v, dict) else v
          for k, v in config.items()}


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
