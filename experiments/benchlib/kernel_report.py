"""A resource report per kernel case: what the compiled H100 (or A100) program
asks of the GPU, and how its HBM traffic compares with the minimum.

For each case of `gpu_cases.CASES` (or a subset) the kernel is compiled for its
GPU on this CPU machine and the report gives

  from the executable  (`gpu_executable`): grid, threads per block, dynamic
      shared memory of the launch (CustomKernelProto.shared_memory_bytes),
      static shared memory, registers per thread and the per-thread frame
      (cubin EIATTRs), and ptxas's spill stores / loads (`ptxas -v` over the
      kernel's PTX from an XLA dump of the same compile);
  from the shapes  (`traffic`): useful and tiled FLOPs, planned HBM bytes
      following the kernel's tiling, the minimum bytes, planned / minimum, and
      the H100 roofline max(FLOPs / peak, bytes / bandwidth) at both;
  Mosaic  (`mosaic_report`) the Mosaic GPU kernel a Hopper runs the case on,
      its shared memory and planned / minimum bytes beside the Triton ones
      (the tests compile every such case for H100: tests/kernels/).

Context lengths (an assumption, not a measurement): every sequence of a
paged / MLA case holds `ctx` keys (its Q new tokens included); in a ragged
case the prefill chunk is sequence 0 and its last token sees `ctx` keys
(ctx - prefill_tokens of earlier context: the case's page table holds
ctx / ps pages, so a longer context could not be addressed), and the
B - 1 decode sequences hold `ctx` keys each. Values that cannot be read are
null with the reason under "unavailable"; nothing is estimated in their place.
"""

from __future__ import annotations

import json
import pathlib
import tempfile
from typing import Iterable

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from benchlib import gpu_cases, gpu_executable, results, traffic
from jaxinfer import gpu_compile, ops
from pallas_kernels import mosaic_mla_attention as mma
from pallas_kernels import mosaic_paged_attention as mpa
from pallas_kernels import mosaic_ragged_attention as mra
from pallas_kernels import mosaic_wide_attention as mwa

L2_BYTES = {"h100": 50e6, "a100": 40e6}  # datasheet L2 sizes, for the notes only


def case_sequences(case: gpu_cases.KernelCase) -> list[tuple[int, int]]:
  """(q, kv) per sequence under the module docstring's context assumption."""
  if case.kernel == "ragged":
    return [(case.prefill_tokens, case.ctx)] + [(1, case.ctx)] * (case.B - 1)
  if case.kernel in ("paged", "mla"):
    return [(case.Q, case.ctx)] * case.B
  raise ValueError(f"case {case.name}: kernel {case.kernel!r} has no paged sequences")


def case_traffic(case: gpu_cases.KernelCase) -> traffic.Traffic:
  """The case's `traffic.Traffic` (flash or paged core, with the case's blocks)."""
  e = 2 if case.dtype == "bfloat16" else 4
  if case.kernel == "flash":
    return traffic.flash_traffic(B=case.B, T=case.T, S=case.S, N=case.N, K=case.K, D=case.D,
                                 Dv=case.Dv, window=case.window, sinks=case.sinks, e=e)
  blocks = case.blocks()
  return traffic.paged_traffic(
      case_sequences(case), N=case.N, K=case.K, D=case.D, Dv=case.Dv, ps=case.ps,
      pages_per_seq=case.pages_per_seq, ppcb=blocks["pages_per_compute_block"],
      splits=blocks.get("num_splits", 1), window=case.window,
      v_from_k=case.kernel == "mla" or (case.kernel == "ragged" and case.D != case.Dv), e=e)


def compile_case(case: gpu_cases.KernelCase, dump_dir: str | None = None):
  """The case compiled for its first GPU (optionally dumping XLA's PTX)."""
  gpu = case.gpus[0]
  mesh = gpu_compile.mesh({"data": 1}, gpu=gpu)
  fn, args = gpu_cases.build(case, NamedSharding(mesh, P()))
  # Newer XLA (jax 0.12) dumps the kernels' PTX only for emitters matching
  # xla_dump_emitter_re; jax 0.10 accepts the option and dumps the PTX anyway.
  options = {"xla_dump_to": dump_dir, "xla_dump_hlo_pass_re": "^$",
             "xla_dump_emitter_re": ".*"} if dump_dir else None
  with gpu_compile.lowering(mesh):
    lowered = jax.jit(fn).lower(*args)
  return lowered.compile(compiler_options=options)


def executable_facts(compiled, kernel_name: str, *, gpu: str, dump_dir: str | None) -> dict:
  """Launch, shared memory, registers and spills of the one custom kernel
  named `kernel_name` in a compiled program; `unavailable` names every value
  left null and why."""
  why, facts = {}, dict(grid=None, threads=None, dynamic_smem_bytes=None,
                        static_smem_bytes=None, smem_bytes=None, registers=None,
                        frame_bytes=None, spill_store_bytes=None, spill_load_bytes=None)
  launches = [k for k in gpu_executable.kernel_launches(compiled) if k.name == kernel_name]
  if len(launches) != 1:
    why["launch"] = f"expected one {kernel_name!r} custom kernel, found {len(launches)}"
    return dict(facts, unavailable=why)
  k = launches[0]
  facts.update(grid=list(k.grid), threads=k.threads[0] * k.threads[1] * k.threads[2],
               dynamic_smem_bytes=k.dynamic_smem_bytes)
  if k.cubin is None:
    why["cubin"] = "the kernel's spec holds no ELF cubin"
  else:
    res = gpu_executable.cubin_resources(k.cubin, kernel_name)
    facts.update(static_smem_bytes=res.static_smem_bytes, registers=res.registers,
                 frame_bytes=res.frame_bytes,
                 smem_bytes=k.dynamic_smem_bytes + res.static_smem_bytes)
    for name in ("registers", "frame_bytes"):
      if facts[name] is None:
        why[name] = f"no EIATTR entry for {kernel_name} in the cubin's .nv.info"
    if res.threads and res.threads[0] * max(res.threads[1], 1) * max(res.threads[2], 1) != \
        facts["threads"]:
      why["threads"] = f"launch threads {k.threads} disagree with the cubin's REQNTID {res.threads}"
  facts.update(_spills(kernel_name, dump_dir, facts["registers"], why))
  facts["smem_limit_bytes"] = gpu_compile.target(gpu).smem_per_block
  return dict(facts, unavailable=why)


def _spills(kernel_name: str, dump_dir: str | None, registers, why: dict) -> dict:
  """ptxas -v over the kernel's dumped PTX; records why when it cannot run."""
  reason = "the cubin records the stack frame (frame_bytes), not spill counts; "
  ptx = gpu_executable.ptx_of(dump_dir, kernel_name) if dump_dir else None
  if ptx is None:
    why["spills"] = reason + "no PTX of the kernel in the XLA dump"
    return {}
  try:
    info = gpu_executable.ptxas_spills(ptx, gpu_executable.ptx_target(ptx) or "sm_90a")
  except RuntimeError as e:
    why["spills"] = reason + str(e)
    return {}
  out = dict(spill_store_bytes=info["spill_store_bytes"],
             spill_load_bytes=info["spill_load_bytes"], ptxas_registers=info["registers"])
  if registers is not None and info["registers"] != registers:
    why["ptxas_registers"] = (f"ptxas -v here gives {info['registers']} registers, the "
                              f"executable's cubin {registers}: the spill counts may not match "
                              "XLA's own ptxas run")
  return out


def _kernel_name(case: gpu_cases.KernelCase) -> str:
  return "flash_attention" if case.kernel == "flash" else "paged_attention"


def shape_report(case: gpu_cases.KernelCase) -> dict:
  """FLOPs, bytes, planned / minimum and the roofline of one case, with notes."""
  t = case_traffic(case)
  gpu = gpu_compile.target(case.gpus[0])
  rate = dict(peak_flops=gpu.bf16_flops, bandwidth=gpu.hbm_bandwidth)
  planned_s = traffic.roofline_s(t.flops, t.planned_bytes, **rate)
  min_s = traffic.roofline_s(t.flops, t.minimum_bytes, **rate)
  return dict(flops=t.flops, tiled_flops=t.tiled_flops, planned_bytes=t.planned_bytes,
              minimum_bytes=t.minimum_bytes, planned_over_minimum=t.ratio,
              planned_components=t.planned, minimum_components=t.minimum, tiling=t.tiling,
              roofline_us=planned_s * 1e6, roofline_min_us=min_s * 1e6,
              bound="compute" if t.flops / gpu.bf16_flops >= t.planned_bytes / gpu.hbm_bandwidth
              else "memory",
              notes=_notes(case, t))


def _notes(case: gpu_cases.KernelCase, t: traffic.Traffic) -> list[str]:
  """Why planned exceeds the minimum, in words (each claim from the tiling)."""
  notes, tl = [], t.tiling
  l2 = L2_BYTES[case.gpus[0]] / 1e6
  if case.kernel == "flash":
    notes.append(f"K/V blocks are loaded once per query head and query block "
                 f"({tl['key_blocks_per_head']} key blocks per head): planned counts loads "
                 f"issued, before the {l2:.0f} MB L2 absorbs repeats; not measured")
    return notes
  if tl["row_blocks"] > 1:
    notes.append(f"{tl['rows']} rows per item ({tl['block_q']} tokens x G={tl['G']}) tile into "
                 f"{tl['row_blocks']} row blocks of 64, so the KV is read {tl['row_blocks']}x; "
                 f"the repeat would likely hit the {l2:.0f} MB L2 when an item's row blocks run "
                 "together (see the launch grid, x fastest): likely, not measured")
  if tl["items"] > tl["real_items"]:
    notes.append(f"{tl['items'] - tl['real_items']} padding work items (static W) load the last "
                 "sequence's pages with every row masked")
  if case.kernel == "ragged" and case.prefill_tokens > tl["block_q"]:
    chunk_items = -(-case.prefill_tokens // tl["block_q"])
    notes.append(f"the {case.prefill_tokens}-token prefill chunk is {chunk_items} query-block "
                 f"items of {tl['block_q']} tokens, each loading the chunk's context")
  if case.window:
    notes.append(f"window {case.window}: whole pages of {case.ps} from the window's first page, "
                 f"rounded down to blocks of {tl['ppcb']} pages, are loaded")
  partials = t.planned["partials"] / t.minimum_bytes
  if partials > 0.02:
    notes.append(f"f32 split partials (written, then read by the merge) add {partials:.0%} "
                 f"of the minimum ({tl['splits']} splits x {tl['rows']} rows)")
  return notes


def mosaic_report(case: gpu_cases.KernelCase) -> dict:
  """The Mosaic GPU kernel the case would run on a Hopper (`ops.mosaic_kernel`):
  its shared memory (the kernel's own formula) and planned / minimum HBM
  bytes (`traffic.mosaic_traffic`), beside the Triton figures; or why it
  does not take the case. Registers: not read (the Mosaic kernel's cubin is
  inside the custom call, not in the executable's kernel list)."""
  mla = case.kernel == "mla" or case.D != case.Dv
  q_shape = (case.B, case.N, case.D)
  pool = (1, case.ps, case.D) if mla else (case.K, 1, case.ps, case.D)
  kernel, why = ops.mosaic_kernel(q_shape, case.dtype, pool,
                                  values_dim=None if mla else case.Dv,
                                  latent_dim=case.Dv if mla else None,
                                  max_q=case.prefill_tokens or case.Q, window=case.window,
                                  sinks=case.sinks, quantized=bool(case.kv_dtype))
  if kernel is None:
    row = dict(kernel=None, why=why)
    if mla and case.kernel == "ragged":
      row["items"] = _mla_items(case)
    return row
  t = traffic.mosaic_traffic(case_sequences(case), N=case.N, K=case.K, D=case.D, Dv=case.Dv,
                             ps=case.ps, window=case.window, latent=mla)
  smem = mma.smem_bytes(case.D, case.Dv, 2) if mla else mpa.smem_bytes(case.D, case.ps, 2)
  row = dict(kernel="mosaic_" + kernel, smem_bytes=smem, planned_bytes=t.planned_bytes,
             minimum_bytes=t.minimum_bytes, planned_over_minimum=t.ratio,
             kv_over_minimum=t.planned["kv"] / t.minimum["kv"], tiling=t.tiling)
  cb = mma.cluster_blocks(case.Q * case.N, True) if mla else 1
  if cb > 1:  # opt-in (cluster=True) until a GPU run matches: the row blocks share each read
    c = traffic.mosaic_traffic(case_sequences(case), N=case.N, K=case.K, D=case.D, Dv=case.Dv,
                               ps=case.ps, latent=True, cluster=True)
    row["cluster"] = dict(programs=cb, planned_bytes=c.planned_bytes,
                          planned_over_minimum=c.ratio)
  if kernel == "gqa" and case.kernel == "ragged":  # opt-in wide items (wide=True)
    w = traffic.mosaic_traffic(case_sequences(case), N=case.N, K=case.K, D=case.D, Dv=case.Dv,
                               ps=case.ps, window=case.window, wide=True)
    row["wide"] = dict(smem_bytes=mwa.smem_bytes(case.D, case.ps, 2),
                       planned_bytes=w.planned_bytes, planned_over_minimum=w.ratio)
    c = traffic.mosaic_traffic(case_sequences(case), N=case.N, K=case.K, D=case.D, Dv=case.Dv,
                               ps=case.ps, window=case.window, wide=True, cluster=True)
    row["wide_cluster"] = dict(programs=mra.CLUSTER, tiles=mwa.CLUSTER_TILES,
                               smem_bytes=mwa.smem_bytes(case.D, case.ps, 2,
                                                         tiles=mwa.CLUSTER_TILES),
                               planned_bytes=c.planned_bytes, planned_over_minimum=c.ratio)
  return row


def _mla_items(case: gpu_cases.KernelCase) -> dict:
  """The "mla_items" trial's figures for an MLA mixed case
  (`mosaic_mla_ragged`, clustered): the kernel's shared memory, its planned
  / minimum HBM bytes and its flops per planned byte (the step is
  compute-bound where that passes the GPU's flops / bandwidth)."""
  t = traffic.mosaic_traffic(case_sequences(case), N=case.N, K=1, D=case.D, Dv=case.Dv,
                             ps=case.ps, latent=True, items=True)
  return dict(kernel="mosaic_mla_items", smem_bytes=mma.smem_bytes(case.D, case.Dv, 2),
              planned_bytes=t.planned_bytes, planned_over_minimum=t.ratio,
              kv_over_minimum=t.planned["kv"] / t.minimum["kv"],
              flops_per_byte=t.flops / t.planned_bytes, programs=t.tiling["items"])


def case_report(case: gpu_cases.KernelCase, *, ptxas: bool = True) -> dict:
  """One case: compile it, read the executable, add the shape figures."""
  with tempfile.TemporaryDirectory() as tmp:
    compiled = compile_case(case, tmp if ptxas else None)
    facts = executable_facts(compiled, _kernel_name(case), gpu=case.gpus[0],
                             dump_dir=tmp if ptxas else None)
  if not ptxas:
    facts["unavailable"]["spills"] = "ptxas not run (ptxas=False)"
  shapes = dict(B=case.B, Q=case.Q, T=case.T, S=case.S, N=case.N, K=case.K, D=case.D,
                Dv=case.Dv, ps=case.ps, ctx=case.ctx, window=case.window, sinks=case.sinks,
                prefill_tokens=case.prefill_tokens, blocks=case.blocks())
  return dict(name=case.name, kernel=case.kernel, model=case.model, gpu=case.gpus[0],
              shapes=shapes, executable=facts, **shape_report(case),
              mosaic=mosaic_report(case) if case.kernel != "flash" else None)


def run_report(*, names: Iterable[str] | None = None, ptxas: bool = True,
               json_out: str | None = None, verbose: bool = True) -> dict:
  """The report over `names` (default: every case): {"cases": [...],
  "assumptions": ..., "targets": ...}; prints the table and writes JSON."""
  cases = gpu_cases.CASES if names is None else [gpu_cases.get(n) for n in names]
  rows = []
  for case in cases:
    rows.append(case_report(case, ptxas=ptxas))
    if verbose:
      print(format_row(rows[-1]), flush=True)
  report = dict(
      assumptions=__doc__.split("Context lengths")[1].strip().replace("\n", " "),
      targets={g: dict(bf16_flops=t.bf16_flops, hbm_bandwidth=t.hbm_bandwidth,
                       smem_per_block=t.smem_per_block)
               for g, t in gpu_compile.TARGETS.items()},
      cases=rows)
  if json_out:
    results.write_report(report, json_out)
  return report


HEADER = (f"{'case':34s} {'smem KiB':>9s} {'regs':>5s} {'spills':>7s} {'planned/min':>11s} "
          f"{'roofline us':>11s} {'at min us':>9s} bound")


def format_row(row: dict) -> str:
  """One table line: smem (dynamic + static), registers, spill stores+loads."""
  ex = row["executable"]
  fmt = lambda v, f: "null" if v is None else format(v, f)
  spills = (None if ex.get("spill_store_bytes") is None
            else ex["spill_store_bytes"] + ex["spill_load_bytes"])
  smem = None if ex["smem_bytes"] is None else ex["smem_bytes"] / 1024
  return (f"{row['name']:34s} {fmt(smem, '9.1f')} {fmt(ex['registers'], '5d')} "
          f"{fmt(spills, '7d')} {row['planned_over_minimum']:11.3f} {row['roofline_us']:11.1f} "
          f"{row['roofline_min_us']:9.1f} {row['bound']}")


def format_table(report: dict) -> str:
  return "\n".join([HEADER] + [format_row(r) for r in report["cases"]])


def kv_read_factor(report: dict, *, model: str, heads_per_device: int | None = None) -> float:
  """planned / minimum bytes of the model's decode cases (paged / MLA kernels;
  only those with `heads_per_device` q heads when given): the largest, so a
  simulator that charges the minimum KV bytes can charge what the kernel reads.
  Raises ValueError when the report has no such case."""
  rows = [r for r in report["cases"] if r["model"] == model and r["kernel"] in ("paged", "mla")
          and r["gpu"] == "h100"
          and (heads_per_device is None or r["shapes"]["N"] == heads_per_device)]
  if not rows:
    known = sorted({(r["model"], r["shapes"]["N"]) for r in report["cases"]
                    if r["kernel"] in ("paged", "mla")})
    raise ValueError(f"kernel report has no decode case of model {model!r} with "
                     f"heads_per_device={heads_per_device}; known (model, heads): {known}")
  return max(r["planned_over_minimum"] for r in rows)


def load(path: str | pathlib.Path) -> dict:
  return json.loads(pathlib.Path(path).read_text())
