"""`Backend`: validation naming the bad value, resolution against this (CPU)
process, its place in `ModelConfig` (static, saved, kept by `to_hf`), and
the Mosaic kernel choice `ops.mosaic_kernel` and the defaults a Hopper
compile target gets."""

import dataclasses
import importlib.util
import json

import jax
import pytest

import jaxinfer
from jaxinfer import (Backend, Engine, EngineConfig, ModelConfig, gpu_compile, hf_config, models,
                      ops, presets)
from jaxinfer.checkpoint.orbax_io import config_from_dict, config_to_dict
from pallas_kernels import mosaic_paged_attention as mpa


def test_bad_values_raise_naming_the_field_and_the_value():
  with pytest.raises(ValueError, match=r"Backend.attention .*'triton'"):
    Backend(attention="triton")
  with pytest.raises(ValueError, match=r"Backend.target .*'tpu'"):
    Backend(target="tpu")
  with pytest.raises(TypeError):
    Backend("pallas")  # keyword-only
  with pytest.raises(ValueError, match="backend must be a jaxinfer.Backend, got str"):
    presets.get("tiny_dense", backend="pallas")


@pytest.mark.parametrize("field", ["dense_attention", "grouped_matmul"])
def test_tokamax_without_the_package_is_named(monkeypatch, field):
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "tokamax" else find_spec(name, *a))
  with pytest.raises(ValueError, match=rf"Backend.{field}='tokamax' needs the tokamax package "
                                       r".*jaxinfer\[tokamax\].*Python >= 3.12"):
    Backend(**{field: "tokamax"})


def test_resolution_on_this_cpu_process():
  assert jax.default_backend() == "cpu"
  assert Backend().resolved_target() == "cpu" and not Backend().on_gpu()
  assert Backend(target="gpu").resolved_target() == "gpu" and Backend(target="gpu").on_gpu()
  # (attention kernel, interpret): auto is Pallas for a GPU target, XLA otherwise.
  assert Backend().attention_kernel() == ("xla", True)
  assert Backend(target="gpu").attention_kernel() == ("pallas", False)
  assert Backend(attention="pallas").attention_kernel() == ("pallas", True)
  assert Backend(attention="xla", target="gpu").attention_kernel() == ("xla", False)
  assert Backend(attention="mosaic", target="gpu").attention_kernel() == ("mosaic", False)


def test_a_frozen_hashable_value_and_a_distinct_static_config():
  assert jaxinfer.Backend is jaxinfer.backend.Backend
  assert Backend(target="gpu") == Backend(target="gpu") != Backend()
  assert len({Backend(), Backend(), Backend(attention="xla")}) == 2
  with pytest.raises(dataclasses.FrozenInstanceError):
    Backend().target = "gpu"
  cfg = presets.get("tiny_dense")
  assert cfg.backend == Backend()
  gpu = dataclasses.replace(cfg, backend=Backend(target="gpu"))
  assert hash(gpu) != hash(cfg) and gpu != cfg


def test_saved_configs_keep_the_backend_and_read_the_old_fields():
  cfg = presets.get("tiny_moe", backend=Backend(attention="pallas", target="cpu"))
  assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg
  old = {k: v for k, v in config_to_dict(cfg).items() if k != "backend"}
  old.update(attention_impl="mosaic", kernel_target="gpu")  # saved before Backend
  assert config_from_dict(old).backend == Backend(attention="mosaic", target="gpu")


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
def test_to_hf_round_trip_keeps_the_backend(name):
  cfg = presets.get(name, backend=Backend(attention="xla", target="gpu"))
  hf = hf_config.to_hf(cfg)
  assert "backend" not in hf and ModelConfig.from_hf(hf).backend == Backend()
  assert dataclasses.replace(ModelConfig.from_hf(hf), backend=cfg.backend) == cfg


def test_mosaic_kernel_choice():
  gqa = dict(q_shape=(8, 8, 64), dtype="bfloat16", k_pages_shape=(2, 64, 16, 64), values_dim=64)
  mla = dict(q_shape=(8, 16, 96), dtype="bfloat16", k_pages_shape=(1, 64, 64, 96), latent_dim=64)
  # MLA's kernel takes decode and verify steps (up to 8 row blocks of max_q x heads),
  # without window, sinks or quantized pages.
  assert ops.mosaic_kernel(**mla, max_q=33)[1].startswith(
      "MLA step with max_q 33 x 16 heads = 528 query rows > 512")
  # On work items (the "mla_items" trial) any step.
  assert ops.mosaic_kernel(**mla, max_q=512, items=True) == (
      (None, mpa.available()) if mpa.available() else ("mla", None))
  for bad in (dict(window=128), dict(sinks=True), dict(quantized=True)):
    kernel, why = ops.mosaic_kernel(**mla, **bad)
    assert kernel is None and "window" in why
  # float32 queries: no wgmma inputs, on any jax.
  assert ops.mosaic_kernel(**dict(gqa, dtype="float32"))[0] is None
  missing = mpa.available()  # jax < 0.11: no Mosaic GPU kernels, named
  for max_q in (1, 2, 64):  # GQA: decode-only and mixed steps alike
    assert ops.mosaic_kernel(**gqa, max_q=max_q) == ((None, missing) if missing else ("gqa", None))
  for max_q in (1, 4, 32):
    assert ops.mosaic_kernel(**mla, max_q=max_q) == ((None, missing) if missing else
                                                     ("mla", None))


def test_default_kernels_follow_the_target_gpu():
  """attention / grouped_matmul None: Mosaic for a Hopper target on a jax
  with Mosaic GPU, Triton (and XLA's ragged_dot) for an A100 or on jax
  0.10, read from the compile target while a program is lowered for it."""
  hopper = mpa.available() is None
  for gpu, mosaic in (("h100", hopper), ("a100", False)):
    with gpu_compile.lowering(gpu_compile.mesh({"data": 1}, gpu=gpu)):
      assert jaxinfer.backend.hopper_target() == (gpu == "h100")
      assert Backend(target="gpu").attention_kernel() == ("mosaic" if mosaic else "pallas", False)
      assert Backend(target="gpu").grouped_matmul_kernel() == ("mosaic" if mosaic else "xla")
      assert Backend(target="gpu", grouped_matmul="xla").grouped_matmul_kernel() == "xla"
      # The default keeps long prefill chunks on Triton (run 7); explicit "mosaic" takes all.
      shapes = ((8, 8, 64), "bfloat16", (2, 64, 16, 64), (4, 64))
      for max_q, backend, want in ((ops.MOSAIC_AUTO_MAX_Q, Backend(target="gpu"), mosaic),
                                   (ops.MOSAIC_AUTO_MAX_Q + 1, Backend(target="gpu"), False),
                                   (2048, Backend(target="gpu", attention="mosaic"), hopper)):
        kernel = ops.paged_kernel(*shapes, max_q=max_q, values_dim=64, backend=backend)[0]
        assert kernel == ("mosaic_gqa" if want else "pallas"), (gpu, max_q, kernel)
  with pytest.raises(ValueError, match=r"Backend.grouped_matmul .*'triton'"):
    Backend(grouped_matmul="triton")
  for bad in ("mla_cluster", ("wide",), 1):
    with pytest.raises(ValueError, match=r"Backend.trials must be a tuple of"):
      Backend(trials=bad)
  assert Backend(trials=["wide_items"]) == Backend(trials=("wide_items",))  # a saved list


def test_trial_variants_are_opt_in_and_only_where_they_apply():
  """Backend.trials: MLA decode as one cluster a sequence only for 2 to 8 row
  blocks of max_q x heads (128 heads: 2; 64: one block, nothing shared; 1024:
  more than a cluster holds) and MLA verify steps of several row
  blocks only as a cluster ("mla_items": MLA verify and mixed steps on work
  items); GQA wide items only for steps whose chunks fill
  more than one 64-row tile (not decode) and within shared memory, in
  clusters for those whose chunks fill more than one item of 4 tiles."""
  latent = (1, 64, 64, 576)  # [K, P, page_size, R + Hr]: the latent pool
  cases = [((8, 128, 576), latent, 1, (), "mosaic_mla"),
           ((8, 128, 576), latent, 1, ("mla_cluster",), "mosaic_mla_cluster"),
           ((8, 64, 576), latent, 1, ("mla_cluster",), "mosaic_mla"),
           ((8, 1024, 576), latent, 1, ("mla_cluster",), "mosaic_mla"),  # > 8 row blocks
           # Verify steps: 4 tokens x 16 heads are one row block; x 128 heads 8, read
           # once only as a cluster (else Triton); 8 tokens x 128 heads: 16 blocks.
           ((8, 16, 576), latent, 4, (), "mosaic_mla"),
           ((8, 128, 576), latent, 4, (), "pallas"),
           ((8, 128, 576), latent, 4, ("mla_cluster",), "mosaic_mla_cluster"),
           ((8, 128, 576), latent, 8, ("mla_cluster",), "pallas"),
           # "mla_items": verify and mixed steps on work items, decode as before.
           ((8, 128, 576), latent, 8, ("mla_items",), "mosaic_mla_items"),
           ((543, 128, 576), latent, 512, ("mla_items", "mla_cluster"), "mosaic_mla_items"),
           ((8, 16, 576), latent, 4, ("mla_items",), "mosaic_mla_items"),
           ((8, 128, 576), latent, 1, ("mla_items",), "mosaic_mla"),
           ((64, 32, 128), (8, 64, 16, 128), 64, ("wide_items",), "mosaic_gqa_wide"),
           ((64, 32, 128), (8, 64, 16, 128), 64, (), "mosaic_gqa"),
           ((64, 32, 128), (8, 64, 16, 128), 16, ("wide_items",), "mosaic_gqa"),  # one tile
           ((8, 32, 128), (8, 64, 16, 128), 1, ("wide_items",), "mosaic_gqa"),  # decode
           # Clusters where a chunk fills more than one item of 4 tiles (64 tokens at GQA 4).
           ((128, 32, 128), (8, 64, 16, 128), 128, ("cluster_items",), "mosaic_gqa_cluster"),
           ((64, 32, 128), (8, 64, 16, 128), 64, ("cluster_items",), "mosaic_gqa_wide"),
           ((8, 32, 128), (8, 64, 16, 128), 1, ("cluster_items",), "mosaic_gqa")]
  for q_shape, pool, max_q, trials, want in cases:
    backend = Backend(target="gpu", attention="mosaic", trials=trials)
    mla = pool is latent
    kernel = ops.paged_kernel(q_shape, "bfloat16", pool, (8, 16), max_q=max_q,
                              latent_dim=512 if mla else None, values_dim=None if mla else 128,
                              backend=backend)[0]
    assert kernel == (want if mpa.available() is None else "pallas"), (q_shape, trials, kernel)
  # Attention None keeps chunks past MOSAIC_AUTO_MAX_Q on Triton (or XLA where Triton
  # cannot tile them), but for the trials made for long chunks.
  long = ops.MOSAIC_AUTO_MAX_Q + 1
  for q_shape, pool, trials, want in (
      ((543, 128, 576), latent, ("mla_items",), "mosaic_mla_items"),
      ((543, 32, 128), (8, 64, 16, 128), ("cluster_items",), "mosaic_gqa_cluster"),
      ((543, 32, 128), (8, 64, 16, 128), ("wide_items",), None)):
    mla = pool is latent
    with gpu_compile.lowering(gpu_compile.mesh({"data": 1}, gpu="h100")):
      kernel, plain = (ops.paged_kernel(q_shape, "bfloat16", pool, (8, 16), max_q=long,
                                        latent_dim=512 if mla else None,
                                        values_dim=None if mla else 128,
                                        backend=Backend(target="gpu", trials=t))[0]
                       for t in (trials, ()))
    assert plain in ("pallas", "xla")
    assert kernel == (want if want and mpa.available() is None else plain), (trials, kernel)


def test_engine_stats_name_the_kernels_the_steps_run():
  """Engine.stats()["kernels"], read off the shapes as the ops read them:
  XLA on this CPU process; an explicit "mosaic" takes GQA steps of head dim
  64 (interpreted on CPU, jax >= 0.11) and MLA decode, Pallas otherwise."""
  small = EngineConfig(page_size=16, num_pages=16, max_num_seqs=2, max_num_batched_tokens=32)
  cfg = presets.get("tiny_moe")
  eng = Engine(cfg, models.init_params(cfg, jax.random.key(0)), small)
  assert eng.stats()["kernels"] == {"decode": "xla", "mixed": "xla", "grouped_matmul": "xla"}
  cfg = presets.get("tiny_dense", head_dim=64, dtype="bfloat16",
                    backend=Backend(attention="mosaic"))
  eng = Engine(cfg, models.init_params(cfg, jax.random.key(0)), small)
  want = "pallas" if mpa.available() else "mosaic_gqa"
  assert eng.stats()["kernels"] == {"decode": want, "mixed": want}
