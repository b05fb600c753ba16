"""HSTU (Zhai et al. 2024) over packed jagged tokens, and DLRMv3's candidate head.

Each layer, on the packed tokens x [T, D] (residual stream):

  U, V, Q, K = split(SiLU(LayerNorm(x) W_uvqk + b_uvqk))      # f1, phi1
  s_ij       = alpha q_i . k_j + rab_l(i, j)                  # per head
  A_i        = sum_j mask(i, j) SiLU(s_ij) / n * v_j          # pointwise, not softmax
  x         += (LayerNorm(A) * U) W_o + b_o                   # f2, residual

- n is cfg.max_seq_len (a constant: a user's scores never depend on the
  batch); alpha = 1/sqrt(qk_dim) as DLRMv3's STU; LayerNorm(A) is over the
  concatenated heads, without learned params (the reference's
  `_norm_attn_output`).
- rab_l(i, j) = pos_bias_l[p_i - p_j] + time_bias_l[bucket(t_i - t_j)], shared
  by the heads (the reference's `RelativeBucketedTimeAndPositionBasedBias`);
  bucket(dt) = floor(ln(max(|dt|, 1)) / 0.301) clipped to time_buckets. The
  query timestamp is the token's own (the original pairs t_{i+1} with t_j).
- mask (the reference's `_get_valid_attn_mask` with num_targets): i and j
  belong to the same user and, with positions clamped to the first candidate's
  (p -> min(p, len - num_targets)), p_i > p_j or i == j. History is causal;
  a candidate sees the whole history and itself, never another candidate, so
  its score does not depend on the other candidates. The same clamped
  positions index pos_bias.

Tokens are one user's contextual token (its pooled sparse features:
`tables.pooled`), history tokens (item + action rows) and candidate tokens
(item + the "unknown" action 0). A final LayerNorm, then the head scores a
candidate c: logit = w2 . SiLU([h_c, e_c] W1 + b1) + b2, with e_c its item row.

The attention is `ops.hstu_attention` under cfg.backend: the jagged Pallas
kernel (`pallas_kernels.hstu_attention`) on GPU, a dense [T, T] XLA form
elsewhere. Padding tokens (past offsets[B]) form one padding user.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxinfer import ops
from jaxinfer.recsys import tables as tables_lib
from jaxinfer.recsys.batch import JaggedBatch
from jaxinfer.recsys.config import HSTUConfig

_LN_EPS = 1e-6


def layer_norm(x, w=None, b=None):
  """LayerNorm over the last axis, in float32."""
  x = x.astype(jnp.float32)
  mu = jnp.mean(x, -1, keepdims=True)
  var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
  y = (x - mu) * lax.rsqrt(var + _LN_EPS)
  return y if w is None else y * w + b


def token_layout(batch: JaggedBatch):
  """Per token: user (segment, B for padding), clamped position -> ([T], [T])."""
  offsets = batch.offsets
  T, B = batch.item_ids.shape[0], batch.num_targets.shape[0]
  t = jnp.arange(T, dtype=jnp.int32)
  seg = jnp.searchsorted(offsets, t, side="right").astype(jnp.int32) - 1  # B past the users
  pos = t - offsets[seg]
  history = jnp.concatenate([jnp.diff(offsets) - batch.num_targets, jnp.full((1,), T, jnp.int32)])
  return seg, jnp.minimum(pos, history[seg])


def hstu_layer(cfg: HSTUConfig, p: dict, x, seg, cpos, timestamps):
  """One HSTU layer on x [T, D] with its params p (one slice of the stacked layers)."""
  T = x.shape[0]
  N, A, H = cfg.num_heads, cfg.qk_dim, cfg.v_dim
  dt = jnp.dtype(cfg.dtype)
  h = layer_norm(x, p["in_norm_w"], p["in_norm_b"]).astype(dt)
  uvqk = jax.nn.silu(jnp.dot(h, p["w_uvqk"], preferred_element_type=jnp.float32,
                             precision=lax.Precision.HIGHEST) + p["b_uvqk"])
  u, v, q, k = jnp.split(uvqk, [N * H, 2 * N * H, 2 * N * H + N * A], axis=-1)
  attn = ops.hstu_attention(
      q.reshape(T, N, A).astype(dt), k.reshape(T, N, A).astype(dt), v.reshape(T, N, H).astype(dt),
      segment_ids=seg, positions=cpos, timestamps=timestamps, pos_bias=p["pos_bias"],
      time_bias=p["time_bias"], alpha=cfg.alpha, n=cfg.max_seq_len, backend=cfg.backend)
  o = (layer_norm(attn.reshape(T, N * H).astype(jnp.float32)) * u).astype(dt)
  y = jnp.dot(o, p["w_o"], preferred_element_type=jnp.float32,
              precision=lax.Precision.HIGHEST) + p["b_o"]
  return (x.astype(jnp.float32) + y).astype(x.dtype)


def embed(cfg: HSTUConfig, tables, batch: JaggedBatch):
  """Token embeddings [T, D] and the candidates' item rows [C, D] (float32)."""
  names = {"items": batch.item_ids, "actions": batch.action_ids}
  for f in range(len(cfg.user_feature_rows)):
    names[f"user_{f}"] = batch.feature_ids[f]
  rows = tables_lib.lookup_many(tables, names)
  B = batch.num_targets.shape[0]
  ctx = sum(tables_lib.pooled(rows[f"user_{f}"], batch.feature_offsets[f], B)
            for f in range(len(cfg.user_feature_rows)))  # [B, D]
  seg, _ = token_layout(batch)
  is_ctx = jnp.arange(seg.shape[0]) == batch.offsets[jnp.minimum(seg, B - 1)]
  ctx_tok = jnp.concatenate([ctx, jnp.zeros_like(ctx[:1])])[seg]
  x = jnp.where(is_ctx[:, None], ctx_tok, rows["items"] + rows["actions"])
  return x, rows["items"][batch.target_index]


def forward(cfg: HSTUConfig, params: dict, batch: JaggedBatch):
  """The trunk: final hidden states [T, D] (float32) of every packed token."""
  x, _ = embed(cfg, params["tables"], batch)
  return _trunk(cfg, params, x, batch)


def _trunk(cfg: HSTUConfig, params, x, batch):
  seg, cpos = token_layout(batch)

  def body(x, p):
    return hstu_layer(cfg, p, x, seg, cpos, batch.timestamps), None

  x, _ = lax.scan(body, x.astype(jnp.float32), params["layers"])
  return layer_norm(x, params["out_norm_w"], params["out_norm_b"])


def score(cfg: HSTUConfig, params: dict, batch: JaggedBatch):
  """Candidate logits [C] (float32; sigmoid for the click probability) of a
  batch as `batch.pack` makes it (checked on the host: `batch.validate`)."""
  x, cand_rows = embed(cfg, params["tables"], batch)
  h = _trunk(cfg, params, x, batch)[batch.target_index]
  hp = params["head"]
  z = jnp.concatenate([h, cand_rows.astype(jnp.float32)], -1)
  z = jax.nn.silu(jnp.dot(z, hp["w1"].astype(jnp.float32), precision=lax.Precision.HIGHEST)
                  + hp["b1"])
  return (jnp.dot(z, hp["w2"].astype(jnp.float32), precision=lax.Precision.HIGHEST)
          + hp["b2"])[:, 0]
