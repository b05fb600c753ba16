"""Times the `pallas_kernels` against their peers and a roofline measured in the same run.

For each kernel a sweep of shapes; for each shape the kernel ("ours"), the peers
that can run here, and a float32 reference used only to check every output:

  flash   prefill, T = S: jax.nn.dot_product_attention (xla, cudnn), tokamax
          (mosaic, triton), jax's Pallas GPU `mha` (no GQA: K/V are repeated to
          N heads outside the timed call), jax's Mosaic GPU `attention_mgpu`
          ("jax_mosaic_fa3", Hopper), torch's scaled_dot_product_attention
          where torch with CUDA is installed (same inputs, through DLPack)
  paged   decode / verify over the page pool: `paged_attention_reference` (the
          XLA baseline), jax's Pallas GPU `paged_attention` (Q = 1 only)
  mla     absorbed MLA decode over the latent pool: `mla_paged_attention_reference`
  ragged  one engine step's mixed prefill-chunk + decode batch:
          `ragged_paged_attention_reference`
  qmatmul weight-only quantized matmul (fp8 / int4 / MXFP4 codes): the XLA
          form that dequantizes W and then dots, and a bf16 W dot
  gmm     the MoE grouped matmul (ragged_dot) through `ops.grouped_matmul`
          on jax's Hopper kernel `ragged_dot_mgpu`: XLA's `ragged_dot`; also
          as "ours_mosaic_experts" (`ops.mosaic_experts`, our Mosaic kernel)

The ragged step also runs as "ours_mosaic" (`mosaic_ragged_attention`, Hopper)
, "ours_mosaic_wide" (its two-warpgroup items, wide=True) and
"ours_mosaic_cluster" (those items in clusters sharing each K/V read,
cluster=True); MLA also as "ours_mosaic_cluster" (row blocks sharing each
latent read, cluster=True), "ours_mosaic_slots4" (4 latent blocks in
flight), "ours_mosaic_keys64" (64 latent rows a loop step, block_keys=64)
and "ours_mosaic_split" (each warpgroup half of S's dot, split_scores=True);
a mixed MLA step ("ragged", DeepSeek's 128 heads) on the Triton ragged kernel
("ours") and the Mosaic items ("ours_mosaic_items", clustered;
"ours_mosaic_items_plain"; "ours_mosaic_items_keys64"; "ours_mosaic_items_split").

The decode kernels also run as "ours_split": the same kernel with split-K
(`num_splits`) sized to give the GPU about two programs per SM.

Timing: every implementation is jitted, compiled and warmed up; a sample is
`inner` back-to-back calls, blocked at the end and divided by `inner` (so a
kernel shorter than a launch is not timed as launch overhead); the time is the
median of `repeats` samples. On GPU the calls rotate over enough input sets
(256 MiB in all, at most 512 sets) that repeated calls do not run out of the L2
cache. Inputs are
random normal, never zeros.

Shape sets: "default" (the full sweep), "gpu_day" (the same kernels and
peers, fewer shapes, most telling first, for a time-boxed run) and "tiny"
(a CPU smoke test). With a `deadline`, cases and implementations that would
start past it are recorded as skipped ("time box").
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib
import itertools
import json
import math
import os
import re
import statistics
import time
import zlib
from typing import Any

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from benchlib.kernel_case import (Case, Impl, mosaic_skip as _mosaic_skip, normal as _normal,
                                  random_codes as _random_codes,
                                  random_scales as _random_scales)
from benchlib.kernel_gmm import gmm_cases
from pallas_kernels import mosaic_mla_attention as mma
from pallas_kernels import mosaic_mla_ragged as mmr
from pallas_kernels import mosaic_paged_attention as mpa
from pallas_kernels import mosaic_ragged_attention as mra
from pallas_kernels import mosaic_wide_attention as mwa
from jaxinfer import ops
from jaxinfer.models import quant

KERNELS = ("flash", "paged", "mla", "ragged", "qmatmul", "gmm")
SHAPES = ("default", "gpu_day", "tiny")
CONTEXTS = (512, 2048, 8192, 32768)
PRIMARY = {"flash": "tflops", "paged": "gbps", "mla": "gbps", "ragged": "gbps", "qmatmul": "gbps",
           "gmm": "tflops"}
CONVENTIONS = {
    "time_s": "median over `repeats` samples of (wall time of `inner` back-to-back jitted calls, "
              "block_until_ready at the end) / inner; first_call_s: the first call, compilation "
              "included unless an identical program was already compiled (the reference check)",
    "flops": "qmatmul: 2*M*N*K. flash: 4*B*T*S*N*H, halved when causal (T == S). paged/mla/ragged: "
             "2*(D + Dv)*N per (query row, visible key) pair, counted exactly (MLA: D = R + Hr, "
             "Dv = R). Every implementation is credited the same logical work.",
    "bytes": "qmatmul: codes + scales + x + out. flash: q + k + v + out, each once. paged/ragged: K and V pages actually read "
             "(ceil(length / page_size) whole pages per sequence, once per KV head) + q + out; "
             "mla: latent pages read (once for all heads) + q_latent + q_rope + out.",
    "tflops": "flops / time_s / 1e12", "gbps": "bytes / time_s / 1e9",
    "frac_peak_flops": "tflops / roofline.matmul_tflops",
    "frac_peak_bw": "gbps / roofline.hbm_gbps",
    "roofline_frac": "max(flops / peak flops, bytes / peak bandwidth) / time_s: 1 = at the roofline",
    "ours_over_peer_time": "time_s(ours) / time_s(peer): < 1 means ours is faster",
    "rel_err": "||out - ref|| / ||ref|| against the float32 reference on float32 inputs",
}
_MiB, _GiB = 1 << 20, 1 << 30
_TARGET_SAMPLE_S = 0.01  # one timing sample lasts about this long
_MAX_INNER = 64
_ROTATE_BYTES, _MAX_SETS = 256 * _MiB, 512  # GPU input rotation (L2 is ~50 MB)


@dataclasses.dataclass(frozen=True)
class _Env:
  gpu: bool
  dtype: Any
  interpret: bool
  peers: bool
  budget: float  # bytes a peer or reference may allocate beyond its inputs
  sms: int  # programs are sized for this many cores


def _gpu_peer(env, module):
  """-> (module, "") for a GPU-only peer that can run here, else (None, why not)."""
  if not env.gpu:
    return None, "GPU only"
  try:
    return importlib.import_module(module), ""
  except Exception as e:  # noqa: BLE001  (any import failure means "not available")
    return None, f"not importable: {short_error(e)}"


def _split_count(env, programs, pages_per_seq):
  """Split-K ways giving ~2 programs per SM (power of two <= 16 and <= the pages)."""
  want, n = -(-2 * env.sms // programs), 1
  while n < want and n < 16 and 2 * n <= pages_per_seq:
    n *= 2
  return n


def _page_tables(key, lengths, page_size):
  """Each sequence gets ceil(len / page_size) distinct pages of a shuffled pool,
  so reads are scattered as in a long-running server. -> ([B, pages_per_seq], P)."""
  pages = [-(-n // page_size) for n in lengths]
  perm = jax.random.permutation(key, sum(pages)).tolist()
  width, rows, at = max(pages), [], 0
  for n in pages:
    rows.append(perm[at:at + n] + [0] * (width - n))
    at += n
  return jnp.asarray(rows, jnp.int32), sum(pages)


def _pairs(lengths, q_lens):
  """(query row, visible key) pairs: the Q queries sit at the end of the KV, causal."""
  return sum(q * n - q * (q - 1) // 2 for q, n in zip(q_lens, lengths))


# ----------------------------------------------------------------------------- flash


def _flash_case(env, *, B, T, N, K, H, causal):
  S, item = T, jnp.dtype(env.dtype).itemsize
  logits = 4.0 * B * N * T * S  # one float32 [B, N, T, S] array
  scale = 1.0 / math.sqrt(H)

  def make_args(key):
    kq, kk, kv = jax.random.split(key, 3)
    return (_normal(kq, (B, T, N, H), env.dtype), _normal(kk, (B, S, K, H), env.dtype),
            _normal(kv, (B, S, K, H), env.dtype))

  impls = {"ours": Impl(functools.partial(pk.flash_attention, causal=causal,
                                          interpret=env.interpret))}
  if env.peers:
    dpa = lambda impl: functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                         implementation=impl)
    impls["xla"] = Impl(dpa("xla"), temp_bytes=3 * logits)
    impls["cudnn"] = Impl(dpa("cudnn"), skip="" if env.gpu else "GPU only")
    tokamax, why = _gpu_peer(env, "tokamax")
    for impl in ("mosaic", "triton"):
      fn = tokamax and functools.partial(tokamax.dot_product_attention, is_causal=causal,
                                         implementation=impl)
      impls[f"tokamax_{impl}"] = Impl(fn, skip=why)
    mha, why = _gpu_peer(env, "jax.experimental.pallas.ops.gpu.attention")
    repeat = lambda q, k, v: (q, jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2))
    impls["jax_pallas_mha"] = Impl(
        lambda q, k, v: mha.mha(q, k, v, None, scale, causal), prep=repeat, skip=why,
        note="K/V repeated to N heads outside the timed call" if N != K else "")
    fa3, why = _gpu_peer(env, "jax.experimental.pallas.ops.gpu.attention_mgpu")
    block_kv = 128 if H <= 128 else 64  # K and V stages within shared memory at H = 192
    impls["jax_mosaic_fa3"] = Impl(
        lambda q, k, v: fa3.attention(q, k, v, fa3.TuningConfig(
            block_q=64, block_kv=block_kv, max_concurrent_steps=2, causal=causal)),
        prep=lambda q, k, v: (q * jnp.asarray(scale, q.dtype), k, v),
        skip=why or _mosaic_skip(env, None),
        note=f"jax's attention_mgpu (Mosaic GPU, FlashAttention-3 style), block_kv {block_kv}; "
             "q scaled outside the timed call (the kernel takes no softmax scale)")
    impls["torch_sdpa"] = _torch_sdpa(env, causal=causal, gqa=N != K)
  reference = Impl(functools.partial(pk.flash_attention_reference, causal=causal),
                   temp_bytes=4 * logits)
  return Case(
      kernel="flash", label=f"B{B} T{T} N{N}/K{K} H{H}{' causal' if causal else ''}",
      series=f"N{N}/K{K} H{H}{' causal' if causal else ''}", context=S,
      shape=dict(B=B, T=T, S=S, N=N, K=K, H=H, causal=causal),
      flops=4.0 * B * T * S * N * H * (0.5 if causal else 1.0),
      bytes=item * B * (2 * T * N * H + 2 * S * K * H), make_args=make_args, impls=impls,
      reference=reference)


def _torch_sdpa(env, *, causal, gqa):
  """torch.nn.functional.scaled_dot_product_attention on the same GPU (its own
  kernel choice: flash / cuDNN / memory-efficient), fed the jax inputs through
  DLPack and transposed to [B, N, T, H] outside the timed call."""
  torch, why = _gpu_peer(env, "torch")
  if torch is not None and not torch.cuda.is_available():
    torch, why = None, "torch has no CUDA device"
  if torch is None:
    return Impl(None, skip=why)
  sdpa = torch.nn.functional.scaled_dot_product_attention

  def prep(q, k, v):
    return tuple(torch.from_dlpack(a).transpose(1, 2).contiguous() for a in (q, k, v))

  def post(out):  # [B, N, T, H] torch -> [B, T, N, H] jax, through the host
    return jnp.asarray(out.transpose(1, 2).float().cpu().numpy())

  return Impl(lambda q, k, v: sdpa(q, k, v, is_causal=causal, enable_gqa=gqa), prep=prep,
              sync=lambda out: torch.cuda.synchronize(), post=post,
              note=f"torch {torch.__version__}; inputs via DLPack, transposed untimed")


def _flash_cases(env, shapes):
  if shapes == "tiny":
    specs = [dict(B=1, T=64, N=4, K=2, H=32, causal=True),
             dict(B=2, T=48, N=2, K=2, H=64, causal=False)]
  elif shapes == "gpu_day":  # Llama-3 GQA at three lengths, then MLA prefill's 192 heads
    specs = [dict(B=16384 // T, T=T, N=32, K=8, H=128, causal=True) for T in (2048, 8192, 1024)]
    specs.append(dict(B=4, T=4096, N=16, K=16, H=192, causal=True))
  else:  # B * T = 16k tokens per call; head configs of Llama-3 (GQA 4), MHA 64, MLA prefill
    specs = [dict(B=max(1, 16384 // T), T=T, N=N, K=K, H=H, causal=True)
             for N, K, H in ((32, 8, 128), (32, 32, 64), (16, 16, 192)) for T in CONTEXTS]
    specs += [dict(B=16384 // T, T=T, N=32, K=8, H=128, causal=False) for T in (2048, 8192)]
  return [_flash_case(env, **s) for s in specs]


# ----------------------------------------------------------------------------- paged


def _paged_case(env, *, B, S, ps, Q, N, K, D):
  item, lengths = jnp.dtype(env.dtype).itemsize, [S] * B
  pps = -(-S // ps)
  pages_read = B * pps
  f32_kv = 4.0 * pages_read * ps * K * 2 * D  # the reference's gathered float32 K and V

  def make_args(key):
    kq, kk, kv, kt = jax.random.split(key, 4)
    tables, P = _page_tables(kt, lengths, ps)
    q = _normal(kq, (B, N, D) if Q == 1 else (B, Q, N, D), env.dtype)
    return (q, _normal(kk, (K, P, ps, D), env.dtype), _normal(kv, (K, P, ps, D), env.dtype),
            jnp.asarray(lengths, jnp.int32), tables)

  ours = functools.partial(pk.paged_attention, interpret=env.interpret)
  splits = _split_count(env, B * K, pps)
  impls = {"ours": Impl(ours)}
  if splits > 1:
    impls["ours_split"] = Impl(functools.partial(ours, num_splits=splits),
                               note=f"num_splits={splits}")
  mosaic_splits = _split_count(env, B * K, -(-pps // mpa.pages_per_block(ps)))
  impls["ours_mosaic"] = Impl(
      functools.partial(mpa.mosaic_paged_attention, num_splits=mosaic_splits),
      skip=_mosaic_skip(env, mpa.unsupported((B, Q, N, D), env.dtype, (K, 1, ps, D),
                                              values_dim=D)),
      note=f"Mosaic GPU (TMA + wgmma), num_splits={mosaic_splits}")
  temp = 2 * f32_kv + 3 * 4.0 * B * N * Q * pps * ps
  if env.peers:
    impls["xla_reference"] = Impl(pk.paged_attention_reference, temp_bytes=temp,
                                  note="pure jnp, float32 compute")
    mod, why = _gpu_peer(env, "jax.experimental.pallas.ops.gpu.paged_attention")
    k_splits = math.gcd(16, pps)
    ppcb = math.gcd(8, pps // k_splits)
    # The op has no sm_scale: q arrives pre-scaled by 1/sqrt(D), outside the timed call.
    prescale = lambda q, *rest: ((q * (1.0 / math.sqrt(D))).astype(q.dtype), *rest)
    impls["jax_pallas_paged"] = Impl(
        lambda q, k, v, lens, tables: mod.paged_attention(
            q, k, v, tables, lens, k_splits=k_splits, pages_per_compute_block=ppcb),
        prep=prescale, skip=why or ("" if Q == 1 else "Q > 1 unsupported"),
        note=f"k_splits={k_splits}, pages_per_compute_block={ppcb}; q pre-scaled, untimed")
  return Case(
      kernel="paged", label=f"B{B} S{S} ps{ps} Q{Q} N{N}/K{K} D{D}",
      series=f"B{B} ps{ps} Q{Q}", context=S,
      shape=dict(B=B, S=S, page_size=ps, Q=Q, N=N, K=K, D=D, Dv=D),
      flops=2.0 * 2 * D * N * _pairs(lengths, [Q] * B),
      bytes=item * (pages_read * ps * K * 2 * D + B * Q * N * 2 * D), make_args=make_args,
      impls=impls, reference=Impl(pk.paged_attention_reference, temp_bytes=temp + f32_kv))


def _paged_cases(env, shapes):
  if shapes == "tiny":
    specs = [dict(B=2, S=64, ps=16, Q=1, N=4, K=2, D=32),
             dict(B=2, S=40, ps=16, Q=2, N=4, K=2, D=32)]
  elif shapes == "gpu_day":  # batch 1 / 8 / 64 at 1k / 8k / 32k, page sizes 16 and 64, MTP verify
    specs = [dict(B=B, S=S, ps=ps, Q=1, N=32, K=8, D=128)
             for B, S in ((8, 8192), (64, 1024), (1, 32768)) for ps in (16, 64)]
    specs += [dict(B=8, S=8192, ps=16, Q=4, N=32, K=8, D=128),
              dict(B=64, S=8192, ps=16, Q=1, N=32, K=8, D=128),
              dict(B=1, S=1024, ps=16, Q=1, N=32, K=8, D=128)]
  else:  # Llama-3-8B/70B attention: 32 query heads over 8 KV heads of 128
    specs = [dict(B=B, S=S, ps=ps, Q=1, N=32, K=8, D=128)
             for ps in (16, 64) for B in (1, 8, 64) for S in CONTEXTS]
    specs += [dict(B=8, S=S, ps=16, Q=4, N=32, K=8, D=128) for S in CONTEXTS]
  return [_paged_case(env, **s) for s in specs]


# ----------------------------------------------------------------------------- mla


# The MLA kernel's variants kernel_bench times beside it: name, kwargs, what changes.
_MLA_VARIANTS = (("slots4", dict(slots=4), " with 4 latent blocks in flight"),
                 ("keys64", dict(block_keys=64), " with 64 latent rows a loop step"),
                 ("split", dict(split_scores=True), ", each warpgroup half of S's dot"))


def _mla_case(env, *, B, S, ps, N, R, Hr):
  item, lengths = jnp.dtype(env.dtype).itemsize, [S] * B
  pps = -(-S // ps)
  pages_read = B * pps
  f32_pages = 4.0 * pages_read * ps * (R + Hr)
  scale = 1.0 / math.sqrt(128 + 64)  # DeepSeek-V3: 1/sqrt(qk_nope + qk_rope head dims)

  def make_args(key):
    kq, kr, kp, kt = jax.random.split(key, 4)
    tables, P = _page_tables(kt, lengths, ps)
    return (_normal(kq, (B, N, R), env.dtype), _normal(kr, (B, N, Hr), env.dtype),
            _normal(kp, (P, ps, R + Hr), env.dtype), jnp.asarray(lengths, jnp.int32), tables)

  ours = functools.partial(pk.mla_paged_attention, sm_scale=scale, interpret=env.interpret)
  splits = _split_count(env, B, pps)
  impls = {"ours": Impl(ours)}
  if splits > 1:
    impls["ours_split"] = Impl(functools.partial(ours, num_splits=splits),
                               note=f"num_splits={splits}")
  # Rows: N heads in blocks of 64; split-K to about two programs per SM.
  mosaic_splits = _split_count(env, B * -(-N // mpa.ROWS), -(-S // mma.KEYS))
  impls["ours_mosaic"] = Impl(
      functools.partial(mma.mosaic_mla_attention, sm_scale=scale, num_splits=mosaic_splits),
      skip=_mosaic_skip(env, mma.unsupported(R + Hr, R, ps, env.dtype)),
      note=f"Mosaic GPU (TMA + wgmma, 2 warpgroups), num_splits={mosaic_splits}")
  if mma.cluster_blocks(N, True) > 1:  # the row blocks as one cluster: each latent read once
    impls["ours_mosaic_cluster"] = Impl(
        functools.partial(mma.mosaic_mla_attention, sm_scale=scale, num_splits=mosaic_splits,
                          cluster=True),
        skip=_mosaic_skip(env, mma.unsupported(R + Hr, R, ps, env.dtype)),
        note=f"Mosaic GPU, {mma.cluster_blocks(N, True)} row blocks a cluster sharing each "
             f"latent read (TMA multicast), num_splits={mosaic_splits}")
  cluster = mma.cluster_blocks(N, True) > 1
  for name, kw, what in _MLA_VARIANTS:  # each as ours_mosaic(_cluster) with one change
    impls[f"ours_mosaic_{name}"] = Impl(
        functools.partial(mma.mosaic_mla_attention, sm_scale=scale, num_splits=mosaic_splits,
                          cluster=cluster, **kw),
        skip=_mosaic_skip(env, mma.unsupported(R + Hr, R, ps, env.dtype, **kw)),
        note=f"as ours_mosaic{'_cluster' if cluster else ''}{what}")
  reference = functools.partial(pk.mla_paged_attention_reference, sm_scale=scale)
  temp = f32_pages + 3 * 4.0 * B * N * pps * ps
  if env.peers:
    impls["xla_reference"] = Impl(reference, temp_bytes=temp, note="pure jnp, float32 compute")
  return Case(
      kernel="mla", label=f"B{B} S{S} ps{ps} N{N} R{R}+{Hr}", series=f"B{B} ps{ps}", context=S,
      shape=dict(B=B, S=S, page_size=ps, Q=1, N=N, R=R, Hr=Hr),
      flops=2.0 * (2 * R + Hr) * N * _pairs(lengths, [1] * B),
      bytes=item * (pages_read * ps * (R + Hr) + B * N * (2 * R + Hr)), make_args=make_args,
      impls=impls, reference=Impl(reference, temp_bytes=temp + f32_pages))


def _mla_cases(env, shapes):
  if shapes == "tiny":
    specs = [dict(B=2, S=64, ps=16, N=8, R=64, Hr=16)]
  elif shapes == "gpu_day":
    specs = [dict(B=B, S=S, ps=ps, N=128, R=512, Hr=64)
             for B, S in ((8, 8192), (64, 1024), (1, 32768)) for ps in (64, 16)]
  else:  # DeepSeek-V3: kv_lora_rank 512, rope 64, 128 heads, page sizes 64 and 16
    specs = [dict(B=B, S=S, ps=ps, N=128, R=512, Hr=64)
             for ps in (64, 16) for B in (1, 8, 64) for S in CONTEXTS]
  return [_mla_case(env, **s) for s in specs]


# ----------------------------------------------------------------------------- ragged


def _step_layout(seqs):
  """(query tokens, KV tokens after the step) per sequence -> (q_lens, kv
  lengths, cu_q_lens) as lists."""
  q_lens, lengths = [q for q, _ in seqs], [n for _, n in seqs]
  return q_lens, lengths, [0, *itertools.accumulate(q_lens)]


def _ragged_case(env, *, name, seqs, ps, N, K, D):
  """seqs: (query tokens, KV tokens after the step) per sequence."""
  item = jnp.dtype(env.dtype).itemsize
  q_lens, lengths, cu = _step_layout(seqs)
  B, T, max_q = len(seqs), sum(q_lens), max(q_lens)
  pages_read = sum(-(-n // ps) for n in lengths)
  pps = max(-(-n // ps) for n in lengths)
  f32_kv = 4.0 * B * pps * ps * K * 2 * D

  def make_args(key):
    kq, kk, kv, kt = jax.random.split(key, 4)
    tables, P = _page_tables(kt, lengths, ps)
    return (_normal(kq, (T, N, D), env.dtype), _normal(kk, (K, P, ps, D), env.dtype),
            _normal(kv, (K, P, ps, D), env.dtype), jnp.asarray(lengths, jnp.int32), tables,
            jnp.asarray(cu, jnp.int32))

  impls = {"ours": Impl(functools.partial(pk.ragged_paged_attention, max_q=max_q,
                                          interpret=env.interpret))}
  impls["ours_mosaic"] = Impl(
      functools.partial(mra.mosaic_ragged_attention, max_q=max_q),
      skip=_mosaic_skip(env, mpa.unsupported((1, 1, N, D), env.dtype, (K, 1, ps, D),
                                             values_dim=D)),
      note=f"Mosaic GPU work items of {mra.tokens_per_item(N // K)} tokens (TMA + wgmma)")
  wide_smem = mwa.smem_bytes(D, ps, 2, item)
  impls["ours_mosaic_wide"] = Impl(
      functools.partial(mra.mosaic_ragged_attention, max_q=max_q, wide=True),
      skip=_mosaic_skip(env, mpa.unsupported((1, 1, N, D), env.dtype, (K, 1, ps, D),
                                             values_dim=D)
                        or (None if wide_smem <= mpa.SMEM_BYTES else
                            (ValueError, f"wide items need {wide_smem} B of shared memory"))),
      note=f"Mosaic GPU wide items of {mra.tokens_per_item(N // K, True)} tokens on two "
           "warpgroups sharing each K/V block")
  impls["ours_mosaic_cluster"] = dataclasses.replace(
      impls["ours_mosaic_wide"],
      fn=functools.partial(mra.mosaic_ragged_attention, max_q=max_q, wide=True, cluster=True),
      note=f"the wide items, a chunk's consecutive ones (up to {mra.CLUSTER}) as one cluster "
           "sharing each K/V read (TMA multicast)")
  reference = functools.partial(pk.ragged_paged_attention_reference, max_q=max_q)
  temp = f32_kv + 3 * 4.0 * B * N * max_q * pps * ps
  if env.peers:
    impls["xla_reference"] = Impl(reference, temp_bytes=temp, note="pure jnp, float32 compute")
  chunks = sum(q > 1 for q in q_lens)
  return Case(
      kernel="ragged", label=f"{name}: {chunks} chunks + {B - chunks} decodes, S<={max(lengths)}",
      series=name, context=max(lengths),
      shape=dict(B=B, T=T, max_q=max_q, page_size=ps, N=N, K=K, D=D, q_lens=q_lens,
                 kv_lens=lengths),
      flops=2.0 * 2 * D * N * _pairs(lengths, q_lens),
      bytes=item * (pages_read * ps * K * 2 * D + T * N * 2 * D), make_args=make_args,
      impls=impls, reference=Impl(reference, temp_bytes=temp + f32_kv))


def _geometric(lo, hi, n):
  return [round(lo * (hi / lo) ** (i / max(n - 1, 1))) for i in range(n)]


def _ragged_cases(env, shapes):
  if shapes == "tiny":
    mixes = [("tiny", [(8, 32), (1, 48), (1, 64), (3, 20)])]
  elif shapes == "gpu_day":  # a mixed step, and a prefill-bound one (two 2k chunks)
    mixes = [("mix32", [(128, n) for n in (1024, 2048, 4096, 8192)]
              + [(1, n) for n in _geometric(512, 8192, 28)]),
             ("prefill2x2k", [(2048, 2048), (2048, 4096), (1, 1024), (1, 2048)])]
  else:  # prefill chunks of 128 tokens (at the end of their KV) among decodes
    mixes = [("mix32", [(128, n) for n in (1024, 2048, 4096, 8192)]
              + [(1, n) for n in _geometric(512, 8192, 28)]),
             ("mix64", [(128, n) for n in (8192, 32768)]
              + [(1, n) for n in _geometric(512, 32768, 62)])]
  dims = dict(ps=16, N=4, K=2, D=32) if shapes == "tiny" else dict(ps=16, N=32, K=8, D=128)
  cases = [_ragged_case(env, name=name, seqs=seqs, **dims) for name, seqs in mixes]
  if shapes == "tiny":
    return cases + [_mla_ragged_case(env, name="tiny_mla", seqs=[(8, 32), (1, 48), (3, 20)],
                                     ps=16, N=8, R=64, Hr=32)]
  # DeepSeek-V3 (128 heads): a 256-token chunk at the end of 2k keys beside 15 decodes
  # (the float32 reference pads every sequence to the chunk: ~13 GB); first on a GPU day
  mla = _mla_ragged_case(env, name="dsv3_mix16",
                         seqs=[(256, 2048)] + [(1, n) for n in _geometric(512, 2048, 15)],
                         ps=64, N=128, R=512, Hr=64)
  return [mla] + cases if shapes == "gpu_day" else cases + [mla]


def _mla_ragged_case(env, *, name, seqs, ps, N, R, Hr):
  """A mixed MLA step over one latent pool: the Triton ragged kernel ("ours",
  values the latent's first R columns) and the Mosaic items
  (`mosaic_mla_ragged`, clustered and plain)."""
  item = jnp.dtype(env.dtype).itemsize
  q_lens, lengths, cu = _step_layout(seqs)
  B, T, max_q, D = len(seqs), sum(q_lens), max(q_lens), R + Hr
  pps = max(-(-n // ps) for n in lengths)
  scale = 1.0 / math.sqrt(128 + 64)

  def make_args(key):
    kq, kp, kt = jax.random.split(key, 3)
    tables, P = _page_tables(kt, lengths, ps)
    return (_normal(kq, (T, N, D), env.dtype), _normal(kp, (P, ps, D), env.dtype),
            jnp.asarray(lengths, jnp.int32), tables, jnp.asarray(cu, jnp.int32))

  triton = lambda q, pages, *rest: pk.ragged_paged_attention(
      q, pages[None], None, *rest, max_q=max_q, sm_scale=scale, v_head_dim=R,
      interpret=env.interpret)
  mosaic = lambda q, pages, *rest, cluster, **kw: mmr.mosaic_mla_ragged_attention(
      q[..., :R], q[..., R:], pages, *rest, max_q=max_q, sm_scale=scale, cluster=cluster, **kw)
  skip = _mosaic_skip(env, mma.unsupported(D, R, ps, env.dtype))
  impls = {"ours": Impl(triton, note="Triton ragged kernel over the latent pool")}
  impls["ours_mosaic_items"] = Impl(
      functools.partial(mosaic, cluster=True), skip=skip,
      note=f"Mosaic GPU items of {mmr.tokens_per_item(N, True)} tokens in clusters of "
           f"{mmr.row_blocks(N, True)} row blocks sharing each latent read")
  impls["ours_mosaic_items_plain"] = Impl(
      functools.partial(mosaic, cluster=False), skip=skip,
      note=f"Mosaic GPU items of {mmr.tokens_per_item(N)} tokens, no clusters")
  for name, kw, what in _MLA_VARIANTS[1:]:  # 64 keys a step; S's dot split
    impls[f"ours_mosaic_items_{name}"] = Impl(
        functools.partial(mosaic, cluster=True, **kw),
        skip=_mosaic_skip(env, mma.unsupported(D, R, ps, env.dtype, **kw)),
        note=f"as ours_mosaic_items{what}")
  reference = lambda q, *rest: mmr.mosaic_mla_ragged_attention_reference(
      q[..., :R], q[..., R:], *rest, max_q=max_q, sm_scale=scale)
  temp = 4.0 * B * pps * ps * D + 3 * 4.0 * B * N * max_q * pps * ps
  if env.peers:
    impls["xla_reference"] = Impl(reference, temp_bytes=temp, note="pure jnp, float32 compute")
  chunks = sum(q > 1 for q in q_lens)
  return Case(
      kernel="ragged", label=f"{name}: MLA N{N}, {chunks} chunks + {B - chunks} decodes, "
                             f"S<={max(lengths)}",
      series=name, context=max(lengths),
      shape=dict(B=B, T=T, max_q=max_q, page_size=ps, N=N, R=R, Hr=Hr, q_lens=q_lens,
                 kv_lens=lengths),
      flops=2.0 * (2 * R + Hr) * N * _pairs(lengths, q_lens),
      bytes=item * (sum(-(-n // ps) for n in lengths) * ps * D + T * N * (D + R)),
      make_args=make_args, impls=impls, reference=Impl(reference, temp_bytes=temp))


# ----------------------------------------------------------------------------- qmatmul


def _qmatmul_case(env, *, M, N, K, method, block):
  block = quant.FIXED_BLOCKS.get(method, block)
  bo, bi = block[0] or N, block[1] or K
  code_dt, scale_dt = jnp.dtype(quant.VALUE_DTYPES[method]), jnp.dtype(quant.SCALE_DTYPES[method])
  codes_shape, scale_shape = (N, quant.stored_in(method, K)), (-(-N // bo), -(-K // bi))
  kw = dict(block=block, packed=quant.PACKING.get(method))
  item = jnp.dtype(env.dtype).itemsize

  def make_args(key):
    kx, kc, ks = jax.random.split(key, 3)
    args = (_normal(kx, (M, K), env.dtype), _random_codes(kc, codes_shape, code_dt),
            _random_scales(ks, scale_shape, scale_dt))
    return args + (jnp.asarray(0.02, jnp.float32),) if method == "nvfp4" else args

  def dequantized(codes, scale, s2, dtype):
    return pk.dequantize_reference(codes, scale, scale2=s2, **kw).astype(dtype)

  impls = {"ours": Impl(lambda x, c, s, s2=None: pk.quantized_matmul(
      x, c, s, scale2=s2, interpret=env.interpret, **kw))}
  if env.peers:
    impls["xla_dequant_dot"] = Impl(
        lambda x, c, s, s2=None: jnp.dot(x, dequantized(c, s, s2, x.dtype).T),
        temp_bytes=6.0 * N * K, note="dequantize (table lookup, block repeat) then dot, in XLA")
    impls["bf16_weight_dot"] = Impl(
        lambda x, w: jnp.dot(x, w.T),
        prep=lambda x, c, s, s2=None: (x, dequantized(c, s, s2, x.dtype)),
        note="x @ W^T with W already dequantized to the activations' dtype (untimed)")
  reference = Impl(lambda x, c, s, s2=None: pk.quantized_matmul_reference(x, c, s, scale2=s2, **kw),
                   temp_bytes=8.0 * N * K)
  code_bytes = math.prod(codes_shape) * code_dt.itemsize
  return Case(
      kernel="qmatmul", label=f"M{M} N{N} K{K} {method} {block[0]}x{block[1]}",
      series=f"{method} N{N} K{K}", context=M,
      shape=dict(M=M, N=N, K=K, method=method, block=list(block)),
      flops=2.0 * M * N * K,
      bytes=code_bytes + math.prod(scale_shape) * scale_dt.itemsize + item * M * (K + N),
      make_args=make_args, impls=impls, reference=reference)


def _qmatmul_cases(env, shapes):
  if shapes == "tiny":
    specs = [dict(M=4, N=64, K=128, method="fp8", block=(32, 32)),
             dict(M=3, N=64, K=64, method="mxfp4", block=(0, 0))]
  elif shapes == "gpu_day":  # Llama-3-8B's gate (fp8 128-blocks, int4 per channel), GPT-OSS MXFP4
    specs = [dict(M=8, N=14336, K=4096, method="fp8", block=(128, 128)),
             dict(M=8, N=14336, K=4096, method="int4", block=(1, 0)),
             dict(M=8, N=5760, K=2880, method="mxfp4", block=(0, 0)),
             dict(M=256, N=14336, K=4096, method="fp8", block=(128, 128)),
             dict(M=1, N=14336, K=4096, method="fp8", block=(128, 128))]
  else:
    specs = [dict(M=M, N=14336, K=4096, method=m, block=b)
             for m, b in (("fp8", (128, 128)), ("int4", (1, 0)), ("mxfp4", (0, 0)),
                          ("nvfp4", (0, 0))) for M in (1, 8, 64, 256)]
  return [_qmatmul_case(env, **s) for s in specs]


_BUILDERS = {"flash": _flash_cases, "paged": _paged_cases, "mla": _mla_cases,
             "ragged": _ragged_cases, "qmatmul": _qmatmul_cases, "gmm": gmm_cases}


# ----------------------------------------------------------------------------- timing


def _nbytes(tree):
  return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def _block(out, sync=None):
  """Waits for `out` (jax arrays, or a peer's outputs through its `sync`)."""
  if sync is None:
    return jax.block_until_ready(out)
  sync(out)
  return out


def _time_calls(fn, arg_sets, *, warmup, repeats, sync=None):
  """-> (first output, first_call_s, inner, per-call samples in seconds)."""
  n = len(arg_sets)
  t0 = time.perf_counter()
  first = _block(fn(*arg_sets[0]), sync)
  first_s = time.perf_counter() - t0
  for i in range(warmup):
    _block(fn(*arg_sets[(i + 1) % n]), sync)
  t0 = time.perf_counter()
  _block(fn(*arg_sets[1 % n]), sync)
  one = time.perf_counter() - t0
  inner = max(1, min(_MAX_INNER, math.ceil(_TARGET_SAMPLE_S / max(one, 1e-7))))
  keep_all = sync is None and inner * _nbytes(first) <= 256 * _MiB  # else block on the last
  samples = []
  for r in range(repeats):
    outs = []
    t0 = time.perf_counter()
    for i in range(inner):
      out = fn(*arg_sets[(r * inner + i) % n])
      outs = outs + [out] if keep_all else [out]
    _block(outs, sync)
    samples.append((time.perf_counter() - t0) / inner)
  return first, first_s, inner, samples


def _rel_err(out, ref):
  out = jnp.asarray(out, jnp.float32)
  if not bool(jnp.all(jnp.isfinite(out))):
    return float("nan")
  return float(jnp.linalg.norm((out - ref).ravel()) / jnp.linalg.norm(ref.ravel()))


def measure_roofline(*, gpu, dtype, warmup, repeats):
  """Peak bandwidth (device copy: bytes read + written) and matmul rate, measured here."""
  dtype = jnp.dtype(dtype)
  n = (2 * _GiB if gpu else 64 * _MiB) // dtype.itemsize
  x = jax.random.uniform(jax.random.key(1), (n,), jnp.float32, 1.0, 2.0).astype(dtype)
  copy = jax.jit(lambda x: x + jnp.asarray(1, x.dtype))
  _, _, _, t = _time_calls(copy, [(x,)], warmup=warmup, repeats=max(repeats, 5))
  copy_s = statistics.median(t)
  del x
  m = 8192 if gpu else 1024
  ka, kb = jax.random.split(jax.random.key(2))
  a, b = _normal(ka, (m, m), dtype), _normal(kb, (m, m), dtype)
  _, _, _, t = _time_calls(jax.jit(jnp.matmul), [(a, b)], warmup=warmup, repeats=max(repeats, 5))
  mm_s = statistics.median(t)
  return dict(hbm_gbps=2 * n * dtype.itemsize / copy_s / 1e9, copy_bytes=2 * n * dtype.itemsize,
              copy_time_s=copy_s, matmul_tflops=2.0 * m ** 3 / mm_s / 1e12, matmul_m=m,
              matmul_dtype=dtype.name, matmul_time_s=mm_s,
              method="copy: jit(x + 1) over a 1-D array, bytes = read + written; matmul: "
                     "jit(a @ b) of two random [M, M] arrays at default precision; medians "
                     "as for the kernels")


def _metrics(case, t, roof):
  tflops, gbps = case.flops / t / 1e12, case.bytes / t / 1e9
  floor = max(tflops / roof["matmul_tflops"], gbps / roof["hbm_gbps"])
  return dict(tflops=tflops, gbps=gbps, frac_peak_flops=tflops / roof["matmul_tflops"],
              frac_peak_bw=gbps / roof["hbm_gbps"], roofline_frac=floor)


def short_error(e):
  """An exception as one line: 'Type: first line of the message' (<= 300 chars)."""
  text = f"{type(e).__name__}: {e}".strip().splitlines()
  return (text[0] if text else type(e).__name__)[:300]


def _past(deadline, margin=0.0):
  return deadline is not None and time.monotonic() + margin > deadline


def _run_case(case, env, roof, *, warmup, repeats, deadline=None):
  """-> the case's JSON entry; an implementation's failure is recorded, never raised.
  Implementations that would start past `deadline` (time.monotonic()) are skipped."""
  key = jax.random.key(zlib.crc32(case.label.encode()))
  sets = [case.make_args(key)]
  # Rotate over enough sets that the calls, taken together, do not fit the L2 cache.
  n_sets = min(_MAX_SETS, math.ceil(_ROTATE_BYTES / max(_nbytes(sets[0]), 1))) if env.gpu else 1
  sets += [case.make_args(jax.random.fold_in(key, i)) for i in range(1, n_sets)]
  entry = dict(kernel=case.kernel, label=case.label, series=case.series, context=case.context,
               shape=case.shape, flops=case.flops, bytes=case.bytes, input_sets=n_sets, impls={})

  ref, why_no_ref = None, ""
  if case.reference.temp_bytes > env.budget:
    why_no_ref = f"reference needs ~{case.reference.temp_bytes / _GiB:.1f} GiB"
  else:
    # The activations / q / k / v (env.dtype) go up to float32; stored codes and scales stay.
    up = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == env.dtype else a, sets[0])
    try:
      ref = jax.block_until_ready(jax.jit(case.reference.fn)(*up)).astype(jnp.float32)
    except Exception as e:  # noqa: BLE001
      why_no_ref = f"reference failed: {short_error(e)}"
    del up
  tol = 5e-3 if jnp.dtype(env.dtype) == jnp.float32 else 2e-2
  entry.update(rel_err_tol=tol, reference_note=why_no_ref)

  for name, impl in case.impls.items():
    rec = dict(note=impl.note) if impl.note else {}
    entry["impls"][name] = rec
    if impl.skip or impl.temp_bytes > env.budget or _past(deadline):
      rec.update(status="skipped", reason=impl.skip or (
          "time box" if _past(deadline) else
          f"needs ~{impl.temp_bytes / _GiB:.1f} GiB beyond its inputs"))
      continue
    try:
      args = [impl.prep(*s) for s in sets] if impl.prep else sets
      fn = impl.fn if impl.sync else jax.jit(impl.fn)
      out, first_s, inner, t = _time_calls(fn, args, warmup=warmup, repeats=repeats,
                                             sync=impl.sync)
      del args
      if impl.post:
        out = impl.post(out)
    except Exception as e:  # noqa: BLE001
      rec.update(status="error", error=short_error(e))
      continue
    time_s = statistics.median(t)
    rec.update(status="ok", time_s=time_s, time_min_s=min(t), time_max_s=max(t),
               inner=inner, first_call_s=first_s, **_metrics(case, time_s, roof))
    if ref is not None:
      rec["rel_err"] = _rel_err(out, ref)
      rec["numerics_ok"] = bool(rec["rel_err"] <= tol)
    del out
    if impl.sync:
      _release_torch_cache()
  ours = entry["impls"]["ours"]
  for name, rec in entry["impls"].items():
    if name != "ours" and rec.get("status") == "ok" and ours.get("status") == "ok":
      rec["ours_over_peer_time"] = ours["time_s"] / rec["time_s"]
  return entry


def _release_torch_cache():
  """Hands torch's cached blocks back to the device, so jax can use them."""
  import sys  # noqa: PLC0415
  torch = sys.modules.get("torch")
  if torch is not None and torch.cuda.is_available():
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- output


def device_slug(kind):
  return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "device"


def format_table(result):
  """A compact text table of a run_kernel_bench result."""
  roof = result["roofline"]
  lines = [f"device {result['meta']['device_kind']} | {result['meta']['dtype']} | interpret="
           f"{result['meta']['interpret']} | peak {roof['hbm_gbps']:.0f} GB/s, "
           f"{roof['matmul_tflops']:.1f} TFLOP/s (measured)",
           f"{'kernel':<7} {'shape':<44} {'ours ms':>9} {'ours':>13} {'roofl':>6} "
           f"{'rel_err':>8}  t_ours/t_peer (! = rel_err over tolerance)"]
  for kernel, entries in result["results"].items():
    unit = "TFLOP/s" if PRIMARY[kernel] == "tflops" else "GB/s"
    for e in entries:
      o = e["impls"]["ours"]
      if o.get("status") != "ok":
        lines.append(f"{kernel:<7} {e['label']:<44} {'ours ' + o.get('status', '?'):>9}  "
                     f"{o.get('error', o.get('reason', ''))[:60]}")
        continue
      err = f"{o['rel_err']:.1e}" if "rel_err" in o else "-"
      if o.get("numerics_ok") is False:
        err += "!"
      peers = []
      for name, r in e["impls"].items():
        if name == "ours" or r.get("status") == "skipped":
          continue
        bad = "!" if r.get("numerics_ok") is False else ""
        peers.append(f"{name} {r['ours_over_peer_time']:.2f}{bad}" if "ours_over_peer_time" in r
                     else f"{name} {r.get('status')}")
      lines.append(f"{kernel:<7} {e['label']:<44} {o['time_s'] * 1e3:>9.3f} "
                   f"{o[PRIMARY[kernel]]:>7.3g} {unit:<5} {o['roofline_frac']:>6.1%} {err:>8}  "
                   + ", ".join(peers))
  return "\n".join(lines)


def plot_panel(ax, result, kernel):
  """One kernel's throughput vs context on `ax`: colour = series, line style = impl."""
  import matplotlib.pyplot as plt  # noqa: PLC0415  (optional dependency)
  styles = ["-o", "--s", ":^", "-.v", "--D", ":x", "-.*"]
  metric, entries = PRIMARY[kernel], result["results"][kernel]
  series = list(dict.fromkeys(e["series"] for e in entries))
  names = list(dict.fromkeys(n for e in entries for n in e["impls"]))
  colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for si, s in enumerate(series):
    for ni, name in enumerate(names):
      pts = sorted((e["context"], e["impls"][name][metric]) for e in entries
                   if e["series"] == s and e["impls"].get(name, {}).get("status") == "ok")
      if pts:
        ax.plot(*zip(*pts), styles[ni % len(styles)], color=colours[si % len(colours)],
                label=f"{name} | {s}", markersize=4)
  peak = result["roofline"]["matmul_tflops" if metric == "tflops" else "hbm_gbps"]
  ax.axhline(peak, color="grey", lw=0.8, ls=":", label="measured peak")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("tokens M" if kernel == "qmatmul" else
                "context (keys per sequence; ragged: longest)")
  ax.set_ylabel("TFLOP/s" if metric == "tflops" else "GB/s")
  ax.set_title(kernel)
  ax.legend(fontsize=6, ncol=2)


def _plot(result, path):
  """Throughput vs context, one panel per kernel -> the path, or None when
  matplotlib is not installed."""
  try:
    import matplotlib  # noqa: PLC0415  (optional dependency)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    return None
  kernels = list(result["results"])
  cols = min(2, len(kernels))
  rows = -(-len(kernels) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(8 * cols, 5.5 * rows), squeeze=False)
  for ax in axes.flat[len(kernels):]:
    ax.set_visible(False)
  for ax, kernel in zip(axes.flat, kernels):
    plot_panel(ax, result, kernel)
  fig.suptitle(f"{result['meta']['device_kind']}, {result['meta']['dtype']}")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _check_args(kernels, shapes, repeats, warmup) -> list[str]:
  kernels = list(kernels)
  unknown = sorted(set(kernels) - set(KERNELS))
  if unknown or not kernels:
    raise ValueError(f"kernels must be a non-empty subset of {KERNELS}, got {kernels}")
  if shapes not in SHAPES:
    raise ValueError(f"shapes must be one of {SHAPES}, got {shapes!r}")
  if repeats < 1 or warmup < 0:
    raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
  return kernels


def _sweep(result: dict, env: "_Env", kernels, shapes, *, warmup, repeats, save,
           deadline=None) -> None:
  """The roofline, then every case of every kernel into `result` (saved after each).
  Cases that would start past `deadline` are listed in result["skipped"]."""
  result["roofline"] = roof = measure_roofline(gpu=env.gpu, dtype=env.dtype, warmup=warmup,
                                               repeats=repeats)
  save()
  print(f"roofline: {roof['hbm_gbps']:.1f} GB/s copy, "
        f"{roof['matmul_tflops']:.2f} TFLOP/s matmul ({env.dtype.name})", flush=True)
  # Round robin over the kernels (each one's cases most telling first), so a
  # deadline cuts every kernel's tail rather than the last kernels whole.
  queues = [[(kernel, c) for c in _BUILDERS[kernel](env, shapes)] for kernel in kernels]
  order = [q[i] for i in range(max(map(len, queues))) for q in queues if i < len(q)]
  for kernel, case in order:
    if _past(deadline, margin=5.0):
      result.setdefault("skipped", []).append(f"{kernel}: {case.label} (time box)")
      save()
      continue
    t0 = time.perf_counter()
    entry = _run_case(case, env, roof, warmup=warmup, repeats=repeats, deadline=deadline)
    result["results"][kernel].append(entry)
    save()
    o = entry["impls"]["ours"]
    took = f"{time.perf_counter() - t0:.1f}s"
    print(f"[{kernel}] {case.label}: " + (f"ours {o['time_s'] * 1e3:.3f} ms" if "time_s" in o
                                        else f"ours {o['status']}") + f" ({took})", flush=True)


def bench_env(*, dtype=None, interpret=None, peers=True):
  """-> (_Env, device) for this process's first device: dtype None = bfloat16
  on GPU, float32 elsewhere; interpret None = True iff not on GPU."""
  dev = jax.devices()[0]
  gpu = dev.platform == "gpu"
  dtype = jnp.dtype(dtype or ("bfloat16" if gpu else "float32"))
  interpret = (not gpu) if interpret is None else bool(interpret)
  limit = (dev.memory_stats() or {}).get("bytes_limit")
  env = _Env(gpu=gpu, dtype=dtype, interpret=interpret, peers=peers,
             budget=0.3 * limit if limit else 4.0 * _GiB, sms=getattr(dev, "core_count", 8))
  return env, dev


def new_result(env, dev, *, kernels, shapes, repeats, warmup) -> dict:
  """The result skeleton run_kernel_bench and sweep fill."""
  return dict(
      meta=dict(device_kind=dev.device_kind, platform=dev.platform, jax=jax.__version__,
                time=datetime.datetime.now().isoformat(timespec="seconds"),
                dtype=env.dtype.name, interpret=env.interpret, shapes=shapes,
                kernels=list(kernels), repeats=repeats, warmup=warmup, peers=env.peers,
                memory_budget_bytes=env.budget, sms=env.sms),
      conventions=CONVENTIONS, roofline={}, results={k: [] for k in kernels},
      json_path=None, plot_path=None)


def sweep(result: dict, env, *, shapes, repeats, warmup, save, deadline=None) -> dict:
  """Fills `result` (from new_result) with the roofline and every case, calling
  save() after each; cases past `deadline` (time.monotonic()) are skipped."""
  kernels = _check_args(result["results"], shapes, repeats, warmup)
  t_run = time.perf_counter()
  _sweep(result, env, kernels, shapes, warmup=warmup, repeats=repeats, save=save,
         deadline=deadline)
  result["meta"]["wall_s"] = time.perf_counter() - t_run
  save()
  return result


def plot(result, path):
  """The throughput plot of a result -> (path or None, why there is none)."""
  try:
    return _plot(result, path), "matplotlib is not installed"
  except Exception as e:  # noqa: BLE001  (the plot is optional; the JSON is already written)
    return None, f"plotting failed: {short_error(e)}"


def run_kernel_bench(*, kernels=KERNELS, shapes="default", dtype=None, interpret=None,
                     repeats=20, warmup=3, peers=True, out_dir="experiments/results"):
  """Runs the sweep, prints progress and a table, writes JSON (+ PNG) -> the result dict.

  Files: <out_dir>/kernel_bench_<device kind>_<YYYY-MM-DD>[_<kernels>].json and
  .png (the kernels are named only for a subset; a rerun on the same day overwrites).

  dtype: None = bfloat16 on GPU, float32 elsewhere. interpret: None = True iff
  not on GPU. The JSON is rewritten after every case, so a run cut short keeps
  what it measured. Paths land in result["json_path"] / result["plot_path"].
  """
  kernels = _check_args(kernels, shapes, repeats, warmup)
  env, dev = bench_env(dtype=dtype, interpret=interpret, peers=peers)
  os.makedirs(out_dir, exist_ok=True)
  # A run over a subset of the kernels names them, so it does not overwrite a full run.
  subset = "" if set(kernels) == set(KERNELS) else "_" + "-".join(kernels)
  base = os.path.join(out_dir, f"kernel_bench_{device_slug(dev.device_kind)}_"
                               f"{datetime.date.today():%Y-%m-%d}{subset}")
  result = new_result(env, dev, kernels=kernels, shapes=shapes, repeats=repeats, warmup=warmup)
  result["json_path"] = base + ".json"

  def save():
    with open(result["json_path"], "w") as f:
      json.dump(result, f, indent=1)

  sweep(result, env, shapes=shapes, repeats=repeats, warmup=warmup, save=save)
  result["plot_path"], why_no_plot = plot(result, base + ".png")
  save()
  print("\n" + format_table(result))
  print(f"\nwrote {result['json_path']}" + (
      f" and {result['plot_path']}" if result["plot_path"] else f" (no plot: {why_no_plot})"))
  return result
