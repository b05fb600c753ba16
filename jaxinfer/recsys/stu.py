"""DLRMv3's STU layers (generative-recommenders' `STULayer` / `STUStack`) over
users packed on one token axis.

One layer on the packed tokens x [T, D] (the residual stream), with
generative-recommenders' inference form (no dropout):

  U, V, Q, K = split(LayerNorm(x; w_in, b_in) W_uvqk + b_uvqk)     # [NH, NH, NA, NA]
  U          = SiLU(U)                             # SiLU on U only: not on V, Q or K
  A_i        = sum_j mask(i, j) SiLU(alpha q_i . k_j) / n * v_j     # per head, no softmax
  x         += concat(U, A, U * LayerNorm(A; w_out, b_out)) W_out   # no bias

- LayerNorm eps 1e-6 (both); LayerNorm(A) spans the concatenated heads [NH]
  (use_group_norm False), with its learned weight and bias.
- alpha = 1/sqrt(attn_qk_dim). No relative attention bias (the STULayer that
  DlrmHSTU builds has none).
- n is the batch's padded length, as `pytorch_hstu_mha` and the Triton kernel
  divide by their max_seq_len argument: DlrmHSTU passes max(history) +
  max(candidates) + 1 (the contextual token) over the batch's users. It is a
  traced value (`DlrmBatch.n`), so one compiled program serves batches of any
  such length: the attention runs with n = 1 and its output is divided by n.
- mask (`_get_valid_attn_mask`, causal, target-aware, contextual_seq_len 0):
  i and j are the same user's and, with positions clamped at the first
  candidate (p -> min(p, len - num_candidates)), p_i > p_j or i == j. The
  contextual token is position 0, an ordinary causal token; a candidate sees
  the contextual token, the history and itself, never another candidate.

The attention is `ops.hstu_attention` (the jagged Pallas kernel on GPU, the
dense XLA form elsewhere) with zero (absent) relative-bias tables.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxinfer import ops
from jaxinfer.recsys.dlrm_config import DlrmV3Config

STU_LN_EPS = 1e-6


def layer_norm(x, w, b, eps: float):
  """LayerNorm over the last axis in float32, with learned weight and bias."""
  x = x.astype(jnp.float32)
  mu = jnp.mean(x, -1, keepdims=True)
  var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
  return (x - mu) * lax.rsqrt(var + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)


def dot(cfg: DlrmV3Config, x, w):
  """x @ w with inputs in cfg.dtype, accumulated in float32."""
  dt = jnp.dtype(cfg.dtype)
  return jnp.dot(x.astype(dt), w.astype(dt), preferred_element_type=jnp.float32,
                 precision=lax.Precision.HIGHEST)


def token_layout(offsets, num_candidates, num_tokens: int):
  """Per packed token -> dict of [T] int32 arrays: user (B past the users),
  local (index inside its user: 0 is the contextual token), high (its user's
  length - candidates: the first candidate's index), mask_pos (local clamped
  at high) and attn_user (the user; padding tokens each one of their own)."""
  B = num_candidates.shape[0]
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  user = jnp.minimum(jnp.searchsorted(offsets, t, side="right").astype(jnp.int32) - 1, B)
  local = t - offsets[user]
  lengths = jnp.concatenate([jnp.diff(offsets), jnp.full((1,), num_tokens + 1, jnp.int32)])
  nc = jnp.concatenate([num_candidates, jnp.zeros((1,), jnp.int32)])
  high = (lengths - nc)[user]
  return {"user": user, "local": local, "high": high, "mask_pos": jnp.minimum(local, high),
          "attn_user": jnp.where(user < B, user, B + local)}


def stu_layer(cfg: DlrmV3Config, p: dict, x, attn_user, mask_pos, n):
  """One STU layer on x [T, D] (float32) with p one layer's slice of params["stu"];
  n the batch's traced 1/n denominator (module docstring) -> [T, D] float32."""
  T = x.shape[0]
  N, A, H = cfg.num_heads, cfg.attn_qk_dim, cfg.attn_linear_dim
  dt = jnp.dtype(cfg.dtype)
  h = layer_norm(x, p["in_norm_w"], p["in_norm_b"], STU_LN_EPS)
  uvqk = dot(cfg, h, p["uvqk_w"]) + p["uvqk_b"].astype(jnp.float32)
  u, v, q, k = jnp.split(uvqk, [N * H, 2 * N * H, 2 * N * H + N * A], axis=-1)
  u = jax.nn.silu(u)
  zeros = jnp.zeros((1,), jnp.float32)  # no relative bias: rab == 0 exactly
  attn = ops.hstu_attention(
      q.reshape(T, N, A).astype(dt), k.reshape(T, N, A).astype(dt),
      v.reshape(T, N, H).astype(dt), segment_ids=attn_user, positions=mask_pos,
      timestamps=jnp.zeros((T,), jnp.int32), pos_bias=zeros, time_bias=zeros,
      alpha=cfg.alpha, n=1.0, backend=cfg.backend)
  attn = attn.reshape(T, N * H).astype(jnp.float32) / n.astype(jnp.float32)
  y = u * layer_norm(attn, p["out_norm_w"], p["out_norm_b"], STU_LN_EPS)
  return x + dot(cfg, jnp.concatenate([u, attn, y], -1), p["out_w"])


def stu_stack(cfg: DlrmV3Config, layers: dict, x, layout: dict, n):
  """The STU stack (params["stu"], stacked [L, ...]) over x [T, D] -> [T, D]
  float32; layout from `token_layout`, n the batch's [] int32 denominator."""
  def body(x, p):
    return stu_layer(cfg, p, x, layout["attn_user"], layout["mask_pos"], n), None

  x, _ = lax.scan(body, x.astype(jnp.float32), layers)
  return x
