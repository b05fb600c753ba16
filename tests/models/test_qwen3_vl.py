"""Qwen3-VL / Qwen3-VL-MoE against transformers (committed fixtures made by
tests/fixtures/make_vl_fixtures.py: tiny random checkpoints, HF processor
pixels, HF rope positions, vision features and logits at float32), the
image processor against HF's, and named errors for bad input."""

import dataclasses
import io
import json

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from conftest import FIXTURES
from jaxinfer import checkpoint, models, vision_inputs
from jaxinfer.config import ModelConfig
from jaxinfer.models import multimodal

VL = FIXTURES / "hf_vl"
CASES = [("qwen3_vl", "two_images"), ("qwen3_vl", "image_video"), ("qwen3_vl_moe", "two_images")]
PROC = json.loads((VL / "processor.json").read_text())
PROC_CFG = vision_inputs.ProcessorConfig(
    **{k: v for k, v in PROC.items() if k != "images"})


def rel_err(ours, ref):
  return float(np.max(np.abs(np.asarray(ours) - ref)) / np.max(np.abs(ref)))


def png(h, w, seed) -> bytes:
  """The fixture generator's images: seeded uint8 noise as PNG bytes."""
  arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
  buf = io.BytesIO()
  Image.fromarray(arr).save(buf, format="PNG")
  return buf.getvalue()


@pytest.fixture(scope="module")
def loaded():
  cache = {}

  def get(name):
    if name not in cache:
      cache[name] = checkpoint.load_hf(str(VL / name), dtype=jnp.float32)
    return cache[name]
  return get


def test_config_from_hf():
  cfg = ModelConfig.from_hf(json.loads((VL / "qwen3_vl_moe" / "config.json").read_text()))
  assert cfg.mrope_section == (2, 3, 3) and cfg.qk_norm and cfg.norm_topk_prob
  assert cfg.vision.deepstack_indexes == (0, 2) and cfg.vision.patch_dim == 3 * 2 * 4 * 4
  assert cfg.dense_layers == (1,) and not cfg.tie_embeddings
  hf = json.loads((VL / "qwen3_vl" / "config.json").read_text())
  hf["vision_config"]["window_size"] = 112
  with pytest.raises(ValueError, match="vision_config keys.*window_size"):
    ModelConfig.from_hf(hf)


def test_config_round_trips_through_orbax_metadata():
  import json as json_lib
  from jaxinfer.checkpoint.orbax_io import config_from_dict, config_to_dict
  cfg = ModelConfig.from_hf(json.loads((VL / "qwen3_vl" / "config.json").read_text()))
  assert config_from_dict(json_lib.loads(json_lib.dumps(config_to_dict(cfg)))) == cfg


def test_config_old_rope_scaling_form():
  """Published Qwen3-VL configs carry rope_theta + rope_scaling (with the
  MRoPE keys) in text_config, and vision model_type qwen3_vl_moe."""
  hf = json.loads((VL / "qwen3_vl_moe" / "config.json").read_text())
  text = hf["text_config"]
  rope = text.pop("rope_parameters")
  text.update(rope_theta=5e6, rope_scaling=dict(rope, rope_theta=None, mrope_section=[4, 2, 2]))
  del text["rope_scaling"]["rope_theta"]
  hf["vision_config"]["model_type"] = "qwen3_vl_moe"
  cfg = ModelConfig.from_hf(hf)
  assert cfg.rope_theta == 5e6 and cfg.mrope_section == (4, 2, 2)
  text["rope_scaling"]["mrope_interleaved"] = False
  with pytest.raises(ValueError, match="mrope_interleaved"):
    ModelConfig.from_hf(hf)


@pytest.mark.parametrize("name,case", CASES)
def test_matches_hf(loaded, name, case):
  cfg, params = loaded(name)
  f = dict(np.load(VL / name / f"{case}.npz"))
  grids = dict(image_grid_thw=f.get("image_grid_thw"), video_grid_thw=f.get("video_grid_thw"))
  positions, _ = multimodal.rope_positions(cfg, f["tokens"], **grids)
  np.testing.assert_array_equal(positions, f["positions"])
  feats, deep = multimodal.encode_images(cfg, params, f["pixel_values"], f["image_grid_thw"])
  assert rel_err(feats, f["image_embeds"]) <= 1e-4
  assert deep.shape == f["image_deepstack"].shape and rel_err(deep, f["image_deepstack"]) <= 1e-4
  logits = multimodal.vl_logits(cfg, params, f["tokens"], f["pixel_values"],
                                pixel_values_videos=f.get("pixel_values_videos"), **grids)
  assert rel_err(logits[0], f["logits"]) <= 1e-4


@pytest.mark.parametrize("name,case", CASES)
def test_placeholder_expansion_matches_hf_prompt(loaded, name, case):
  """The fixture prompts (make_vl_fixtures.run_case) with one pad per image
  and video expand to HF's token ids."""
  cfg, _ = loaded(name)
  vc = cfg.vision
  f = np.load(VL / name / f"{case}.npz")
  image = [vc.vision_start_token_id, vc.image_token_id, vc.vision_end_token_id]
  video = [vc.video_token_id] if "video_grid_thw" in f else []
  n_images = len(f["image_grid_thw"])
  collapsed = [5, 6, *image, 7, 8, 9] + (image if n_images > 1 else []) + video + [10, 11]
  out = multimodal.expand_placeholders(cfg, collapsed, f["image_grid_thw"],
                                       f["video_grid_thw"] if video else None)
  assert out == f["tokens"][0].tolist()


def test_cached_greedy_equals_full_forwards(loaded):
  """Prefill in chunks of 5 (chunks end inside both images), then greedy
  decode with MRoPE positions continuing from the prompt's deltas: the
  tokens of repeated full forwards, and the prefill logits of one."""
  cfg, params = loaded("qwen3_vl")
  f = np.load(VL / "qwen3_vl" / "two_images.npz")
  tokens, pixels, grid = f["tokens"], f["pixel_values"], f["image_grid_thw"]
  T = tokens.shape[1]
  visual = multimodal.visual_inputs(cfg, params, tokens, pixels, grid)
  _, deltas = multimodal.rope_positions(cfg, tokens, grid)
  cache = models.init_cache(cfg, batch=1, max_len=T + 4)
  chunks = []
  for s in range(0, T, 5):
    logits, cache = multimodal.vl_forward(cfg, params, multimodal.slice_inputs(visual, s, s + 5), cache)
    chunks.append(np.asarray(logits))
  assert rel_err(np.concatenate(chunks, axis=1)[0], f["logits"]) <= 1e-4
  seq, cached, step_logits = tokens[0].tolist(), [], []
  for _ in range(4):
    cached.append(int(np.argmax(logits[0, -1])))
    step = multimodal.text_inputs(cfg, params, [[cached[-1]]], [[len(seq) + len(cached) - 1 + deltas[0]]])
    logits, cache = multimodal.vl_forward(cfg, params, step, cache)
    step_logits.append(np.asarray(logits[0, -1]))
  full = []
  for _ in range(4):
    out = multimodal.vl_logits(cfg, params, np.array([seq + full]), pixels, grid)
    full.append(int(np.argmax(out[0, -1])))
  assert cached == full
  last = multimodal.vl_logits(cfg, params, np.array([seq + full]), pixels, grid)[0, T:]
  assert rel_err(np.stack(step_logits), np.asarray(last)) <= 1e-4
  assert deltas[0] < 0  # the images' tokens take fewer positions than tokens: the delta matters


def test_expert_parallel_matches_hf(loaded):
  """The MoE model with its experts split over 4 CPU devices (tp_attn_ep;
  the vision tower replicated) gives HF's logits."""
  import jax
  from jaxinfer import sharding
  cfg, params = loaded("qwen3_vl_moe")
  f = np.load(VL / "qwen3_vl_moe" / "two_images.npz")
  mesh = sharding.make_mesh({"expert": 4}, devices=jax.devices()[:4])
  placed = sharding.shard_params(cfg, params, mesh, layout="tp_attn_ep")
  assert placed["layers"][0]["mlp"]["w_gate"].sharding.spec[1] == "expert"
  logits = multimodal.vl_logits(cfg, placed, f["tokens"], f["pixel_values"], f["image_grid_thw"])
  assert rel_err(logits[0], f["logits"]) <= 1e-4


def test_encoder_cache_encodes_each_image_once(loaded):
  from jaxinfer.engine.encoder_cache import EncoderCache, image_hash, split_images
  cfg, params = loaded("qwen3_vl")
  f = np.load(VL / "qwen3_vl" / "two_images.npz")
  tokens, pixels, grid = f["tokens"], f["pixel_values"], f["image_grid_thw"]
  cache = EncoderCache(cfg, params)
  first = multimodal.visual_inputs(cfg, params, tokens, pixels, grid, encoder=cache.encode)
  again = multimodal.visual_inputs(cfg, params, tokens, pixels, grid, encoder=cache.encode)
  assert cache.stats() == dict(hits=2, misses=2, entries=2, tokens=len(f["image_embeds"]),
                               hit_rate=0.5)
  for a, b in ((first.embeds, again.embeds), (first.deepstack, again.deepstack)):
    np.testing.assert_array_equal(a, b)
  # Images encoded one at a time give the batch's features.
  assert rel_err(cache.encode(pixels, grid)[0], f["image_embeds"]) <= 1e-4
  (p0, g0), (p1, g1) = split_images(pixels, grid)
  assert image_hash(p0, g0) != image_hash(p1, g1)
  assert image_hash(p0, g0) != image_hash(p0 + 1e-3, g0)
  small = EncoderCache(cfg, params, max_tokens=20)  # 15 + 10 tokens: the first is evicted
  small.encode(pixels, grid)
  assert small.stats()["entries"] == 1 and small.stats()["tokens"] == 10


def test_processor_matches_hf():
  images = [png(*spec) for spec in PROC["images"]]
  ref = np.load(VL / "processor.npz")
  pixels, grids = vision_inputs.process_images(images, PROC_CFG)
  np.testing.assert_array_equal(grids, ref["image_grid_thw"])
  np.testing.assert_array_equal(pixels, ref["pixel_values"])  # bit-exact
  # Aspect ratios kept, areas within [min_pixels, max_pixels] after rounding.
  for (h, w, _), (t, gh, gw) in zip(PROC["images"], grids):
    area = gh * gw * PROC_CFG.patch_size ** 2
    assert t == 1 and PROC_CFG.min_pixels <= area <= PROC_CFG.max_pixels
    assert abs(gh / gw - h / w) / (h / w) < 0.5


def test_video_frames_are_temporal_patches():
  frame = np.asarray(Image.open(io.BytesIO(png(20, 28, 7))))
  image_pixels, image_grid = vision_inputs.process_images([frame], PROC_CFG)
  video_pixels, video_grid = vision_inputs.process_video([frame, frame], PROC_CFG)
  assert tuple(image_grid[0]) == video_grid
  np.testing.assert_array_equal(video_pixels, image_pixels)
  # 3 frames pad to 4 with the last: 2 temporal patches, the second [f2, f2].
  frames = [np.asarray(Image.open(io.BytesIO(png(20, 28, s)))) for s in (1, 2, 3)]
  pixels, grid = vision_inputs.process_video(frames, PROC_CFG)
  last, _ = vision_inputs.process_images([frames[2]], PROC_CFG)
  assert grid[0] == 2 and pixels.shape[0] == 2 * grid[1] * grid[2]
  np.testing.assert_array_equal(pixels[pixels.shape[0] // 2:], last)


def test_text_only_prompt_is_plain_rope(loaded):
  """Without images MRoPE's three positions agree: the text model's logits."""
  cfg, params = loaded("qwen3_vl")
  tokens = np.arange(3, 15, dtype=np.int32)[None]
  np.testing.assert_allclose(multimodal.vl_logits(cfg, params, tokens),
                             models.logits(cfg, params, tokens), rtol=1e-5, atol=1e-5)


def test_corrupt_image():
  data = png(24, 40, 1)
  for bad in (b"not an image at all", data[: len(data) // 2]):
    with pytest.raises(vision_inputs.ImageError, match="cannot decode image"):
      vision_inputs.process_images([bad], PROC_CFG)


def test_too_many_pixels():
  small = dataclasses.replace(PROC_CFG, max_input_pixels=1000)
  with pytest.raises(vision_inputs.ImageError, match="max_input_pixels 1000"):
    vision_inputs.process_images([png(40, 30, 1)], small)
  with pytest.raises(vision_inputs.ImageError, match="aspect ratio"):
    vision_inputs.process_images([np.zeros((1, 300, 3), np.uint8)], PROC_CFG)


def test_placeholder_count_mismatch(loaded):
  cfg, params = loaded("qwen3_vl")
  f = np.load(VL / "qwen3_vl" / "two_images.npz")
  img = cfg.vision.image_token_id
  with pytest.raises(ValueError, match="1 image placeholders .* for 2 images"):
    multimodal.expand_placeholders(cfg, [5, img, 6], f["image_grid_thw"])
  tokens = f["tokens"].copy()
  tokens[0, np.nonzero(tokens[0] == img)[0][0]] = 7  # one visual token fewer
  with pytest.raises(ValueError, match="placeholder tokens"):
    multimodal.vl_logits(cfg, params, tokens, f["pixel_values"], f["image_grid_thw"])


def test_image_sent_to_text_only_model():
  cfg = ModelConfig.from_hf(json.loads((FIXTURES / "hf" / "qwen3_moe" / "config.json").read_text()))
  pixels, grid = vision_inputs.process_images([png(24, 40, 1)], PROC_CFG)
  with pytest.raises(ValueError, match="text-only model"):
    multimodal.expand_placeholders(cfg, [1, 2], grid)
  with pytest.raises(ValueError, match="text-only model"):
    multimodal.vl_logits(cfg, {}, np.ones((1, 4), np.int32), pixels, grid)
