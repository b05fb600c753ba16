"""The quantized weight formats decoded by their published formulas
(quant_formats.md), one element at a time in numpy: the reference the
quantized-weight tests (models/test_quant.py, checkpoint/test_quant_checkpoint.py)
compare against."""

import numpy as np

LUT_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _nibbles(packed):
  """uint8 [..., I/2] -> codes [..., I], the low nibble the even element."""
  out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
  out[..., 0::2], out[..., 1::2] = packed & 0xF, packed >> 4
  return out


def reference(values, scale, scale2, method, block):
  """W [*, O, I] by the published formulas, one element at a time in numpy."""
  values, scale = np.asarray(values), np.asarray(scale)
  if method in ("mxfp4", "nvfp4"):
    codes = LUT_E2M1[_nibbles(values)]
  elif method == "int4":
    n = _nibbles(values).astype(np.int32)
    codes = np.where(n >= 8, n - 16, n).astype(np.float32)
  else:
    codes = values.astype(np.float32)
  *_, out, d_in = codes.shape
  bo, bi = block[0] or out, block[1] or d_in
  o, i = np.arange(out)[:, None], np.arange(d_in)[None, :]
  if method == "mxfp4":
    s = 2.0 ** (scale[..., o, i // 32].astype(np.float32) - 127)
  elif method == "nvfp4":
    s = scale[..., o, i // 16].astype(np.float32) * np.asarray(scale2)[..., None, None]
  else:
    s = scale[..., o // bo, i // bi]
  return codes * s
