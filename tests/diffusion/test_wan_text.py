"""Prompts as strings: our tokenization against transformers' T5 tokenizer on
the same tokenizer.json (diffusers' prompt cleaning first), and videos from
string prompts against diffusers' WanPipeline(prompt=...) on a whole tiny
pipeline directory (tokenizer/, text_encoder/, both experts, vae/)."""

import re
import shutil

import numpy as np
import pytest
import torch
import transformers
from diffusers.pipelines.wan.pipeline_wan import prompt_clean

from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.diffusion import loading, wan_text
from jaxinfer.engine.video import VideoEngine, VideoRequest
from jaxinfer.serving import mlperf_video
from wan_tiny import dit_dirs, tiny_vae, wan_pipeline_dir, write_tokenizer  # noqa: F401

PROMPTS = ["a cat surfing a wave", "", "  A dog &amp;amp;  the\tred\n moon.  ",
           "the blue sky " * 9, "Zebra ünïcode"]


@pytest.mark.parametrize("length", [8, 512])
def test_tokens_equal_transformers(tmp_path, length):
  write_tokenizer(tmp_path / "tokenizer")
  ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tokenizer"))
  want = ref([prompt_clean(p) for p in PROMPTS], padding="max_length", max_length=length,
             truncation=True, add_special_tokens=True, return_attention_mask=True)
  ids, mask = wan_text.PromptTokenizer(str(tmp_path / "tokenizer")).encode(PROMPTS, length)
  assert ids.shape == mask.shape == (len(PROMPTS), length)
  np.testing.assert_array_equal(ids, want.input_ids)
  np.testing.assert_array_equal(mask, want.attention_mask)
  assert mask[1].sum() == 1 and ids[1, 0] == 1  # "": </s> alone
  assert 2 in ids[4]  # characters outside the vocabulary: <unk>
  if length == 8:  # truncated to 8 tokens, the closing </s> kept
    assert mask[3].all() and ids[3, -1] == 1


def _reference(pipe, latents, prompt, neg, length):
  with torch.no_grad():
    out = pipe(prompt=prompt, negative_prompt=neg, latents=torch.from_numpy(latents[None]),
               height=32, width=48, num_frames=9, num_inference_steps=6, guidance_scale=4.0,
               guidance_scale_2=3.0, max_sequence_length=length, output_type="np").frames
  return np.asarray(out)[0] * 255


def test_string_prompts_match_diffusers(wan_pipeline_dir):
  root, pipe = wan_pipeline_dir
  model, params = loading.load_pipeline(str(root), num_steps=6, height=32, width=48, frames=9,
                                        text_len=16)
  assert params.text.tokenizer is not None
  latents = np.random.default_rng(5).standard_normal(model.latent_shape()[1:]).astype(np.float32)
  prompt, neg = "a red cat &amp; the moon", "blue"
  ref = _reference(pipe, latents, prompt, neg, 16)
  engine = VideoEngine(model, params.high, params.low, params.vae, max_batch=3, text=params.text)
  ids = pipe.tokenizer(prompt_clean(prompt)).input_ids  # token ids, unpadded
  emb = np.asarray(params.text.embed([neg], 16)[0])  # embeddings [L, Dt]
  videos = engine.generate([VideoRequest(prompt, neg, latents), VideoRequest(ids, emb, latents),
                            VideoRequest(prompt, "", latents)])
  err = float(np.max(np.abs(videos[0] - ref)))
  print(f"frames from string prompts: max|ours - diffusers| = {err:.2f} of 255")
  assert err <= 1.0 and np.std(ref) > 2.0
  assert np.max(np.abs(videos[1].astype(int) - videos[0])) <= 1  # ids and embeddings: the same
  assert np.max(np.abs(videos[2].astype(int) - videos[0])) > 8  # the negative prompt matters


def test_string_prompt_without_tokenizer_names_the_file(wan_pipeline_dir, tmp_path):
  root, _ = wan_pipeline_dir
  shutil.copytree(root, tmp_path / "p", ignore=shutil.ignore_patterns("tokenizer"))
  model, params = loading.load_pipeline(str(tmp_path / "p"), num_steps=2, height=32, width=48,
                                        frames=9, text_len=16)
  engine = VideoEngine(model, params.high, params.low, params.vae, text=params.text)
  latents = np.zeros(model.latent_shape()[1:], np.float32)
  missing = re.escape(str(tmp_path / "p" / "tokenizer" / "tokenizer.json"))
  with pytest.raises(CheckpointError, match=f"request 0: VideoRequest.text: .*{missing} does not"):
    engine.generate([VideoRequest("a cat", "", latents)])
  with pytest.raises(CheckpointError, match=f"sample 0: VideoRequest.neg_text: .*{missing}"):
    mlperf_video.VideoSUT(engine, mlperf_video.prompt_samples([[3, 4, 1], [5, 1]], latents, "x"))
  engine.check_request(VideoRequest([3, 4, 1], [1], latents))  # token ids still work
  with pytest.raises(ValueError, match="VideoRequest.text: token ids must be in"):
    engine.check_request(VideoRequest([3, 64], [1], latents))
  with pytest.raises(ValueError, match="VideoRequest.neg_text: token ids must be 1 to 16 ints"):
    engine.check_request(VideoRequest([1], [1] * 17, latents))
  bare = VideoEngine(model, params.high, params.low, params.vae)
  with pytest.raises(ValueError, match="VideoRequest.text is a prompt.*no text encoder"):
    bare.check_request(VideoRequest("a cat", "", latents))
