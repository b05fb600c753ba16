"""The Qwen3-VL fixture's processor and two test images (PNG bytes), shared
by the engine, HTTP and MLPerf tests of image requests."""

import io
import json

import numpy as np
from PIL import Image

from conftest import FIXTURES
from jaxinfer import vision_inputs

VL = FIXTURES / "hf_vl"
PROC = vision_inputs.ProcessorConfig(**{k: v for k, v in json.loads(
    (VL / "processor.json").read_text()).items() if k != "images"})


def png(h, w, seed) -> bytes:
  arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
  buf = io.BytesIO()
  Image.fromarray(arr).save(buf, format="PNG")
  return buf.getvalue()


A, B = png(24, 40, 1), png(37, 19, 2)  # 15 and 10 visual tokens
