"""An independent float64 NumPy DlrmHSTU (MLPerf DLRMv3's reference model), one
user at a time, with explicit loops: no packing, nothing shared with
`jaxinfer.recsys` but the reference's state-dict names.

Written from generative-recommenders' PyTorch modules (inference: no dropout)
and read off a DlrmHSTU state dict `sd` {key: array} in the reference's own
layouts (nn.Linear weights [out, in]; the STU's [in, out]); the action
weights and the time periods come from the module's registered buffers, as
the torch modules read them. hp: num_heads, linear_dim, qk_dim,
min_uih_length (contextual_feature_to_min_uih_length["user_id"]).

Two quantities the reference computes in float32 are computed in float32 here
too, because they are floors of float32 values: the time bucket
(`pytorch_add_timestamp_positional_embeddings`: int64 difference -> float32
by `clamp(min=1e-6)`) and the time features' period counts
(`TimestampLayerNormPostprocessor`: int64 timestamps / float32 buffers).
"""

from __future__ import annotations

import numpy as np

EMB = "_embedding_collection.embeddings."
PRE = "_hstu_transducer._input_preprocessor."
POS = "_hstu_transducer._positional_encoder."
STU = "_hstu_transducer._stu_module._stu_layers."
POST = "_hstu_transducer._output_postprocessor."
ITEM = "_item_embedding_mlp."
PRED = "_multitask_module._prediction_module."


def f64(sd, key):
  return np.asarray(sd[key], np.float64)


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def silu(x):
  return x * sigmoid(x)


def layer_norm(x, w, b, eps):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * w + b


def linear(sd, prefix, x):
  """torch.nn.Linear: x W^T + b."""
  return x @ f64(sd, prefix + "weight").T + f64(sd, prefix + "bias")


def mlp(sd, prefix, x, final_norm=True):
  """Sequential(Linear, SwishLayerNorm, Linear[, LayerNorm]); eps 1e-5."""
  h = linear(sd, prefix + "0.", x)
  h = h * sigmoid(layer_norm(h, f64(sd, prefix + "1.weight"), f64(sd, prefix + "1.bias"), 1e-5))
  y = linear(sd, prefix + "2.", h)
  if final_norm:
    y = layer_norm(y, f64(sd, prefix + "3.weight"), f64(sd, prefix + "3.bias"), 1e-5)
  return y


def action_embedding(sd, bitmask):
  weights = np.asarray(sd[PRE + "_action_encoder._combined_action_weights"])
  table = f64(sd, PRE + "_action_encoder._action_embedding_table")
  return np.concatenate([table[k] * float((int(bitmask) & int(w)) > 0)
                         for k, w in enumerate(weights)])


def preprocess_user(sd, hp, r):
  """ContextualPreprocessor for one request -> [1 + h + c, D] (contextual first)."""
  h, c = len(r.item_ids), len(r.candidate_ids)
  items = np.concatenate([r.item_ids, r.candidate_ids]).astype(int)
  cats = np.concatenate([r.category_ids, r.candidate_category_ids]).astype(int)
  out = (mlp(sd, PRE + "_content_embedding_mlp.", f64(sd, EMB + "item_id.weight")[items])
         + mlp(sd, PRE + "_additional_embedding_mlp.",
               f64(sd, EMB + "item_category_id.weight")[cats]))
  target = f64(sd, PRE + "_action_encoder._target_action_embedding_table")[0]
  acts = [action_embedding(sd, r.action_weights[i]) for i in range(h)] + [target] * c
  if acts:
    out = out + mlp(sd, PRE + "_action_embedding_mlp.", np.stack(acts))
  user = f64(sd, EMB + "user_id.weight")[int(r.user_id)]
  gate = 1.0 if h + c >= hp["min_uih_length"] else 0.0
  ctx = (gate * user) @ f64(sd, PRE + "_batched_contextual_linear_weights")[0]
  ctx = ctx + f64(sd, PRE + "_batched_contextual_linear_bias")[0]
  return np.concatenate([ctx[None], out.reshape(h + c, -1)])


def user_timestamps(r):
  """The contextual token's 0, the history's, the candidates' query time."""
  c = len(r.candidate_ids)
  return [0] + [int(t) for t in r.timestamps] + [int(r.query_time)] * c


def time_bucket(query, t, num_buckets):
  dt = np.float32(query - t)  # torch: int64 -> float32 by clamp(min=1e-6)
  dt = np.maximum(dt, np.float32(1e-6)) / np.float32(60.0)
  return int(min(max(int(np.sqrt(dt)), 0), num_buckets))


def positional_user(sd, x, r):
  """HSTUPositionalEncoder (contextual_seq_len 1) on one user's x [L, D]."""
  pos_table = f64(sd, POS + "_position_embeddings_weight")
  time_table = f64(sd, POS + "_timestamp_embeddings_weight")
  L, D = x.shape
  high = L - len(r.candidate_ids)
  ts = user_timestamps(r)
  query = ts[L - 1]
  out = np.empty_like(x)
  for i in range(L):
    p = 0 if i == 0 else min(high - min(i, high) + 1, pos_table.shape[0] - 1)
    b = time_bucket(query, ts[i], time_table.shape[0] - 1)
    out[i] = x[i] * np.sqrt(D) + time_table[b] + pos_table[p]
  return out


def stu_layer_user(sd, hp, layer, x, num_candidates, n):
  """One STULayer on one user's x [L, D]; n the batch's max_seq_len."""
  p = f"{STU}{layer}."
  N, H, A = hp["num_heads"], hp["linear_dim"], hp["qk_dim"]
  L = x.shape[0]
  h = layer_norm(x, f64(sd, p + "_input_norm_weight"), f64(sd, p + "_input_norm_bias"), 1e-6)
  uvqk = h @ f64(sd, p + "_uvqk_weight") + f64(sd, p + "_uvqk_beta")
  u, v, q, k = np.split(uvqk, [N * H, 2 * N * H, 2 * N * H + N * A], axis=1)
  u = silu(u)
  q, k, v = q.reshape(L, N, A), k.reshape(L, N, A), v.reshape(L, N, H)
  max_id = L - num_candidates
  attn = np.zeros((L, N, H))
  for head in range(N):
    for i in range(L):
      for j in range(L):
        row, col = min(i, max_id), min(j, max_id)
        if i == j or row > col:
          s = q[i, head] @ k[j, head] / np.sqrt(A)
          attn[i, head] += silu(s) / n * v[j, head]
  attn = attn.reshape(L, N * H)
  y = u * layer_norm(attn, f64(sd, p + "_output_norm_weight"), f64(sd, p + "_output_norm_bias"),
                     1e-6)
  return x + np.concatenate([u, attn, y], 1) @ f64(sd, p + "_output_weight")


def stu_stack_user(sd, hp, x, num_candidates, n):
  layer = 0
  while f"{STU}{layer}._uvqk_weight" in sd:
    x = stu_layer_user(sd, hp, layer, x, num_candidates, n)
    layer += 1
  return x


def time_features(sd, t):
  """One timestamp -> [cos, sin] per (period, units) buffer pair, float32 periods."""
  periods = np.asarray(sd[POST + "_period_units"], np.float32).reshape(-1)
  units = np.asarray(sd[POST + "_units_per_period"], np.float32).reshape(-1)
  out = []
  for period, unit in zip(periods, units):
    since = np.floor_divide(np.float32(t), period)
    angle = np.remainder(since, unit) / unit * np.float32(2) * np.float32(3.14)
    out += [np.cos(np.float64(angle)), np.sin(np.float64(angle))]
  return np.asarray(out)


def postprocess(sd, h, t):
  """TimestampLayerNormPostprocessor: one candidate's h [D] at query time t -> [D]."""
  z = np.concatenate([h, time_features(sd, t)])
  y = linear(sd, POST + "_time_feature_combiner.", z)
  return layer_norm(y, f64(sd, POST + "_layer_norm.weight"), f64(sd, POST + "_layer_norm.bias"),
                    1e-5)


def item_embedding(sd, item_id, category_id):
  rows = np.concatenate([f64(sd, EMB + "item_id.weight")[int(item_id)],
                         f64(sd, EMB + "item_category_id.weight")[int(category_id)]])
  return mlp(sd, ITEM, rows)


def prediction(sd, user, item):
  """The multitask prediction module on user * item -> logits [tasks]."""
  return mlp(sd, PRED, user * item, final_norm=False)


def batch_n(requests):
  """DlrmHSTU's max_seq_len for a batch: max history + max candidates + 1."""
  return (max(len(r.item_ids) for r in requests)
          + max(len(r.candidate_ids) for r in requests) + 1)


def user_logits(sd, hp, r, n):
  """One request's candidate logits [c, tasks] in a batch of denominator n."""
  c = len(r.candidate_ids)
  x = positional_user(sd, preprocess_user(sd, hp, r), r)
  x = stu_stack_user(sd, hp, x, c, n)
  out = []
  for j in range(c):
    user = postprocess(sd, x[x.shape[0] - c + j], int(r.query_time))
    item = item_embedding(sd, r.candidate_ids[j], r.candidate_category_ids[j])
    out.append(prediction(sd, user, item))
  return np.asarray(out).reshape(c, len(sd[PRED + "2.bias"]))
