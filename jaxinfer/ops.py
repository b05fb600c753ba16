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
  ragged_paged_attention  an engine step's mixed batch over the page pool
  hstu_attention          HSTU's pointwise SiLU attention over packed jagged users (DLRMv3)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxinfer import xla_attention
from jaxinfer.backend import Backend
import pallas_kernels
from pallas_kernels import cpu as cpu_kernels
from pallas_kernels import mosaic_grouped_matmul as mosaic_experts_kernel
from pallas_kernels import mosaic_mla_attention as mosaic_mla
from pallas_kernels import mosaic_mla_ragged
from pallas_kernels import mosaic_paged_attention as mosaic
from pallas_kernels import mosaic_ragged_attention as mosaic_ragged
from pallas_kernels import mosaic_wide_attention as mosaic_wide
from pallas_kernels.paged_attention import dequantize, gpu_blocks, tile_error
from pallas_kernels.ragged_paged_attention import to_padded

try:  # jax's Hopper grouped matmul (Mosaic GPU; jax >= 0.11 takes it on Hopper)
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as _ragged_dot_mgpu
except ImportError:  # a jax without it
  _ragged_dot_mgpu = None

_BLOCK_Q, _BLOCK_K = 64, 128  # XLA attention blocks (queries, keys)
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
  else XLA's (the Mosaic kernel has no interpreter: a CPU target runs XLA)."""
  if backend.grouped_matmul_kernel() == "mosaic" and backend.on_gpu():
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
# it has no register tiles (`pallas_kernels.cpu.tiled`), its streaming path
# only: bench_moe's experts (round 31's 2-core Xeon, one layer, ms, streaming against XLA's
# loop `moe._experts_split`): 1 token 1.45 vs 2.02, 8 tokens 8.4 vs 10.2, 32
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
  target, the native kernels built (`pallas_kernels.cpu.available`: the
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
  the C++ CPU kernel (`pallas_kernels.cpu.split_experts_ffn`); call where
  `cpu_experts` holds."""
  return cpu_kernels.split_experts_ffn(xs, sizes, list(w_gate_up), list(w_down),
                                       activation=activation, limit=limit, alpha=alpha)


def pack_panels(w2):
  """A float32 projection [In, Out] -> the C++ CPU kernel's 32-column
  panels [ceil(Out / 32), In, 32] (`pallas_kernels.cpu.pack_panels`)."""
  return cpu_kernels.pack_panels(w2)


def unpack_panels(wp, out: int):
  """The inverse of `pack_panels`: panels -> [In, out]."""
  return cpu_kernels.unpack_panels(wp, out)


def panel_linear(x2, wp, out: int):
  """x2 [rows, In] times a projection in panels (`pack_panels`) -> [rows,
  out] float32: the C++ CPU kernel (`pallas_kernels.cpu.panel_matmul`)
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
  impl, interpret = backend.attention_kernel()
  small = min(q.shape[-1], v.shape[-1]) < 16
  if impl == "xla" or (not interpret and small and backend.attention is None):
    B, T = q.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return _attention_xla(q, k, v, pos, jnp.full((B,), T, jnp.int32), window, sinks, scale)
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
  masks nothing. Head dims below 16 run XLA (as `causal_attention`)."""
  impl, interpret = backend.attention_kernel()
  small = min(q.shape[-1], v.shape[-1]) < 16
  if impl == "xla" or (not interpret and small and backend.attention is None):
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    pos = jnp.full((B, T), S - 1, jnp.int32)
    return _attention_xla(q, k, v, pos, jnp.full((B,), S, jnp.int32), 0, None, scale)
  return pallas_kernels.flash_attention(q, k, v, causal=False, sm_scale=scale,
                                        interpret=interpret)


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
  return _attention_xla(q, k, v, q_positions, kv_lengths, window, sinks, scale)


def _attention_xla(q, k, v, q_positions, kv_lengths, window, sinks, scale):
  # Past one block of queries and of keys, blocks with an online softmax: no
  # [T, S] scores, and key blocks past causality or the window are skipped
  # (bench_dense prefill @512 on a 2-core CPU: see `xla_attention`).
  if q.shape[1] > _BLOCK_Q and k.shape[1] > _BLOCK_K:
    return xla_attention.blocked(q, k, v, q_positions, kv_lengths, window, sinks, scale,
                                 block_q=_BLOCK_Q, block_k=_BLOCK_K)
  return xla_attention.dense(q, k, v, q_positions, kv_lengths, window, sinks, scale)


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


def ragged_paged_attention(q, k_pages, v_pages, *, kv_lens, page_table, cu_q_lens, max_q,
                           window=0, sinks=None, scale, v_head_dim=None, layer=None,
                           k_scale=None, v_scale=None, new_kv=None, latent_out=None,
                           expand=None, q_rows=None, backend: Backend = Backend()):
  """Attention for a token-flattened mixed batch over a paged KV cache.

  q [T, N, Hk]: the step's tokens, sequence b owning rows
  cu_q_lens[b]:cu_q_lens[b + 1] (its newest tokens, the last at position
  kv_lens[b] - 1). k_pages [K, P, page_size, Hk], v_pages [K, P, page_size, Hv];
  page_table [B, pages_per_seq]; max_q (static) >= every sequence's query count.
  v_pages None: the values are the first v_head_dim columns of the keys (MLA's
  latent, one pool for both). layer: pools carry a leading layer axis
  ([L, K, P, page_size, H]) and this layer's pages are read (gathered
  directly, never slicing the layer's whole pool). Rows past cu_q_lens[-1] are padding and return
  zeros. -> [T, N, Hv]. k_scale / v_scale (float32 scalars, or None):
  quantized pages (fp8 / int8, `kv.pool.KV_CACHE_DTYPES`) read as
  pages * scale: per tile in the kernel, after the gather on the XLA path
  (MLA: k_scale, the latent's one scale).

  new_kv: the step's own keys and values (k [T, K, Hk], v [T, K, Hv], as
  written to the pages), or None. On the XLA path, a step (max_q > 1) whose
  sequences are each a fresh chunk (from position 0) or one decode token (a
  batch of fresh prompts, or prompts admitted beside decodes) then attends
  packed over its own keys for the prompts (`xla_attention.packed`: no page
  gather, no per-sequence padding) and over the pages for the decode tokens
  only; any other step (a chunk continuing past position 0) over the pages.
  GQA pools without scales only.

  latent_out (MLA): W_uv [N, Hv, R]; the result is then latent result x
  W_uv [T, N, Hv]. expand: a callable -> the step's q, k [T, N, Dq], v [T,
  N, Hv] in MLA's expanded form, traced only in the branch above, whose
  prompts then attend packed over those (bench_moe: Dq 96, not 288 + 256).
  q_rows: None, or a callable rows -> q[rows] (None: all) computing queries
  inside the XLA path's branches (q then gives the shape): fresh MLA prompts
  need absorbed queries for their decode rows only, not every token's.

  GPU target: the kernel tiled by `paged_tiling`, or (attention None)
  the XLA path where `tile_error` says the kernel cannot tile the shapes.
  "mosaic" (the default on a Hopper target, `Backend`): GQA steps on
  `mosaic_paged_attention` (decode-only) or `mosaic_ragged_attention`
  (mixed), decode-only MLA steps on `mosaic_mla_attention` (variants:
  `Backend.trials`), where their `unsupported` finds nothing against the
  shapes (`mosaic_kernel`); other steps "pallas".
  """
  kernel, interpret, tiling = paged_kernel(
      q.shape, q.dtype, k_pages.shape, page_table.shape, max_q=max_q,
      values_dim=None if v_pages is None else v_pages.shape[-1], latent_dim=v_head_dim,
      window=window, sinks=sinks is not None, quantized=k_scale is not None, backend=backend)
  post = lambda o: latent_values(o, latent_out)
  if kernel.startswith("mosaic"):
    return post(_mosaic_step(kernel, q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q,
                             window, sinks, scale, v_head_dim, layer, interpret))
  if kernel == "pallas":
    return post(pallas_kernels.ragged_paged_attention(
        q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q=max_q, sm_scale=scale,
        window=window, sinks=sinks, v_head_dim=v_head_dim, layer=layer, k_scale=k_scale,
        v_scale=v_scale, interpret=interpret, **tiling))
  return _ragged_xla(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q, window, sinks,
                     scale, v_head_dim, layer, (k_scale, v_scale), new_kv, latent_out, expand,
                     post, q_rows)


def latent_values(out, w_uv):
  """MLA: the heads' values [..., N, Hv] from the absorbed form's latent
  result [..., N, R] (x W_uv [N, Hv, R], `layouts.AbsorbedMLA`); out
  itself when w_uv is None."""
  if w_uv is None:
    return out
  return jnp.einsum("...NR,NHR->...NH", out, w_uv.astype(out.dtype))


def _ragged_xla(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q, window, sinks,
                scale, v_head_dim, layer, kv_scales, new_kv, latent_out, expand, post, q_rows=None):
  """`ragged_paged_attention`'s XLA path: packed fresh prompts where it can
  (`_fresh_or_paged_xla`), else over the pages."""
  if q_rows is None:
    q_rows = lambda rows=None: q if rows is None else q[rows]
  if layer is None:
    k_pages = k_pages[None]
    v_pages = None if v_pages is None else v_pages[None]
    layer = 0
  paged = lambda: post(_ragged_paged_xla(
      q_rows(), k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q, window, sinks, scale,
      v_head_dim, layer, kv_scales, trim=max_q == 1))
  if v_pages is not None and new_kv is not None and latent_out is None:
    fresh_qkv = lambda: (q, *new_kv)
  elif v_pages is None and expand is not None and latent_out is not None:
    fresh_qkv = expand  # MLA: the prompts in the expanded form
  else:
    fresh_qkv = None
  if fresh_qkv is None or max_q == 1 or kv_scales[0] is not None:
    return paged()
  return _fresh_or_paged_xla(q_rows, k_pages, v_pages, fresh_qkv, kv_lens, page_table, cu_q_lens,
                             window, sinks, scale, layer, paged, v_head_dim, post, q.shape[0])


def _fresh_or_paged_xla(q_rows, k_pages, v_pages, fresh_qkv, kv_lens, page_table, cu_q_lens,
                        window, sinks, scale, layer, paged, v_head_dim, post, T):
  """`_fresh_and_decodes_xla` where every sequence is a fresh chunk or one
  decode token (chosen by value in the step), the prompts packed over
  fresh_qkv() (traced in that branch only), else paged()."""
  packed = lambda: _packed_xla(*fresh_qkv(), cu_q_lens, window, sinks, scale)
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  decodes = (q_lens == 1) & (kv_lens > 1)  # a lone token past position 0
  return jax.lax.cond(
      jnp.all((kv_lens == q_lens) | decodes),
      lambda: _fresh_and_decodes_xla(q_rows, k_pages, v_pages, packed(), kv_lens, page_table,
                                     cu_q_lens, decodes, window, sinks, scale, layer,
                                     v_head_dim, post, T),
      paged)


# Query and key block of the packed XLA path (`xla_attention.packed`).
_PACKED_BLOCK = 128

# How a step's index maps search their (short, sorted) offsets: every probe
# against every offset in one fusion. jnp's default binary search is a while
# loop of log2(offsets) trips, 4 launches each, in every compiled GPU step
# (llama3_8b decode on an H100 at batch 64: 31 of the step's launches).
SEARCH = "compare_all"


def token_sequences(cu_q_lens, T: int):
  """[T] int32: the sequence each of a step's tokens belongs to (the last b
  with cu_q_lens[b] <= t; B for the padding past cu_q_lens[-1])."""
  t = jnp.arange(T, dtype=jnp.int32)
  return (jnp.searchsorted(cu_q_lens, t, side="right", method=SEARCH) - 1).astype(jnp.int32)


def _packed_xla(q, k, v, cu_q_lens, window, sinks, scale):
  """A step of fresh chunks (each starting at position 0) over its own keys
  and values, packed: token t of sequence b sits at position t - cu_q_lens[b];
  rows past cu_q_lens[-1] are padding and return zeros."""
  T = q.shape[0]
  t = jnp.arange(T, dtype=jnp.int32)
  seq = token_sequences(cu_q_lens, T)
  positions = t - cu_q_lens[seq]
  out = xla_attention.packed(q, k, v, seq, positions, window, sinks, scale,
                             block=min(_PACKED_BLOCK, T), seq_starts=cu_q_lens)
  return jnp.where((t < cu_q_lens[-1])[:, None, None], out, 0).astype(q.dtype)


def _fresh_and_decodes_xla(q_rows, k_pages, v_pages, packed, kv_lens, page_table, cu_q_lens,
                           decodes, window, sinks, scale, layer, v_head_dim, post, T):
  """A step whose sequences are each a fresh chunk (from position 0) or one
  decode token (`decodes` [B]): the fresh chunks' attention `packed` [T, N,
  Hv] (`_packed_xla` over the step's own keys), the decode tokens over their
  pages (then `post`: MLA's W_uv), one query row a sequence as in a decode
  step, gathered for the decodes only: none, at most a quarter of the
  sequences, or all of them (`lax.switch`). q_rows(rows): the queries of
  the step's tokens rows (T of them)."""
  B = page_table.shape[0]
  firsts = q_rows(jnp.clip(cu_q_lens[:-1], 0, T - 1))  # [B, N, H]: each sequence's first token

  def decode_rows(rows):  # -> [B, N, Hv]: sequence b's decode attention (others: any values)
    order = jnp.argsort(jnp.where(decodes, 0, 1), stable=True)[:rows]  # the decodes first
    out = post(_ragged_paged_xla(firsts[order], k_pages, v_pages,
                                 jnp.where(decodes[order], kv_lens[order], 0), page_table[order],
                                 jnp.arange(rows + 1, dtype=jnp.int32), 1, window, sinks, scale,
                                 v_head_dim, layer, (None, None)))
    return out[jnp.clip(jnp.cumsum(decodes) - 1, 0, rows - 1)]

  sizes = sorted({max(1, B // 4), B})
  n = jnp.sum(decodes)
  dec = jax.lax.switch(jnp.searchsorted(jnp.asarray([0] + sizes), n),
                       [lambda: jnp.zeros(firsts.shape[:2] + packed.shape[-1:], packed.dtype)]
                       + [lambda r=r: decode_rows(r).astype(packed.dtype) for r in sizes])
  seq = token_sequences(cu_q_lens, T)  # B for the padding rows
  b = jnp.clip(seq, 0, B - 1)
  return jnp.where(((seq < B) & decodes[b])[:, None, None], dec[b], packed)


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


def xla_item_size(num_tokens: int, num_seqs: int, max_q: int) -> int:
  """Query tokens per row of the XLA path's query layout: max_q (one row per
  sequence, [B, max_q]) where that pads at most 2x over the step's tokens
  (decode steps, batches of prompts), else the largest power of two p <= max_q
  with B * p <= T (at least 1): rows of p tokens of one sequence, so a mixed
  step (a long chunk among decodes) attends about 2T rows, not B * max_q."""
  if num_seqs * max_q <= 2 * num_tokens:
    return max_q
  p = 1
  while 2 * p <= max_q and num_seqs * 2 * p <= num_tokens:
    p *= 2
  return p


def _page_rows(pool, layer, table):
  """pool [L, K, P, ps, H], table [R, pages] -> [K, R * pages, ps, H]: the
  pages of `layer`, gathered as whole rows of the pool flattened to
  [L * K * P, ps, H] (bench_dense's decode at batch 8, 12 pages a sequence,
  the gathers and attention of 8 layers: 5.4 ms against 6.2 indexing
  pool[layer, heads, table], one run)."""
  L, K, P = pool.shape[:3]
  rows = (layer * K + jnp.arange(K, dtype=jnp.int32)[:, None]) * P + table.reshape(1, -1)
  return jnp.take(pool.reshape((L * K * P,) + pool.shape[3:]), rows.reshape(-1), axis=0,
                  mode="clip")


def _ragged_paged_xla(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q, window,
                      sinks, scale, v_head_dim, layer, kv_scales, per_item=None, trim=False):
  # Reference path: each row's sequence's pages gathered into a contiguous
  # [S] view (KV-head-major), the ragged queries laid out in rows of
  # `per_item` tokens of one sequence (`xla_item_size`; the Mosaic ragged
  # kernel's work items), then the dense kernel (`dense_kmajor`; blocked past
  # a block of queries and of keys).
  B, pages = page_table.shape
  T = q.shape[0]
  dims = kernel_dims(k_pages)
  K, page_size = dims["kv_head"], dims["slot"]
  per_item = per_item or xla_item_size(T, B, max_q)

  def gather(pool, scale, table):  # [L, K, P, ps, H] -> [K, R, pages * ps, H] of `layer`
    g = _page_rows(pool, layer, table)  # [K, R * pages, ps, H]
    g = g.reshape(K, table.shape[0], table.shape[1] * page_size, pool.shape[-1])
    return g if scale is None else dequantize(g, scale, q.dtype)

  def attend_pages(qr, table, q_pos, kv_len):
    k = gather(k_pages, kv_scales[0], table)
    v = k[..., :v_head_dim] if v_pages is None else gather(v_pages, kv_scales[1], table)
    if qr.shape[1] > _BLOCK_Q and k.shape[2] > _BLOCK_K:  # blocked: [R, S, K, H]
      return _attention_xla(qr, k.transpose(1, 2, 0, 3), v.transpose(1, 2, 0, 3), q_pos, kv_len,
                            window, sinks, scale)
    return xla_attention.dense_kmajor(qr, k, v, q_pos, kv_len, window, sinks, scale)

  def attend(qr, table, q_pos, kv_len):
    # trim (a decode-only step): its pages come in powers of two; where every
    # row's keys fit in the first three quarters, only those are gathered
    # (the 1.5x page bucket without another program). Prompt programs, whose
    # attention has several branches already, keep one: each branch is more
    # machine code, and serve.py's warm-up then ran out of memory maps
    # (docs/known_issues.md).
    short = 3 * pages // 4
    if not trim or pages < 4 or pages % 4:
      return attend_pages(qr, table, q_pos, kv_len)
    return jax.lax.cond(jnp.max(kv_len) <= short * page_size,
                        lambda: attend_pages(qr, table[:, :short], q_pos, kv_len),
                        lambda: attend_pages(qr, table, q_pos, kv_len))

  if per_item == max_q:  # a row per sequence
    q_pad, seq, row, valid = to_padded(q, cu_q_lens, max_q)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    q_pos = (kv_lens - q_lens)[:, None] + jnp.arange(max_q, dtype=jnp.int32)[None]
    out = attend(q_pad, page_table, q_pos, kv_lens)[seq, row]
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)
  num_items = -(-T // per_item) + B  # >= sum over sequences of ceil(q_len / per_item)
  items, first, item_cu = mosaic_ragged.work_items(cu_q_lens, kv_lens, per_item=per_item,
                                                   num_items=num_items)
  u = jnp.arange(per_item, dtype=jnp.int32)
  q_rows = q[jnp.clip(first[:, None] + u[None], 0, T - 1)]  # [I, per_item, N, H]
  out = attend(q_rows, page_table[items[:, 0]], items[:, 1:2] + u[None], items[:, 2])
  # Back to token order: token t is row (t - start) % per_item of its
  # sequence's item (t - start) // per_item.
  t = jnp.arange(T, dtype=jnp.int32)
  b = jnp.clip(token_sequences(cu_q_lens, T), 0, B - 1)
  offset = t - cu_q_lens[b]
  out = out[jnp.clip(item_cu[b] + offset // per_item, 0, num_items - 1), offset % per_item]
  return jnp.where((t < cu_q_lens[-1])[:, None, None], out, 0).astype(q.dtype)
