"""Bytes the expert-parallel token exchange puts on the wire, per MoE layer,
step and rank, read from compiled programs.

One MoE layer of `cfg` runs expert-parallel (`moe_ep`, layout dp_attn_ep) on
`t` tokens per rank; the program is compiled for the backend's target (H100s
from this CPU machine, or the CPU devices) and its collectives are read from the HLO:
each all-to-all's buffers, and for a ragged all-to-all the send operand
(only its first send_sizes rows cross the wire). The routed bytes are what
must move: every (token, expert) copy's activation row, t * k rows, there and
back (a copy whose expert is on its own rank moves too, counted alike).

  before      one [n, t k, D] buffer sized for every copy to one rank (the
              exchange up to this change; compiled as capacity_factor = n)
  capacity    the CPU exchange: [n, C, D] per round, C = ceil(1.25 t k / n);
              figures are per round (one round when no destination gets
              more than C rows)
  ragged      the GPU exchange: send_sizes rows per destination, the routed
              copies, so exactly the routed bytes (sizes are run-time values:
              the compiled program shows the buffers they come from, listed as
              send_buffer_bytes); its receive buffer is sized for the worst case
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from benchlib import hlo_report
from jaxinfer import gpu_compile, sharding
from jaxinfer.backend import Backend
from jaxinfer.config import ModelConfig
from jaxinfer.models import moe as moe_lib, specs as specs_lib
from jaxinfer.models.moe_ep import plan_from_params

_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "f8e4m3fn": 1, "u8": 1}
_SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|pred|f8e4m3fn|u8)\[([\d,]*)\]")
_HLO_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def _nbytes(dtype: str, dims: str) -> int:
  return _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)


def collective_bytes(hlo: str, dtype: str | None = None) -> dict:
  """Per collective kind in compiled HLO (`hlo_report.collective_ops`): the
  bytes of its results (all-to-all, all-gather, all-reduce: what each rank
  sends or receives), and for ragged all-to-alls the send operands (first
  operand) instead. A ragged all-to-all moves only its send_sizes rows (known
  at run time); the send operand is the buffer they are taken from. dtype
  (an HLO name, e.g. "bf16"): count only arrays of that type (the
  activations, leaving out int32 ids and bool flags)."""
  out = {"all_to_all": 0, "ragged_all_to_all_send": 0, "all_gather": 0, "all_reduce": 0}
  for kind, result in hlo_report.collective_ops(hlo):
    if kind == "ragged-all-to-all":  # async start: ((operand, output, offsets...), output)
      shapes = _SHAPE.findall(result)[:1]
      key = "ragged_all_to_all_send"
    else:
      shapes = _SHAPE.findall(_outputs(result))
      key = kind.replace("-", "_")
    out[key] += sum(_nbytes(d, dims) for d, dims in shapes if dtype in (None, d))
  return out


def _outputs(result: str) -> str:
  """An op's result type without the operands an async start carries along:
  "((operands...), outputs)" -> "outputs"; anything else unchanged."""
  if not result.startswith("(("):
    return result
  depth = 0
  for i, ch in enumerate(result[1:], 1):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return result[i + 1:]
  return result


def _one_moe_layer(cfg: ModelConfig) -> ModelConfig:
  return dataclasses.replace(cfg, num_layers=1, dense_layers=(), num_mtp_layers=0,
                             layer_types=())


def compile_layer(cfg: ModelConfig, mesh, tokens_per_rank: int, *, strategy: str,
                  capacity_factor: float = 1.25, backend: Backend = Backend(target="gpu")) -> str:
  """HLO text of one expert-parallel MoE layer over `tokens_per_rank` tokens
  on each rank of `mesh` (every axis an expert axis), compiled for `backend`."""
  cfg = dataclasses.replace(_one_moe_layer(cfg), backend=backend)
  params = gpu_compile.abstract(specs_lib.abstract_params(cfg),
                                sharding.param_shardings(cfg, mesh, "dp_attn_ep"))
  plan = dataclasses.replace(plan_from_params(params), strategy=strategy,
                             capacity_factor=capacity_factor)
  n = plan.size
  rows = NamedSharding(mesh, P(plan.axes))
  x = jax.ShapeDtypeStruct((n * tokens_per_rank, 1, cfg.d_model), cfg.compute_dtype(),
                           sharding=rows)

  def layer(mlp_p, x):
    return moe_lib.moe(cfg, jax.tree.map(lambda a: a[0], mlp_p), x, plan)[0]

  with gpu_compile.lowering(mesh):
    lowered = jax.jit(layer).lower(params["layers"][0]["mlp"], x)
  return lowered.compile().as_text()


def report(cfg: ModelConfig, mesh, tokens_per_rank=(1, 2, 4, 8, 16, 32, 64), *,
           backend: Backend = Backend(target="gpu")) -> list[dict]:
  """Per tokens-per-rank t: routed bytes and each exchange's compiled bytes
  (dispatch + combine, per MoE layer, step and rank) and their ratio."""
  n = math.prod(mesh.shape.values())
  row_bytes = cfg.d_model * jnp.dtype(cfg.compute_dtype()).itemsize
  k = cfg.num_experts_per_tok
  act = _HLO_DTYPE[jnp.dtype(cfg.compute_dtype()).name]
  rows = []
  for t in tokens_per_rank:
    routed = 2 * t * k * row_bytes  # there and back
    row = dict(tokens_per_rank=t, ranks=n, top_k=k, routed_bytes=routed)
    exchanges = {"before": ("all_to_all", n), "capacity": ("all_to_all", 1.25)}
    if backend.on_gpu():
      exchanges["ragged"] = ("ragged", 1.25)
    for name, (strategy, factor) in exchanges.items():
      hlo = compile_layer(cfg, mesh, t, strategy=strategy, capacity_factor=factor,
                          backend=backend)
      c = collective_bytes(hlo)
      if name == "ragged":  # send_sizes = each destination's routed copies: exactly routed
        row[name] = dict(bytes=routed, ratio=1.0, send_buffer_bytes=c["ragged_all_to_all_send"],
                         collectives=c)
        continue
      moved = collective_bytes(hlo, dtype=act)["all_to_all"]  # activation rows only
      row[name] = dict(bytes=moved, ratio=moved / routed, collectives=c)
    rows.append(row)
  return rows
