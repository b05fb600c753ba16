"""The UMT5 text encoder against transformers' UMT5EncoderModel (a tiny random
config saved with save_pretrained), padded prompts included."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxinfer.diffusion import umt5

TINY = dict(vocab_size=96, d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2,
            relative_attention_num_buckets=32, relative_attention_max_distance=128,
            feed_forward_proj="gated-gelu", dropout_rate=0.0)


def test_encoder_matches_transformers(tmp_path):
  torch.manual_seed(0)
  model = transformers.UMT5EncoderModel(transformers.UMT5Config(**TINY)).eval()
  with torch.no_grad():  # the rel-bias tables start at zero-ish scale; make them matter
    for blk in model.encoder.block:
      blk.layer[0].SelfAttention.relative_attention_bias.weight.normal_(0, 1.0)
      blk.layer[0].layer_norm.weight.normal_(1.0, 0.1)
  model.save_pretrained(tmp_path)
  cfg, params = umt5.load_encoder(str(tmp_path))
  # 90 tokens: relative distances past max_exact reach the logarithmic buckets.
  ids = torch.randint(1, 96, (2, 90), generator=torch.Generator().manual_seed(1))
  mask = torch.ones_like(ids)
  mask[1, 40:] = 0  # a padded prompt
  with torch.no_grad():
    ref = (model(input_ids=ids, attention_mask=mask).last_hidden_state * mask[..., None]).numpy()
  ours = np.asarray(umt5.prompt_embeddings(cfg, params, jnp.asarray(ids.numpy()),
                                           jnp.asarray(mask.numpy())))
  err = float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))
  print(f"UMT5: max|ours - transformers| / max|transformers| = {err:.2e}")
  assert err < 1e-5
  assert np.all(ours[1, 40:] == 0) and np.abs(ours[1, :40]).max() > 0.1
  with pytest.raises(ValueError, match="token ids must be"):
    umt5.prompt_embeddings(cfg, params, jnp.zeros((2, 4), jnp.int32), jnp.ones((2, 5)))
