"""The Engine with images (Qwen3-VL, the tiny float32 fixture checkpoint):
greedy tokens equal repeated full forwards (`multimodal.vl_logits`) through
chunked prefill inside an image, the prefix cache (a hit with the same
image, a miss with another), mixed text and image batches and tensor
parallelism; the encoder runs once per distinct image; bad input raises a
named error and the engine keeps serving."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vl_inputs import A, B, PROC, VL, png
from jaxinfer import Engine, EngineConfig, SamplingParams, checkpoint, models, sharding, vision_inputs
from jaxinfer.models import layers, multimodal, vision

IMG = 120  # the fixture's image placeholder id
PAD_T = 64  # reference forwards padded to one length (causal: padding after is unseen)


@pytest.fixture(scope="module")
def model():
  return checkpoint.load_hf(str(VL / "qwen3_vl"), dtype=jnp.float32)


def engine(model, **kw):
  cfg, params = model
  kw = dict(dict(page_size=4, num_pages=96, max_num_seqs=4, max_num_batched_tokens=32,
                 image_processor=PROC), **kw)
  return Engine(cfg, params, EngineConfig(**kw))


def reference(model, prompt, images, n):
  """Greedy by repeated full forwards on the growing sequence."""
  cfg, params = model
  pixels = grids = None
  if images:
    pixels, grids = vision_inputs.process_images(images, PROC)
  toks = multimodal.expand_placeholders(cfg, prompt, grids) if images else list(prompt)
  out = []
  for _ in range(n):
    seq = np.zeros((1, PAD_T), np.int32)
    seq[0, :len(toks)] = toks
    logits = multimodal.vl_logits(cfg, params, seq, pixels, grids)
    out.append(int(np.argmax(logits[0, len(toks) - 1])))
    toks.append(out[-1])
  return out


GREEDY = SamplingParams(max_tokens=5, temperature=0.0)
P1 = [1, 2, 3, IMG, 5, 6, 7]  # 3 + 15 + 3 = 21 tokens with image A
P2 = [9, IMG, 8, 7, IMG, 4]  # two images
P3 = [11, 12, 13, 14, 15, 16]  # text only


def test_mixed_batch_with_chunks_inside_images(model):
  """Chunks of 8: the first image's 15 tokens span three chunks; text and
  image requests share the steps."""
  eng = engine(model, prefill_chunk_size=8)
  outs = eng.generate([P1, P2, P3], GREEDY, images=[[A], [B, A], None])
  assert outs[0].metrics.prompt_tokens == 21
  for out, (p, im) in zip(outs, [(P1, [A]), (P2, [B, A]), (P3, None)]):
    assert out.token_ids == reference(model, p, im, GREEDY.max_tokens)


def test_mrope_over_equal_axes_is_rope(model):
  # What the text step relies on: a text token's three MRoPE axes are equal.
  cfg = model[0]
  p = jnp.asarray([[0, 5, 16, 200]], jnp.int32)
  for ours, ref in zip(layers.mrope_cos_sin(cfg, jnp.stack([p] * 3)), layers.rope_cos_sin(cfg, p)):
    np.testing.assert_array_equal(ours, ref)


def test_only_steps_with_visual_tokens_carry_visual_rows(model):
  """Chunks of 8 over 1 + 15 visual + 10 text tokens: the two chunks holding
  visual tokens carry visual rows; the text chunks after the image and the
  decode steps run the text step, rotated by the MRoPE position p + delta
  (delta -10 here) as plain RoPE. Tokens equal the full-forward reference."""
  P4 = [1, IMG] + list(range(20, 30))
  eng = engine(model, prefill_chunk_size=8)
  outs = eng.generate([P4, P3], GREEDY, images=[[A], None])
  assert outs[0].metrics.prompt_tokens == 26
  stats = eng.stats()
  assert stats["visual_steps"] == 2
  assert stats["steps"] == 4 + GREEDY.max_tokens - 1  # 4 prefill chunks, then decodes
  assert outs[0].token_ids == reference(model, P4, [A], GREEDY.max_tokens)
  assert outs[1].token_ids == reference(model, P3, None, GREEDY.max_tokens)


def test_prefix_cache_hits_same_image_misses_another(model):
  eng = engine(model)
  first = eng.generate([P1], GREEDY, images=[[A]])[0]
  assert first.metrics.cached_prompt_tokens == 0
  same = eng.generate([P1], GREEDY, images=[[A]])[0]
  assert same.metrics.cached_prompt_tokens == 20  # 5 full pages; the last token is computed
  assert same.token_ids == first.token_ids == reference(model, P1, [A], GREEDY.max_tokens)
  other = eng.generate([P1[:3] + [IMG] + P1[4:]], GREEDY, images=[[B]])[0]
  assert other.metrics.cached_prompt_tokens == 0  # page 0 already holds an image token
  assert other.token_ids == reference(model, P1, [B], GREEDY.max_tokens)
  assert eng.stats()["cached_prompt_tokens"] == 20


def test_encoder_runs_once_per_distinct_image(model, monkeypatch):
  calls = []
  encode = vision.encode
  monkeypatch.setattr(vision, "encode", lambda *a: calls.append(1) or encode(*a))
  eng = engine(model)
  eng.generate([P1, P1, P2], SamplingParams(max_tokens=2), images=[[A], [A], [B, A]])
  assert len(calls) == 2
  stats = eng.stats()
  assert stats["encoder_calls"] == 2 and stats["encoder_cache_hits"] == 2
  calls.clear()
  eng = engine(model, encoder_cache_tokens=0)  # no cache: every image of every request
  eng.generate([P1, P1, P2], SamplingParams(max_tokens=2), images=[[A], [A], [B, A]])
  assert len(calls) == 4 and eng.stats()["encoder_calls"] == 4


def test_bad_input_named_and_engine_keeps_serving(model):
  eng = engine(model, image_processor=dataclasses.replace(PROC, max_input_pixels=2000))
  rid = eng.submit(P1, GREEDY, images=[A])  # a good request, running alongside
  eng.step()
  with pytest.raises(ValueError, match="cannot decode image"):
    eng.submit(P1, GREEDY, images=[b"not an image at all"])
  with pytest.raises(ValueError, match="more than max_input_pixels 2000"):
    eng.submit(P1, GREEDY, images=[png(50, 50, 3)])
  with pytest.raises(ValueError, match="2 image placeholders .* for 1 images"):
    eng.submit([1, IMG, IMG, 2], GREEDY, images=[A])
  with pytest.raises(ValueError, match="1 image placeholders .* for 0 images"):
    eng.submit(P1, GREEDY)
  with pytest.raises(ValueError, match="1 video placeholders .* for 0 videos"):
    eng.submit([1, 121, 2], GREEDY)  # videos are not served by the Engine
  with pytest.raises(TypeError, match="images must be a non-empty list"):
    eng.submit(P1, GREEDY, images=A)
  while eng.has_unfinished():
    eng.step()
  assert eng.output(rid).token_ids == reference(model, P1, [A], GREEDY.max_tokens)
  assert eng.stats()["encoder_calls"] == 1
  cfg, params = model
  text = Engine(dataclasses.replace(cfg, vision=None), {k: v for k, v in params.items()
                                                         if k != "vision"},
                EngineConfig(page_size=4, num_pages=32, max_num_seqs=2))
  with pytest.raises(ValueError, match="images sent to a text-only model"):
    text.submit([1, 2, 3], GREEDY, images=[A])
  assert text.generate([[1, 2, 3]], GREEDY)[0].finish_reason == "length"


def test_tensor_parallel_matches(model):
  """Heads split over 2 devices (a random model with 2 KV heads)."""
  cfg = dataclasses.replace(model[0], num_kv_heads=2)
  params = models.init_params(cfg, jax.random.key(0))
  model = (cfg, params)
  mesh = sharding.make_mesh({"tensor": 2}, jax.devices()[:2])
  eng = Engine(cfg, params, EngineConfig(page_size=4, num_pages=64, max_num_seqs=4,
                                         max_num_batched_tokens=32, prefill_chunk_size=8,
                                         image_processor=PROC), mesh=mesh, layout="tp")
  outs = eng.generate([P1, P3], GREEDY, images=[[A], None])
  assert outs[0].token_ids == reference(model, P1, [A], GREEDY.max_tokens)
  assert outs[1].token_ids == reference(model, P3, None, GREEDY.max_tokens)


def moe_model(num_kv_heads=None):
  """The tiny Qwen3-VL-MoE (4 experts); num_kv_heads: a random model with
  that many KV heads (the fixture's one KV head does not split over tensor)."""
  cfg, params = checkpoint.load_hf(str(VL / "qwen3_vl_moe"), dtype=jnp.float32)
  if num_kv_heads is None:
    return cfg, params
  cfg = dataclasses.replace(cfg, num_kv_heads=num_kv_heads)
  return cfg, models.init_params(cfg, jax.random.key(1))


def test_moe_tp_attn_ep_matches():
  """Qwen3-VL-MoE, attention heads over tensor=2 and the experts over all
  four devices (tp_attn_ep): a text and an image request in one batch."""
  model = moe_model(num_kv_heads=2)
  cfg, params = model
  mesh = sharding.make_mesh({"tensor": 2, "expert": 2}, jax.devices()[:4])
  eng = Engine(cfg, params, EngineConfig(page_size=4, num_pages=64, max_num_seqs=4,
                                         max_num_batched_tokens=32, prefill_chunk_size=8,
                                         image_processor=PROC), mesh=mesh, layout="tp_attn_ep")
  outs = eng.generate([P1, P3], GREEDY, images=[[A], None])
  assert eng.stats()["visual_steps"] >= 1
  assert outs[0].token_ids == reference(model, P1, [A], GREEDY.max_tokens)
  assert outs[1].token_ids == reference(model, P3, None, GREEDY.max_tokens)


def test_moe_attention_dp_matches():
  """Qwen3-VL-MoE under dp_attn_ep on data=2 x expert=2 (four attention-DP
  ranks, experts over all four): image and text requests in one batch on
  different ranks, chunks inside images; decode steps after the images run
  the text step at p + delta on each rank."""
  model = moe_model()
  cfg, params = model
  mesh = sharding.make_mesh({"data": 2, "expert": 2}, jax.devices()[:4])
  eng = Engine(cfg, params, EngineConfig(page_size=4, num_pages=48, max_num_seqs=4,
                                         max_num_batched_tokens=32, prefill_chunk_size=8,
                                         image_processor=PROC), mesh=mesh, layout="dp_attn_ep")
  assert eng.num_ranks == 4
  prompts, imgs = [P1, P3, P2], [[A], None, [B, A]]
  outs = eng.generate(prompts, GREEDY, images=imgs)
  stats = eng.stats()
  assert sorted(stats["requests_per_rank"]) == [0, 1, 1, 1]
  assert stats["visual_steps"] >= 1
  for out, p, im in zip(outs, prompts, imgs):
    assert out.token_ids == reference(model, p, im, GREEDY.max_tokens)
