"""Checkpoint import errors, MTP loading and the orbax round trip."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import FIXTURES
from jaxinfer import checkpoint, models, presets
from jaxinfer.checkpoint import CheckpointError


def _copy(name, tmp_path):
  dst = tmp_path / name
  shutil.copytree(FIXTURES / "hf" / name, dst)
  return dst


def _edit(d, fn):
  tensors = load_file(d / "model.safetensors")
  fn(tensors)
  save_file(tensors, d / "model.safetensors")


Q = "model.layers.1.self_attn.q_proj.weight"


def test_missing_tensor_is_named(tmp_path):
  d = _copy("llama", tmp_path)
  _edit(d, lambda t: t.pop(Q))
  with pytest.raises(CheckpointError, match=f"missing tensor '{Q}'"):
    checkpoint.load_hf(str(d))


def test_unexpected_tensor_is_named(tmp_path):
  d = _copy("llama", tmp_path)
  _edit(d, lambda t: t.update({"model.layers.0.mystery.weight": np.zeros(3, np.float32)}))
  with pytest.raises(CheckpointError, match="model.layers.0.mystery.weight"):
    checkpoint.load_hf(str(d))


def test_wrong_shape_is_named(tmp_path):
  d = _copy("llama", tmp_path)
  _edit(d, lambda t: t.update({Q: t[Q][:-1]}))
  with pytest.raises(CheckpointError, match=rf"'{Q}' has shape \[63, 64\], expected \[64, 64\]"):
    checkpoint.load_hf(str(d))


def test_config_mismatching_tensors_is_named(tmp_path):
  d = _copy("llama", tmp_path)
  cfg = json.loads((d / "config.json").read_text())
  cfg["intermediate_size"] = 100
  (d / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match="mlp.*shape"):
    checkpoint.load_hf(str(d))


def test_wrong_dtype_is_named(tmp_path):
  d = _copy("llama", tmp_path)
  _edit(d, lambda t: t.update({Q: t[Q].astype(np.int32)}))
  with pytest.raises(CheckpointError, match=f"'{Q}' has dtype I32"):
    checkpoint.load_hf(str(d))


def test_truncated_file(tmp_path):
  d = _copy("llama", tmp_path)
  f = d / "model.safetensors"
  f.write_bytes(f.read_bytes()[:-1000])
  with pytest.raises(CheckpointError, match="cannot read model.safetensors"):
    checkpoint.load_hf(str(d))


def test_unreadable_file(tmp_path):
  d = _copy("llama", tmp_path)
  (d / "model.safetensors").write_bytes(b"not a safetensors file at all")
  with pytest.raises(CheckpointError, match="cannot read model.safetensors"):
    checkpoint.load_hf(str(d))


def test_truncated_shard_and_missing_shard(tmp_path):
  d = _copy("llama_sharded", tmp_path)
  shard = sorted(d.glob("*.safetensors"))[2]
  shard.write_bytes(shard.read_bytes()[:-10])
  with pytest.raises(CheckpointError, match=f"cannot read {shard.name}"):
    checkpoint.load_hf(str(d))
  shard.unlink()
  with pytest.raises(CheckpointError, match=f"lists {shard.name}, which does not exist"):
    checkpoint.load_hf(str(d))


def test_missing_dir_config_and_bad_json(tmp_path):
  with pytest.raises(FileNotFoundError, match="not a directory"):
    checkpoint.load_hf(str(tmp_path / "nope"))
  with pytest.raises(FileNotFoundError, match="no config.json"):
    checkpoint.load_hf(str(tmp_path))
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(CheckpointError, match="invalid JSON"):
    checkpoint.load_hf(str(tmp_path))


def test_sharded_checkpoint_equals_single_file():
  _, a = checkpoint.load_hf(str(FIXTURES / "hf" / "llama"))
  _, b = checkpoint.load_hf(str(FIXTURES / "hf" / "llama_sharded"))
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_fused_expert_layout_loads_identically(tmp_path):
  """transformers 5's in-memory layout: experts.gate_up_proj [E, 2F, D], down_proj [E, D, F]."""
  d = _copy("qwen3_moe", tmp_path)
  cfg, ref = checkpoint.load_hf(str(d))

  def fuse(t):
    for layer in (0, 2):
      p = f"model.layers.{layer}.mlp.experts"
      E = cfg.num_experts
      gate = [t.pop(f"{p}.{e}.gate_proj.weight") for e in range(E)]
      up = [t.pop(f"{p}.{e}.up_proj.weight") for e in range(E)]
      down = [t.pop(f"{p}.{e}.down_proj.weight") for e in range(E)]
      t[f"{p}.gate_up_proj"] = np.concatenate([np.stack(gate), np.stack(up)], axis=1)
      t[f"{p}.down_proj"] = np.stack(down)

  _edit(d, fuse)
  _, fused = checkpoint.load_hf(str(d))
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(ref), jax.tree.leaves(fused)))


def test_deepseek_mtp_layer_loads_when_present(tmp_path):
  d = _copy("deepseek_v3", tmp_path)
  cfg, _ = checkpoint.load_hf(str(d))
  assert cfg.num_mtp_layers == 0  # save_pretrained dropped the MTP weights
  L, D = cfg.num_layers, cfg.d_model
  rng = np.random.default_rng(0)

  def add_mtp(t):
    for name in list(t):
      if name.startswith(f"model.layers.{L - 1}."):  # an MoE block, as the MTP block is
        t[name.replace(f"layers.{L - 1}.", f"layers.{L}.")] = t[name] + 0.5
    t[f"model.layers.{L}.enorm.weight"] = rng.normal(size=D).astype(np.float32)
    t[f"model.layers.{L}.hnorm.weight"] = rng.normal(size=D).astype(np.float32)
    t[f"model.layers.{L}.eh_proj.weight"] = rng.normal(size=(D, 2 * D)).astype(np.float32)
    t[f"model.layers.{L}.shared_head.norm.weight"] = rng.normal(size=D).astype(np.float32)
    t[f"model.layers.{L}.shared_head.head.weight"] = t["lm_head.weight"]
    t[f"model.layers.{L}.embed_tokens.weight"] = t["model.embed_tokens.weight"]

  _edit(d, add_mtp)
  tensors = load_file(d / "model.safetensors")
  cfg, params = checkpoint.load_hf(str(d))
  assert cfg.num_mtp_layers == 1
  mtp = params["mtp"]
  np.testing.assert_array_equal(mtp["eh_proj"][0], tensors[f"model.layers.{L}.eh_proj.weight"].T)
  np.testing.assert_array_equal(mtp["block"]["mlp"]["w_gate"][0, 2],
                                tensors[f"model.layers.{L}.mlp.experts.2.gate_proj.weight"].T)
  np.testing.assert_array_equal(mtp["norm"][0], tensors[f"model.layers.{L}.shared_head.norm.weight"])


def test_orbax_round_trip_is_bit_exact(tmp_path):
  cfg, params = checkpoint.load_hf(str(FIXTURES / "hf" / "gpt_oss"))
  checkpoint.save(str(tmp_path / "ck"), cfg, params)
  cfg2, params2 = checkpoint.restore(str(tmp_path / "ck"))
  assert cfg2 == cfg
  assert jax.tree.structure(params2) == jax.tree.structure(params)
  assert all(np.array_equal(x, y) and x.dtype == y.dtype
             for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(params2)))
  with pytest.raises(ValueError, match="already holds a checkpoint"):
    checkpoint.save(str(tmp_path / "ck"), cfg, params)


def test_orbax_restore_into_shardings(tmp_path):
  cfg = presets.get("tiny_moe")
  params = models.init_params(cfg, jax.random.key(0))
  checkpoint.save(str(tmp_path / "ck"), cfg, params)
  mesh = jax.make_mesh((8,), ("x",))
  shard_rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  shardings = jax.tree.map(lambda _: replicated, params)
  shardings["embed"] = shard_rows  # [V=256, D]: vocab rows over 8 devices
  _, restored = checkpoint.restore(str(tmp_path / "ck"), shardings=shardings)
  assert restored["embed"].sharding == shard_rows
  assert len(restored["embed"].addressable_shards) == 8
  assert restored["embed"].addressable_shards[0].data.shape == (32, cfg.d_model)
  np.testing.assert_array_equal(restored["embed"], params["embed"])
  _, bf16 = checkpoint.restore(str(tmp_path / "ck"), dtype=jnp.bfloat16)
  assert bf16["embed"].dtype == jnp.bfloat16


def test_restore_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="not a jaxinfer checkpoint"):
    checkpoint.restore(str(tmp_path))
  cfg = presets.get("tiny_dense")
  params = models.init_params(cfg, jax.random.key(0))
  with pytest.raises(ValueError, match="does not match"):
    checkpoint.save(str(tmp_path / "x"), presets.get("tiny_moe"), params)


def test_load_hf_into_shardings():
  mesh = jax.make_mesh((8,), ("x",))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  _, params = checkpoint.load_hf(str(FIXTURES / "hf" / "mixtral"), shardings=replicated)
  assert params["embed"].sharding == replicated


def test_bf16_checkpoint_loads_as_float32_and_bfloat16(tmp_path):
  import ml_dtypes
  d = _copy("llama", tmp_path)
  _edit(d, lambda t: t.update({k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()}))
  ref = load_file(d / "model.safetensors")["model.embed_tokens.weight"]
  _, p32 = checkpoint.load_hf(str(d), dtype=jnp.float32)
  _, p16 = checkpoint.load_hf(str(d), dtype=jnp.bfloat16)
  assert p32["embed"].dtype == jnp.float32 and p16["embed"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(p32["embed"]), ref.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(p16["embed"]).view(np.uint16), ref.view(np.uint16))
