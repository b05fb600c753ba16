"""`HSTUConfig`, its presets and its one param declaration.

The paper-era HSTU (Zhai et al., "Actions Speak Louder than Words", 2024) over
a user's history of (item, action, timestamp) events, scoring candidate items
appended after it: relative position and time biases in every layer and a
fixed n. MLPerf v6.0's DLRMv3 runs a different model, the reference's
`DlrmHSTU` (`recsys.dlrm_config`, `recsys.dlrm_v3`); this one stays as a
variant under its own names: the `hstu_paper` preset (DLRMv3's sizes: 5
layers, 4 heads, embedding dim 512, 1B items, 5M users) and `tiny_hstu`.
`recsys.family.get` reads every recsys preset.

`param_specs(cfg)` declares every weight once (shape, logical axes,
initializer); `init_params`, `abstract_params` and the table shardings
(`recsys.tables`) read it. Tree (L layers, D embed, N heads, A qk head dim,
H value head dim, R rows):
  tables: items [R_items, D], actions [R_actions, D], user_<i> [R_i, D] (one per
          user sparse feature; bags sum-pooled into the user's contextual token)
  layers (stacked over L): in_norm_w/b [L, D]; w_uvqk [L, D, N(2H + 2A)],
          b_uvqk [L, N(2H + 2A)]; w_o [L, NH, D], b_o [L, D];
          pos_bias [L, P] (P = max_seq_len), time_bias [L, time_buckets + 1]
  out_norm_w/b [D]; head: w1 [2D, F], b1 [F], w2 [F, 1], b2 [1]
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxinfer.backend import Backend
from jaxinfer.models.specs import ParamSpec, abstract_from_specs, init_from_specs


@dataclasses.dataclass(frozen=True, kw_only=True)
class HSTUConfig:
  """A DlrmHSTU model: tables, trunk and head sizes (hashable, jit-static).

  max_seq_len bounds a user's tokens (1 contextual + history + candidates);
  it sizes the position bias and is the `n` of the attention's `1/n`
  (a constant, so a user's scores do not depend on who shares the batch).
  time_buckets: |dt| seconds bucketed as floor(ln(max(|dt|, 1)) / 0.301),
  clipped to time_buckets (the reference's log bucketization).
  """
  num_items: int
  num_actions: int = 8  # action 0: unknown (candidates)
  user_feature_rows: tuple[int, ...] = (16,)
  embed_dim: int = 32
  num_layers: int = 2
  num_heads: int = 2
  qk_dim: int = 16
  v_dim: int = 16
  max_seq_len: int = 64
  time_buckets: int = 64
  head_hidden: int = 32
  dtype: str = "float32"
  table_dtype: str = "float32"
  backend: Backend = Backend()  # attention: jagged Pallas kernel on GPU, XLA elsewhere

  def __post_init__(self):
    for f in ("num_items", "num_actions", "embed_dim", "num_layers", "num_heads", "qk_dim",
              "v_dim", "max_seq_len", "time_buckets", "head_hidden"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"HSTUConfig.{f} must be an int >= 1, got {v!r}")
    if self.max_seq_len < 2:
      raise ValueError(f"HSTUConfig.max_seq_len must be >= 2, got {self.max_seq_len}")
    rows = self.user_feature_rows
    if not rows or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1
                           for r in rows):
      raise ValueError(f"HSTUConfig.user_feature_rows must be a non-empty tuple of ints >= 1 "
                       f"(the contextual token pools them), got {rows!r}")

  @property
  def alpha(self) -> float:
    """The q.k scale (DLRMv3's STU: 1/sqrt(attention dim))."""
    return 1.0 / math.sqrt(self.qk_dim)

  def table_rows(self) -> dict[str, int]:
    rows = {"items": self.num_items, "actions": self.num_actions}
    rows.update({f"user_{i}": r for i, r in enumerate(self.user_feature_rows)})
    return rows


def tiny() -> HSTUConfig:
  """Tests and the tiny LoadGen runs: 2 layers, 2 heads, D 32, 1000 items."""
  return HSTUConfig(num_items=1000, user_feature_rows=(16, 24), embed_dim=32, num_layers=2,
                    num_heads=2, qk_dim=16, v_dim=16, max_seq_len=64, time_buckets=32,
                    head_hidden=32)


def hstu_paper() -> HSTUConfig:
  """The paper-era HSTU at MLPerf v6.0 DLRMv3's sizes: 5 HSTU layers, 4 heads, D 512,
  1B items, user features of 5M users; bf16 tables (~1 TB: 2 bytes a value)."""
  return HSTUConfig(num_items=1_000_000_000, num_actions=16,
                    user_feature_rows=(5_000_000, 1_000_000, 100_000), embed_dim=512,
                    num_layers=5, num_heads=4, qk_dim=128, v_dim=128, max_seq_len=4096,
                    time_buckets=128, head_hidden=512, dtype="bfloat16", table_dtype="bfloat16")


PRESETS = {"tiny_hstu": tiny, "hstu_paper": hstu_paper}


def get(name: str, **overrides) -> HSTUConfig:
  """The preset `name` ("tiny_hstu", "hstu_paper"), with optional field overrides."""
  if name not in PRESETS:
    raise ValueError(f"unknown recsys preset {name!r}; available: {sorted(PRESETS)}")
  cfg = PRESETS[name]()
  return dataclasses.replace(cfg, **overrides) if overrides else cfg


def param_specs(cfg: HSTUConfig) -> dict:
  """The abstract param tree (module docstring)."""
  D, L, N = cfg.embed_dim, cfg.num_layers, cfg.num_heads
  f, t = jnp.dtype(cfg.dtype), jnp.dtype(cfg.table_dtype)
  uvqk = N * (2 * cfg.v_dim + 2 * cfg.qk_dim)
  tables = {name: ParamSpec((rows, D), t, ("rows", "embed"), "table")
            for name, rows in cfg.table_rows().items()}
  layers = {
      "in_norm_w": ParamSpec((L, D), f, ("layers", "embed"), "ones"),
      "in_norm_b": ParamSpec((L, D), f, ("layers", "embed"), "zeros"),
      "w_uvqk": ParamSpec((L, D, uvqk), f, ("layers", "embed", "mlp")),
      "b_uvqk": ParamSpec((L, uvqk), f, ("layers", "mlp"), "zeros"),
      "w_o": ParamSpec((L, N * cfg.v_dim, D), f, ("layers", "mlp", "embed")),
      "b_o": ParamSpec((L, D), f, ("layers", "embed"), "zeros"),
      "pos_bias": ParamSpec((L, cfg.max_seq_len), f, ("layers", None), "bias"),
      "time_bias": ParamSpec((L, cfg.time_buckets + 1), f, ("layers", None), "bias"),
  }
  head = {"w1": ParamSpec((2 * D, cfg.head_hidden), f, ("embed", "mlp")),
          "b1": ParamSpec((cfg.head_hidden,), f, ("mlp",), "zeros"),
          "w2": ParamSpec((cfg.head_hidden, 1), f, ("mlp", None)),
          "b2": ParamSpec((1,), f, (None,), "zeros")}
  return {"tables": tables, "layers": layers, "head": head,
          "out_norm_w": ParamSpec((D,), f, ("embed",), "ones"),
          "out_norm_b": ParamSpec((D,), f, ("embed",), "zeros")}


def abstract_params(cfg: HSTUConfig):
  """`jax.ShapeDtypeStruct` tree of `param_specs` (nothing allocates)."""
  return abstract_from_specs(param_specs(cfg))


def _init_leaf(spec: ParamSpec, key):
  if spec.init in ("ones", "zeros"):
    return (jnp.ones if spec.init == "ones" else jnp.zeros)(spec.shape, spec.dtype)
  if spec.init == "table":
    std = 0.1  # rows of unit-scale sums: a token adds ~3 rows
  elif spec.init == "bias":
    std = 0.1
  else:
    std = spec.shape[-2] ** -0.5  # fan-in of [.., in, out]
  return (std * jax.random.normal(key, spec.shape, jnp.float32)).astype(spec.dtype)


def init_params(cfg: HSTUConfig, key):
  """Random params from `param_specs` (tiny configs: the tables allocate)."""
  return init_from_specs(param_specs(cfg), key, _init_leaf)
