"""Generate text with a jaxinfer model.

  python experiments/generate.py                       # bundled tiny_moe preset
  python experiments/generate.py --hf_dir=path/to/hf   # an HF checkpoint (token ids prompt)
  python experiments/generate.py --preset=tiny_dense --prompt="def main():" --temperature=0.8

Until the trained default model lands, presets run with random weights: the
text is noise, the throughput figures are real.
"""

from absl import app, flags

from jaxinfer import SamplingParams, run

_PRESET = flags.DEFINE_string("preset", "tiny_moe", "model preset (random weights)")
_HF_DIR = flags.DEFINE_string("hf_dir", None, "HF checkpoint directory (overrides --preset)")
_CKPT = flags.DEFINE_string("checkpoint_dir", None, "orbax checkpoint from checkpoint.save")
_PROMPT = flags.DEFINE_string("prompt", "def fibonacci(n):", "text prompt (byte-level models)")
_PROMPT_IDS = flags.DEFINE_list("prompt_ids", None, "prompt token ids (any model)")
_BATCH = flags.DEFINE_integer("batch", 1, "copies of the prompt to decode together")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "tokens to generate")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy")
_TOP_K = flags.DEFINE_integer("top_k", 0, "0 = off")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "1 = off")
_SEED = flags.DEFINE_integer("seed", 0, "sampling and init seed")


def main(argv):
  del argv
  source = dict(hf_dir=_HF_DIR.value) if _HF_DIR.value else (
      dict(checkpoint_dir=_CKPT.value) if _CKPT.value else dict(preset=_PRESET.value))
  cfg, params = run.load_model(**source, seed=_SEED.value)
  ids = ([int(i) for i in _PROMPT_IDS.value] if _PROMPT_IDS.value
         else run.encode_bytes(cfg, _PROMPT.value))
  sampling = SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=_TEMPERATURE.value,
                            top_k=_TOP_K.value, top_p=_TOP_P.value, seed=_SEED.value)
  res = run.run_generate(cfg, params, prompts=[ids] * _BATCH.value, sampling=sampling)
  print(f"model: {source} ({cfg.model_type}, {cfg.attention}, "
        f"{'MoE' if cfg.is_moe else 'dense'}, dtype {cfg.compute_dtype().name})")
  print(f"prompt ({len(ids)} tokens): {ids if cfg.vocab_size != 256 else repr(_PROMPT.value)}")
  out = res.tokens[0].tolist()
  print(f"generated ids: {out}")
  if cfg.vocab_size == 256:
    print(f"generated text: {run.decode_bytes(out)!r}")
  print(f"prefill+first token: {res.prefill_s * 1e3:.1f} ms; decode: "
        f"{res.decode_tokens_per_s:.1f} tokens/s at batch {_BATCH.value} "
        "(median of 3, this machine)")


if __name__ == "__main__":
  app.run(main)
