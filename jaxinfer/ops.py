"""The one kernel dispatch. Model code calls these; it never branches on backend.

Each kernel op takes a static `Backend` (`jaxinfer.backend`), which models
pass from their config (`ModelConfig.backend`): `attention` picks the
kernels ("xla", "pallas", "mosaic", or None: Pallas for a GPU target, XLA
otherwise), `target` the device the program is built for ("gpu", "cpu", or
None: the process's default backend).

With a GPU target and attention None, a shape the GPU kernel cannot tile
(`paged_attention.tile_error`) runs the XLA path instead; an explicit
"pallas" raises the kernel's ValueError. GPU tiling of the paged kernel comes
from shapes alone (`paged_tiling`). "mosaic" (None's choice on a Hopper
target with jax >= 0.11) sends paged steps to the Mosaic GPU kernels where
they take the shapes (`mosaic_kernel`), every other step to "pallas"; the
unquantized MoE matmul goes to jax's `ragged_dot_mgpu` under the Backend's
grouped_matmul "mosaic" (`grouped_matmul`, `mosaic_grouped_matmul`).

  causal_attention        full causal self-attention (prefill without a cache)
  full_attention          every query sees every key (diffusion transformers)
  attention               queries at arbitrary positions over a padded KV range (XLA)
  ragged_paged_attention  an engine step's mixed batch over the page pool: one
                          `AttentionCall` (q, the `PagedKV` pools and step
                          metadata, the step's own K/V, window, sinks, scale,
                          MLA's W_uv), plain tensors, no callbacks; MLA's
                          expanded form for fresh prompts is the model's
                          choice (`fresh_prompts`, `packed_attention`,
                          `fresh_and_decodes`)
  hstu_attention          HSTU's pointwise SiLU attention over packed jagged users (DLRMv3)

This module dispatches; the XLA implementations (dense, blocked, packed and
the paged step's) live in `xla_attention`, the kernels in `pallas_kernels`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxinfer import backend as backend_lib
from jaxinfer import library_attention, xla_attention
from jaxinfer.backend import Backend
import pallas_kernels
import native_kernels as cpu_kernels
from pallas_kernels import mosaic_grouped_matmul as mosaic_experts_kernel
from pallas_kernels import mosaic_mla_attention as mosaic_mla
from pallas_kernels import mosaic_mla_ragged
from pallas_kernels import mosaic_paged_attention as mosaic
from pallas_kernels import mosaic_ragged_attention as mosaic_ragged
from pallas_kernels import mosaic_wide_attention as mosaic_wide
from pallas_kernels.paged_attention import gpu_blocks, tile_error, to_padded

try:  # jax's Hopper grouped matmul (Mosaic GPU; jax >= 0.11 takes it on Hopper)
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as _ragged_dot_mgpu
except ImportError:  # a jax without it
  _ragged_dot_mgpu = None

_SM_PROGRAMS = 132  # split-K below this many (sequence, KV head) programs (H100: 132 SMs)
# The default ("mosaic" by attention None) keeps steps with more query tokens a
# sequence than this on Triton: on the H200 (run 7) the Mosaic ragged kernel was
# 1.41x Triton on a step of 128-token chunks and decodes, 0.79x on 2048-token
# chunks (64-row work items re-read a long chunk's keys). Explicit "mosaic": any.
MOSAIC_AUTO_MAX_Q = 128
# The kernels' per-layer page pool [K, P, ps, H] (`pallas_kernels.paged_attention`;
# `kv.pool.PoolLayout` lays GQA pools out so, with a layer axis first).
KERNEL_AXES = ("kv_head", "page", "slot", "dim")


def kernel_dims(k_pages) -> dict[str, int]:
  """Named sizes of a kernel-layout pool ([(L,) K, P, ps, H])."""
  return dict(zip(KERNEL_AXES, k_pages.shape[-len(KERNEL_AXES):]))


def quantized_matmul(x, codes, scale, *, block, packed=None, scale2=None,
                     backend: Backend = Backend()):
  """x [M, K] @ W^T with W [N, K] = codes * scale (* scale2) over `block`
  blocks (codes float8_e4m3fn / int8, or uint8 two per byte with packed=
  "int4" / "e2m1"), on the Pallas kernel that dequantizes tile by tile
  (`pallas_kernels.quantized_matmul`): compiled for a GPU target, interpreted
  otherwise. -> [M, N] in x's dtype. (`layers.linear` picks it.)"""
  return pallas_kernels.quantized_matmul(x, codes, scale, block=block, packed=packed,
                                         scale2=scale2, interpret=not backend.on_gpu())


def quantized_grouped_matmul(xs, codes, scale, group_sizes, *, block, packed=None, scale2=None,
                             backend: Backend = Backend()):
  """`jax.lax.ragged_dot` of xs [R, K] (sorted by expert, group_sizes [E]) with
  the experts' W_e [N, K] = codes[e] * scale[e] (* scale2[e]), on the Pallas
  kernel that dequantizes tile by tile (compiled for a GPU target,
  interpreted otherwise). -> [R, N]. (`moe_core.grouped_ffn` picks it.)"""
  return pallas_kernels.quantized_grouped_matmul(xs, codes, scale, group_sizes, block=block,
                                                 packed=packed, scale2=scale2,
                                                 interpret=not backend.on_gpu())


def mosaic_grouped_matmul(xs_shape, w_shape, dtype, w_dtype) -> tuple[dict | None, str | None]:
  """(ragged_dot_mgpu's tiling, None) when jax's Hopper grouped matmul
  takes xs [R, In] times w [E, In, Out], else (None, why): same bfloat16 /
  float16 dtypes, In a multiple of 64, Out of 64, a jax that has it."""
  if _ragged_dot_mgpu is None:
    return None, f"jax {jax.__version__} has no Mosaic GPU ragged_dot (jax >= 0.11 needed)"
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16) or jnp.dtype(w_dtype) != jnp.dtype(dtype):
    return None, f"xs {jnp.dtype(dtype)} and w {jnp.dtype(w_dtype)} must be one of bf16 / f16"
  In, Out = w_shape[-2:]
  if In % 64 or Out % 64:
    return None, f"w's [In, Out] = [{In}, {Out}] must be multiples of 64"
  block_n = 128 if Out % 128 == 0 else 64
  return dict(block_m=64, block_n=block_n, block_k=64, max_concurrent_steps=4,
              grid_block_n=1), None


def grouped_matmul(xs, w, group_sizes, *, backend: Backend = Backend()):
  """`lax.ragged_dot` of xs [R, In] (rows sorted by expert, group_sizes [E])
  with the experts' w [E, In, Out] -> [R, Out]; rows past sum(group_sizes)
  are 0. Under grouped_matmul "mosaic" (`Backend.grouped_matmul_kernel`),
  jax's Hopper kernel `ragged_dot_mgpu` where `mosaic_grouped_matmul`
  takes the shapes (TMA + wgmma, persistent over the SMs) on a GPU target,
  else XLA's (the Mosaic kernel has no interpreter: a CPU target runs XLA).
  Under "tokamax", `tokamax.ragged_dot` (its Mosaic GPU kernel where it
  takes the case, else its XLA form)."""
  kernel = backend.grouped_matmul_kernel()
  if kernel == "tokamax":
    out = backend_lib.tokamax().ragged_dot(xs, w, group_sizes.astype(jnp.int32))
    rows = jnp.arange(xs.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), out, 0).astype(out.dtype)
  if kernel == "mosaic" and backend.on_gpu():
    tiling, _ = mosaic_grouped_matmul(xs.shape, w.shape, xs.dtype, w.dtype)
    if tiling is not None:
      R = xs.shape[0]
      padded = jnp.pad(xs, ((0, -R % 8), (0, 0)))  # its TMA tiles take rows in 8s
      out = _ragged_dot_mgpu.ragged_dot(padded, w, group_sizes=group_sizes.astype(jnp.int32),
                                        **tiling)[:R]
      rows = jnp.arange(R, dtype=jnp.int32)[:, None]
      return jnp.where(rows < jnp.sum(group_sizes), out, 0)  # the kernel leaves them unwritten
  return jax.lax.ragged_dot(xs, w, group_sizes)


def mosaic_experts_fit(x_dtype, w_shape, w_dtype, block=None, packed=None) -> str | None:
  """Why the Mosaic expert kernel (`pallas_kernels.mosaic_grouped_matmul`:
  the gate-up fusion, quantized weights) cannot take an experts' weight
  (codes [E, Out, In] with scale block (bo, bi), packed "e2m1" / "int4"
  codes [E, Out, In / 2], or plain [E, In, Out]), else None."""
  return mosaic_experts_kernel.unsupported(x_dtype, w_shape, w_dtype, block, packed)


def mosaic_experts(xs, w, group_sizes, *, scale=None, block=None, packed=None, scale2=None,
                   bias=None, up=None, up_scale=None, up_scale2=None, up_bias=None,
                   activation="silu", limit=7.0, alpha=1.702, backend: Backend = Backend()):
  """The experts' grouped matmul on our Mosaic GPU kernel: glu(xs W^T + bias,
  xs U^T + up_bias) with up (the gate-up fusion: xs read once), else xs W^T
  + bias, for rows sorted by expert (group_sizes [E]); weights one-byte
  codes [E, Out, In] with block scales, packed 4-bit codes (MXFP4 / NVFP4
  "e2m1", "int4") or plain [E, In, Out] (`mosaic_experts_fit`). Compiled for a GPU target, interpreted otherwise.
  -> [R, Out] in xs's dtype. (`moe_core.grouped_ffn` picks it under the
  "fused_experts" trial.)"""
  return mosaic_experts_kernel.mosaic_grouped_matmul(
      xs, w, group_sizes, scale=scale, block=block, packed=packed, scale2=scale2, bias=bias,
      up=up, up_scale=up_scale, up_scale2=up_scale2, up_bias=up_bias, activation=activation,
      limit=limit, alpha=alpha, interpret=not backend.on_gpu())


# Average rows per expert up to which `cpu_experts` runs the C++ kernel when
# it has no register tiles (`native_kernels.tiled`), its streaming path
# only: bench_moe's experts (round 31's 2-core Xeon, one layer, ms, streaming against XLA's
# loop `moe.experts_split`): 1 token 1.45 vs 2.02, 8 tokens 8.4 vs 10.2, 32
# tokens 16.2 vs 24.9, 64 tokens 21.6 vs 36.7, 128 tokens (12 rows) 34.8 vs
# 38.5, 256 tokens 60.3 vs 57.8. With the tiles it runs at any size: 256
# tokens 44.8 vs 69.1, 1024 tokens 128.6 vs 185.6, 2048 tokens 242 vs 350.
CPU_EXPERT_ROWS = 12
CPU_EXPERTS = True  # False: the XLA loop always (tests compare the two)


def cpu_experts_fit(dtype, quantized: bool, bias: bool) -> bool:
  """The experts the C++ CPU kernel can run: float32, not quantized, no
  biases (`cpu_experts` per call from the arrays; `steps.kernel_choice`
  from the config)."""
  return dtype == jnp.float32 and not quantized and not bias


def cpu_experts(num_rows: int, num_experts: int, xs_dtype, w_gate_up, w_down, bias: bool,
                backend: Backend) -> bool:
  """Whether `routed_experts_cpu` takes a step's routed experts: a CPU
  target, the native kernels built (`native_kernels.available`: the
  first call, when a step is traced, builds them),
  float32 rows and weights held as plain arrays, no expert biases, and with
  the kernel's register tiles any number of rows, else at most
  CPU_EXPERT_ROWS token copies per expert on average."""
  plain = all(getattr(w, "dtype", None) == jnp.float32 and getattr(w, "ndim", 0) == 2
              for w in (*w_gate_up, *w_down))  # a `QuantizedWeight` has neither
  if not (CPU_EXPERTS and not backend.on_gpu() and cpu_experts_fit(xs_dtype, not plain, bias)
          and cpu_kernels.available()):
    return False
  return cpu_kernels.tiled() or num_rows <= CPU_EXPERT_ROWS * num_experts


def cpu_experts_choice(eligible: bool) -> str:
  """How split experts run on a CPU target (`Engine.stats()["kernels"]`),
  building nothing: eligible: float32 experts without biases or
  quantization; then the C++ kernels' `status()` ("xla: <reason>", "native
  on first use") until they are loaded, and once loaded "native", or with
  no register tiles native up to CPU_EXPERT_ROWS rows per expert."""
  if not eligible:
    return "xla"
  state = cpu_kernels.status()
  if state != "native":
    return state
  if cpu_kernels.tiled():
    return "native"
  return f"native up to {CPU_EXPERT_ROWS} rows per expert, xla above"


def routed_experts_cpu(xs, sizes, w_gate_up, w_down, *, activation: str, limit: float,
                       alpha: float):
  """xs [M, D] token copies sorted by expert, sizes [E] their counts -> [M,
  D]: each copy through its expert's gated FFN (rows past the sum are 0), on
  the C++ CPU kernel (`native_kernels.split_experts_ffn`); call where
  `cpu_experts` holds."""
  return cpu_kernels.split_experts_ffn(xs, sizes, list(w_gate_up), list(w_down),
                                       activation=activation, limit=limit, alpha=alpha)


def pack_panels(w2):
  """A float32 projection [In, Out] -> the C++ CPU kernel's 32-column
  panels [ceil(Out / 32), In, 32] (`native_kernels.pack_panels`)."""
  return cpu_kernels.pack_panels(w2)


def unpack_panels(wp, out: int):
  """The inverse of `pack_panels`: panels -> [In, out]."""
  return cpu_kernels.unpack_panels(wp, out)


def panel_linear(x2, wp, out: int):
  """x2 [rows, In] times a projection in panels (`pack_panels`) -> [rows,
  out] float32: the C++ CPU kernel (`native_kernels.panel_matmul`)
  where it builds (on this first use, when the step is traced), else the
  same product in XLA (slow: panels are the layout `engine.weight_layout`
  picks only where the kernel may build)."""
  x2 = x2.astype(jnp.float32)
  if cpu_kernels.available():
    return cpu_kernels.panel_matmul(x2, wp)[:, :out]
  return cpu_kernels.panel_matmul_reference(x2, wp)[:, :out]


def paged_tiling(num_seqs: int, num_kv_heads: int, pages_per_seq: int, page_size: int, *,
                 num_q_heads: int | None = None, max_q: int = 1, head_dim: int = 128,
                 value_dim: int | None = None, values_from_keys: bool = False,
                 quantized_kv: bool = False) -> dict:
  """GPU tiling of the paged kernel from static shapes (the kernel's keyword
  arguments): `pallas_kernels.paged_attention.gpu_blocks`, i.e. ~64 keys
  per loop step, split-K (up to 8) when sequences x KV heads x row blocks
  give fewer than ~2 programs per H100 SM and the split partials stay under
  5% of the KV bytes, 8 warps for MLA-wide values; quantized_kv (1-byte
  pages): the KV bytes at 1 a value, and one pipeline stage for MLA-wide
  values (shared memory)."""
  b = gpu_blocks(num_seqs=num_seqs, num_kv_heads=num_kv_heads,
                 num_q_heads=num_q_heads or num_kv_heads, max_q=max_q,
                 pages_per_seq=pages_per_seq, page_size=page_size, head_dim=head_dim,
                 value_dim=value_dim or head_dim, values_from_keys=values_from_keys,
                 sms=_SM_PROGRAMS, quantized_kv=quantized_kv)
  return dataclasses.asdict(b)


def causal_attention(q, k, v, *, window=0, window_choices=(0,), sinks=None, scale,
                     backend: Backend = Backend()):
  """Causal self-attention: q [B, T, N, Hk], k [B, T, K, Hk], v [B, T, K, Hv].

  window may be traced (a scanned layer's); the Pallas kernel needs it static,
  so it then switches over `window_choices` (the model's distinct windows).
  The GPU kernel pads head dims to powers of two; below 16 (no tensor-core
  tile) attention None runs XLA.
  """
  if _library(backend, q, v, sinks=sinks, window=window):
    return library_attention.dense(q, k, v, causal=True, scale=scale,
                                   impl=backend.attention_library(), window=window)
  impl, interpret = backend.attention_kernel()
  small = min(q.shape[-1], v.shape[-1]) < 16
  if impl == "xla" or (not interpret and small and backend.attention is None):
    B, T = q.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return xla_attention.attention(q, k, v, pos, jnp.full((B,), T, jnp.int32), window, sinks,
                                   scale)
  flash = lambda w: functools.partial(pallas_kernels.flash_attention, causal=True, sm_scale=scale,
                                      window=w, interpret=interpret)
  if isinstance(window, int):
    return flash(window)(q, k, v, sinks=sinks)
  if len(window_choices) == 1:
    return flash(window_choices[0])(q, k, v, sinks=sinks)
  index = jnp.argmax(jnp.asarray(window_choices, jnp.int32) == window)
  return jax.lax.switch(index, [lambda q, k, v, s, w=w: flash(w)(q, k, v, sinks=s)
                                for w in window_choices], q, k, v, sinks)


def hstu_attention(q, k, v, *, segment_ids, positions, timestamps, pos_bias, time_bias, alpha,
                   n, backend: Backend = Backend()):
  """HSTU attention over packed jagged users (`pallas_kernels.hstu_attention`'s
  semantics): q/k [T, N, A], v [T, N, H] -> [T, N, H]. XLA runs the dense
  [T, T] form (`hstu_attention_reference`); Pallas the jagged kernel, which
  visits only each user's own key blocks."""
  impl, interpret = backend.attention_kernel()
  fn = pallas_kernels.hstu_attention_reference if impl == "xla" else functools.partial(
      pallas_kernels.hstu_attention, interpret=interpret)
  return fn(q, k, v, segment_ids=segment_ids, positions=positions, timestamps=timestamps,
            pos_bias=pos_bias, time_bias=time_bias, alpha=alpha, n=n)


def full_attention(q, k, v, *, scale, backend: Backend = Backend()):
  """Unmasked attention: q [B, T, N, Hk], k [B, S, K, Hk], v [B, S, K, Hv]
  -> [B, T, N, Hv] in q's dtype (a video DiT's self- and cross-attention).

  GPU: the flash kernel without causality; XLA: every query placed after the
  last key (position S - 1), so the causal XLA form, blocked past one block,
  masks nothing. Head dims below 16 run XLA (as `causal_attention`).
  `Backend.dense_attention` where the library takes the case (`_library`)."""
  if _library(backend, q, v):
    return library_attention.dense(q, k, v, causal=False, scale=scale,
                                   impl=backend.attention_library())
  impl, interpret = backend.attention_kernel()
  small = min(q.shape[-1], v.shape[-1]) < 16
  if impl == "xla" or (not interpret and small and backend.attention is None):
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    pos = jnp.full((B, T), S - 1, jnp.int32)
    return xla_attention.attention(q, k, v, pos, jnp.full((B,), S, jnp.int32), 0, None, scale)
  return pallas_kernels.flash_attention(q, k, v, causal=False, sm_scale=scale,
                                        interpret=interpret)


def _library(backend: Backend, q, v, *, sinks=None, window=0) -> bool:
  """Whether `Backend.dense_attention` asks for the library and it takes
  attention of q [..., N, Hk] with values v [..., Hv]
  (`library_attention.unfit`)."""
  return backend.attention_library() is not None and library_attention.unfit(
      backend.attention_library(), q.shape, v.shape[-1], q.dtype, sinks=sinks, window=window,
      on_gpu=backend.on_gpu()) is None


def attention(q, k, v, *, q_positions, kv_lengths, window=0, sinks=None, scale):
  """Causal grouped-query attention over a (possibly padded) key range.

  q [B, T, N, Hk]; k [B, S, K, Hk]; v [B, S, K, Hv]; N % K == 0.
  q_positions [B, T] int32: absolute position of each query; key j sits at
  position j. Key j is visible to query t iff j < kv_lengths[b],
  j <= q_positions[b, t] and (window == 0 or q_positions - j < window)
  (HF's sliding-window rule). `window` may be a traced scalar (scanned layers).
  sinks [N] or None: a learned logit per head in the softmax denominator
  (GPT-OSS). Returns [B, T, N, Hv] in q's dtype (zeros for a row that sees no
  key); softmax runs in float32.
  Every backend runs this XLA form (it takes no `Backend`).
  """
  return xla_attention.attention(q, k, v, q_positions, kv_lengths, window, sinks, scale)


def paged_kernel(q_shape, dtype, k_pages_shape, page_table_shape, *, max_q: int,
                 values_dim=None, latent_dim=None, window=0, sinks: bool = False,
                 quantized: bool = False,
                 backend: Backend = Backend()) -> tuple[str, bool, dict]:
  """The kernel `ragged_paged_attention` runs a step on, from shapes alone:
  -> (kernel, interpret, Pallas tiling). kernel: "mosaic_gqa" / "mosaic_mla"
  (`mosaic_kernel`; "mosaic_mla_cluster" / "mosaic_mla_items" /
  "mosaic_gqa_wide" / "mosaic_gqa_cluster" where `Backend.trials` names their variant and it
  applies, `_trial`), "pallas",
  or "xla" (the choice, or attention None's fallback where `tile_error`
  says the GPU kernel cannot tile the shapes). Attention None's Mosaic
  default takes steps of at most `MOSAIC_AUTO_MAX_Q` query tokens a
  sequence (longer chunks: Triton, faster there in run 7), but for the
  trials made for long chunks ("gqa_cluster", "mla_items"); an MLA verify
  step of several 64-row blocks takes it only as a cluster (the
  "mla_cluster" trial), else Triton.
  Arguments as `mosaic_kernel`'s; page_table_shape [B, pages_per_seq]."""
  impl, interpret = backend.attention_kernel()
  if impl == "mosaic":
    items = values_dim is None and max_q > 1 and "mla_items" in backend.trials
    kernel, _ = mosaic_kernel(q_shape, dtype, k_pages_shape, values_dim=values_dim,
                              latent_dim=latent_dim, max_q=max_q, window=window, sinks=sinks,
                              quantized=quantized, items=items)
    if kernel == "mla" and items:
      kernel = "mla_items"
    elif kernel == "mla" and max_q > 1 and "mla_cluster" not in backend.trials:
      # Unclustered, each row block of a verify step reads the whole latent: Triton's
      # tiling is no worse where there are several.
      kernel = kernel if mosaic_mla.cluster_blocks(max_q * q_shape[1], True) == 1 else None
    kernel = kernel and _trial(kernel, q_shape, k_pages_shape, max_q, backend.trials)
    if kernel and (backend.attention == "mosaic" or max_q <= MOSAIC_AUTO_MAX_Q
                   or kernel in ("gqa_cluster", "mla_items")):  # trials for long chunks
      return f"mosaic_{kernel}", interpret, {}
    impl = "pallas"
  if impl != "pallas" or interpret:
    return impl, interpret, {}
  page_size, kv_heads = k_pages_shape[-2], k_pages_shape[-4]
  dv = latent_dim if values_dim is None else values_dim
  tiling = paged_tiling(page_table_shape[0], kv_heads, page_table_shape[1], page_size,
                        num_q_heads=q_shape[1], max_q=max_q, head_dim=q_shape[-1],
                        value_dim=dv, values_from_keys=values_dim is None,
                        quantized_kv=quantized)
  if backend.attention is None and tile_error(q_shape[-1], dv, page_size,
                                              tiling["pages_per_compute_block"]):
    return "xla", interpret, {}
  return "pallas", interpret, tiling


def _trial(kernel, q_shape, k_pages_shape, max_q, trials):
  """The Mosaic kernel's variant `Backend.trials` asks for, where it applies:
  "mla_cluster" for 2 to 8 row blocks of max_q x heads, "gqa_wide" for steps
  whose chunks fill more than one 64-row tile (within shared memory),
  "gqa_cluster" ("cluster_items") for those whose chunks fill more than one
  item of `mosaic_wide_attention.CLUSTER_TILES` tiles; else kernel.
  ("mla_items" is `paged_kernel`'s: it also bounds `mosaic_kernel`'s rows.)"""
  if kernel == "mla" and "mla_cluster" in trials:
    return "mla_cluster" if mosaic_mla.cluster_blocks(max_q * q_shape[1], True) > 1 else kernel
  wide = {"wide_items", "cluster_items"} & set(trials)
  if kernel == "gqa" and wide and max_q > 1:
    group = q_shape[1] // k_pages_shape[-4]
    fits = lambda tiles: mosaic_wide.smem_bytes(q_shape[-1], k_pages_shape[-2], 2,
                                                tiles=tiles) <= mosaic.SMEM_BYTES
    if not (fits(mosaic_wide.TILES) and max_q > mosaic_ragged.tokens_per_item(group)):
      return kernel
    clustered = ("cluster_items" in trials and fits(mosaic_wide.CLUSTER_TILES)
                 and max_q > mosaic_ragged.tokens_per_item(group, tiles=mosaic_wide.CLUSTER_TILES))
    return "gqa_cluster" if clustered else "gqa_wide"
  return kernel


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedKV:
  """Where a paged step's keys and values live (a `kv.contexts.PagedContext`
  gives it, its pages written): the pools, k_pages [(L,) K, P, page_size,
  Hk] and v_pages [(L,) K, P, page_size, Hv], or v_pages None for MLA's
  latent pool (one pool for both: the values its first latent_dim columns);
  layer: the pools carry a leading layer axis and this layer's pages are
  read (gathered directly, never slicing the layer's pool), or None;
  k_scale / v_scale: quantized pages' float32 scalars (fp8 / int8,
  `kv.pool.KV_CACHE_DTYPES`: pages * scale, per tile in the kernel, after
  the gather on the XLA path; MLA: k_scale only) or None; the step's
  sequences: kv_lens [B] (after the step), page_table [B, pages_per_seq],
  cu_q_lens [B + 1] (sequence b owns query rows cu_q_lens[b]:cu_q_lens[b + 1],
  its newest tokens, the last at position kv_lens[b] - 1); max_q (static):
  at least every sequence's query count; fresh (static): the host knows
  every sequence is a fresh chunk (from position 0, no cached prefix:
  kv_lens equal the query counts), so `Backend.dense_attention` may take
  the step (`ragged_paged_attention`)."""

  k_pages: jax.Array
  v_pages: jax.Array | None = None
  kv_lens: jax.Array
  page_table: jax.Array
  cu_q_lens: jax.Array
  layer: jax.Array | int | None = None
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None
  max_q: int = dataclasses.field(metadata=dict(static=True), default=1)
  latent_dim: int | None = dataclasses.field(metadata=dict(static=True), default=None)
  fresh: bool = dataclasses.field(metadata=dict(static=True), default=False)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionCall:
  """One paged attention call, plain tensors, keyword-only: q [T, N, Hk] (the step's
  tokens; MLA: the absorbed queries [T, N, R + Hr]), kv (`PagedKV`), new_kv:
  the step's own keys and values (k [T, K, Hk], v [T, K, Hv], as written to
  the pages; GQA) or None, window (an int or a traced scalar, 0: none),
  sinks [N] or None, scale (static); values: MLA's W_uv [N, Hv, R] (the
  result is then the heads' values, `latent_values`), or None."""

  q: jax.Array
  kv: PagedKV
  new_kv: tuple | None = None
  window: jax.Array | int = 0
  sinks: jax.Array | None = None
  scale: float = dataclasses.field(metadata=dict(static=True))
  values: jax.Array | None = None


def _call_kernel(call: AttentionCall, backend: Backend):
  """`paged_kernel` for a call's shapes."""
  kv = call.kv
  values_dim = None if kv.v_pages is None else kv.v_pages.shape[-1]
  return paged_kernel(call.q.shape, call.q.dtype, kv.k_pages.shape, kv.page_table.shape,
                      max_q=kv.max_q, values_dim=values_dim, latent_dim=kv.latent_dim,
                      window=call.window, sinks=call.sinks is not None,
                      quantized=kv.k_scale is not None, backend=backend)


def ragged_paged_attention(call: AttentionCall, backend: Backend = Backend()):
  """Attention for a token-flattened mixed batch over a paged KV cache:
  `call.q` [T, N, Hk] over `call.kv`'s pages -> [T, N, Hv] (MLA: the latent
  result [T, N, R], times `call.values` where given). Rows past
  cu_q_lens[-1] are padding and return zeros.

  GPU target: the kernel tiled by `paged_tiling`, or (attention None) the
  XLA path where `tile_error` says the kernel cannot tile the shapes.
  "mosaic" (the default on a Hopper target, `Backend`): GQA steps on
  `mosaic_paged_attention` (decode-only) or `mosaic_ragged_attention`
  (mixed), decode-only MLA steps on `mosaic_mla_attention` (variants:
  `Backend.trials`), where their `unsupported` finds nothing against the
  shapes (`mosaic_kernel`); other steps "pallas". The XLA path is
  `xla_attention.ragged`: with `call.new_kv`, a step (max_q > 1) whose
  sequences are each a fresh chunk (from position 0) or one decode token
  attends the chunks packed over their own keys (`xla_attention.packed`:
  no page gather, no per-sequence padding) and the pages for the decode
  tokens only; any other step over the pages. (MLA's fresh chunks in the
  expanded form: `fresh_prompts`, the model's choice.)"""
  if _fresh_library(call, backend):  # every sequence a fresh chunk, known on the host
    kv, (k, v) = call.kv, call.new_kv
    return library_attention.fresh_packed(call.q, k, v, kv.cu_q_lens, kv.max_q, scale=call.scale,
                                          impl=backend.attention_library(), window=call.window)
  return latent_values(_paged_step(call, *_call_kernel(call, backend)), call.values)


def _fresh_library(call: AttentionCall, backend: Backend) -> bool:
  """Whether a paged step attends its chunks through
  `Backend.dense_attention`: a GQA step (its own K/V at hand, pages without
  scales) of chunks (max_q > 1) the host marked fresh (`PagedKV.fresh`: the
  choice is made once for the step, no traced branch in each layer) and
  the library takes (`_library`)."""
  kv = call.kv
  return (kv.fresh and call.new_kv is not None and kv.max_q > 1 and kv.latent_dim is None
          and call.values is None and kv.k_scale is None
          and _library(backend, call.q, call.new_kv[1], sinks=call.sinks, window=call.window))


def _paged_step(call: AttentionCall, kernel: str, interpret: bool, tiling: dict):
  """The step on `kernel` (`paged_kernel`'s choice)."""
  kv = call.kv
  if kernel.startswith("mosaic"):
    return _mosaic_step(kernel, call.q, kv.k_pages, kv.v_pages, kv.kv_lens, kv.page_table,
                        kv.cu_q_lens, kv.max_q, call.window, call.sinks, call.scale,
                        kv.latent_dim, kv.layer, interpret)
  if kernel == "pallas":
    return pallas_kernels.ragged_paged_attention(
        call.q, kv.k_pages, kv.v_pages, kv.kv_lens, kv.page_table, kv.cu_q_lens, max_q=kv.max_q,
        sm_scale=call.scale, window=call.window, sinks=call.sinks, v_head_dim=kv.latent_dim,
        layer=kv.layer, k_scale=kv.k_scale, v_scale=kv.v_scale, interpret=interpret, **tiling)
  return xla_attention.ragged(call)


def fresh_prompts(call: AttentionCall, backend: Backend = Backend()):
  """Whether a step may attend its fresh chunks packed over their own keys
  (MLA: in the expanded form, `models.attention.mla`): None (static) unless
  the step runs the XLA path (`paged_kernel`) with max_q > 1 over pages
  without scales; else (every sequence a fresh chunk or one decode token: a
  traced bool, decodes [B] bool), for `packed_attention` and
  `fresh_and_decodes`. call.q may be a ShapeDtypeStruct (shapes only)."""
  kv = call.kv
  if _call_kernel(call, backend)[0] != "xla" or kv.max_q == 1 or kv.k_scale is not None:
    return None
  return xla_attention.fresh_or_decodes(kv.cu_q_lens, kv.kv_lens)


def packed_attention(q, k, v, cu_q_lens, *, window=0, sinks=None, scale):
  """A step of fresh chunks over its own keys and values, packed (the XLA
  path, `xla_attention.packed_step`): q [T, N, Hk], k [T, K, Hk], v [T, K,
  Hv] -> [T, N, Hv], padding rows zeros."""
  return xla_attention.packed_step(q, k, v, cu_q_lens, window, sinks, scale)


def fresh_and_decodes(firsts, kv: PagedKV, packed, decodes, *, window=0, sinks=None, scale,
                      values=None):
  """`packed` [T, N, Hv] (the fresh chunks' `packed_attention`) with the
  decode tokens' rows (decodes [B], from `fresh_prompts`) attended over
  their pages from their queries firsts [B, N, Hk] (each sequence's first
  token's), then `values` (MLA: W_uv [N, Hv, R]) -> [T, N, Hv]
  (`xla_attention.fresh_and_decodes`)."""
  return xla_attention.fresh_and_decodes(firsts, kv, packed, decodes, window=window, sinks=sinks,
                                         scale=scale, values=values)


latent_values = xla_attention.latent_values


def _ragged_mosaic(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q, window, sinks,
                   scale, layer, interpret, variant="gqa"):
  """A GQA step on the Mosaic GPU kernels: decode-only steps (one token a
  sequence) laid out per sequence on `mosaic_paged_attention` with split-K
  for small batches; any other step on `mosaic_ragged_attention`'s work
  items (variant "gqa_wide": its two-tile items; "gqa_cluster": those in
  clusters)."""
  if max_q > 1:
    return mosaic_ragged.mosaic_ragged_attention(
        q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q=max_q, sm_scale=scale,
        window=window, sinks=sinks, layer=layer, wide=variant != "gqa",
        cluster=variant == "gqa_cluster", interpret=interpret)
  q_pad, seq, row, valid = to_padded(q, cu_q_lens, 1)
  dims = kernel_dims(k_pages)
  splits = 1
  while (splits < 8 and page_table.shape[0] * dims["kv_head"] * splits < _SM_PROGRAMS
         and 2 * splits * mosaic.pages_per_block(dims["slot"]) <= page_table.shape[1]):
    splits *= 2
  out = mosaic.mosaic_paged_attention(q_pad, k_pages, v_pages, kv_lens, page_table,
                                      sm_scale=scale, window=window, sinks=sinks,
                                      num_splits=splits, layer=layer, interpret=interpret)
  return jnp.where(valid[:, None, None], out[seq, row], 0).astype(q.dtype)


def mosaic_kernel(q_shape, dtype, k_pages_shape, *, values_dim=None, latent_dim=None,
                  max_q: int = 1, window=0, sinks: bool = False, quantized: bool = False,
                  items: bool = False) -> tuple[str | None, str | None]:
  """Which Mosaic GPU kernel takes a paged step where the attention kernel
  is "mosaic": ("gqa", None) for GQA pages (`mosaic_paged_attention` for
  decode-only steps, `mosaic_ragged_attention` for mixed ones), ("mla",
  None) for a decode or verify step over MLA's latent pool
  (`mosaic_mla_attention`), or (None, why) when none does (the step then
  runs "pallas").

  q_shape [T, N, Hk] (the step's tokens); k_pages_shape [(L,) K, P,
  page_size, Hk]; values_dim: the value pages' head dim, or None for MLA's
  latent pool (keys and values in one pool, the values its first latent_dim
  columns); max_q: the step's most query tokens a sequence; window: an int,
  or a traced one (a scanned layer's); sinks: the layer has attention
  sinks; quantized: fp8 / int8 pages. The MLA kernel takes decode and
  verify steps (these: max_q x N query rows within one cluster of row
  blocks, `mosaic_mla_attention.MAX_CLUSTER` x 64; items: any step, on
  `mosaic_mla_ragged`'s work items) without window, sinks or quantized
  pages."""
  page_size = k_pages_shape[-2]  # [..., K, P, page_size, Hk]
  if values_dim is None:
    rows = max_q * q_shape[1]
    if max_q > 1 and not items and rows > mosaic_mla.MAX_CLUSTER * mosaic.ROWS:
      return None, (f"MLA step with max_q {max_q} x {q_shape[1]} heads = {rows} query rows > "
                    f"{mosaic_mla.MAX_CLUSTER * mosaic.ROWS}: the Mosaic MLA kernel takes "
                    "decode and verify steps")
    if not isinstance(window, int) or window or sinks or quantized:
      return None, "a window (or a traced one), sinks or quantized latent pages"
    bad = mosaic_mla.unsupported(q_shape[-1], latent_dim, page_size, dtype)
    return ("mla", None) if bad is None else (None, bad[1])
  bad = mosaic.unsupported((1, 1, *q_shape[1:]), dtype, k_pages_shape, quantized=quantized,
                           values_dim=values_dim)
  return ("gqa", None) if bad is None else (None, bad[1])


def _mosaic_step(kernel, q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q, window,
                 sinks, scale, v_head_dim, layer, interpret):
  """The step on the Mosaic GPU kernel `paged_kernel` picked."""
  if kernel == "mosaic_mla_items":
    return _ragged_mosaic_mla_items(q, k_pages, kv_lens, page_table, cu_q_lens, scale,
                                    v_head_dim, layer, interpret, max_q)
  if kernel.startswith("mosaic_mla"):
    return _ragged_mosaic_mla(q, k_pages, kv_lens, page_table, cu_q_lens, scale, v_head_dim,
                              layer, interpret, max_q, kernel == "mosaic_mla_cluster")
  return _ragged_mosaic(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q, window,
                        sinks, scale, layer, interpret, kernel.removeprefix("mosaic_"))


def _ragged_mosaic_mla(q, k_pages, kv_lens, page_table, cu_q_lens, scale, latent_dim, layer,
                       interpret, max_q=1, cluster=False):
  """MLA's decode or verify step on the Mosaic GPU kernel. A sequence's
  tokens end its max_q rows (the kernel puts row Q - 1 at position
  kv_len - 1), the rows before them padding; the pool read as
  `_latent_run`'s one run of pages."""
  q_pad, seq, row, valid = to_padded(q, cu_q_lens, max_q)
  if max_q > 1:  # right-align: the last token of a sequence on row max_q - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    row = jnp.clip(row + max_q - q_lens[seq], 0, max_q - 1)
    q_pad = jnp.zeros_like(q_pad).at[jnp.where(valid, seq, q_pad.shape[0]), row].set(
        q, mode="drop")
  blocks = -(-max_q * q.shape[1] // mosaic.ROWS)
  pages, table, splits = _latent_run(k_pages, page_table, layer, rows=blocks)
  out = mosaic_mla.mosaic_mla_attention(q_pad[..., :latent_dim], q_pad[..., latent_dim:], pages,
                                        kv_lens, table, sm_scale=scale, num_splits=splits,
                                        cluster=cluster, interpret=interpret)
  return jnp.where(valid[:, None, None], out[seq, row], 0).astype(q.dtype)


def _latent_run(k_pages, page_table, layer, rows):
  """MLA's latent pool [(L,) 1, P, ps, R + Hr] as one run of pages ([L * P,
  ps, R + Hr], a free reshape), this layer's page numbers offset by layer *
  P (no layer's pool sliced out), and split-K for a step of B sequences x
  `rows` row blocks: doubled (to 8) while the programs fill fewer than the
  SMs and each split keeps two latent blocks."""
  dims = kernel_dims(k_pages)
  pages = k_pages.reshape(-1, dims["slot"], k_pages.shape[-1])
  table = page_table if layer is None else page_table + layer * dims["page"]
  splits = 1
  while (splits < 8 and page_table.shape[0] * rows * splits < _SM_PROGRAMS
         and 2 * splits * max(1, mosaic_mla.KEYS // dims["slot"]) <= page_table.shape[1]):
    splits *= 2
  return pages, table, splits


def _ragged_mosaic_mla_items(q, k_pages, kv_lens, page_table, cu_q_lens, scale, latent_dim,
                             layer, interpret, max_q):
  """MLA's verify or mixed step on `mosaic_mla_ragged`'s work items, a long
  chunk's in clusters (the "mla_items" trial); interpreted (CPU) without
  clusters, whose launches stall the interpreter inside a jitted step (same
  sums)."""
  pages, table, splits = _latent_run(k_pages, page_table, layer,
                                     rows=mosaic_mla_ragged.row_blocks(q.shape[1]))
  return mosaic_mla_ragged.mosaic_mla_ragged_attention(
      q[..., :latent_dim], q[..., latent_dim:], pages, kv_lens, table, cu_q_lens, max_q=max_q,
      sm_scale=scale, num_splits=splits, cluster=not interpret, interpret=interpret)
