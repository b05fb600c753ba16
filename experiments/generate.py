"""Generate completions with the jaxinfer Engine and print a metrics table.

  python experiments/generate.py            # the bundled trained model, MTP speculation K=3
  python experiments/generate.py --prompt="def add(a, b):" --prompt="import os" --temperature=0.8
  python experiments/generate.py --num_draft_tokens=0      # plain decoding
  python experiments/generate.py --model=tiny_dense        # a preset with random weights
  python experiments/generate.py --hf_dir=path/to/hf --prompt="Hello"   # needs tokenizer.json
  python experiments/generate.py --hf_dir=path/to/hf --prompt_ids=1,2,3
  python experiments/generate.py --cpu_devices=8 --mesh=data=2,expert=4 --layout=dp_attn_ep
      # sharded over 8 simulated CPU devices (attention data parallel + expert
      # parallel), with MTP speculation per attention-DP rank
"""


from absl import flags
import jax

from benchlib import cli, flag_config, model_flags
from benchlib.sharding_report import parse_mesh
from jaxinfer import EngineConfig, MTPConfig, SamplingParams, run, sharding
from jaxinfer.tokenizer import load_tokenizer

_MODEL = model_flags.define()
_PROMPT = flags.DEFINE_multi_string(
    "prompt", ["def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n",
               "class Stack:\n    def __init__(self):\n"], "a prompt (repeatable)")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", None, "a file with one prompt per line")
_PROMPT_IDS = flags.DEFINE_list("prompt_ids", None, "one prompt as token ids (any model)")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 96, "tokens to generate per prompt")
_DRAFT = flags.DEFINE_integer("num_draft_tokens", 3, "MTP speculative drafts per step "
                              "(0 = off; models without MTP modules decode plainly)")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", 1, "decode steps per dispatch when not "
                                     "speculating (EngineConfig.decode_steps)")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy")
_TOP_K = flags.DEFINE_integer("top_k", 0, "0 = off")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "1 = off")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed of the first prompt (+i for prompt i)")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "KV page size (tokens)")
_NUM_PAGES = flags.DEFINE_integer("num_pages", None, "KV pool pages (default: from memory)")
_MAX_SEQS = flags.DEFINE_integer("max_num_seqs", 32, "sequences per step")
_TOKEN_BUDGET = flags.DEFINE_integer("max_num_batched_tokens", 256, "tokens per step")
_MESH = flags.DEFINE_string("mesh", None, "run the Engine sharded on a mesh of all devices, "
                            "e.g. data=2,expert=4 or data=2,tensor=4 (default: one device)")
_LAYOUT = flags.DEFINE_enum("layout", "tp", list(sharding.LAYOUTS), "sharding layout (with --mesh)")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "simulate this many CPU devices (XLA's "
                                    "host platform device count) for --mesh on a CPU machine")
_CONFIG = flag_config.define_config(__file__)


def _prompts(model):
  """-> (tokenizer or None, prompts as token ids) from the flags."""
  if _PROMPT_IDS.value:
    return None, [[int(i) for i in _PROMPT_IDS.value]]
  # No tokenizer: load_tokenizer's error says what to give instead.
  tok = model.tokenizer or load_tokenizer(model.cfg, model.source.get("hf_dir"))
  texts = _PROMPT.value
  if _PROMPTS_FILE.value:
    with open(_PROMPTS_FILE.value) as f:
      texts = [line.rstrip("\n") for line in f if line.strip()]
  return tok, [tok.encode(t) for t in texts]


def _print_outputs(res, tok) -> None:
  for i, out in enumerate(res.outputs):
    if tok:
      print(f"\n--- [{i}] prompt + completion ({out.finish_reason}) ---\n"
            f"{tok.decode(out.prompt_token_ids)}{cli.bold(tok.decode(out.token_ids))}")
    else:
      print(f"\n[{i}] prompt: {out.prompt_token_ids}\n[{i}] completion "
            f"({out.finish_reason}): {out.token_ids}")


def _print_summary(s: dict, spec) -> None:
  rows = [
      ("requests", f"{s['requests']}"),
      ("generated tokens", f"{s['generated_tokens']}"),
      ("tokens/s (after warm-up)", f"{s['tokens_per_s']:.1f}"),
      ("TTFT p50 / p90", f"{s['ttft_p50_s'] * 1e3:.1f} / {s['ttft_p90_s'] * 1e3:.1f} ms"),
      ("TPOT p50 / p90", f"{s['tpot_p50_s'] * 1e3:.2f} / {s['tpot_p90_s'] * 1e3:.2f} ms"),
      ("prefix-cache hits", f"{s['cached_prompt_tokens']} of {s['prompt_tokens']} prompt tokens"),
      ("steps / tokens per step", f"{s['steps']} / {s['tokens_per_step']:.1f}"),
      ("compiled step programs", f"{s['compiles']}"),
      ("preemptions", f"{s['preemptions']}"),
  ]
  if spec is not None:
    acc = ", ".join(f"{a:.2f}" for a in s["spec_acceptance_per_position"])
    rows += [("MTP drafts per step (K)", f"{spec.num_draft_tokens}"),
             ("mean accepted length", f"{s['spec_mean_accepted_length']:.2f} tokens / step"),
             ("acceptance per position", acc)]
  else:
    rows.append(("speculative decoding", "off"))
  print("\n" + "\n".join(f"  {k:<26} {v}" for k, v in rows))


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  if _CPU_DEVICES.value:  # before anything initialises JAX's backends
    jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  mesh = sharding.make_mesh(parse_mesh(_MESH.value)) if _MESH.value else None
  model = _MODEL.load()
  cfg, params = model.cfg, model.params
  tok, prompts = _prompts(model)
  sampling = [SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=_TEMPERATURE.value,
                             top_k=_TOP_K.value, top_p=_TOP_P.value, seed=_SEED.value + i)
              for i in range(len(prompts))]
  spec = None
  if _DRAFT.value and cfg.num_mtp_layers and "mtp" in params:
    spec = MTPConfig(num_draft_tokens=_DRAFT.value)
  engine_config = EngineConfig(page_size=_PAGE_SIZE.value, num_pages=_NUM_PAGES.value,
                               max_num_seqs=_MAX_SEQS.value,
                               max_num_batched_tokens=_TOKEN_BUDGET.value, speculative=spec,
                               decode_steps=1 if spec else _DECODE_STEPS.value)
  res = run.run_engine(cfg, params, prompts=prompts, sampling=sampling,
                       engine_config=engine_config, mesh=mesh,
                       layout=_LAYOUT.value if mesh is not None else None)

  print(f"model: {model.name} ({cfg.model_type}, {cfg.attention}, "
        f"{'MoE' if cfg.is_moe else 'dense'}, {cfg.compute_dtype().name})")
  if mesh is not None:
    print(f"mesh: {dict(mesh.shape)} over {mesh.devices.size} {jax.devices()[0].platform} devices, "
          f"layout {_LAYOUT.value}, {res.summary['dp_ranks']} attention-DP ranks "
          f"(requests per rank {res.summary['requests_per_rank']})")
  _print_outputs(res, tok)
  _print_summary(res.summary, spec)


if __name__ == "__main__":
  cli.run(main)
