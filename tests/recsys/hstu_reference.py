"""An independent float64 NumPy DlrmHSTU, one user at a time (no packing).

Written from the equations (Zhai et al. 2024, eqs. 1-3; the reference
implementation's masks and biases as `jaxinfer/recsys/hstu.py`'s docstring
states them), with explicit per-user loops: nothing here is shared with the
JAX code but the param tree's names.
"""

import math

import numpy as np


def silu(x):
  return x / (1.0 + np.exp(-x))


def layer_norm(x, w=None, b=None, eps=1e-6):
  mu = x.mean(-1, keepdims=True)
  y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
  return y if w is None else y * w + b


def user_tokens(cfg, tables, user):
  """x [n, D], positions clamped to the first candidate's, timestamps [n]."""
  ctx = sum(tables[f"user_{f}"][list(user.features[f])].sum(0) if len(user.features[f])
            else np.zeros(cfg.embed_dim) for f in range(len(cfg.user_feature_rows)))
  hist = [tables["items"][i] + tables["actions"][a] for i, a in zip(user.items, user.actions)]
  cand = [tables["items"][c] + tables["actions"][0] for c in user.candidates]
  x = np.stack([ctx, *hist, *cand])
  n, h = len(x), 1 + len(user.items)
  pos = np.minimum(np.arange(n), h)
  first = user.timestamps[0] if len(user.items) else user.query_time
  ts = np.array([first, *user.timestamps, *[user.query_time] * len(user.candidates)], np.float64)
  return x, pos, ts


def bucket(cfg, dt):
  return int(min(max(math.floor(math.log(max(abs(dt), 1.0)) / 0.301), 0), cfg.time_buckets))


def layer(cfg, p, x, pos, ts):
  n = len(x)
  N, A, H = cfg.num_heads, cfg.qk_dim, cfg.v_dim
  uvqk = silu(layer_norm(x, p["in_norm_w"], p["in_norm_b"]) @ p["w_uvqk"] + p["b_uvqk"])
  u = uvqk[:, :N * H]
  v = uvqk[:, N * H:2 * N * H].reshape(n, N, H)
  q = uvqk[:, 2 * N * H:2 * N * H + N * A].reshape(n, N, A)
  k = uvqk[:, 2 * N * H + N * A:].reshape(n, N, A)
  attn = np.zeros((n, N, H))
  for i in range(n):
    for j in range(n):
      if not (pos[i] > pos[j] or i == j):
        continue
      rab = p["pos_bias"][min(pos[i] - pos[j], cfg.max_seq_len - 1)] + p["time_bias"][
          bucket(cfg, ts[i] - ts[j])]
      for hd in range(N):
        s = q[i, hd] @ k[j, hd] / math.sqrt(A) + rab
        attn[i, hd] += silu(s) / cfg.max_seq_len * v[j, hd]
  y = (layer_norm(attn.reshape(n, N * H)) * u) @ p["w_o"] + p["b_o"]
  return x + y


def score_user(cfg, params, user):
  """Logits [num candidates] of one user, float64."""
  P = to64(params)
  x, pos, ts = user_tokens(cfg, P["tables"], user)
  for l in range(cfg.num_layers):
    x = layer(cfg, {k: v[l] for k, v in P["layers"].items()}, x, pos, ts)
  h = layer_norm(x, P["out_norm_w"], P["out_norm_b"])
  c = len(user.candidates)
  hc = h[len(h) - c:]
  e = P["tables"]["items"][list(user.candidates)]
  hp = P["head"]
  z = silu(np.concatenate([hc, e], -1) @ hp["w1"] + hp["b1"])
  return (z @ hp["w2"] + hp["b2"])[:, 0]


def to64(tree):
  if isinstance(tree, dict):
    return {k: to64(v) for k, v in tree.items()}
  return np.asarray(tree, np.float64)
