"""The vLLM side of `experiments/bench_vs_vllm.py`, run with the Python of a
separate virtualenv that has vLLM's CPU build (it brings its own torch, which
must not meet jax's environment). Imports nothing of jaxinfer.

  python vllm_peer.py checkpoint --config_json=cfg.json --out=DIR [--seed=0]
      random float32 weights (transformers' `from_config`), safetensors and a
      word-level tokenizer.json of the config's vocabulary ("t0" ... "tN-1")
  python vllm_peer.py offline --model=DIR --dtype=float32 --max_tokens=64 ...
      loads `vllm.LLM` once, then answers one JSON line per command line read
      from stdin: {"prompts": [[ids], ...]} -> {"seconds", "tokens": [[ids], ...]}
      on a stdout line starting with MARK
      (greedy, ignore_eos, max_tokens each), so the driver can interleave its
      repeats with jaxinfer's; "quit" ends it.
      MLA checkpoints whose latent + rope width is not 512 + 64 run with
      VLLM_MLA_DISABLE=1 (vLLM's CPU MLA kernel compiles for that width only).
  python vllm_peer.py serve --model=DIR --dtype=float32 --port=8100
      execs vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`;
      the `vllm serve` entry point looks for a package named `vllm`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def make_checkpoint(config_json: str, out: str, seed: int) -> None:
  import torch
  import transformers
  from tokenizers import Tokenizer, models, pre_tokenizers

  with open(config_json) as f:
    hf = json.load(f)
  config = transformers.AutoConfig.for_model(**hf)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  model.save_pretrained(out)
  vocab = {f"t{i}": i for i in range(config.vocab_size)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0",
                                              bos_token="t1", eos_token="t2")
  fast.save_pretrained(out)


MARK = "@@vllm_peer "  # vLLM logs to stdout too: the driver reads only lines with this mark


def _reply(obj) -> None:
  print(MARK + json.dumps(obj), flush=True)


CPU_MLA_HEAD = 576  # vLLM 0.32's CPU MLA kernel: kv_lora_rank 512 + rope 64 only


def mla_as_mha(model_dir: str) -> bool:
  """Sets VLLM_MLA_DISABLE=1 (vLLM then runs MLA as multi-head attention on
  decompressed K and V) when the checkpoint's latent + rope width is not the
  one vLLM's CPU MLA kernel compiles for; vLLM refuses to start otherwise
  ("Head dimension N is not supported by MLA"). Returns whether it did."""
  with open(os.path.join(model_dir, "config.json")) as f:
    hf = json.load(f)
  if "kv_lora_rank" not in hf or hf["kv_lora_rank"] + hf["qk_rope_head_dim"] == CPU_MLA_HEAD:
    return False
  os.environ["VLLM_MLA_DISABLE"] = "1"
  print(f"vllm_peer: MLA head {hf['kv_lora_rank'] + hf['qk_rope_head_dim']} != "
        f"{CPU_MLA_HEAD}: VLLM_MLA_DISABLE=1", file=sys.stderr, flush=True)
  return True


def offline(args) -> None:
  mla_as_mha(args.model)
  from vllm import LLM, SamplingParams, TokensPrompt

  llm = LLM(model=args.model, dtype=args.dtype, seed=0,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
            gpu_memory_utilization=args.memory_utilization)
  params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
  _reply({"ready": True})
  for line in sys.stdin:
    if line.strip() == "quit":
      break
    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(line)["prompts"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    _reply({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]})


def serve(args) -> None:
  mla_as_mha(args.model)  # os.environ reaches the exec'd server
  argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
          "--dtype", args.dtype, "--port", str(args.port), "--host", "127.0.0.1",
          "--served-model-name", "bench", "--seed", "0", "--max-model-len",
          str(args.max_model_len), "--gpu-memory-utilization", str(args.memory_utilization)]
  os.execv(sys.executable, argv)


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("command", choices=["checkpoint", "offline", "serve"])
  p.add_argument("--config_json")
  p.add_argument("--out")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--model")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--max_tokens", type=int, default=64)
  p.add_argument("--max_num_batched_tokens", type=int, default=None)
  p.add_argument("--max_num_seqs", type=int, default=None)
  p.add_argument("--max_model_len", type=int, default=2048)
  p.add_argument("--port", type=int, default=8100)
  # vLLM's CPU backend reserves this fraction of the NUMA node's memory (KV cache included);
  # its default 0.92 refuses to start on a node with other processes' memory in use.
  p.add_argument("--memory_utilization", type=float, default=0.5)
  args = p.parse_args()
  if args.command == "checkpoint":
    make_checkpoint(args.config_json, args.out, args.seed)
  elif args.command == "offline":
    offline(args)
  else:
    serve(args)


if __name__ == "__main__":
  main()
