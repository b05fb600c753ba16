"""transformers' `generate` as the Engine's decode peer, in the same run and
on the same device: a causal LM with random weights built from an HF config
dict (`jaxinfer.hf_config.to_hf` of our config), greedy, a static KV cache
(`generation_config.cache_implementation = "static"`).

On a GPU: bfloat16, and the decode step under `torch.compile` (mode
"reduce-overhead": CUDA graphs, fullgraph): with a static cache on a CUDA
device `generate` compiles the decode step itself, with the
`generation_config.compile_config` given (transformers'
`_valid_auto_compile_criteria`); the prefill runs eagerly, so the timed
decode is the compiled step's. (Wrapping `model.forward` in `torch.compile`
as well, the older recipe, would compile the prefill too and nest two
compiles.) The dry run (CPU): float32, no compile and one torch thread
(a shared CPU's load makes a multi-threaded step's time jump tenfold), the
same code otherwise.

Timing, per batch: a warm-up `generate` of `new_tokens` and one of 1 token
(compiles, CUDA graphs), then `repeats` pairs of timed calls on other
prompts, each call fenced by a device synchronize: generate_s[n] is the
fastest wall time of the calls making n new tokens; decode_s = generate_s
[new_tokens] - generate_s[1] (the same prefill in both, so what is left is
the new_tokens - 1 decode steps); tokens_per_s = batch * (new_tokens - 1)
/ decode_s, as the Engine's decode convention counts tokens after the
first. EOS is off (eos_token_id None), so every call makes exactly n tokens.

torch and transformers are imported inside `measure_generate` only:
importing this module never needs them.
"""

from __future__ import annotations

import gc
import time

_DEFAULT_BATCH_S = 60.0  # a batch's estimate before one has run (compile included)


def _check(batches, prompt_len: int, new_tokens: int, repeats: int) -> None:
  if not batches or any(not isinstance(b, int) or b < 1 for b in batches):
    raise ValueError(f"measure_generate: batches must be positive ints, got {batches!r}")
  if not isinstance(prompt_len, int) or prompt_len < 1:
    raise ValueError(f"measure_generate: prompt_len must be an int >= 1, got {prompt_len!r}")
  if not isinstance(new_tokens, int) or new_tokens < 2:
    raise ValueError(f"measure_generate: new_tokens must be an int >= 2 (one decode step "
                     f"at least), got {new_tokens!r}")
  if not isinstance(repeats, int) or repeats < 1:
    raise ValueError(f"measure_generate: repeats must be an int >= 1, got {repeats!r}")


def _short(e: BaseException) -> str:
  """An exception as one line: 'Type: first line of the message' (<= 300 chars)."""
  lines = f"{type(e).__name__}: {e}".strip().splitlines()
  return (lines[0] if lines else type(e).__name__)[:300]


def _imports():
  """-> (torch, transformers, '') or (None, None, why not)."""
  try:
    import torch  # noqa: PLC0415  (optional: only the peer needs it)
    import transformers  # noqa: PLC0415
  except Exception as e:  # noqa: BLE001  (any import failure means "no peer")
    return None, None, f"not importable: {_short(e)}"
  return torch, transformers, ""


def _build(torch, transformers, hf_config: dict, device: str, dtype, compile_decode: bool):
  """The random-weight causal LM, eval mode, EOS off, static cache, and
  (compile_decode) generate's compile of the decode step configured."""
  hf = dict(hf_config, eos_token_id=None, pad_token_id=0)
  config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
  torch.manual_seed(0)
  with torch.device(device):
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
  model.eval()
  gen = model.generation_config
  gen.eos_token_id, gen.pad_token_id, gen.do_sample = None, 0, False
  gen.cache_implementation = "static"
  if compile_decode:
    gen.compile_config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead",
                                                    dynamic=False)
  else:
    gen.disable_compile = True
  return model


def _timed_batch(torch, model, *, batch: int, prompt_len: int, new_tokens: int, repeats: int,
                 device: str, seed: int) -> dict:
  """Warm-up, then `repeats` timed pairs (new_tokens, 1) at this batch (module docstring)."""
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  gen = torch.Generator().manual_seed(seed + batch)
  vocab = model.config.vocab_size

  def call(n: int) -> float:
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=gen).to(device)
    sync()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n)
    sync()
    wall = time.perf_counter() - t0
    if tuple(out.shape) != (batch, prompt_len + n):
      raise AssertionError(f"generate made {tuple(out.shape)}, expected "
                           f"{(batch, prompt_len + n)}")
    return wall

  t0 = time.perf_counter()
  call(new_tokens)
  call(1)
  first_call_s = time.perf_counter() - t0
  walls = {new_tokens: [], 1: []}
  for _ in range(repeats):
    for n in walls:
      walls[n].append(call(n))
  full, one = min(walls[new_tokens]), min(walls[1])
  decode_s = full - one
  entry = dict(batch=batch, first_call_s=first_call_s,
               generate_s={str(n): min(w) for n, w in walls.items()},
               decode_s=decode_s, decode_tokens=batch * (new_tokens - 1),
               compiled_decode=hasattr(model, "_compiled_call"))
  if decode_s > 0:
    entry.update(tokens_per_s=batch * (new_tokens - 1) / decode_s,
                 step_s=decode_s / (new_tokens - 1))
  else:
    entry.update(tokens_per_s=None, note="decode_s <= 0: the two timings did not separate")
  return entry


def _release(torch, gpu: bool) -> dict:
  """Compiled graphs and cached blocks handed back, so the device's memory is
  free for what runs next. -> what torch still holds."""
  gc.collect()
  if not gpu:
    return {}
  compiler = getattr(torch, "compiler", None)
  if compiler is not None and hasattr(compiler, "reset"):
    compiler.reset()
  torch.cuda.empty_cache()
  return dict(torch_reserved_after_bytes=torch.cuda.memory_reserved())


def measure_generate(hf_config: dict, *, batches, prompt_len: int, new_tokens: int, gpu: bool,
                     deadline: float | None = None, repeats: int = 5, seed: int = 0) -> dict:
  """The peer's decode tokens/s at each batch (module docstring) -> {status
  "ok" | "skipped" (reason: torch or transformers not importable, no CUDA
  device), torch, transformers, device, dtype, compile, params, build_s,
  batches: {batch_B: {status, tokens_per_s, step_s, decode_s, generate_s,
  first_call_s, compiled_decode} | {status "skipped" | "error", ...}}}. A
  batch whose estimate (the last batch's wall time) would end past
  `deadline` (a time.monotonic() value) is skipped."""
  _check(batches, prompt_len, new_tokens, repeats)
  torch, transformers, why = _imports()
  if why:
    return dict(status="skipped", reason=f"torch / transformers {why}")
  if gpu and not torch.cuda.is_available():
    return dict(status="skipped", reason=f"torch {torch.__version__} sees no CUDA device")
  transformers.logging.set_verbosity_error()
  device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
  out = dict(status="ok", torch=torch.__version__, transformers=transformers.__version__,
             device=torch.cuda.get_device_name() if gpu else "cpu", dtype=str(dtype).split(".")[-1],
             compile=(dict(mode="reduce-overhead", fullgraph=True, dynamic=False,
                           what="generate's compile of the decode step") if gpu else None),
             cache_implementation="static", prompt_len=prompt_len, new_tokens=new_tokens,
             repeats=repeats, batches={})
  threads = torch.get_num_threads()
  if not gpu:
    torch.set_num_threads(1)
  t0 = time.perf_counter()
  model = None
  try:
    model = _build(torch, transformers, hf_config, device, dtype, compile_decode=gpu)
    out.update(build_s=time.perf_counter() - t0, params=sum(p.numel() for p in model.parameters()),
               attn_implementation=getattr(model.config, "_attn_implementation", None))
    estimate = _DEFAULT_BATCH_S if gpu else 0.0
    for b in batches:
      key = f"batch_{b}"
      left = None if deadline is None else deadline - time.monotonic()
      if left is not None and left < estimate:
        out["batches"][key] = dict(status="skipped", reason="time box", estimate_s=estimate,
                                   left_s=left)
        continue
      t1 = time.perf_counter()
      try:
        out["batches"][key] = dict(status="ok", **_timed_batch(
            torch, model, batch=b, prompt_len=prompt_len, new_tokens=new_tokens,
            repeats=repeats, device=device, seed=seed))
      except Exception as e:  # noqa: BLE001  (recorded; the next batch runs)
        out["batches"][key] = dict(status="error", error=_short(e))
      estimate = out["batches"][key]["wall_s"] = time.perf_counter() - t1
  finally:
    del model
    out.update(_release(torch, gpu))
    torch.set_num_threads(threads)
  return out
