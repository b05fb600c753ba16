"""Quantized projections of an HF checkpoint -> `QuantizedWeight` host arrays.

`read_quantized(read, ref, q, spec)` reads the weight named by a
`hf_names.WeightRef` in the layout `q.layout` names (shared reference
`quant_formats.md`), checks every tensor's dtype and shape, and returns
(values, scale, scale2) in `models.quant`'s layout, rows selected and
experts stacked. Values stay in their storage dtype: nothing is dequantized.

  layout               values             scale                    scale2
  deepseek_fp8         W.weight f8        W.weight_scale_inv f32   -
  fbgemm_fp8           W.weight f8        W.weight_scale [O, 1]    -
  modelopt (fp8)       W.weight f8        W.weight_scale []        -      (+ input_scale)
  modelopt (nvfp4)     W.weight u8        W.weight_scale f8        W.weight_scale_2 (+ input_scale)
  compressed_tensors   W.weight f8 /      W.weight_scale           W.weight_global_scale = 1 / scale2
                       W.weight_packed u8                          (+ input_scale, input_global_scale)
  mxfp4 (GPT-OSS)      W_blocks u8 [.., O, I/32, 16]   W_scales u8 E8M0   -
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxinfer.checkpoint.errors import CheckpointError as QuantError
from jaxinfer.config import QuantConfig
from jaxinfer.models import quant as quant_lib




def tensor_names(q: QuantConfig, weight: str) -> dict:
  """The tensors holding HF weight `weight` quantized: values, scale, scale2
  (or None) and optional extras that are consumed unread (activation scales)."""
  base = weight[:-len(".weight")] if weight.endswith(".weight") else weight
  if q.layout == "mxfp4":
    return dict(values=f"{base}_blocks", scale=f"{base}_scales", scale2=None, extra=())
  if q.layout == "deepseek_fp8":
    return dict(values=weight, scale=f"{base}.weight_scale_inv", scale2=None, extra=())
  if q.layout == "fbgemm_fp8":
    return dict(values=weight, scale=f"{base}.weight_scale", scale2=None,
                extra=(f"{base}.input_scale_ub",))
  if q.layout == "modelopt":
    s2 = f"{base}.weight_scale_2" if q.method == "nvfp4" else None
    return dict(values=weight, scale=f"{base}.weight_scale", scale2=s2, extra=(f"{base}.input_scale",))
  if q.layout == "compressed_tensors":
    nv = q.method == "nvfp4"
    return dict(values=f"{base}.weight_packed" if nv else weight, scale=f"{base}.weight_scale",
                scale2=f"{base}.weight_global_scale" if nv else None,
                extra=(f"{base}.input_scale", f"{base}.input_global_scale"))
  raise QuantError(f"no checkpoint tensors for quantization layout {q.layout!r}")


_VALUE_DTYPE = {"fp8": "F8_E4M3", "nvfp4": "U8", "mxfp4": "U8"}
_SCALE_DTYPES = {"fp8": ("F32", "BF16", "F16"), "nvfp4": ("F8_E4M3",), "mxfp4": ("U8",)}


def _scale_shapes(q: QuantConfig, out: int, d_in: int) -> tuple[tuple[int, ...], ...]:
  """Accepted on-disk shapes of one matrix's scale (after its lead dims)."""
  if q.method == "mxfp4":
    return ((out, d_in // 32),)
  if q.method == "nvfp4":
    return ((out, d_in // 16),)
  no, ni = quant_lib.scale_shape(q.block, out, d_in)
  if (no, ni) == (1, 1):
    return ((), (1,), (1, 1))
  if ni == 1:
    return ((no, 1), (no,))
  return ((no, ni),)


def _values_shape(q: QuantConfig, out: int, d_in: int) -> tuple[int, ...]:
  if q.method == "mxfp4":
    return (out, d_in // 32, 16)
  return (out, quant_lib.stored_in(q.method, d_in))


def _check_data(name: str, kind: str, a: np.ndarray, q: QuantConfig) -> None:
  """Corrupt data: NaN fp8 codes, E8M0 255 (NaN), non-finite or non-positive scales."""
  if a.dtype == np.uint8 and kind == "scale" and q.method == "mxfp4":
    bad = a == 255
  elif kind == "values" and q.method == "fp8":
    bad = (a.view(np.uint8) & 0x7F) == 0x7F
  elif kind == "values":
    return
  else:
    f = a.astype(np.float32)
    bad = ~np.isfinite(f) | (f < 0) if kind == "scale" else ~np.isfinite(f) | (f <= 0)
  if np.any(bad):
    raise QuantError(f"tensor {name!r}: {int(np.sum(bad))} corrupt {kind} entries "
                     f"(NaN codes or non-finite / negative scales)")


def _one(read: Callable, q: QuantConfig, weight: str, lead: tuple, out: int, d_in: int):
  """One HF weight -> (values [*lead, out, I'], scale [*lead, no, ni], scale2 [*lead] | None)."""
  names = tensor_names(q, weight)
  if q.method in quant_lib.PACKED and d_in % (32 if q.method == "mxfp4" else 16):
    raise QuantError(f"{weight}: input dim {d_in} is not a multiple of the {q.method} block")
  values = read(names["values"], [(*lead, *_values_shape(q, out, d_in))], (_VALUE_DTYPE[q.method],),
                f"quantized values of {weight}")
  scale_shapes = [(*lead, *s) for s in _scale_shapes(q, out, d_in)]
  scale = read(names["scale"], scale_shapes, _SCALE_DTYPES[q.method], f"the scale of {weight}")
  _check_data(names["values"], "values", values, q)
  _check_data(names["scale"], "scale", scale, q)
  values = values.reshape(*lead, out, -1)
  scale = scale.reshape(*lead, *quant_lib.scale_shape(
      quant_lib.FIXED_BLOCKS.get(q.method, q.block), out, d_in))
  scale2 = None
  if names["scale2"]:
    s2 = read(names["scale2"], [(*lead,), (*lead, 1)], ("F32",), f"the second-level scale of {weight}")
    _check_data(names["scale2"], "scale2", s2, q)
    s2 = s2.reshape(lead).astype(np.float32)
    scale2 = 1.0 / s2 if q.layout == "compressed_tensors" else s2
  return values, scale, scale2


def _rows(q: QuantConfig, ref, values, scale):
  """A fused tensor's rows for this leaf; block-scaled rows must align to blocks."""
  if ref.rows is None:
    return values, scale
  bo = quant_lib.block_sizes(quant_lib.FIXED_BLOCKS.get(q.method, q.block), ref.out, ref.d_in)[0]
  if bo == 1:
    return values[..., ref.rows, :], scale[..., ref.rows, :]
  start, stop, step = ref.rows.indices(ref.out)
  if step != 1 or start % bo or (stop % bo and stop != ref.out):
    raise QuantError(f"{ref.names[0]}: rows {start}:{stop}:{step} of a fused weight split its "
                     f"{bo}-row scale blocks")
  return values[..., start:stop, :], scale[..., start // bo:-(-stop // bo), :]


def read_quantized(read: Callable, ref, q: QuantConfig):
  """The leaf `ref` names -> (values, scale, scale2 | None) numpy arrays.

  read(name, shapes, dtypes, what) -> the tensor as numpy (storage dtype),
  raising a named error when missing or of another shape / dtype."""
  parts = []
  for name in ref.names:
    values, scale, scale2 = _one(read, q, name, ref.lead, ref.out, ref.d_in)
    values, scale = _rows(q, ref, values, scale)
    parts.append((values, scale, scale2))
  if not ref.stacked:
    return parts[0]
  stack = lambda i: None if parts[0][i] is None else np.stack([p[i] for p in parts])
  return stack(0), stack(1), stack(2)


def extra_names(q: QuantConfig, ref) -> list[str]:
  """Tensors of this leaf consumed without being read (activation scales)."""
  return [n for w in ref.names for n in tensor_names(q, w)["extra"]]
