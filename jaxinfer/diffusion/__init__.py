"""Text to video: WAN-2.2-T2V-A14B (the MLPerf Inference v6.0 benchmark) in JAX.

  wan_config    WanConfig: one expert's DiT dimensions (diffusers config.json)
  wan_weights   the DiT's weight declarations; diffusers safetensors loading
  wan_dit       the DiT: 3D patches, 3D RoPE, q/k RMS norm, cross-attention,
                timestep modulation, the head (pure functions)
  wan_vae       the Wan 2.1 VAE decoder, chunked a latent frame at a time
  umt5          the UMT5 text encoder (prompt embeddings)
  wan_text      prompts (strings or token ids) -> UMT5 tokens and embeddings
  unipc         UniPC multistep on flow sigmas, as a coefficient table
  wan_pipeline  two experts, CFG batched, the jitted denoising loop, generate
  wan_parallel  CFG / sequence (Ulysses) / tensor parallel DiT passes
  presets       WanModel: a14b() (real dimensions), tiny(); parameter counts
  loading       a whole diffusers WanPipeline directory
  files         its JSON and tensors read with errors that name the file
"""
