"""`DlrmV3Config`: MLPerf DLRMv3's reference model (generative-recommenders'
`DlrmHSTU` as MLPerf Inference v6.0's `configs.py` builds it), its presets and
its one param declaration (the reference's state-dict names: `recsys.dlrm_state`).

The model (`recsys.dlrm_v3`, `recsys.stu`) per user: a contextual user_id
token, the history's items, then the candidates, one token each:

  token   = content_mlp(item row) + category_mlp(category row) + action_mlp(a)
  a       = history: concat_k [bit_k(action bitmask)] * action_table[k];
            candidates: the learned candidate_action row
  ctx     = gate * user row @ contextual_w + contextual_b
            (gate = 1 iff history + candidates >= contextual_min_uih_length)
  x       = token * sqrt(D) + position[p] + time[bucket(query_time - t)]
  x       = STU layers (`recsys.stu`); candidate c's output h_c
  user_c  = LayerNorm([h_c, cos/sin of hour-of-day and day-of-week] W + b)
  item_c  = item_mlp([item row, category row])
  logit_c = prediction(user_c * item_c); the reference returns sigmoid(logit)

mlp = Linear, SwishLayerNorm (x * sigmoid(LN(x))), Linear, LayerNorm
(eps 1e-5); the prediction MLP has no final LayerNorm.

Param tree (E table dim, D transducer dim, L layers, N heads, H attn_linear_dim,
A attn_qk_dim, U = N(2H + 2A), K action types, F time features); our linear
weights are [in, out] (torch's nn.Linear stores [out, in]: `recsys.dlrm_state`
maps each leaf to its reference state-dict key, transposed or not):
  tables: item_id, item_category_id, user_id [rows, E]
  preprocessor: content_mlp, category_mlp (mlp of E), action_mlp (mlp of 8K),
    action_table [K, 8], candidate_action [1, 8K], contextual_w [1, E, D],
    contextual_b [1, D]
  positional: position [P, D], time [Bt + 1, D]
  stu (stacked over L): in_norm_w/b [L, D], uvqk_w [L, D, U], uvqk_b [L, U],
    out_norm_w/b [L, NH], out_w [L, 3NH, D]
  postprocessor: w [D + 2F, D], b [D], norm_w/b [D]
  item_mlp (mlp of 2E); head: w0 [D, Hh], b0, swish_w/b [Hh], w1 [Hh, tasks], b1
  an mlp: w0 [in, h], b0 [h], swish_w/b [h], w1 [h, D], b1 [D], norm_w/b [D]
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.backend import Backend
from jaxinfer.models.specs import ParamSpec, abstract_from_specs, init_from_specs

_POSITIVE = ("num_heads", "attn_linear_dim", "attn_qk_dim", "num_layers", "embedding_dim",
             "transducer_dim", "preprocessor_hidden_dim", "item_mlp_hidden_dim",
             "prediction_hidden_dim", "action_embedding_dim", "num_position_buckets",
             "num_time_buckets", "max_seq_len", "max_num_candidates", "item_rows",
             "category_rows", "user_rows")


def _check_int(name: str, v, lo: int) -> None:
  if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
    raise ValueError(f"DlrmV3Config.{name} must be an int >= {lo}, got {v!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DlrmV3Config:
  """DlrmHSTU's sizes (hashable, jit-static); defaults are MLPerf's `configs.py`
  (hstu_* fields without the prefix). item_mlp_hidden_dim and
  prediction_hidden_dim are the reference's hard-coded 512s; max_num_candidates
  is max_num_candidates_inference; contextual_min_uih_length is
  contextual_feature_to_min_uih_length["user_id"] (compared, as the reference
  does, with history + candidates). The one contextual feature is user_id
  (contextual_feature_to_max_length {"user_id": 1}): one token per user."""
  num_heads: int = 4
  attn_linear_dim: int = 128
  attn_qk_dim: int = 128
  num_layers: int = 5
  embedding_dim: int = 512  # E: the tables' width (hstu_embedding_table_dim)
  transducer_dim: int = 512  # D: the STU stack's width
  preprocessor_hidden_dim: int = 256
  item_mlp_hidden_dim: int = 512
  prediction_hidden_dim: int = 512
  action_embedding_dim: int = 8
  action_weights: tuple[int, ...] = (1, 2, 4, 8, 16)
  contextual_min_uih_length: int = 20
  num_position_buckets: int = 8192
  num_time_buckets: int = 2048
  time_duration_features: tuple[tuple[int, int], ...] = ((3600, 24), (86400, 7))
  max_seq_len: int = 16384
  max_num_candidates: int = 2048
  item_rows: int = 1_000_000_000
  category_rows: int = 128
  user_rows: int = 10_000_000
  task_names: tuple[str, ...] = ("rating",)  # binary tasks
  dtype: str = "float32"  # matmul inputs (accumulation, norms, residual: float32)
  table_dtype: str = "float32"
  backend: Backend = Backend()

  def __post_init__(self):
    for f in _POSITIVE:
      _check_int(f, getattr(self, f), 1)
    _check_int("contextual_min_uih_length", self.contextual_min_uih_length, 0)
    if self.max_num_candidates >= self.max_seq_len:
      raise ValueError(f"DlrmV3Config.max_num_candidates ({self.max_num_candidates}) must be "
                       f"below max_seq_len ({self.max_seq_len}): a user has a contextual token")
    w = tuple(self.action_weights)
    if not w or len(set(w)) != len(w) or not all(
        isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x > 0 for x in w):
      raise ValueError(f"DlrmV3Config.action_weights must be distinct ints > 0 (bitmask "
                       f"bits), got {self.action_weights!r}")
    object.__setattr__(self, "action_weights", tuple(int(x) for x in w))
    tdf = tuple(tuple(p) for p in self.time_duration_features)
    if not all(len(p) == 2 and all(isinstance(x, int) and x > 0 for x in p) for p in tdf):
      raise ValueError(f"DlrmV3Config.time_duration_features must be (seconds per unit, "
                       f"units per period) pairs of ints > 0, got {self.time_duration_features!r}")
    object.__setattr__(self, "time_duration_features", tdf)
    names = tuple(self.task_names)
    if not names or len(set(names)) != len(names) or not all(
        isinstance(n, str) and n for n in names):
      raise ValueError(f"DlrmV3Config.task_names must be distinct non-empty strings, "
                       f"got {self.task_names!r}")
    object.__setattr__(self, "task_names", names)
    for f in ("dtype", "table_dtype"):
      try:
        ok = jnp.issubdtype(jnp.dtype(getattr(self, f)), jnp.floating)
      except TypeError:
        ok = False
      if not ok:
        raise ValueError(f"DlrmV3Config.{f} must name a float dtype, got {getattr(self, f)!r}")
    if not isinstance(self.backend, Backend):
      raise ValueError(f"DlrmV3Config.backend must be a jaxinfer.backend.Backend, "
                       f"got {self.backend!r}")

  @property
  def alpha(self) -> float:
    """The q.k scale: 1/sqrt(attn_qk_dim) (STULayer's default attn_alpha)."""
    return 1.0 / math.sqrt(self.attn_qk_dim)

  @property
  def uvqk_dim(self) -> int:
    return self.num_heads * (2 * self.attn_linear_dim + 2 * self.attn_qk_dim)

  @property
  def action_dim(self) -> int:
    return len(self.action_weights) * self.action_embedding_dim

  @property
  def num_tasks(self) -> int:
    return len(self.task_names)

  def table_rows(self) -> dict[str, int]:
    return {"item_id": self.item_rows, "item_category_id": self.category_rows,
            "user_id": self.user_rows}


def dlrm_v3() -> DlrmV3Config:
  """MLPerf v6.0 DLRMv3: 5 STU layers, 4 heads of 128, D 512, fp16 tables of 1B
  items, 128 categories, 10M users; the dense model in bf16 (as MLPerf's runs)."""
  return DlrmV3Config(dtype="bfloat16", table_dtype="float16")


def tiny() -> DlrmV3Config:
  """Tests: every width distinct (E 24, D 32, 2 heads, qk 16, linear 24), 2
  layers, max_seq_len 64 (a full user's positions pass the 48 buckets)."""
  return DlrmV3Config(num_heads=2, attn_linear_dim=24, attn_qk_dim=16, num_layers=2,
                      embedding_dim=24, transducer_dim=32, preprocessor_hidden_dim=20,
                      item_mlp_hidden_dim=28, prediction_hidden_dim=36,
                      num_position_buckets=48, num_time_buckets=16, max_seq_len=64,
                      max_num_candidates=8, item_rows=1000, category_rows=16, user_rows=100)


PRESETS = {"dlrm_v3": dlrm_v3, "tiny_dlrm_v3": tiny}


def _mlp(din: int, hidden: int, dout: int, f, final_norm: bool = True) -> dict:
  out = {"w0": ParamSpec((din, hidden), f, ("embed", "mlp")),
         "b0": ParamSpec((hidden,), f, ("mlp",), "zeros"),
         "swish_w": ParamSpec((hidden,), f, ("mlp",), "ones"),
         "swish_b": ParamSpec((hidden,), f, ("mlp",), "zeros"),
         "w1": ParamSpec((hidden, dout), f, ("mlp", "embed")),
         "b1": ParamSpec((dout,), f, ("embed",), "zeros")}
  if final_norm:
    out["norm_w"] = ParamSpec((dout,), f, ("embed",), "ones")
    out["norm_b"] = ParamSpec((dout,), f, ("embed",), "zeros")
  return out


def param_specs(cfg: DlrmV3Config) -> dict:
  """The abstract param tree (module docstring)."""
  E, D, L = cfg.embedding_dim, cfg.transducer_dim, cfg.num_layers
  NH = cfg.num_heads * cfg.attn_linear_dim
  f, t = jnp.dtype(cfg.dtype), jnp.dtype(cfg.table_dtype)
  Hp, K = cfg.preprocessor_hidden_dim, len(cfg.action_weights)
  tables = {name: ParamSpec((rows, E), t, ("rows", "embed"), "table")
            for name, rows in cfg.table_rows().items()}
  pre = {"content_mlp": _mlp(E, Hp, D, f), "category_mlp": _mlp(E, Hp, D, f),
         "action_mlp": _mlp(cfg.action_dim, Hp, D, f),
         "action_table": ParamSpec((K, cfg.action_embedding_dim), f, (None, None), "small"),
         "candidate_action": ParamSpec((1, cfg.action_dim), f, (None, None), "small"),
         "contextual_w": ParamSpec((1, E, D), f, (None, "embed", "mlp")),
         "contextual_b": ParamSpec((1, D), f, (None, "embed"), "zeros")}
  positional = {
      "position": ParamSpec((cfg.num_position_buckets, D), f, (None, "embed"), "small"),
      "time": ParamSpec((cfg.num_time_buckets + 1, D), f, (None, "embed"), "small")}
  stu = {"in_norm_w": ParamSpec((L, D), f, ("layers", "embed"), "ones"),
         "in_norm_b": ParamSpec((L, D), f, ("layers", "embed"), "zeros"),
         "uvqk_w": ParamSpec((L, D, cfg.uvqk_dim), f, ("layers", "embed", "mlp")),
         "uvqk_b": ParamSpec((L, cfg.uvqk_dim), f, ("layers", "mlp"), "zeros"),
         "out_norm_w": ParamSpec((L, NH), f, ("layers", "mlp"), "ones"),
         "out_norm_b": ParamSpec((L, NH), f, ("layers", "mlp"), "zeros"),
         "out_w": ParamSpec((L, 3 * NH, D), f, ("layers", "mlp", "embed"))}
  post = {"w": ParamSpec((D + 2 * len(cfg.time_duration_features), D), f, ("embed", "mlp")),
          "b": ParamSpec((D,), f, ("mlp",), "zeros"),
          "norm_w": ParamSpec((D,), f, ("embed",), "ones"),
          "norm_b": ParamSpec((D,), f, ("embed",), "zeros")}
  return {"tables": tables, "preprocessor": pre, "positional": positional, "stu": stu,
          "postprocessor": post, "item_mlp": _mlp(2 * E, cfg.item_mlp_hidden_dim, D, f),
          "head": _mlp(D, cfg.prediction_hidden_dim, cfg.num_tasks, f, final_norm=False)}


def abstract_params(cfg: DlrmV3Config):
  """`jax.ShapeDtypeStruct` tree of `param_specs` (nothing allocates)."""
  return abstract_from_specs(param_specs(cfg))


def _init_leaf(spec: ParamSpec, key):
  if spec.init in ("ones", "zeros"):
    return (jnp.ones if spec.init == "ones" else jnp.zeros)(spec.shape, spec.dtype)
  std = {"table": 1.0, "small": 0.1}.get(spec.init, spec.shape[-2] ** -0.5 if len(spec.shape) > 1
                                         else 1.0)  # else fan-in of [.., in, out]
  return (std * jax.random.normal(key, spec.shape, jnp.float32)).astype(spec.dtype)


def init_params(cfg: DlrmV3Config, key):
  """Random params: unit-normal table rows, 0.1-normal action / position / time
  rows, fan-in scaled normal weights, norms at identity, zero biases (tiny
  configs only: the tables allocate)."""
  return init_from_specs(param_specs(cfg), key, _init_leaf)
