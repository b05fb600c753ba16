"""What a compiled GPU step costs, read off its optimized HLO text: kernel
launches a step, weight bytes copied a step, loops without a known trip count.

  report = hlo_report.read(compiled.as_text(), weights=hlo_report.param_weights)
  report.launches, report.weight_copy_bytes, report.unknown_trip_loops

Launches: every instruction of the entry computation, of each while body
(times its `known_trip_count`, once where XLA knows none) and of called
computations that runs on the device by itself: fusions (and async
`fusion-start`s), custom calls (cuBLAS, Pallas / Triton, Mosaic GPU),
copies, collectives (their `-start`), sorts, unfused scatters, gathers,
dots, reduces... Fused computations (`calls=` of a fusion) launch nothing of
their own; `parameter`, `constant`, `tuple`, `get-tuple-element`,
`bitcast`, the `-done` halves and other bookkeeping are free. A
`conditional` counts its costliest branch.

Weight copies: data-movement operations (copy, transpose, or a fusion whose
fused computation only slices, copies, transposes, reshapes or concatenates)
over weight data, counted by the bytes they write: XLA:GPU's
`dynamic_slice_fusion` that copies one layer's weights out of a scanned
stack (async as `fusion-start` on newer jax), and the entry's
`wrapped_transpose` of a whole stacked projection. Weight data are the entry
parameters `weights(instruction)` accepts (the step's `params...` arguments), the
results of data movement over them, and the while-loop tuple elements they
enter. Lookups that write less than `MIN_COPY_BYTES` (an embedding row) are
reads, not copies.

Kernel calls and collectives in the same text (`gpu_plan.compile_program`
reports them): the Pallas (`TRITON_CALL`) and Mosaic GPU (`MOSAIC_CALL`)
custom calls, `kernel_gathers` (pools gathered whole around a kernel),
`collective_ops` / `collectives` (by kind), `quantized_gathers` (1-byte
weights gathered); and XLA's own cost estimate of a compiled program,
`xla_cost`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

MIN_COPY_BYTES = 1 << 20
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1,
                "s4": 0.5, "u4": 0.5, "f4e2m1fn": 0.5, "bf16": 2, "f16": 2, "s16": 2,
                "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# Opcodes that launch nothing by themselves.
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
         "add-dependency", "opt-barrier", "partition-id", "replica-id", "domain",
         "get-dimension-size", "custom-call-done"}
# Opcodes that only move data (inside a fusion: a fusion of only these is a copy).
_MOVES = {"parameter", "constant", "copy", "transpose", "dynamic-slice", "slice", "bitcast",
          "reshape", "concatenate", "tuple", "get-tuple-element", "broadcast"}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%(\S+)\s*\(.*\{\s*$")
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True))
                    + r")\[([\d,]*)\]")


@dataclasses.dataclass
class Instr:
  name: str
  type: str  # the result type text
  opcode: str
  operands: list[str]
  attrs: str  # everything after the operand list
  root: bool = False

  def attr(self, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
    return m.group(1) if m else None


@dataclasses.dataclass
class Computation:
  name: str
  entry: bool
  instrs: list[Instr]

  @property
  def by_name(self) -> dict[str, Instr]:
    return {i.name: i for i in self.instrs}

  @property
  def root(self) -> Instr:
    return next(i for i in self.instrs if i.root)


@dataclasses.dataclass(frozen=True)
class Report:
  launches: int  # kernel launches a step
  weight_copy_bytes: int  # bytes written by copies of weight data a step
  weight_copies: tuple[tuple[str, int, int], ...]  # (instruction, bytes, times a step)
  loops: int  # while loops
  unknown_trip_loops: tuple[str, ...]  # while loops without a known trip count

  def per_layer(self, num_layers: int) -> float:
    return self.launches / num_layers

  def as_dict(self, num_layers: int | None = None) -> dict:
    out = dict(launches=self.launches, weight_copy_bytes=self.weight_copy_bytes,
               weight_copies=[dict(op=n, bytes=b, times=t) for n, b, t in self.weight_copies],
               loops=self.loops, unknown_trip_loops=list(self.unknown_trip_loops))
    if num_layers:
      out["launches_per_layer"] = round(self.per_layer(num_layers), 2)
    return out


def param_weights(param: Instr) -> bool:
  """The step's weight arguments (an entry `parameter`): jax names them by
  their path, `params__layers___0___attn____wq__.1` for
  params['layers'][0]['attn']['wq'] (`model_params__...` for the
  `steps.StepModel`'s model.params), and keeps the path as the op_name
  (`param.63`, op_name="params['layers'][0]['attn']['wo']" once the SPMD
  partitioner has renamed them)."""
  return (param.name.startswith(("params_", "model_params_")) or
          "op_name=\"params[" in param.attrs or "op_name=\"model.params[" in param.attrs)


def parse(hlo: str) -> dict[str, Computation]:
  """Optimized HLO text -> its computations by name."""
  comps, current = {}, None
  for line in hlo.splitlines():
    if current is None:
      m = _HEADER.match(line)
      if m:
        current = Computation(m.group(2), bool(m.group(1)), [])
      continue
    if line.startswith("}"):
      comps[current.name] = current
      current = None
      continue
    m = _INSTR.match(line)
    if m:
      operands, attrs = _split_operands(m.group(4))
      current.instrs.append(Instr(m.group(1), m.group(2), m.group(3), operands, attrs,
                                  root=line.lstrip().startswith("ROOT")))
  return comps


def _split_operands(rest: str) -> tuple[list[str], str]:
  """'%a, %b), kind=...' -> (['a', 'b'], 'kind=...'): the operand list ends at
  the parenthesis that closes the opcode's."""
  depth = 1
  for i, ch in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return re.findall(r"%([\w.\-]+)", rest[:i]), rest[i + 1:]
  return re.findall(r"%([\w.\-]+)", rest), ""


def array_bytes(type_text: str) -> int:
  """Bytes of the arrays in a type text (a tuple's elements summed)."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(type_text):
    total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return int(total)


def _trip_count(instr: Instr) -> int | None:
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
  return int(m.group(1)) if m else None


def _is_move(instr: Instr, comps: dict[str, Computation]) -> bool:
  if instr.opcode in ("copy", "transpose", "copy-start"):
    return True
  if instr.opcode in ("fusion", "fusion-start"):
    called = comps.get(instr.attr("calls") or "")
    return called is not None and all(i.opcode in _MOVES for i in called.instrs)
  return False


def _written_bytes(instr: Instr, comps: dict[str, Computation]) -> int:
  """Bytes an operation writes: its result, or for an async start the fused
  computation's result."""
  if instr.opcode.endswith("-start") and instr.attr("calls") in comps:
    return array_bytes(comps[instr.attr("calls")].root.type)
  return array_bytes(instr.type)


def read(hlo: str, weights: Callable[[Instr], bool] = param_weights) -> Report:
  """Launches, weight copies and loops of one compiled program's HLO text."""
  comps = parse(hlo)
  entry = next(c for c in comps.values() if c.entry)
  counts = dict(launches=0, loops=0)
  copies: list[tuple[str, int, int]] = []
  unknown: list[str] = []

  def walk(comp: Computation, weight_names: set[str], times: int) -> int:
    """Launches of one run of `comp` (its weight-copy bytes recorded times `times`)."""
    names = set(weight_names)
    launches = 0
    by_name = comp.by_name
    for ins in comp.instrs:
      from_weights = any(o in names for o in ins.operands)
      if ins.opcode == "parameter" and comp.entry and weights(ins):
        names.add(ins.name)
      elif ins.opcode in ("bitcast", "get-tuple-element", "reshape") and from_weights:
        if ins.opcode != "get-tuple-element" or _gte_is_weight(ins, by_name, names):
          names.add(ins.name)
      elif ins.opcode == "tuple" and from_weights:
        names.add(ins.name)
      if ins.opcode == "while":
        counts["loops"] += 1
        trips = _trip_count(ins)
        if trips is None:
          unknown.append(ins.name)
        body = comps[ins.attr("body")]
        init = by_name.get(ins.operands[0]) if ins.operands else None
        inner = _weight_elements(init, names, body)
        launches += (trips or 1) * walk(body, inner, times * (trips or 1))
        if trips is None:
          launches += walk(comps[ins.attr("condition")], set(), times)
        continue
      if ins.opcode == "conditional":
        branches = re.findall(r"%([\w.\-]+)", ins.attrs.split("branch_computations=")[-1]
                              .split("}")[0]) if "branch_computations" in ins.attrs else \
            [ins.attr("true_computation"), ins.attr("false_computation")]
        launches += max((walk(comps[b], set(), times) for b in branches if b in comps),
                        default=0)
        continue
      if ins.opcode == "call":
        launches += walk(comps[ins.attr("to_apply")], set(), times)
        continue
      if ins.opcode in _FREE or ins.opcode.endswith("-done"):
        continue
      launches += 1
      if from_weights and _is_move(ins, comps):
        written = _written_bytes(ins, comps)
        names.add(ins.name)
        if written >= MIN_COPY_BYTES:
          copies.append((f"{comp.name}/{ins.name}", written, times))
    return launches

  counts["launches"] = walk(entry, set(), 1)
  return Report(launches=counts["launches"],
                weight_copy_bytes=sum(b * t for _, b, t in copies),
                weight_copies=tuple(copies), loops=counts["loops"],
                unknown_trip_loops=tuple(unknown))


def _gte_is_weight(ins: Instr, by_name: dict[str, Instr], names: set[str]) -> bool:
  """A get-tuple-element of a weight tuple: the element at its index is one
  (a tuple built here: that operand; else the whole tuple counts)."""
  src = by_name.get(ins.operands[0])
  index = int(ins.attr("index") or 0)
  if src is not None and src.opcode == "tuple" and index < len(src.operands):
    return src.operands[index] in names
  return True


def _weight_elements(init: Instr | None, names: set[str], body: Computation) -> set[str]:
  """The while body's get-tuple-elements of its parameter that carry weights
  (the init tuple's elements at those indices are weight data)."""
  if init is None or init.opcode != "tuple":
    return set()
  indices = {i for i, o in enumerate(init.operands) if o in names}
  param = next((i.name for i in body.instrs if i.opcode == "parameter"), None)
  return {i.name for i in body.instrs if i.opcode == "get-tuple-element"
          and i.operands[:1] == [param] and int(i.attr("index") or 0) in indices}


# ----------------------------------------------------------------------------- kernel calls, collectives, XLA's cost

TRITON_CALL = "__gpu$xla.gpu.triton"  # the Pallas kernels' custom call in compiled HLO
MOSAIC_CALL = 'custom_call_target="mosaic_gpu'  # the Mosaic GPU kernels' (mosaic_gpu_v2)


def kernel_gathers(hlo: str, pool_shapes=()) -> int:
  """All-gathers XLA placed around the Pallas kernels in compiled HLO text:
  GSPMD cannot split a custom call, so outside `shard_map` (tp layouts) it
  gathers the kernel's sharded operands (the page pool) whole on every device.
  Counted: gathers tagged with the kernel (jax 0.10's XLA), and gathers that
  produce a whole pool of `pool_shapes` (newer XLA gathers the pool where the
  step writes it, one combined gather tagged with the scatter)."""
  dims = ["[" + ",".join(map(str, s)) + "]" for s in pool_shapes]
  return sum(1 for line in hlo.splitlines()
             if ("all-gather-start(" in line or " all-gather(" in line)
             and ("pallas_call" in line or any(d in line for d in dims)))


_COLLECTIVES = ("all-to-all", "ragged-all-to-all", "all-gather", "all-reduce")
_COLLECTIVE_LINE = re.compile(r"= (.*?) (ragged-all-to-all|all-to-all|all-gather|all-reduce)"
                              r"(?:-start)?\(")


def collective_ops(hlo: str):
  """(kind, result type text) of every collective op in compiled HLO text
  (async starts or sync ops; the matching -done lines are not counted)."""
  for line in hlo.splitlines():
    m = _COLLECTIVE_LINE.search(line)
    if m:
      yield m.group(2), m.group(1)


def quantized_gathers(hlo: str) -> int:
  """All-gathers of 1-byte arrays (quantized weights in their storage dtype)
  in compiled HLO text: 0 when every quantized weight is read where it lies."""
  return sum(1 for kind, ty in collective_ops(hlo)
             if kind == "all-gather" and re.search(r"\b(f8e4m3fn|u8|s8)\[", ty))


def collectives(hlo: str) -> dict:
  """Collective ops in compiled HLO text, by kind (async starts or sync ops)."""
  counts = {op.replace("-", "_"): 0 for op in _COLLECTIVES}
  for kind, _ in collective_ops(hlo):
    counts[kind.replace("-", "_")] += 1
  return counts


def xla_cost(compiled) -> dict:
  """XLA's own estimate of a compiled program's bytes accessed and FLOPs
  (`cost_analysis()`), or why the backend gives none."""
  try:
    cost = compiled.cost_analysis()
  except (NotImplementedError, RuntimeError) as e:
    return dict(unavailable=f"{type(e).__name__}: {e}")
  if isinstance(cost, (list, tuple)):  # older jax: one dict per program
    cost = cost[0] if cost else {}
  if not cost:  # jax 0.10.2 and 0.12.1 give None for a compile-only GPU target
    return dict(unavailable=f"cost_analysis() gave {cost!r} for this target")
  if "bytes accessed" not in cost:
    return dict(unavailable="cost_analysis() has no 'bytes accessed'")
  return dict(bytes_accessed=float(cost["bytes accessed"]), flops=float(cost.get("flops", 0.0)))
