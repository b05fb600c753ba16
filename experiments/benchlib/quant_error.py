"""Weight-only quantization error on the bundled default model: for each
method (`models.quant`), the logits' relative error against the float model
(max |q - f| / max |f| over a text's positions), the share of positions
whose argmax agrees (teacher-forced), and the weight bytes."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxinfer import models
from jaxinfer.config import QuantConfig
from jaxinfer.models import quant
from jaxinfer.run import load_default_model

METHODS = {"fp8": (1, 0), "int8": (1, 0), "int4": (1, 32), "mxfp4": (1, 32), "nvfp4": (1, 16)}
TEXT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
        "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\nclass Stack:\n")


def report(methods=tuple(METHODS), text: str = TEXT) -> list[dict]:
  cfg, params, tok = load_default_model(jnp.float32)
  tokens = jnp.asarray([tok.encode(text)], jnp.int32)
  ref = np.asarray(models.logits(cfg, params, tokens))
  rows = []
  for method in methods:
    qcfg = dataclasses.replace(cfg, quant=QuantConfig(method=method, block=METHODS[method]))
    qp = models.specs.quantize_params(qcfg, params)
    out = np.asarray(models.logits(qcfg, qp, tokens))
    rows.append(dict(method=method, block=list(METHODS[method]), tokens=int(tokens.shape[1]),
                     logits_rel_err=float(np.abs(out - ref).max() / np.abs(ref).max()),
                     argmax_agreement=float(np.mean(out.argmax(-1) == ref.argmax(-1))),
                     bytes_ratio=quant.nbytes(qp) / quant.nbytes(params)))
  return rows
