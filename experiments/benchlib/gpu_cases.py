"""The kernel shapes the seed models serve with, as compile cases for GPUs.

Each `KernelCase` names one `pallas_kernels` call at serving shapes: the
per-device shard of a seed model under its usual layout (Llama-3.1 8B on one
GPU, 70B and 405B tensor parallel over 8; DeepSeek-V3 MLA with all 128 heads
per rank under attention DP, or 16 under TP 8; GPT-OSS with head dim 64,
sinks and a 128-token window; Qwen3-MoE-235B's 64 q / 4 KV heads), page
sizes 16 and 64, pools of 32k pages, 1..4 query tokens per sequence
(speculative verify), and mixed prefill + decode steps of 512+ tokens, plus
quantized KV pages (fp8 e4m3 / int8 with float32 scales, dequantized per tile
in the kernel: `EngineConfig(kv_cache_dtype=...)`).

`build(case, sharding)` gives the jitted function and its abstract arguments,
so the same list drives the H100 compile gate (tests/gpu/test_gpu_compile_kernels.py)
and the per-kernel resource report (`experiments/kernel_report.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from pallas_kernels import mosaic_mla_ragged as mmr
from pallas_kernels import mosaic_ragged_attention as mra
from jaxinfer import ops

POOL_PAGES = 32768  # pages in every case's pool


@dataclasses.dataclass(frozen=True)
class KernelCase:
  """kernel: flash | paged | mla | ragged. Dims (project alphabet): B sequences,
  Q query tokens per sequence (paged/mla), T query tokens (flash: per sequence;
  ragged: the step's total), S keys per sequence (flash), N q heads, K kv heads,
  D qk head dim, Dv value head dim, ps page size, ctx tokens of context per
  sequence (pages per sequence = ctx / ps), window, sinks. kv_dtype: the
  pages' dtype when quantized ("float8_e4m3fn" | "int8", with scalar
  scales); "" : the compute dtype."""

  name: str
  kernel: str
  model: str
  B: int = 1
  Q: int = 1
  T: int = 0
  S: int = 0
  N: int = 1
  K: int = 1
  D: int = 128
  Dv: int = 128
  ps: int = 16
  ctx: int = 8192
  window: int = 0
  sinks: bool = False
  prefill_tokens: int = 0  # ragged: tokens of the one prefill chunk; the rest decode
  layers: int = 1  # ragged: stacked pool [L, ...], layer read inside the kernel
  dtype: str = "bfloat16"
  gpus: tuple[str, ...] = ("h100",)
  kv_dtype: str = ""

  @property
  def pages_per_seq(self) -> int:
    return self.ctx // self.ps

  def blocks(self) -> dict:
    """Kernel tiling for the case: the Engine's own (`ops.paged_tiling`)."""
    if self.kernel == "flash":
      return {}
    max_q = self.prefill_tokens or self.Q
    return ops.paged_tiling(self.B, self.K, self.pages_per_seq, self.ps, num_q_heads=self.N,
                            max_q=max_q, head_dim=self.D, value_dim=self.Dv,
                            values_from_keys=self.kernel == "mla" or self.D != self.Dv,
                            quantized_kv=bool(self.kv_dtype))


def _c(name, kernel, model, **kw):
  return KernelCase(name=name, kernel=kernel, model=model, **kw)


LLAMA8 = dict(N=32, K=8)  # one GPU
LLAMA70_TP8 = dict(N=8, K=1)  # 64 q / 8 kv heads over 8 GPUs
LLAMA405_TP8 = dict(N=16, K=1)  # 128 q / 8 kv
MLA = dict(D=576, Dv=512, K=1)  # DeepSeek-V3: latent 512 + rope 64, one shared KV head
GPT_OSS = dict(N=64, K=8, D=64, Dv=64, window=128, sinks=True)  # 120B, sliding layers
QWEN3_MOE = dict(N=64, K=4)  # 235B-A22B on one GPU's attention

CASES = (
    # decode and verify over the page pool
    _c("llama8b_decode_ps16", "paged", "llama3_1_8b", B=64, **LLAMA8),
    _c("llama8b_verify4_ps16", "paged", "llama3_1_8b", B=64, Q=4, **LLAMA8),
    _c("llama8b_decode_ps64", "paged", "llama3_1_8b", B=64, ps=64, **LLAMA8),
    _c("llama70b_tp8_decode_ps16", "paged", "llama3_1_70b", B=64, **LLAMA70_TP8),
    _c("llama70b_tp8_verify4_ps64", "paged", "llama3_1_70b", B=32, Q=4, ps=64, **LLAMA70_TP8),
    _c("llama405b_tp8_decode_b1", "paged", "llama3_1_405b", B=1, ctx=32768, **LLAMA405_TP8),
    _c("llama405b_tp8_verify4_ps16", "paged", "llama3_1_405b", B=32, Q=4, **LLAMA405_TP8),
    _c("gptoss_decode_window_sinks", "paged", "gpt_oss_120b", B=64, **GPT_OSS),
    _c("gptoss_verify4_window_sinks_ps64", "paged", "gpt_oss_120b", B=16, Q=4, ps=64, **GPT_OSS),
    _c("qwen3moe_decode_ps16", "paged", "qwen3_moe_235b", B=64, **QWEN3_MOE),
    _c("qwen3moe_verify2_ps64", "paged", "qwen3_moe_235b", B=32, Q=2, ps=64, **QWEN3_MOE),
    # DeepSeek MLA (absorbed) over the latent pool
    _c("dsv3_mla_dp_decode_ps64", "mla", "deepseek_v3", B=32, N=128, ps=64, **MLA),
    _c("dsv3_mla_dp_verify4_ps64", "mla", "deepseek_v3", B=16, Q=4, N=128, ps=64, **MLA),
    _c("dsv3_mla_tp8_decode_ps16", "mla", "deepseek_v3", B=64, N=16, **MLA),
    _c("dsv3_mla_dp_decode_b1_32k", "mla", "deepseek_v3", B=1, N=128, ps=64, ctx=32768, **MLA),
    # mixed prefill + decode steps (one call for the whole step)
    _c("llama8b_mixed_512p_63d", "ragged", "llama3_1_8b", B=64, T=575, prefill_tokens=512,
       layers=4, **LLAMA8),
    _c("llama70b_tp8_mixed_1024p_31d", "ragged", "llama3_1_70b", B=32, T=1055,
       prefill_tokens=1024, layers=4, ps=64, **LLAMA70_TP8),
    _c("gptoss_mixed_512p_63d", "ragged", "gpt_oss_120b", B=64, T=575, prefill_tokens=512,
       layers=4, **GPT_OSS),
    _c("dsv3_mla_mixed_512p_31d", "ragged", "deepseek_v3", B=32, T=543, N=128,
       prefill_tokens=512, layers=4, ps=64, **MLA),
    _c("qwen3moe_mixed_512p_63d", "ragged", "qwen3_moe_235b", B=64, T=575, prefill_tokens=512,
       layers=4, **QWEN3_MOE),
    # quantized KV pages (fp8 e4m3 / int8), dequantized per tile in the kernel
    _c("llama8b_decode_ps16_fp8kv", "paged", "llama3_1_8b", B=64, kv_dtype="float8_e4m3fn",
       **LLAMA8),
    _c("dsv3_mla_dp_decode_ps64_fp8kv", "mla", "deepseek_v3", B=32, N=128, ps=64,
       kv_dtype="float8_e4m3fn", **MLA),
    _c("llama8b_mixed_512p_63d_int8kv", "ragged", "llama3_1_8b", B=64, T=575,
       prefill_tokens=512, layers=4, kv_dtype="int8", **LLAMA8),
    # prefill (flash)
    _c("llama8b_prefill_4k", "flash", "llama3_1_8b", B=1, T=4096, S=4096, **LLAMA8),
    _c("llama405b_tp8_prefill_2k", "flash", "llama3_1_405b", B=2, T=2048, S=2048,
       **LLAMA405_TP8),
    _c("dsv3_prefill_tp8_192_128", "flash", "deepseek_v3", B=1, T=4096, S=4096, N=16, K=16,
       D=192, Dv=128),
    _c("gptoss_prefill_window_sinks", "flash", "gpt_oss_120b", B=1, T=4096, S=4096, **GPT_OSS),
    _c("qwen3moe_prefill_chunk_512_of_8k", "flash", "qwen3_moe_235b", B=1, T=512, S=8192,
       **QWEN3_MOE),
    # the same kernels for A100 (Triton, sm_80)
    _c("a100_llama8b_decode_ps16", "paged", "llama3_1_8b", B=64, gpus=("a100",), **LLAMA8),
    _c("a100_dsv3_mla_tp8_decode", "mla", "deepseek_v3", B=64, N=16, gpus=("a100",), **MLA),
    _c("a100_llama8b_prefill_4k", "flash", "llama3_1_8b", B=1, T=4096, S=4096, gpus=("a100",),
       **LLAMA8),
)


def get(name: str) -> KernelCase:
  for c in CASES:
    if c.name == name:
      return c
  raise ValueError(f"unknown kernel case {name!r}; known: {[c.name for c in CASES]}")


def build(case: KernelCase, sharding=None):
  """-> (fn, abstract args): `jax.jit(fn).lower(*args)` builds the case."""
  dt = jnp.dtype(case.dtype)
  S = lambda shape, d=dt: jax.ShapeDtypeStruct(shape, d, sharding=sharding)
  i32 = jnp.int32
  c = case
  sinks = S((c.N,), jnp.float32) if c.sinks else None
  if c.kernel == "flash":
    fn = functools.partial(_flash, window=c.window)
    return fn, (S((c.B, c.T, c.N, c.D)), S((c.B, c.S, c.K, c.D)), S((c.B, c.S, c.K, c.Dv)),
                sinks)
  tables = S((c.B, c.pages_per_seq), i32)
  lengths = S((c.B,), i32)
  kv = jnp.dtype(c.kv_dtype or c.dtype)
  scale = S((), jnp.float32) if c.kv_dtype else None  # k_scale = v_scale: one argument
  if c.kernel == "paged":
    fn = functools.partial(pk.paged_attention, window=c.window, **c.blocks())
    q = S((c.B, c.Q, c.N, c.D))
    kp, vp = S((c.K, POOL_PAGES, c.ps, c.D), kv), S((c.K, POOL_PAGES, c.ps, c.Dv), kv)
    return _with_sinks(fn), (q, kp, vp, lengths, tables, sinks, scale)
  if c.kernel == "mla":
    R = c.Dv
    fn = functools.partial(pk.mla_paged_attention, sm_scale=1 / math.sqrt(192), **c.blocks())
    return (lambda ql, qr, pages, lengths, tables, s: fn(ql, qr, pages, lengths, tables,
                                                         kv_scale=s),
            (S((c.B, c.Q, c.N, R)), S((c.B, c.Q, c.N, c.D - R)),
             S((POOL_PAGES, c.ps, c.D), kv), lengths, tables, scale))
  if c.kernel == "ragged":
    mla = c.D != c.Dv
    max_q = c.prefill_tokens
    fn = functools.partial(pk.ragged_paged_attention, max_q=max_q, window=c.window,
                           v_head_dim=c.Dv if mla else None, **c.blocks())
    kp = S((c.layers, c.K, POOL_PAGES, c.ps, c.D), kv)
    vp = None if mla else S((c.layers, c.K, POOL_PAGES, c.ps, c.Dv), kv)
    return (_ragged(fn, mla),
            (S((c.T, c.N, c.D)), kp, vp, lengths, tables, S((c.B + 1,), i32), sinks,
             S((), i32), scale))
  raise ValueError(f"unknown kernel {c.kernel!r}")


def build_mosaic_ragged(case: KernelCase, sharding=None, **variant):
  """-> (fn, abstract args) of an unquantized GQA ragged case on
  `mosaic_ragged_attention` (variant: wide / cluster), as `build`."""
  c = case
  if c.kernel != "ragged" or c.D != c.Dv or c.kv_dtype:
    raise ValueError(f"case {c.name}: not an unquantized GQA ragged case")
  S = lambda shape, d=jnp.dtype(c.dtype): jax.ShapeDtypeStruct(shape, d, sharding=sharding)
  pool = S((c.layers, c.K, POOL_PAGES, c.ps, c.D))
  fn = lambda q, kp, vp, kv_lens, tables, cu, sinks, layer: mra.mosaic_ragged_attention(
      q, kp, vp, kv_lens, tables, cu, max_q=c.prefill_tokens, window=c.window, sinks=sinks,
      layer=layer, sm_scale=1 / math.sqrt(c.D), **variant)
  return fn, (S((c.T, c.N, c.D)), pool, pool, S((c.B,), jnp.int32),
              S((c.B, c.pages_per_seq), jnp.int32), S((c.B + 1,), jnp.int32),
              S((c.N,), jnp.float32) if c.sinks else None, S((), jnp.int32))


def build_mosaic_mla_ragged(case: KernelCase, sharding=None, *, cluster=True):
  """-> (fn, abstract args) of an MLA ragged case on `mosaic_mla_ragged`
  (one layer's latent pool), as `build`."""
  c = case
  if c.kernel != "ragged" or c.D == c.Dv or c.kv_dtype:
    raise ValueError(f"case {c.name}: not an unquantized MLA ragged case")
  S = lambda shape, d=jnp.dtype(c.dtype): jax.ShapeDtypeStruct(shape, d, sharding=sharding)
  fn = lambda q, pages, kv_lens, tables, cu: mmr.mosaic_mla_ragged_attention(
      q[..., :c.Dv], q[..., c.Dv:], pages, kv_lens, tables, cu, max_q=c.prefill_tokens,
      sm_scale=1 / math.sqrt(192), cluster=cluster)
  return fn, (S((c.T, c.N, c.D)), S((POOL_PAGES, c.ps, c.D)), S((c.B,), jnp.int32),
              S((c.B, c.pages_per_seq), jnp.int32), S((c.B + 1,), jnp.int32))


def _flash(q, k, v, sinks, *, window):
  return pk.flash_attention(q, k, v, causal=True, window=window, sinks=sinks)


def _with_sinks(fn):
  return lambda q, kp, vp, lengths, tables, sinks, s: fn(q, kp, vp, lengths, tables, sinks=sinks,
                                                         k_scale=s, v_scale=s)


def _ragged(fn, mla):
  return lambda q, kp, vp, kv_lens, tables, cu, sinks, layer, s: fn(
      q, kp, vp, kv_lens, tables, cu, sinks=sinks, layer=layer, k_scale=s,
      v_scale=None if mla else s)


@dataclasses.dataclass(frozen=True)
class HstuCase:
  """A `pallas_kernels.hstu_attention` call at DLRMv3 shapes: T packed tokens of
  a batch of users, N heads, A q/k and H value head dims, P position-bias
  entries (the max sequence length), Bt time buckets + 1."""

  name: str
  T: int
  N: int = 4
  A: int = 128
  H: int = 128
  P: int = 4096
  Bt: int = 129
  dtype: str = "bfloat16"
  gpus: tuple[str, ...] = ("h100",)


HSTU_CASES = (
    # bf16, the preset's compute dtype (a float32 case compiles too, in ~10 s on 2 cores).
    HstuCase("dlrmv3_hstu_8k_tokens_bf16", T=8192),
    HstuCase("dlrmv3_hstu_odd_1500_tokens", T=1500),
    HstuCase("a100_dlrmv3_hstu_8k_tokens", T=8192, gpus=("a100",)),
)


def build_hstu(case: HstuCase, sharding=None):
  """-> (fn, abstract args) of one `HstuCase`, as `build` for `KernelCase`."""
  dt = jnp.dtype(case.dtype)
  S = lambda shape, d=dt: jax.ShapeDtypeStruct(shape, d, sharding=sharding)
  T, N = case.T, case.N
  ints = [S((T,), jnp.int32) for _ in range(3)]
  args = (S((T, N, case.A)), S((T, N, case.A)), S((T, N, case.H)), *ints,
          S((case.P,), jnp.float32), S((case.Bt,), jnp.float32))

  def fn(q, k, v, seg, pos, ts, pos_bias, time_bias):
    return pk.hstu_attention(q, k, v, segment_ids=seg, positions=pos, timestamps=ts,
                             pos_bias=pos_bias, time_bias=time_bias,
                             alpha=1 / math.sqrt(case.A), n=float(case.P))

  return fn, args
