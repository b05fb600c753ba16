"""The A14B preset's parameter counts from shapes equal diffusers' modules of the
same config (built on the meta device: nothing allocated)."""

import diffusers
import torch

from jaxinfer.diffusion import presets, wan_weights

A14B_DIT = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128,
                in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824,
                num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                rope_max_seq_len=1024)


def test_a14b_param_counts_equal_diffusers():
  model = presets.a14b()
  counts = presets.count_params(model)
  with torch.device("meta"):
    dit = diffusers.WanTransformer3DModel(**A14B_DIT)
    vae = diffusers.AutoencoderKLWan()
  assert counts["transformer"] == sum(p.numel() for p in dit.parameters())
  decoder = sum(p.numel() for n, p in vae.named_parameters()
                if n.startswith(("decoder.", "post_quant_conv.")))
  assert counts["vae_decoder"] == decoder
  assert counts["total"] == 2 * counts["transformer"] + decoder
  assert model.tokens() == 75600 and model.latent_shape() == (1, 16, 21, 90, 160)
  assert wan_weights.count_params(presets.tiny().dit) < 1e5
