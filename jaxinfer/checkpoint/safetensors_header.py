"""A safetensors file's header, validated before any tensor is read.

The format: 8 bytes (little-endian u64) N, N bytes of JSON mapping each tensor
name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to
the data after the header; an optional "__metadata__" of strings), then the
data. A hostile or corrupt file can lie in each of these; `read_header`
checks every entry against the file and the others, so a lie is a named
`CheckpointError` before `load_hf` does any device work:

- the header length past the file or over `MAX_HEADER_BYTES`, or not JSON;
- an entry without a known dtype, a shape of non-negative integers, or two
  integer offsets;
- offsets outside the data, out of order, or spanning other than
  prod(shape) x itemsize bytes (a huge declared shape cannot fit the file);
- two tensors' bytes overlapping.
"""

from __future__ import annotations

import json
import math
import os

from jaxinfer.checkpoint.errors import CheckpointError

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2,
            "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
            "F64": 8}


def read_header(fn: str) -> tuple[dict, int]:
  """-> ({name: entry}, offset of the data in the file), every entry checked."""
  name = os.path.basename(fn)

  def bad(why):
    return CheckpointError(f"cannot read {name}: {why}")

  size = os.path.getsize(fn)
  with open(fn, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise bad(f"{size} bytes, shorter than a safetensors header")
    n = int.from_bytes(head, "little")
    if n > min(MAX_HEADER_BYTES, size - 8):
      raise bad(f"the header claims {n} bytes; the file has {size - 8} after its length")
    try:
      meta = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise bad(f"bad header ({e})") from None
  if not isinstance(meta, dict):
    raise bad("the header is not a JSON object")
  data = size - 8 - n
  spans = []
  for tensor, info in meta.items():
    if tensor == "__metadata__":
      continue
    spans.append((*_check_entry(tensor, info, data, bad), tensor))
  spans.sort()
  for (_, hi, a), (lo, _, b) in zip(spans, spans[1:]):
    if lo < hi:
      raise bad(f"tensors {a!r} and {b!r} overlap in the data")
  return {k: v for k, v in meta.items() if k != "__metadata__"}, 8 + n


def _check_entry(tensor: str, info, data: int, bad) -> tuple[int, int]:
  if not isinstance(info, dict):
    raise bad(f"tensor {tensor!r}: its header entry is not an object")
  dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
  if dtype not in ITEMSIZE:
    raise bad(f"tensor {tensor!r}: unknown dtype {dtype!r}")
  if (not isinstance(shape, list)
      or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
    raise bad(f"tensor {tensor!r}: shape {shape!r} is not a list of non-negative integers")
  if (not isinstance(offsets, list) or len(offsets) != 2
      or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
    raise bad(f"tensor {tensor!r}: data_offsets {offsets!r} are not two integers")
  lo, hi = offsets
  if not 0 <= lo <= hi <= data:
    raise bad(f"tensor {tensor!r}: data_offsets [{lo}, {hi}] lie outside the {data} data bytes "
              "(truncated or lying header)")
  want = math.prod(shape) * ITEMSIZE[dtype]
  if hi - lo != want:
    raise bad(f"tensor {tensor!r}: shape {shape} of {dtype} is {want} bytes, its data_offsets "
              f"span {hi - lo}")
  return lo, hi
