"""Each kernel's cases for the kernel benchmarks (`benchlib.kernels`): its
shapes, the kernel ("ours", and its variants), the peers that can run here
and the float32 reference, as `kernel_case.Case` values. `BUILDERS` maps a
kernel name (`kernels.KERNELS`) to its builder, `builder(env, shapes)` ->
cases; `Env` is what a builder asks of the run (GPU or not, dtype, memory
budget, cores). `page_tables` and `split_count` are shared with
`mosaic_tune.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from benchlib.kernel_case import (Case, Impl, gpu_peer, mosaic_skip as _mosaic_skip,
                                  normal as _normal,
                                  random_codes as _random_codes,
                                  random_scales as _random_scales)
from benchlib.kernel_gmm import gmm_cases
from pallas_kernels import mosaic_mla_attention as mma
from pallas_kernels import mosaic_mla_ragged as mmr
from pallas_kernels import mosaic_paged_attention as mpa
from pallas_kernels import mosaic_ragged_attention as mra
from pallas_kernels import mosaic_wide_attention as mwa
from jaxinfer.models import quant

CONTEXTS = (512, 2048, 8192, 32768)


@dataclasses.dataclass(frozen=True)
class Env:
  gpu: bool
  dtype: Any
  interpret: bool
  peers: bool
  budget: float  # bytes a peer or reference may allocate beyond its inputs
  sms: int  # programs are sized for this many cores


def split_count(env, programs, pages_per_seq):
  """Split-K ways giving ~2 programs per SM (power of two <= 16 and <= the pages)."""
  want, n = -(-2 * env.sms // programs), 1
  while n < want and n < 16 and 2 * n <= pages_per_seq:
    n *= 2
  return n


def page_tables(key, lengths, page_size):
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
    tokamax, why = gpu_peer(env, "tokamax")
    for impl in ("mosaic", "triton"):
      fn = tokamax and functools.partial(tokamax.dot_product_attention, is_causal=causal,
                                         implementation=impl)
      impls[f"tokamax_{impl}"] = Impl(fn, skip=why)
    mha, why = gpu_peer(env, "jax.experimental.pallas.ops.gpu.attention")
    repeat = lambda q, k, v: (q, jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2))
    impls["jax_pallas_mha"] = Impl(
        lambda q, k, v: mha.mha(q, k, v, None, scale, causal), prep=repeat, skip=why,
        note="K/V repeated to N heads outside the timed call" if N != K else "")
    fa3, why = gpu_peer(env, "jax.experimental.pallas.ops.gpu.attention_mgpu")
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
  torch, why = gpu_peer(env, "torch")
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
    tables, P = page_tables(kt, lengths, ps)
    q = _normal(kq, (B, N, D) if Q == 1 else (B, Q, N, D), env.dtype)
    return (q, _normal(kk, (K, P, ps, D), env.dtype), _normal(kv, (K, P, ps, D), env.dtype),
            jnp.asarray(lengths, jnp.int32), tables)

  ours = functools.partial(pk.paged_attention, interpret=env.interpret)
  splits = split_count(env, B * K, pps)
  impls = {"ours": Impl(ours)}
  if splits > 1:
    impls["ours_split"] = Impl(functools.partial(ours, num_splits=splits),
                               note=f"num_splits={splits}")
  mosaic_splits = split_count(env, B * K, -(-pps // mpa.pages_per_block(ps)))
  impls["ours_mosaic"] = Impl(
      functools.partial(mpa.mosaic_paged_attention, num_splits=mosaic_splits),
      skip=_mosaic_skip(env, mpa.unsupported((B, Q, N, D), env.dtype, (K, 1, ps, D),
                                              values_dim=D)),
      note=f"Mosaic GPU (TMA + wgmma), num_splits={mosaic_splits}")
  temp = 2 * f32_kv + 3 * 4.0 * B * N * Q * pps * ps
  if env.peers:
    impls["xla_reference"] = Impl(pk.paged_attention_reference, temp_bytes=temp,
                                  note="pure jnp, float32 compute")
    mod, why = gpu_peer(env, "jax.experimental.pallas.ops.gpu.paged_attention")
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
    tables, P = page_tables(kt, lengths, ps)
    return (_normal(kq, (B, N, R), env.dtype), _normal(kr, (B, N, Hr), env.dtype),
            _normal(kp, (P, ps, R + Hr), env.dtype), jnp.asarray(lengths, jnp.int32), tables)

  ours = functools.partial(pk.mla_paged_attention, sm_scale=scale, interpret=env.interpret)
  splits = split_count(env, B, pps)
  impls = {"ours": Impl(ours)}
  if splits > 1:
    impls["ours_split"] = Impl(functools.partial(ours, num_splits=splits),
                               note=f"num_splits={splits}")
  # Rows: N heads in blocks of 64; split-K to about two programs per SM.
  mosaic_splits = split_count(env, B * -(-N // mpa.ROWS), -(-S // mma.KEYS))
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
    tables, P = page_tables(kt, lengths, ps)
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
    tables, P = page_tables(kt, lengths, ps)
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


BUILDERS = {"flash": _flash_cases, "paged": _paged_cases, "mla": _mla_cases,
             "ragged": _ragged_cases, "qmatmul": _qmatmul_cases, "gmm": gmm_cases}
