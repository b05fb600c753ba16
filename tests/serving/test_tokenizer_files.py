"""The default model's Hugging Face tokenizer files (jaxinfer/default_model/
tokenizer.json, tokenizer_config.json, special_tokens_map.json), what tools
such as guidellm and aiperf load from a directory path: they are what
`tokenizer.write_hf_files` writes now, and `tokenizers.Tokenizer.from_file`,
`transformers.AutoTokenizer.from_pretrained(<dir>)` and `HFTokenizer` give
`ByteTokenizer`'s ids for any text (non-ASCII, NUL, the special token) and
its text for any ids (invalid UTF-8 too). Hypothesis: a fixed seed, bounded
example counts, no example database."""

import filecmp
import os

import hypothesis
import hypothesis.strategies as st
import pytest
import tokenizers
import transformers

from jaxinfer.run import DEFAULT_MODEL_DIR
from jaxinfer.tokenizer import DOC_TOKEN, ByteTokenizer, HFTokenizer, write_hf_files

FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
SETTINGS = hypothesis.settings(max_examples=400, deadline=None, derandomize=True, database=None)
# Text that tends to break byte-level tokenizers: the special token and
# control bytes, ByteLevel's own remapped characters, spaces, CRLF,
# combining marks, astral characters and a zero-width joiner sequence.
PIECES = [DOC_TOKEN, "\x01", "\x7f", "Ā", "Ġ", "Ċ", " ", "  ", "\t", "\r\n", "e\u0301", "é",
          "ß", "İ", "ﬁ", "✓", "😀", "👩\u200d💻", "\ufeff", "\ufffd", "<|endoftext|>", "<s>"]
TEXT = st.one_of(st.text(), st.lists(st.sampled_from(PIECES) | st.text(max_size=4),
                                     max_size=12).map("".join))


@pytest.fixture(scope="module")
def tokenizers_():
  """(jaxinfer's byte tokenizer, the HF files through tokenizers, transformers, HFTokenizer)."""
  return (ByteTokenizer(), tokenizers.Tokenizer.from_file(os.path.join(DEFAULT_MODEL_DIR, FILES[0])),
          transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True),
          HFTokenizer(DEFAULT_MODEL_DIR))


def test_the_shipped_files_are_what_write_hf_files_writes(tmp_path):
  written = write_hf_files(str(tmp_path))
  assert sorted(os.path.basename(p) for p in written) == sorted(FILES)
  _, mismatch, errors = filecmp.cmpfiles(DEFAULT_MODEL_DIR, tmp_path, FILES, shallow=False)
  assert not mismatch and not errors, (f"regenerate: python -c \"from jaxinfer.tokenizer import "
                                       f"write_hf_files; write_hf_files('jaxinfer/default_model')\"",
                                       mismatch, errors)


def test_special_tokens_and_vocabulary(tokenizers_):
  byte, fast, auto, hf = tokenizers_
  assert auto.eos_token == auto.bos_token == DOC_TOKEN and auto.eos_token_id == 0
  assert auto.bos_token_id == 0 and auto.all_special_ids == [0]
  assert len(auto) == fast.get_vocab_size() == hf.vocab_size == byte.vocab_size == 256
  assert hf.config["eos_token"] == hf.config["bos_token"] == DOC_TOKEN
  assert fast.encode("a" + DOC_TOKEN).ids == [97, 0]
  # The chat template renders as the server's built-in one.
  messages = [{"role": "user", "content": "hi"}]
  assert auto.apply_chat_template(messages, tokenize=False,
                                  add_generation_prompt=True) == "user: hi\nassistant: "


@SETTINGS
@hypothesis.given(text=TEXT)
def test_every_text_gets_the_byte_tokenizers_ids(tokenizers_, text):
  byte, fast, auto, hf = tokenizers_
  ids = byte.encode(text)
  assert fast.encode(text).ids == ids
  assert fast.encode(text, add_special_tokens=False).ids == ids
  assert auto(text).input_ids == ids
  assert auto.encode(text, add_special_tokens=False) == ids
  assert hf.encode(text) == ids
  assert fast.decode(ids, skip_special_tokens=False) == text


@SETTINGS
@hypothesis.given(ids=st.lists(st.integers(0, 255), max_size=24))
def test_every_id_list_decodes_to_the_byte_tokenizers_text(tokenizers_, ids):
  """Invalid UTF-8 becomes U+FFFD the same way (Python's errors="replace"
  and Rust's from_utf8_lossy); the special token only drops when asked."""
  byte, fast, auto, hf = tokenizers_
  text = byte.decode(ids)
  assert fast.decode(ids, skip_special_tokens=False) == text
  assert auto.decode(ids, skip_special_tokens=False) == text
  assert hf.decode(ids, skip_special_tokens=False) == text
  assert fast.decode(ids) == byte.decode([i for i in ids if i != 0])
