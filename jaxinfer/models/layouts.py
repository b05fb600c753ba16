"""Typed param layouts: the alternative shapes a block's weights take.

The stacked tree of `specs.param_specs` (what `init_params`, `load_hf`,
the shardings and checkpoint restore use) is nested dicts of arrays: one
layout, nothing to tell apart. Every other layout is a type, and the block
runs the path its weights' type names (`isinstance`), never one chosen by
key presence or a mode string:

  FusedMLP      dense gated MLP, gate and up fused into one [D, 2F] matmul
                (`transformer.step_layout`)
  AbsorbedMLA   MLA attention with wkv_b stored as the per-head absorbed
                up-projections w_uk / w_uv (`attention.step_layout`)
  FusedQKV      grouped-query attention with wq, wk and wv one [D, (N + 2K) H]
                matmul, or grouped by KV head, [D, K, G + 2, H]
                (`attention.step_layout`)
  SplitExperts  MoE layer with one array per routed expert, run expert by
                expert over its rows only (`transformer.step_layout`)
  DenseExperts  MoE layer's stacked experts marked for the dense reference
                path (every expert on every token; `cfg.moe_impl="dense"`)

`layers.PackedLinear` (a projection stored transposed) is the sixth.

`WeightForm` names which of them an unrolled step holds (one value per
Engine).

Each is a flax `struct.dataclass` (a registered pytree: `jax.tree`, `jit`,
`scan`, `device_put` see its arrays) and also reads as a read-only mapping
over its set fields (`p["wo"]`, `"router" in p`), so code that only reads
weights by name is layout-agnostic; only the dispatch looks at the type.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from typing import Any

from flax import struct


class _Fields(Mapping):
  """Mapping view over a layout dataclass's array fields that are set (not None)."""

  def __getitem__(self, key):
    value = getattr(self, key, None) if key in self._names() else None
    if value is None:
      raise KeyError(key)
    return value

  def __iter__(self):
    return (k for k in self._names() if getattr(self, k) is not None)

  def __len__(self):
    return sum(1 for _ in self)

  @classmethod
  def _names(cls):  # the weights: static fields (FusedQKV.heads) are not among them
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("pytree_node", True))


@struct.dataclass
class FusedMLP(_Fields):
  """Dense gated MLP read as one [D, 2F] matmul for gate and up (gate
  columns first; fewer, larger matmuls run closer to the memory bandwidth on
  CPU). Either weight plain or a `layers.PackedLinear`."""
  w_gate_up: Any  # [D, 2F]
  w_down: Any  # [F, D]


@struct.dataclass
class AbsorbedMLA(_Fields):
  """MLA attention weights with wkv_b [R, N, Hn + Hv] stored as the
  absorbed per-head up-projections in the layouts the per-head matmuls read
  (transposing wkv_b inside the step made XLA:CPU copy it every step), each
  head's contracted dim minor: bench_moe's decode products of 8 rows, 2-core
  CPU, ms per layer, this layout against the contracted dim major: q x W_uk
  0.038 vs 0.247, the latent result x W_uv 0.049 vs 0.188; at 512 rows
  1.6 vs 4.4 and 2.3 vs 3.9; the prefill's expansions c x W equal (1.5 ms).
  Projections plain or `layers.PackedLinear`; wq or (wq_a, q_norm, wq_b).
  wqkv_a: wq_a and wkv_a as one [D, Rq + R + Hr] matrix (q's columns first;
  wq_a and wkv_a then None), which the transposed unsharded step holds when
  both are float: both read x, and narrow on their own they multiply slower
  (bench_moe's 1024-token prefill, 2-core EPYC: 3.9 + 3.0 ms a layer apart
  in its profile; the Engine's 8 x 128 prefill 634-638 ms fused against
  650-656 apart)."""
  w_uk: Any  # [N, R, Hn]
  w_uv: Any  # [N, Hv, R]
  wkv_a: Any  # [D, R + Hr], or None with wqkv_a
  kv_norm: Any  # [R]
  wo: Any  # [N, Hv, D]
  wq: Any = None  # [D, N, Hn + Hr] (no q LoRA)
  wq_a: Any = None  # [D, Rq]
  q_norm: Any = None  # [Rq]
  wq_b: Any = None  # [Rq, N, Hn + Hr]
  wqkv_a: Any = None  # [D, Rq + R + Hr]


@struct.dataclass
class FusedQKV(_Fields):
  """Grouped-query attention whose q, k and v projections are one matrix,
  [D, (N + 2K) * H] with q's columns first, then k's, then v's (a plain array
  or a `layers.PackedLinear`): one matmul reads x once, and k and v, narrow
  on their own, ride in a wide one (bench_dense prefill, 1024 rows on the
  2-core EPYC, profiled: q, k and v took 23.4 ms a layer, the fused matmul
  16.9 in a later run). heads: (N, K, H), to split
  the product and to rebuild the three (`attention.stacked_layout`).

  grouped: wqkv is [D, K, G + 2, H] instead (G = N / K), each KV head's G
  query heads, then its key, then its value: the GPU step's form. A tensor-
  parallel split of the KV-head axis keeps each head's q, k and v together,
  and one matmul replaces three (in the compiled H100 decode step at batch 1,
  k and v alone became a multiply into weight-sized products and two
  reductions: 4 launches a layer where the fused matmul is one)."""
  wqkv: Any  # [D, (N + 2K) * H], or [D, K, G + 2, H] when grouped
  wo: Any  # [N, H, D]
  heads: tuple = struct.field(pytree_node=False, default=())  # (N, K, H)
  grouped: bool = struct.field(pytree_node=False, default=False)
  bq: Any = None  # [N, H]
  bk: Any = None  # [K, H]
  bv: Any = None  # [K, H]
  bo: Any = None  # [D]
  q_norm: Any = None  # [H]
  k_norm: Any = None  # [H]
  sinks: Any = None  # [N]


@struct.dataclass
class SplitExperts(_Fields):
  """A MoE layer whose routed experts are held one array per expert (the
  Engine's CPU layout: a chosen expert is read in place, an unchosen one
  not at all; slicing a stacked expert copies it on XLA:CPU). Gate and up
  fused per expert; router, biases, shared experts and EPLB tables as in
  the stacked layout."""
  router: Any  # [D, E]
  w_gate_up: tuple  # E x [D, 2F]
  w_down: tuple  # E x [F, D]
  router_bias: Any = None  # [E]
  score_bias: Any = None  # [E]
  b_gate: Any = None  # [E, F]
  b_up: Any = None  # [E, F]
  b_down: Any = None  # [E, D]
  shared: Any = None  # dense MLP params
  eplb_replicas: Any = None  # [E, R]
  eplb_num_replicas: Any = None  # [E]
  # The C++ CPU kernel may run them (`ops.cpu_experts`): unsharded params
  # only, as its custom call has no sharding rule (`WeightForm.native_experts`).
  native: bool = struct.field(pytree_node=False, default=False)


@struct.dataclass
class DenseExperts(Mapping):
  """A MoE layer's stacked params (the dict of `specs`) marked for the dense
  reference path: every expert on every token, masked by the combine
  weights (E/k times the FLOPs). Reads as that dict."""
  params: dict

  def __getitem__(self, key):
    return self.params[key]

  def __iter__(self):
    return iter(self.params)

  def __len__(self):
    return len(self.params)


@dataclasses.dataclass(frozen=True)
class WeightForm:
  """The per-layer form an unrolled step holds its weights in: one value,
  chosen once when an Engine loads them (`engine.weight_layout.choose`; None
  there: the stacked tree, scanned) and kept for the Engine's life.
  `transformer.step_layout` puts stacked params into it and
  `transformer.stacked_layout` takes them back.

  split_experts: each routed expert its own array (`SplitExperts`; not for
    expert-parallel params, whose `moe_ep` wants them stacked)
  native_experts: split experts may run the C++ CPU kernel
    (`SplitExperts.native`, `ops.cpu_experts`; unsharded params only)
  transposed: projections stored [Out, In] (`layers.PackedLinear`, unsharded
    params): quantized ones with their codes unpacked, float ones unless
    floats_in_out
  floats_in_out: float projections kept [In, Out] as loaded (XLA:CPU's
    matmul speed for the two differs by machine: `engine.weight_layout`)
  out_major: transposed float projections multiply into [Out, rows]
    (`layers.PackedLinear.out_major`; also chosen by `engine.weight_layout`)
  panels: transposed float32 projections held as 32-column panels for the
    C++ CPU kernel (`layers.PackedLinear.panels`; chosen the same way)
  fused_qkv: grouped-query float q, k and v as one matrix grouped by KV head
    (`FusedQKV.grouped`; the GPU form, where projections stay [In, Out])"""
  split_experts: bool = False
  native_experts: bool = False
  transposed: bool = False
  floats_in_out: bool = False
  out_major: bool = False
  panels: bool = False
  fused_qkv: bool = False

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if not isinstance(getattr(self, f.name), bool):
        raise ValueError(f"WeightForm.{f.name} must be a bool, got {getattr(self, f.name)!r}")
    if self.floats_in_out + self.out_major + self.panels > 1:
      raise ValueError("WeightForm: floats_in_out keeps float projections [In, Out], out_major "
                       "multiplies packed [Out, In] ones, panels packs them for the C++ "
                       "kernel: pick one")
