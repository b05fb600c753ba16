"""MLPerf DLRMv3's reference model (generative-recommenders' `DlrmHSTU`, inference
form) over a `DlrmBatch`; the STU stack is `recsys.stu`. Shapes: T tokens, B
users, C candidate slots, E table width, D transducer width.

Preprocessor (`ContextualPreprocessor`), per history / candidate token:
  x = content_mlp(item row) + category_mlp(category row) + action_mlp(a)
  a = concat_k [(bitmask & action_weights[k]) > 0] * action_table[k]   (history)
      candidate_action                                                  (candidates)
and the contextual token, first: gate * user row @ contextual_w[0] +
contextual_b[0], gate = (history + candidates >= contextual_min_uih_length):
the reference compares the merged item_id sequence's length, which includes
the candidates; a gated token is the bias, not zero.

Positional encoder (`HSTUPositionalEncoder`, `add_timestamp_positional_embeddings`):
  x * sqrt(D) + position[p] + time[b]
  p = 0 for the contextual token, min(h - i + 1, P - 1) for the history event i
      of h (the newest 2), 1 for every candidate
  b = clip(int(sqrt(max(q - t, 1e-6) / 60)), 0, Bt), in float32 as the
      reference (its int64 difference promoted to float32); q = the user's last
      token's timestamp (its candidates' query time; the newest event's
      without candidates), t = 0 for the contextual token.

Postprocessor (`TimestampLayerNormPostprocessor`) on a candidate's STU output h
at its query time t (float32, as the reference's float buffers promote it):
  u = floor(t / period) mod units; angle = u / units * 2 * 3.14 (3.14, the
  reference's constant); LayerNorm([h, cos a_hour, sin a_hour, cos a_day,
  sin a_day] W + b), eps 1e-5.
Item tower: item_mlp([item row, category row]). Head (`DefaultMultitaskModule`):
  logits = prediction(user * item) [C, tasks]; the reference's inference output
  mt_target_preds is sigmoid(logits) transposed, [tasks, C] (`predict`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.recsys import tables as tables_lib
from jaxinfer.recsys.dlrm_batch import DlrmBatch
from jaxinfer.recsys.dlrm_config import DlrmV3Config
from jaxinfer.recsys.stu import dot, layer_norm, stu_stack, token_layout

LN_EPS = 1e-5  # LayerNorm / SwishLayerNorm / the postprocessor's nn.LayerNorm
TIME_BUCKET_SECONDS = 60.0


def mlp(cfg: DlrmV3Config, p: dict, x):
  """Linear, SwishLayerNorm (x * sigmoid(LN(x))), Linear, then LayerNorm where p
  has norm_w (the prediction MLP has none) -> float32."""
  h = dot(cfg, x, p["w0"]) + p["b0"].astype(jnp.float32)
  h = h * jax.nn.sigmoid(layer_norm(h, p["swish_w"], p["swish_b"], LN_EPS))
  y = dot(cfg, h, p["w1"]) + p["b1"].astype(jnp.float32)
  return layer_norm(y, p["norm_w"], p["norm_b"], LN_EPS) if "norm_w" in p else y


def lookup(tables: dict, batch: DlrmBatch) -> dict:
  """Rows (float32) of every token's item and category [T, E] and every user [B, E];
  tables as `tables.lookup_many` takes them (plain, row- or table-wise sharded)."""
  return tables_lib.lookup_many(tables, {"item_id": batch.item_ids,
                                         "item_category_id": batch.category_ids,
                                         "user_id": batch.user_ids})


def action_embeddings(cfg: DlrmV3Config, p: dict, bitmask, is_candidate):
  """The action encoder: [T] bitmasks -> [T, K * action_embedding_dim]."""
  bits = (bitmask[:, None] & jnp.asarray(cfg.action_weights, jnp.int32)[None]) > 0
  table = p["action_table"].astype(jnp.float32)
  hist = (bits[..., None] * table[None]).reshape(bitmask.shape[0], cfg.action_dim)
  return jnp.where(is_candidate[:, None], p["candidate_action"].astype(jnp.float32), hist)


def preprocess(cfg: DlrmV3Config, params: dict, rows: dict, batch: DlrmBatch, layout: dict):
  """The contextual preprocessor (module docstring) -> token embeddings [T, D] float32."""
  p = params["preprocessor"]
  B = batch.num_candidates.shape[0]
  user, local = layout["user"], layout["local"]
  is_cand = (local >= layout["high"]) & (user < B)
  x = (mlp(cfg, p["content_mlp"], rows["item_id"])
       + mlp(cfg, p["category_mlp"], rows["item_category_id"])
       + mlp(cfg, p["action_mlp"], action_embeddings(cfg, p, batch.action_weights, is_cand)))
  tokens = jnp.diff(batch.offsets) - 1  # history + candidates per user
  gate = (tokens >= cfg.contextual_min_uih_length).astype(jnp.float32)
  ctx = dot(cfg, rows["user_id"] * gate[:, None], p["contextual_w"][0])
  ctx = ctx + p["contextual_b"][0].astype(jnp.float32)  # [B, D]
  ctx_tok = jnp.concatenate([ctx, jnp.zeros_like(ctx[:1])])[user]
  return jnp.where(((local == 0) & (user < B))[:, None], ctx_tok, x)


def query_times(batch: DlrmBatch, layout: dict):
  """Per token, its user's last token's timestamp [T] int32."""
  T = batch.timestamps.shape[0]
  last = batch.timestamps[jnp.clip(batch.offsets[1:] - 1, 0, T - 1)]
  return jnp.concatenate([last, jnp.zeros((1,), last.dtype)])[layout["user"]]


def time_buckets(cfg: DlrmV3Config, query, t):
  """bucket(query - t): clip(int(sqrt(max(dt, 1e-6) / 60)), 0, num_time_buckets)."""
  dt = jnp.maximum((query - t).astype(jnp.float32), jnp.float32(1e-6)) / TIME_BUCKET_SECONDS
  return jnp.clip(jnp.sqrt(dt).astype(jnp.int32), 0, cfg.num_time_buckets)


def positional(cfg: DlrmV3Config, params: dict, x, batch: DlrmBatch, layout: dict):
  """The positional / time encoder (module docstring) on x [T, D] -> [T, D] float32."""
  p = params["positional"]
  local, high = layout["local"], layout["high"]
  pos = jnp.minimum(high - jnp.minimum(local, high) + 1, cfg.num_position_buckets - 1)
  pos = jnp.where(local == 0, 0, pos)
  tb = time_buckets(cfg, query_times(batch, layout), batch.timestamps)
  emb = p["time"][tb].astype(jnp.float32) + p["position"][pos].astype(jnp.float32)
  return x * jnp.float32(cfg.transducer_dim ** 0.5) + emb


def time_features(cfg: DlrmV3Config, t):
  """[C] timestamps -> [C, 2F]: (cos, sin) of each period's angle (module docstring)."""
  tdf = jnp.asarray(cfg.time_duration_features, jnp.float32)
  since = jnp.floor_divide(t.astype(jnp.float32)[:, None], tdf[None, :, 0])
  angle = jnp.remainder(since, tdf[None, :, 1]) / tdf[None, :, 1] * 2 * 3.14  # not 2 pi
  return jnp.stack([jnp.cos(angle), jnp.sin(angle)], -1).reshape(t.shape[0], -1)


def postprocess(cfg: DlrmV3Config, p: dict, h, t):
  """The timestamp LayerNorm postprocessor: h [C, D], query times t [C] -> [C, D]."""
  z = jnp.concatenate([h.astype(jnp.float32), time_features(cfg, t)], -1)
  return layer_norm(dot(cfg, z, p["w"]) + p["b"].astype(jnp.float32), p["norm_w"], p["norm_b"],
                    LN_EPS)


def item_tower(cfg: DlrmV3Config, p: dict, item_rows, category_rows):
  """The candidates' item embeddings: item_mlp([item row, category row]) -> [C, D]."""
  return mlp(cfg, p, jnp.concatenate([item_rows, category_rows], -1))


def head(cfg: DlrmV3Config, p: dict, user, item):
  """The multitask head: prediction(user * item) -> logits [C, tasks]."""
  return mlp(cfg, p, user.astype(jnp.float32) * item.astype(jnp.float32))


def user_embeddings(cfg: DlrmV3Config, params: dict, rows: dict, batch: DlrmBatch):
  """The transducer: preprocess, positional, STU stack, postprocess -> the
  candidate slots' user embeddings [C, D] float32."""
  layout = token_layout(batch.offsets, batch.num_candidates, batch.item_ids.shape[0])
  x = positional(cfg, params, preprocess(cfg, params, rows, batch, layout), batch, layout)
  x = stu_stack(cfg, params["stu"], x, layout, batch.n)
  ci = batch.candidate_index
  return postprocess(cfg, params["postprocessor"], x[ci], batch.timestamps[ci])


def task_logits(cfg: DlrmV3Config, params: dict, batch: DlrmBatch):
  """Every candidate slot's logits [C, tasks] (float32)."""
  rows = lookup(params["tables"], batch)
  ci = batch.candidate_index
  item = item_tower(cfg, params["item_mlp"], rows["item_id"][ci], rows["item_category_id"][ci])
  return head(cfg, params["head"], user_embeddings(cfg, params, rows, batch), item)


def score(cfg: DlrmV3Config, params: dict, batch: DlrmBatch):
  """The first task's ("rating") logits [C] (slots past the real candidates: drop)."""
  return task_logits(cfg, params, batch)[:, 0]


def predict(cfg: DlrmV3Config, params: dict, batch: DlrmBatch):
  """The reference's mt_target_preds: sigmoid of the binary tasks' logits, [tasks, C]."""
  return jax.nn.sigmoid(task_logits(cfg, params, batch)).T
