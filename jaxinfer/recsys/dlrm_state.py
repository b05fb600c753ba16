"""DlrmHSTU's state dict <-> our param tree (`recsys.dlrm_config`'s layout).

`REFERENCE_NAMES` maps each of our leaves to its key in the
reference's `DlrmHSTU.state_dict()` (the modules' attribute names: e.g.
`_hstu_transducer._stu_module._stu_layers.0._uvqk_weight`), and whether the
reference stores it transposed (torch's nn.Linear keeps [out, in]; we keep
[in, out]; the STU's own weights are [in, out] in both). The STU layers' keys,
one per layer, stack on our leading [L] axis (the `lax.scan` over layers).
The reference also keeps three registered buffers (the action encoder's
action weights, the time postprocessor's periods): they may be present and
must equal what the config implies; any other key is an error.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.recsys import dlrm_checkpoint
from jaxinfer.recsys.dlrm_config import DlrmV3Config, param_specs

_PRE = "_hstu_transducer._input_preprocessor."
_MLP_PARTS = {"w0": ("0.weight", True), "b0": ("0.bias", False), "swish_w": ("1.weight", False),
              "swish_b": ("1.bias", False), "w1": ("2.weight", True), "b1": ("2.bias", False),
              "norm_w": ("3.weight", False), "norm_b": ("3.bias", False)}


def _mlp_names(path: tuple[str, ...], prefix: str, final_norm: bool = True) -> dict:
  return {(*path, k): (prefix + name, tr) for k, (name, tr) in _MLP_PARTS.items()
          if final_norm or not k.startswith("norm")}


_STU = "_hstu_transducer._stu_module._stu_layers.{layer}."
# Our leaf path -> (DlrmHSTU state_dict key, stored transposed: torch Linear [out, in]).
# "{layer}" keys are one tensor per STU layer, stacked on our leading axis.
REFERENCE_NAMES: dict[tuple[str, ...], tuple[str, bool]] = {
    ("tables", "item_id"): ("_embedding_collection.embeddings.item_id.weight", False),
    ("tables", "item_category_id"): (
        "_embedding_collection.embeddings.item_category_id.weight", False),
    ("tables", "user_id"): ("_embedding_collection.embeddings.user_id.weight", False),
    **_mlp_names(("preprocessor", "content_mlp"), _PRE + "_content_embedding_mlp."),
    **_mlp_names(("preprocessor", "category_mlp"), _PRE + "_additional_embedding_mlp."),
    **_mlp_names(("preprocessor", "action_mlp"), _PRE + "_action_embedding_mlp."),
    ("preprocessor", "action_table"): (_PRE + "_action_encoder._action_embedding_table", False),
    ("preprocessor", "candidate_action"): (
        _PRE + "_action_encoder._target_action_embedding_table", False),
    ("preprocessor", "contextual_w"): (_PRE + "_batched_contextual_linear_weights", False),
    ("preprocessor", "contextual_b"): (_PRE + "_batched_contextual_linear_bias", False),
    ("positional", "position"): (
        "_hstu_transducer._positional_encoder._position_embeddings_weight", False),
    ("positional", "time"): (
        "_hstu_transducer._positional_encoder._timestamp_embeddings_weight", False),
    ("stu", "in_norm_w"): (_STU + "_input_norm_weight", False),
    ("stu", "in_norm_b"): (_STU + "_input_norm_bias", False),
    ("stu", "uvqk_w"): (_STU + "_uvqk_weight", False),  # [D, U]: stored [in, out]
    ("stu", "uvqk_b"): (_STU + "_uvqk_beta", False),
    ("stu", "out_norm_w"): (_STU + "_output_norm_weight", False),
    ("stu", "out_norm_b"): (_STU + "_output_norm_bias", False),
    ("stu", "out_w"): (_STU + "_output_weight", False),  # [3NH, D]: stored [in, out]
    ("postprocessor", "w"): (
        "_hstu_transducer._output_postprocessor._time_feature_combiner.weight", True),
    ("postprocessor", "b"): (
        "_hstu_transducer._output_postprocessor._time_feature_combiner.bias", False),
    ("postprocessor", "norm_w"): ("_hstu_transducer._output_postprocessor._layer_norm.weight",
                                  False),
    ("postprocessor", "norm_b"): ("_hstu_transducer._output_postprocessor._layer_norm.bias",
                                  False),
    **_mlp_names(("item_mlp",), "_item_embedding_mlp."),
    **_mlp_names(("head",), "_multitask_module._prediction_module.", final_norm=False),
}

# Registered buffers of DlrmHSTU (not params): checked against cfg where present.
REFERENCE_BUFFERS = {
    "action_weights": _PRE + "_action_encoder._combined_action_weights",
    "period_units": "_hstu_transducer._output_postprocessor._period_units",
    "units_per_period": "_hstu_transducer._output_postprocessor._units_per_period",
}


def _leaves(tree, path=()):
  """(path, leaf) of a nested dict, in insertion order."""
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _leaves(v, (*path, k))
    else:
      yield (*path, k), v


def reference_keys(cfg: DlrmV3Config) -> dict[str, tuple[tuple[str, ...], int | None, bool]]:
  """Every DlrmHSTU parameter key of cfg -> (our leaf path, STU layer or None,
  stored transposed)."""
  out = {}
  for path, (key, tr) in REFERENCE_NAMES.items():
    if "{layer}" in key:
      out.update({key.format(layer=i): (path, i, tr) for i in range(cfg.num_layers)})
    else:
      out[key] = (path, None, tr)
  return out


def _buffer_values(cfg: DlrmV3Config) -> dict[str, np.ndarray]:
  tdf = np.asarray(cfg.time_duration_features, np.float64).reshape(-1, 2)
  return {REFERENCE_BUFFERS["action_weights"]: np.asarray(cfg.action_weights),
          REFERENCE_BUFFERS["period_units"]: tdf[:, 0].reshape(1, -1),
          REFERENCE_BUFFERS["units_per_period"]: tdf[:, 1].reshape(1, -1)}


def _check_state_keys(cfg: DlrmV3Config, state: dict, keys: dict) -> None:
  buffers = _buffer_values(cfg)
  unknown = sorted(k for k in state if k not in keys and k not in buffers)
  if unknown:
    raise ValueError(f"reference state has unexpected tensors (not DlrmHSTU params or known "
                     f"buffers of this config): {unknown}")
  missing = sorted(k for k in keys if k not in state)
  if missing:
    raise ValueError(f"reference state is missing tensor {missing[0]!r}"
                     + (f" (and {len(missing) - 1} more: {missing[1:4]}...)"
                        if len(missing) > 1 else ""))
  for k, want in buffers.items():
    got = np.asarray(state.get(k, want), np.float64)
    if got.shape != want.shape or not np.array_equal(got, want):
      raise ValueError(f"reference buffer {k!r} is {got.tolist()}, this config's is "
                       f"{want.tolist()} (action_weights / time_duration_features)")


def from_reference_state(cfg: DlrmV3Config, state: dict, *, as_numpy: bool = False) -> dict:
  """A DlrmHSTU state dict {key: array} (numpy, or anything np.asarray takes)
  -> our param tree in cfg's dtypes. Raises ValueError naming the key of a
  missing tensor, a misshapen one (expected vs got shape, in the reference's
  layout) and any unexpected key; the known buffers (action weights, time
  periods) may be present and must match cfg. as_numpy: numpy leaves (no
  device copy; a table already in its dtype is not copied), for the caller to
  place, e.g. huge tables by `tables.place_params`."""
  keys = reference_keys(cfg)
  _check_state_keys(cfg, state, keys)
  specs = dict(_leaves(param_specs(cfg)))
  per_leaf: dict[tuple[str, ...], dict] = {p: {} for p in specs}
  for key, (path, layer, tr) in keys.items():
    spec = specs[path]
    shape = spec.shape[1:] if layer is not None else spec.shape
    want = tuple(reversed(shape)) if tr else tuple(shape)
    a = np.asarray(state[key])
    if a.shape != want:
      raise ValueError(f"reference tensor {key!r} has shape {a.shape}, expected {want}")
    per_leaf[path][layer] = a.T if tr else a
  params: dict = {}
  for path, parts in per_leaf.items():
    a = np.stack([parts[i] for i in range(cfg.num_layers)]) if None not in parts else parts[None]
    node = params
    for k in path[:-1]:
      node = node.setdefault(k, {})
    dtype = specs[path].dtype
    node[path[-1]] = np.asarray(a).astype(dtype, copy=False) if as_numpy else jnp.asarray(a, dtype)
  return params


def to_reference_state(cfg: DlrmV3Config, params: dict) -> dict[str, np.ndarray]:
  """Our param tree -> DlrmHSTU's state dict (numpy, the reference's layouts and
  the known buffers); `from_reference_state` inverts it."""
  leaves = dict(_leaves(params))
  out = {}
  for key, (path, layer, tr) in reference_keys(cfg).items():
    a = np.asarray(jax.device_get(leaves[path]))
    a = a[layer] if layer is not None else a
    out[key] = a.T if tr else a
  return {**out, **_buffer_values(cfg)}


def load_reference_checkpoint(cfg: DlrmV3Config, path, *, as_numpy: bool = False) -> dict:
  """The reference's checkpoint folder (its `--model-path`: `non_sparse.ckpt` and
  `sparse/`, read by `dlrm_checkpoint.read_reference_checkpoint`) -> our param
  tree (`from_reference_state`); errors name the folder and the key."""
  state = dlrm_checkpoint.read_reference_checkpoint(path)
  try:
    return from_reference_state(cfg, state, as_numpy=as_numpy)
  except ValueError as e:
    raise ValueError(f"DLRMv3 checkpoint {os.fspath(path)}: {e}") from None
