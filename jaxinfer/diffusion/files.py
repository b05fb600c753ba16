"""A diffusers pipeline directory's files, read with errors that name them.

Every loader of this package reads its config.json through `read_config`
and its safetensors inside `naming(directory)`, so a failure is a
`checkpoint.errors.CheckpointError` that says which file (or which
directory: transformer/ and transformer_2/ hold the same tensor names) it
came from, and which key or tensor.
"""

from __future__ import annotations

import contextlib
import json
import os

from jaxinfer.checkpoint.errors import CheckpointError


def read_json(path: str, what: str) -> dict:
  """A JSON object file; what: the directory it belongs to, for the error."""
  if not os.path.exists(path):
    raise CheckpointError(f"{path} does not exist ({what})")
  try:
    with open(path, encoding="utf-8") as f:
      raw = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{path}: invalid JSON ({e})") from None
  if not isinstance(raw, dict):
    raise CheckpointError(f"{path}: a JSON object expected, got {type(raw).__name__}")
  return raw


def build(path: str, make, raw: dict):
  """make(raw), the file's dict: a missing key or a value make rejects raise
  CheckpointError naming the file."""
  try:
    return make(raw)
  except KeyError as e:
    raise CheckpointError(f"{path}: required key {e.args[0]!r} is missing") from None
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{path}: {e}") from None


def read_config(directory: str, class_name: str, make):
  """make(config.json's dict), errors naming the file (`build`); a
  `_class_name` other than class_name is one."""
  path = os.path.join(directory, "config.json")
  raw = read_json(path, f"a {class_name} directory")
  if raw.get("_class_name", class_name) != class_name:
    raise CheckpointError(f"{path}: _class_name {raw['_class_name']!r} is not {class_name}")
  return build(path, make, raw)


@contextlib.contextmanager
def naming(directory: str):
  """CheckpointErrors raised inside say they came from `directory`."""
  try:
    yield
  except CheckpointError as e:
    if directory in str(e):
      raise
    raise CheckpointError(f"{directory}: {e}") from None
