"""The parity tests can fail: a wrong rotary embedding misses HF's logits by
far more than their 1e-4 tolerance.

For each fixture, every rotary variant it uses is perturbed the way a loader
or kernel could get it wrong (the other pair layout, theta, the scaling
dropped, a scaling parameter misread, MRoPE sections shifted by one), and the
perturbed model's distance to the reference logits must be at least MARGIN
times the tolerance, while the unperturbed model stays inside it. The GPT-OSS
YaRN `truncate=False` case is built live (its fixture's correction range is
integral, so truncation cannot show there)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES
from jaxinfer import checkpoint, models
from jaxinfer.checkpoint import hf_build
from jaxinfer.models import multimodal

TOL, MARGIN = 1e-4, 30


def rel_err(ours, ref):
  return float(np.max(np.abs(np.asarray(ours) - ref)) / np.max(np.abs(ref)))


def _scaled(cfg, **kw):
  return dataclasses.replace(cfg, rope_scaling=dataclasses.replace(cfg.rope_scaling, **kw))


def perturbations(cfg) -> dict:
  """name -> a config whose rotary embedding is wrong in one way."""
  out = {"pair_layout": dataclasses.replace(cfg, rope_interleave=not cfg.rope_interleave),
         "theta_x2": dataclasses.replace(cfg, rope_theta=2 * cfg.rope_theta)}
  rs = cfg.rope_scaling
  if rs is not None:
    out["scaling_dropped"] = dataclasses.replace(cfg, rope_scaling=None)
    if rs.kind == "llama3":
      out["llama3_freq_factors_swapped"] = _scaled(
          cfg, low_freq_factor=rs.high_freq_factor, high_freq_factor=rs.low_freq_factor)
    if rs.kind == "yarn":
      out["yarn_mscale_dropped"] = _scaled(cfg, mscale=None, mscale_all_dim=None,
                                           attention_factor=1.0)
      out["yarn_betas_swapped"] = _scaled(cfg, beta_fast=rs.beta_slow, beta_slow=rs.beta_fast)
      if not rs.truncate:
        out["yarn_truncated"] = _scaled(cfg, truncate=True)
  if cfg.mrope_section:
    t, h, w = cfg.mrope_section
    out["mrope_sections_shifted"] = dataclasses.replace(cfg, mrope_section=(t + 1, h - 1, w))
  return out


def _check(cfg, logits_fn, ref):
  assert rel_err(logits_fn(cfg), ref) <= TOL
  errs = {name: rel_err(logits_fn(c), ref) for name, c in perturbations(cfg).items()}
  weak = {k: f"{v:.1e} ({v / TOL:.0f}x)" for k, v in errs.items() if v < MARGIN * TOL}
  assert not weak, f"perturbations within {MARGIN}x the tolerance: {weak}"
  return errs


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen3_moe", "deepseek_v3",
                                  "deepseek_v2lite", "gpt_oss"])
def test_text_fixture_parity_fails_under_every_rotary_perturbation(name):
  d = FIXTURES / "hf" / name
  cfg, params = checkpoint.load_hf(str(d), dtype=jnp.float32)
  tokens, ref = np.load(d / "tokens.npy"), np.load(d / "logits.npy")
  errs = _check(cfg, lambda c: models.logits(c, params, tokens), ref)
  assert "pair_layout" in errs and (cfg.rope_scaling is None or "scaling_dropped" in errs)


@pytest.mark.parametrize("name,case", [("qwen3_vl", "two_images"), ("qwen3_vl", "image_video"),
                                       ("qwen3_vl_moe", "two_images")])
def test_vl_fixture_parity_fails_under_every_rotary_perturbation(name, case):
  cfg, params = checkpoint.load_hf(str(FIXTURES / "hf_vl" / name), dtype=jnp.float32)
  f = dict(np.load(FIXTURES / "hf_vl" / name / f"{case}.npz"))
  grids = dict(image_grid_thw=f.get("image_grid_thw"), video_grid_thw=f.get("video_grid_thw"))

  def logits(c):
    return multimodal.vl_logits(c, params, f["tokens"], f["pixel_values"],
                                pixel_values_videos=f.get("pixel_values_videos"), **grids)[0]
  assert "mrope_sections_shifted" in _check(cfg, logits, f["logits"])


def test_gpt_oss_yarn_truncate_false_shows(tmp_path):
  """A GPT-OSS whose YaRN correction range is fractional (original context
  96, beta_fast 4: the range is [1.72, 3.51], [1, 4] when truncated)."""
  import torch
  rope = dict(rope_type="yarn", rope_theta=500.0, factor=4.0, original_max_position_embeddings=96,
              beta_fast=4.0, beta_slow=1.0, truncate=False)
  model = hf_build.build_model("gpt_oss", seed=5, overrides=dict(rope_parameters=rope))
  model.save_pretrained(tmp_path, safe_serialization=True)
  tokens = np.random.default_rng(5).integers(0, model.config.vocab_size, (2, 12))
  with torch.no_grad():
    ref = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
  cfg, params = checkpoint.load_hf(str(tmp_path), dtype=jnp.float32)
  errs = _check(cfg, lambda c: models.logits(c, params, tokens.astype(np.int32)), ref)
  assert "yarn_truncated" in errs


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rotation_is_hf_rotate_half_bit_for_bit(interleave, dtype):
  """`layers.apply_rope` (one fusion: x * [c, c] + the swapped halves x
  [-s, s]) gives exactly HF's x * cos + rotate_half(x) * sin, the two
  halves computed apart and concatenated."""
  from jaxinfer.models.layers import apply_rope
  r = np.random.default_rng(0)
  x = jnp.asarray(r.standard_normal((2, 5, 3, 16)), dtype)
  ang = jnp.asarray(r.uniform(0, 50, (2, 5, 8)), jnp.float32)
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  xr = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1) if interleave else x
  x1, x2 = xr[..., :8].astype(jnp.float32), xr[..., 8:].astype(jnp.float32)
  c, s = cos[:, :, None], sin[:, :, None]
  want = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(dtype)
  got = apply_rope(x, cos, sin, interleave)
  assert got.dtype == dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
