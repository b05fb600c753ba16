"""Byte-level and HF tokenizer.json tokenizers."""

import shutil

import pytest
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

from conftest import FIXTURES
from jaxinfer import checkpoint, presets
from jaxinfer.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_tokenizer_round_trip():
  tok = ByteTokenizer()
  text = "def f(x):\n  return x ** 2  # é✓"
  assert tok.decode(tok.encode(text)) == text
  assert max(tok.encode(text)) < 256
  assert isinstance(load_tokenizer(presets.get("tiny_moe")), ByteTokenizer)


def test_hf_tokenizer_json_from_checkpoint_dir(tmp_path):
  vocab = {w: i for i, w in enumerate(["[UNK]", "hello", "world", "jax", "!"])}
  t = Tokenizer(tok_models.WordLevel(vocab, unk_token="[UNK]"))
  t.pre_tokenizer = pre_tokenizers.Whitespace()
  d = tmp_path / "ckpt"
  shutil.copytree(FIXTURES / "hf" / "mixtral", d)
  t.save(str(d / "tokenizer.json"))
  cfg, _ = checkpoint.load_hf(str(d))
  tok = load_tokenizer(cfg, str(d))
  assert isinstance(tok, HFTokenizer)
  assert tok.encode("hello jax !") == [1, 3, 4]
  assert tok.decode([1, 2]) == "hello world"
  assert tok.encode("unknown") == [0]


def test_no_tokenizer_is_a_clear_error():
  with pytest.raises(ValueError, match="no tokenizer"):
    load_tokenizer(presets.get("bench_dense"))
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    HFTokenizer("/nonexistent")
