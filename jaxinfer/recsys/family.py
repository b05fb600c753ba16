"""The two recommender models behind one interface, picked by the config's type.

- `DlrmV3Config` -> MLPerf v6.0's DLRMv3 as its reference runs it
  (`recsys.dlrm_v3`: requests are `request.DlrmRequest`s, packed by
  `dlrm_batch.pack`); presets "dlrm_v3" (the benchmark) and "tiny_dlrm_v3".
- `HSTUConfig` -> the paper-era HSTU (`recsys.hstu`: position and time
  biases in every layer, fixed n; requests are `batch.User`s); presets
  "hstu_paper" (DLRMv3's sizes) and "tiny_hstu".

The serving batcher (`serving/dlrm.py`) and the memory plans (`recsys.memory`)
ask `of(cfg)` for the functions they need, so each is written once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxinfer.recsys import batch as hstu_batch
from jaxinfer.recsys import config as hstu_config
from jaxinfer.recsys import dlrm_batch, dlrm_config, dlrm_v3, hstu


@dataclasses.dataclass(frozen=True)
class Family:
  """One model's functions (module docstring)."""
  name: str
  abstract_params: Callable
  init_params: Callable
  score: Callable  # (cfg, params, batch) -> candidate logits [C]
  pack: Callable  # (cfg, samples, *, tokens, users, candidates, feature_ids) -> batch
  abstract_batch: Callable  # (cfg, sharding, *, tokens, users, candidates, feature_ids)
  num_candidates: Callable  # sample -> its candidates
  table_width: Callable  # cfg -> the tables' row width


def _hstu_pack(cfg, samples, *, tokens=None, users=None, candidates=None, feature_ids=None):
  return hstu_batch.pack(cfg, samples, token_bucket=tokens, user_bucket=users,
                         target_bucket=candidates, feature_bucket=feature_ids)


def _hstu_abstract_batch(cfg, sharding, *, tokens, users, candidates, feature_ids=512):
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
  nf = len(cfg.user_feature_rows)
  return hstu_batch.JaggedBatch(
      offsets=s(users + 1), num_targets=s(users), item_ids=s(tokens), action_ids=s(tokens),
      timestamps=s(tokens), target_index=s(candidates),
      feature_ids=tuple(s(feature_ids) for _ in range(nf)),
      feature_offsets=tuple(s(users + 1) for _ in range(nf)))


def _dlrm_pack(cfg, samples, *, tokens=None, users=None, candidates=None, feature_ids=None):
  del feature_ids  # DLRMv3's one contextual feature is the user_id: no bags
  return dlrm_batch.pack(cfg, samples, token_bucket=tokens, user_bucket=users,
                         candidate_bucket=candidates)


def _dlrm_abstract_batch(cfg, sharding, *, tokens, users, candidates, feature_ids=None):
  del feature_ids
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
  return dlrm_batch.DlrmBatch(
      offsets=s(users + 1), num_candidates=s(users), user_ids=s(users), item_ids=s(tokens),
      category_ids=s(tokens), action_weights=s(tokens), timestamps=s(tokens),
      candidate_index=s(candidates), n=s())


HSTU_PAPER = Family("hstu_paper", hstu_config.abstract_params, hstu_config.init_params,
                    hstu.score, _hstu_pack, _hstu_abstract_batch,
                    lambda u: len(u.candidates), lambda cfg: cfg.embed_dim)
DLRM_V3 = Family("dlrm_v3", dlrm_config.abstract_params, dlrm_config.init_params, dlrm_v3.score,
                 _dlrm_pack, _dlrm_abstract_batch, lambda r: len(r.candidate_ids),
                 lambda cfg: cfg.embedding_dim)


def of(cfg: Any) -> Family:
  """The family of a recsys config (module docstring)."""
  if isinstance(cfg, dlrm_config.DlrmV3Config):
    return DLRM_V3
  if isinstance(cfg, hstu_config.HSTUConfig):
    return HSTU_PAPER
  raise TypeError(f"not a recsys config: {type(cfg).__name__} (DlrmV3Config or HSTUConfig)")


PRESETS = {**dlrm_config.PRESETS, **hstu_config.PRESETS}


def get(name: str, **overrides):
  """The recsys preset `name` (`PRESETS`: "dlrm_v3", "tiny_dlrm_v3", "hstu_paper",
  "tiny_hstu"), with optional field overrides."""
  if name not in PRESETS:
    raise ValueError(f"unknown recsys preset {name!r}; available: {sorted(PRESETS)}")
  cfg = PRESETS[name]()
  return dataclasses.replace(cfg, **overrides) if overrides else cfg
