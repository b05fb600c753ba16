"""The kernel bench's MoE grouped-matmul cases ("gmm", `kernels`): jax's
`ragged_dot_mgpu` through `ops.grouped_matmul`, our Mosaic expert kernel
(`ops.mosaic_experts`: one weight, the fused gate-up, GPT-OSS's MXFP4
gate-up against Triton's quantized grouped kernel), XLA's `ragged_dot`,
tokamax's `ragged_dot`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from benchlib.kernel_case import (Case, Impl, gpu_peer, mosaic_skip as _mosaic_skip,
                                  normal as _normal,
                                  random_codes as _random_codes,
                                  random_scales as _random_scales)
from jaxinfer import ops
from jaxinfer.backend import Backend


def _gmm_args(env, key, M, E, In, Out):
  """x [M, In], w [E, In, Out], group sizes: M rows over E experts at random."""
  kx, kw, kg = jax.random.split(key, 3)
  cuts = jnp.sort(jax.random.randint(kg, (E - 1,), 0, M + 1))
  sizes = jnp.diff(jnp.concatenate([jnp.zeros((1,), cuts.dtype), cuts,
                                    jnp.full((1,), M, cuts.dtype)])).astype(jnp.int32)
  return _normal(kx, (M, In), env.dtype), _normal(kw, (E, In, Out), env.dtype) * 0.05, sizes


def _gmm_case(env, *, name, M, E, In, Out):
  """MoE grouped matmul: M routed rows sorted over E experts (random sizes)
  times w [E, In, Out]."""
  item = jnp.dtype(env.dtype).itemsize

  make_args = lambda key: _gmm_args(env, key, M, E, In, Out)
  mosaic = Backend(target="gpu" if env.gpu else "cpu", grouped_matmul="mosaic")
  tiling, why = ops.mosaic_grouped_matmul((M, In), (E, In, Out), env.dtype, env.dtype)
  impls = {"ours": Impl(lambda x, w, g: ops.grouped_matmul(x, w, g, backend=mosaic),
                        skip=_mosaic_skip(env, None if tiling else (ValueError, why))
                        if env.gpu else "",
                        note="jax's ragged_dot_mgpu through ops.grouped_matmul (CPU: XLA)")}
  why = ops.mosaic_experts_fit(env.dtype, (E, In, Out), env.dtype)
  impls["ours_mosaic_experts"] = Impl(
      lambda x, w, g: ops.mosaic_experts(x, w, g, backend=mosaic),
      skip=_mosaic_skip(env, None if why is None else (ValueError, why)),
      note="our Mosaic expert kernel (the fused_experts trial's) on one plain weight")
  if env.peers:
    impls["xla_ragged_dot"] = Impl(jax.lax.ragged_dot, note="XLA's ragged_dot")
    tokamax, why = gpu_peer(env, "tokamax")
    impls["tokamax_mosaic"] = Impl(
        tokamax and (lambda x, w, g: tokamax.ragged_dot(x, w, g, implementation="mosaic")),
        skip=why, note="tokamax's Mosaic GPU ragged_dot (Backend grouped_matmul 'tokamax')")
  reference = Impl(lambda x, w, g: jax.lax.ragged_dot(x, w, g), temp_bytes=4.0 * M * Out)
  return Case(kernel="gmm", label=f"{name}: M{M} E{E} {In}->{Out}", series=name, context=M,
              shape=dict(M=M, E=E, In=In, Out=Out), flops=2.0 * M * In * Out,
              bytes=item * (E * In * Out + M * (In + Out)), make_args=make_args, impls=impls,
              reference=reference)


def _gmm_fused_case(env, *, name, M, E, In, Out):
  """The experts' gate-up: silu(x W_g) * (x W_u) for M rows over E experts,
  w [E, In, Out] twice: "ours" two grouped matmuls (ragged_dot_mgpu on
  Hopper) then the GLU, "ours_mosaic_experts" our kernel fused (x read
  once, the [M, 2 Out] product never in HBM)."""
  item = jnp.dtype(env.dtype).itemsize

  def make_args(key):
    x, w, sizes = _gmm_args(env, key, M, E, In, Out)
    return x, w, _normal(jax.random.fold_in(key, 1), (E, In, Out), env.dtype) * 0.05, sizes

  mosaic = Backend(target="gpu" if env.gpu else "cpu", grouped_matmul="mosaic")
  gmm = lambda x, w, g: ops.grouped_matmul(x, w, g, backend=mosaic)
  why = ops.mosaic_experts_fit(env.dtype, (E, In, Out), env.dtype)
  impls = {"ours": Impl(lambda x, wg, wu, g: jax.nn.silu(gmm(x, wg, g)) * gmm(x, wu, g),
                        note="two ops.grouped_matmul calls (ragged_dot_mgpu), then the GLU"),
           "ours_mosaic_experts": Impl(
               lambda x, wg, wu, g: ops.mosaic_experts(x, wg, g, up=wu, backend=mosaic),
               skip=_mosaic_skip(env, None if why is None else (ValueError, why)),
               note="our Mosaic expert kernel, gate and up fused")}
  rd = jax.lax.ragged_dot
  if env.peers:
    impls["xla_ragged_dot"] = Impl(lambda x, wg, wu, g: jax.nn.silu(rd(x, wg, g)) * rd(x, wu, g),
                                   note="XLA's ragged_dot twice, then the GLU")
  reference = Impl(lambda x, wg, wu, g: jax.nn.silu(rd(x, wg, g)) * rd(x, wu, g),
                   temp_bytes=12.0 * M * Out)
  return Case(kernel="gmm", label=f"{name}: M{M} E{E} {In}->2x{Out} fused", series=name,
              context=M, shape=dict(M=M, E=E, In=In, Out=Out, fused=True),
              flops=4.0 * M * In * Out, bytes=item * (2 * E * In * Out + M * (In + Out)),
              make_args=make_args, impls=impls, reference=reference)


def _gmm_mxfp4_case(env, *, name, M, E, In, Out):
  """GPT-OSS's gate-up on its experts as published (MXFP4, E8M0 scales per
  32 values): "ours" the Pallas (Triton) quantized grouped kernel twice, then
  the GLU; "ours_mosaic_experts" our Mosaic kernel, fused."""
  block, item = (1, 32), jnp.dtype(env.dtype).itemsize

  def make_args(key):
    x, _, sizes = _gmm_args(env, key, M, E, In, Out)
    kg, ku, ksg, ksu = jax.random.split(jax.random.fold_in(key, 2), 4)
    codes = lambda k: _random_codes(k, (E, Out, In // 2), jnp.dtype(jnp.uint8))
    scales = lambda k: _random_scales(k, (E, Out, In // 32), jnp.dtype(jnp.uint8))
    return x, codes(kg), scales(ksg), codes(ku), scales(ksu), sizes

  interp = not env.gpu
  qgmm = lambda x, c, s, g: pk.quantized_grouped_matmul(x, c, s, g, block=block, packed="e2m1",
                                                        interpret=interp)
  deq = lambda c, s: pk.dequantize_reference(c, s, block=block, packed="e2m1")  # [E, Out, In]
  rd = lambda x, c, s, g: jax.lax.ragged_dot(x, jnp.swapaxes(deq(c, s), 1, 2).astype(x.dtype), g)
  why = ops.mosaic_experts_fit(env.dtype, (E, Out, In // 2), jnp.uint8, block, "e2m1")
  backend = Backend(target="gpu" if env.gpu else "cpu", grouped_matmul="mosaic")
  impls = {"ours": Impl(lambda x, cg, sg, cu, su, g: jax.nn.silu(qgmm(x, cg, sg, g))
                        * qgmm(x, cu, su, g),
                        note="the Pallas (Triton) quantized grouped kernel twice, then the GLU"),
           "ours_mosaic_experts": Impl(
               lambda x, cg, sg, cu, su, g: ops.mosaic_experts(
                   x, cg, g, scale=sg, block=block, packed="e2m1", up=cu, up_scale=su,
                   backend=backend),
               skip=_mosaic_skip(env, None if why is None else (ValueError, why)),
               note="our Mosaic expert kernel, MXFP4 gate and up fused")}
  if env.peers:
    impls["xla_dequant_ragged_dot"] = Impl(
        lambda x, cg, sg, cu, su, g: jax.nn.silu(rd(x, cg, sg, g)) * rd(x, cu, su, g),
        temp_bytes=8.0 * E * In * Out, note="dequantize in XLA, then ragged_dot twice")
  reference = Impl(lambda x, cg, sg, cu, su, g: jax.nn.silu(rd(x, cg, sg, g)) * rd(x, cu, su, g),
                   temp_bytes=8.0 * E * In * Out + 12.0 * M * Out)
  return Case(kernel="gmm", label=f"{name}: M{M} E{E} {In}->2x{Out} MXFP4 fused", series=name,
              context=M, shape=dict(M=M, E=E, In=In, Out=Out, fused=True, method="mxfp4"),
              flops=4.0 * M * In * Out,
              bytes=2 * E * Out * In * (0.5 + 1 / 32) + item * M * (In + Out),
              make_args=make_args, impls=impls, reference=reference)


def gmm_cases(env, shapes):
  if shapes == "tiny":
    specs = [dict(name="tiny", M=40, E=4, In=64, Out=128)]
  else:  # DeepSeek-V3 under EP 8 (32 local experts), GPT-OSS-120B's 128 experts
    specs = [dict(name="dsv3_ep8_up", M=M, E=32, In=7168, Out=2048) for M in (256, 4096)]
    specs += [dict(name="dsv3_ep8_down", M=4096, E=32, In=2048, Out=7168),
              dict(name="gptoss_up", M=4096, E=128, In=2880, Out=2880)]
  fused = [dict(name=f"{s['name']}_gate_up", **{k: s[k] for k in ("M", "E", "In", "Out")})
           for s in specs if s["name"].endswith(("tiny", "_up"))]
  mxfp4 = ([dict(name="tiny_mxfp4_gate_up", M=40, E=4, In=64, Out=128)] if shapes == "tiny" else
           [dict(name="gptoss_mxfp4_gate_up", M=M, E=128, In=2880, Out=2880) for M in (64, 4096)])
  return ([_gmm_case(env, **s) for s in specs] + [_gmm_fused_case(env, **s) for s in fused]
          + [_gmm_mxfp4_case(env, **s) for s in mxfp4])
