"""Save / restore (cfg, params) with orbax-checkpoint.

Layout of a checkpoint directory:
  config.json   the ModelConfig fields plus the saved param dtype
  params/       an orbax PyTree checkpoint of the param tree
Restore reads straight into the requested shardings (one Sharding for every
leaf, or a tree of them matching the params), so a sharded model never passes
through a single device.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxinfer.backend import Backend
from jaxinfer.config import ModelConfig, QuantConfig, RopeScaling, VisionConfig
from jaxinfer.models.specs import abstract_params


def config_to_dict(cfg: ModelConfig) -> dict:
  return dataclasses.asdict(cfg)


def config_from_dict(d: dict) -> ModelConfig:
  d = dict(d)
  # Checkpoints saved before `Backend` hold its two fields flat.
  legacy = {"attention_impl": "attention", "kernel_target": "target"}
  if set(legacy) & set(d):
    d["backend"] = {new: d.pop(old, None) for old, new in legacy.items()}
  fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(d) - set(fields))
  if unknown:
    raise ValueError(f"checkpoint config.json: unknown ModelConfig fields {unknown}")
  if d.get("backend") is not None:
    d["backend"] = Backend(**d["backend"])
  if d.get("rope_scaling") is not None:
    d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
  if d.get("quant") is not None:
    q = dict(d["quant"])
    d["quant"] = QuantConfig(**dict(q, block=tuple(q["block"]), targets=tuple(q["targets"])))
  if d.get("vision") is not None:
    v = dict(d["vision"])
    d["vision"] = VisionConfig(**dict(v, deepstack_indexes=tuple(v["deepstack_indexes"])))
  for name in ("layer_types", "dense_layers", "eos_token_ids", "mrope_section"):
    if name in d:
      d[name] = tuple(d[name])
  return ModelConfig(**d)


def save(path: str, cfg: ModelConfig, params) -> None:
  """Writes cfg and params under `path` (created; must not hold a checkpoint)."""
  path = os.path.abspath(path)
  if os.path.exists(os.path.join(path, "params")):
    raise ValueError(f"save: {path} already holds a checkpoint")
  _check_matches(cfg, params)
  dtype = jax.tree.leaves(params)[0].dtype
  os.makedirs(path, exist_ok=True)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(path, "params"), params)
    ckptr.wait_until_finished()
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(dict(config=config_to_dict(cfg), param_dtype=jnp.dtype(dtype).name), f, indent=1)


def restore(path: str, *, shardings=None, dtype=None):
  """-> (cfg, params). `shardings`: a Sharding or a tree matching the params
  (default: the first local device). `dtype`: cast on read (default: as saved)."""
  path = os.path.abspath(path)
  meta_path = os.path.join(path, "config.json")
  if not os.path.exists(meta_path) or not os.path.isdir(os.path.join(path, "params")):
    raise FileNotFoundError(f"restore: {path} is not a jaxinfer checkpoint (config.json + params/)")
  with open(meta_path) as f:
    meta = json.load(f)
  cfg = config_from_dict(meta["config"])
  abstract = abstract_params(cfg, dtype or meta["param_dtype"])
  if shardings is None:
    shardings = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree.map(lambda _: shardings, abstract)
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)
  with ocp.StandardCheckpointer() as ckptr:
    params = ckptr.restore(os.path.join(path, "params"), target)
  return cfg, params


def _check_matches(cfg: ModelConfig, params) -> None:
  expected = abstract_params(cfg)
  got_struct, want_struct = jax.tree.structure(params), jax.tree.structure(expected)
  if got_struct != want_struct:
    raise ValueError(f"save: params tree does not match cfg's spec tree:\n{got_struct}\nvs\n{want_struct}")
  for (kp, a), e in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(expected)):
    if a.shape != e.shape:
      raise ValueError(f"save: param {jax.tree_util.keystr(kp)} has shape {a.shape}, cfg says {e.shape}")
