"""HF transformers + PyTorch on this CPU as the Engine's decode peer
(`benchlib.decode`): a causal LM with random weights from an HF config dict
(`hf_model`), its parameter count (`hf_param_count`) and greedy `generate`
timed per token from inside the call (`bench_hf`). torch and transformers
are imported inside the functions only. (On a GPU: `benchlib.torch_peer`.)
"""

from __future__ import annotations

import os
import time

from benchlib import results


def hf_model(hf: dict, *, threads: int | None = None):
  """An HF causal LM with random weights from a config dict: float32, eval
  mode, torch running `threads` threads (default os.cpu_count())."""
  import torch
  import transformers
  transformers.logging.set_verbosity_error()
  torch.set_num_threads(threads or os.cpu_count())
  hf = dict(hf)
  config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
  return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def hf_param_count(model) -> int:
  """Parameters plus persistent buffers (DeepSeek's router score bias is a
  buffer in HF and a parameter here), each storage counted once."""
  seen = {}
  for v in model.state_dict().values():
    seen[(v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))] = v.numel()
  return sum(seen.values())


def bench_hf(model, *, batch: int, prompt_len: int, new_tokens: int, repeats: int,
             seed: int = 0) -> dict:
  """Greedy `generate` of a [batch, prompt_len] random prompt (attention mask
  of ones), exactly `new_tokens` new tokens (min_new_tokens = max_new_tokens)
  under `torch.inference_mode`, timed per step from inside the call: a
  stopping criterion stamps the clock as each token lands. As for the Engine,
  prefill tokens/s = batch * prompt_len / time to the first token and decode
  tokens/s = batch * (new_tokens - 1) / (last token - first token), so both
  come from one call and no difference of two noisy calls can go negative.
  One untimed warm-up call first. -> {prefill, decode | None}."""
  import torch
  import transformers

  class Clock(transformers.StoppingCriteria):
    def __init__(self):
      self.stamps = []

    def __call__(self, input_ids, scores, **kwargs):
      self.stamps.append(time.perf_counter())
      return torch.zeros(input_ids.shape[0], dtype=torch.bool)

  gen = torch.Generator().manual_seed(seed)
  ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=gen)
  mask = torch.ones_like(ids)
  eos = model.config.eos_token_id
  pad = (eos[0] if isinstance(eos, (list, tuple)) else eos) or 0

  def once():
    clock = Clock()
    t0 = time.perf_counter()
    with torch.inference_mode():
      out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                           stopping_criteria=transformers.StoppingCriteriaList([clock]))
    assert out.shape == (batch, prompt_len + new_tokens), out.shape
    assert len(clock.stamps) == new_tokens, len(clock.stamps)
    first, last = clock.stamps[0], clock.stamps[-1]
    decode = batch * (new_tokens - 1) / (last - first) if new_tokens > 1 else None
    return batch * prompt_len / (first - t0), decode

  once()
  runs = [once() for _ in range(repeats)]
  return dict(prefill=results.spread([p for p, _ in runs]),
              decode=results.spread([d for _, d in runs]) if new_tokens > 1 else None)
