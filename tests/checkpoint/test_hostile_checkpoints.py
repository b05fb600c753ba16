"""Hostile and corrupt checkpoints: each gets a named `CheckpointError` (or,
for non-finite weights, the error or warning asked for), header lies before
any device work, and no loading path unpickles anything."""

import json
import pickle
import shutil
import struct
import warnings

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import FIXTURES
from jaxinfer import checkpoint
from jaxinfer.checkpoint import CheckpointError, hf_load

Q = "model.layers.1.self_attn.q_proj.weight"


def _copy(name, tmp_path):
  dst = tmp_path / name
  shutil.copytree(FIXTURES / "hf" / name, dst)
  return dst


def _split(raw: bytes) -> tuple[dict, bytes]:
  n = struct.unpack("<Q", raw[:8])[0]
  return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(header, data: bytes, length: int | None = None) -> bytes:
  text = header if isinstance(header, bytes) else json.dumps(header).encode()
  return struct.pack("<Q", len(text) if length is None else length) + text + data


def _lie(edit):
  """A case that rewrites model.safetensors' header with edit(header, data)."""
  def apply(d):
    f = d / "model.safetensors"
    header, data = _split(f.read_bytes())
    f.write_bytes(edit(header, data))
  return apply


def _set(key, value):
  def edit(header, data):
    header[Q][key] = value
    return _join(header, data)
  return edit


def _overlap(header, data):
  other = "model.layers.1.self_attn.k_proj.weight"
  lo = header[other]["data_offsets"][0]
  span = header[Q]["data_offsets"][1] - header[Q]["data_offsets"][0]
  header[Q]["data_offsets"] = [lo, lo + span]
  return _join(header, data)


# (case, how it is made, the error's words)
HEADER_CASES = [
    ("header length past the file", _lie(lambda h, d: _join(h, d, length=1 << 40)),
     "the header claims"),
    ("header not JSON", _lie(lambda h, d: _join(b"{" + b"x" * 20, d)), "bad header"),
    ("header a JSON list", _lie(lambda h, d: _join(b"[1, 2]", d)), "not a JSON object"),
    ("unknown dtype", _lie(_set("dtype", "F128")), "unknown dtype 'F128'"),
    ("negative dimension", _lie(_set("shape", [-4, 8])), "not a list of non-negative integers"),
    ("offsets not integers", _lie(_set("data_offsets", ["0", 8])), "are not two integers"),
    ("offsets past the data", _lie(_set("data_offsets", [0, 1 << 40])), "lie outside"),
    ("dtype lie (F16 over F32 bytes)", _lie(_set("dtype", "F16")), "its data_offsets span"),
    ("huge declared shape", _lie(_set("shape", [1 << 40, 1 << 40])), "its data_offsets span"),
    ("two tensors overlapping", _lie(_overlap), "overlap in the data"),
    ("file cut short", lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:-1000]), "lie outside"),
    ("8 bytes of nothing", lambda d: (d / "model.safetensors").write_bytes(b"\0" * 4),
     "shorter than a safetensors header"),
]


@pytest.mark.parametrize("case,make,words", HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_lying_headers_are_named_before_device_work(tmp_path, monkeypatch, case, make, words):
  d = _copy("llama", tmp_path)
  make(d)
  placed = []
  monkeypatch.setattr(hf_load, "_place", lambda host, sharding: placed.append(1))
  with pytest.raises(CheckpointError, match=words) as e:
    checkpoint.load_hf(str(d))
  assert "model.safetensors" in str(e.value)
  assert not placed, f"{case}: {len(placed)} leaves placed on device before the error"


def _index_cases(d):
  idx = d / "model.safetensors.index.json"
  index = json.loads(idx.read_text())
  name, fn = sorted(index["weight_map"].items())[0]
  yield "the index puts a tensor in the wrong file", "which does not hold it", dict(
      index, weight_map={**index["weight_map"], name: next(
          v for v in index["weight_map"].values() if v != fn)})
  yield "the index points outside the directory", "is not a file name", dict(
      index, weight_map={**index["weight_map"], name: "../" + fn})
  yield "the index is not JSON", "invalid JSON", "{oops"
  yield "the index is a list", "no 'weight_map'", [1]


def test_lying_shard_indexes_are_named(tmp_path):
  d = _copy("llama_sharded", tmp_path)
  idx = d / "model.safetensors.index.json"
  original = idx.read_text()
  for case, words, content in list(_index_cases(d)):
    idx.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(CheckpointError, match=words):
      checkpoint.load_hf(str(d))
    idx.write_text(original)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_error_warn_or_load_as_asked(tmp_path, bad):
  d = _copy("llama", tmp_path)
  tensors = load_file(d / "model.safetensors")
  tensors[Q] = tensors[Q].copy()
  tensors[Q][0, :3] = bad
  save_file(tensors, d / "model.safetensors")
  with pytest.raises(CheckpointError, match=f"'{Q}' has 3 non-finite"):
    checkpoint.load_hf(str(d))
  with pytest.warns(UserWarning, match=f"'{Q}' has 3 non-finite"):
    _, params = checkpoint.load_hf(str(d), nonfinite="warn")
  assert not np.isfinite(np.asarray(params["layers"][0]["attn"]["wq"])).all()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    checkpoint.load_hf(str(d), nonfinite="ignore")
  with pytest.raises(ValueError, match="nonfinite must be one of"):
    checkpoint.load_hf(str(d), nonfinite="maybe")


def test_no_loading_path_unpickles(tmp_path, monkeypatch):
  """load_hf (float and quantized checkpoints) and the orbax round trip run
  with pickle's loaders replaced by a tripwire."""
  def tripwire(*a, **k):
    raise AssertionError("a checkpoint loading path unpickled something")

  monkeypatch.setattr(pickle, "load", tripwire)
  monkeypatch.setattr(pickle, "loads", tripwire)
  monkeypatch.setattr(pickle, "Unpickler", tripwire)
  monkeypatch.setattr(np, "load", tripwire)  # .npy files may hold pickles
  cfg, params = checkpoint.load_hf(str(FIXTURES / "hf" / "llama"))
  checkpoint.load_hf(str(FIXTURES / "hf_quant" / "deepseek_v3_fp8"))
  checkpoint.save(str(tmp_path / "ckpt"), cfg, params)
  cfg2, params2 = checkpoint.restore(str(tmp_path / "ckpt"))
  assert cfg2 == cfg
