"""Compiling before serving: every step program that plain traffic can
reach (`programs`), each run once on all-padding batches by `Engine.warmup`
(`steps.Runner.warm`), so no request waits for XLA.

The set is finite because step shapes are bucketed, and small when steps
with a prompt chunk have fixed shapes (`EngineConfig.fixed_prefill_shapes`:
a prompt-step shape per power-of-two pages and `steps.prompt_token_buckets`
size, and a decode shape per
power-of-two sequences and pages; or `fixed_step_shapes`: one shape per page bucket), each also as a
multi-step decode with `decode_steps`, times the sampler variants asked
for: greedy, sampled (no top-k) and, with top_k, each top-k bucket. Few
matters on CPU beyond compile time: each XLA:CPU program holds hundreds of
memory maps, and a process past vm.max_map_count crashes
(docs/known_issues.md); the bucketed prompt steps' thousands of shapes
would get there under long enough traffic. The list runs shortest
contexts first, and `Engine.warmup` stops at a share of the limit
(`map_guard`: a MoE model's programs are larger); past it, a step
program that is not compiled yet drops the compiled ones first.
Requests asking for logprobs, penalties, logit_bias or min_tokens compile
their variants on first use; so does a speculative engine, whose step
shapes also follow its draft counts.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.engine import sampling, steps
from jaxinfer.engine.core import prefill_chunk


def page_buckets(max_pages: int, fixed_prefill: bool) -> list[int]:
  """Every pages-per-sequence bucket a decode step can have
  (`HostCore.step_shapes`)."""
  bucket = steps.fixed_page_bucket if fixed_prefill else steps.page_bucket
  return sorted({bucket(n, max_pages) for n in range(1, max_pages + 1)})


def programs(eng, *, sampled: bool = True, top_k: bool = False) -> list[tuple]:
  """The (StepShapes, decode steps, greedy, k_cap) of every plain program
  traffic can reach (eng: an `Engine`, for its configs and
  max_pages_per_seq; with an attention library, `Backend.attention_library`,
  each prompt shape also as a fresh-chunk program, `steps.fresh_shapes`);
  ValueError when prompt steps are bucketed (too many)."""
  c = eng.config
  chunk = prefill_chunk(c)
  if c.speculative is not None:
    raise ValueError("warmup: plain decoding only (a speculative engine compiles its programs "
                     "as traffic comes)")
  if not (c.fixed_step_shapes or c.fixed_prefill_shapes):
    raise ValueError("warmup: needs EngineConfig(fixed_prefill_shapes=True) or "
                     "fixed_step_shapes=True (bucketed prompt steps reach too many programs "
                     "to compile ahead)")
  samplers = [(True, 0)] + [(False, 0)] * sampled
  if top_k:
    k = sampling.MIN_TOP_K_CAP
    while k <= sampling.MAX_TOP_K_CAP:
      samplers.append((False, k))
      k *= 2
  multi = sorted({1, c.decode_steps})
  seqs = sorted({(steps.bucket(b, c.max_num_batched_tokens), steps.bucket(b, c.max_num_seqs))
                 for b in range(1, c.max_num_seqs + 1)})
  pages = page_buckets(eng.max_pages_per_seq, c.fixed_prefill_shapes)
  if c.fixed_prefill_shapes:  # prompt steps: per token and page bucket; decode steps bucketed
    shapes = [(steps.prompt_step_shapes(c, t, p, chunk), 1)
              for t in steps.prompt_token_buckets(c.max_num_batched_tokens) for p in pages]
    shapes += [(steps.StepShapes(tokens=t, seqs=b, pages=p, max_q=1), n)
               for p in pages for t, b in seqs for n in multi]
  else:  # every step has the prompt steps' shape
    shapes = [(steps.StepShapes(tokens=c.max_num_batched_tokens, seqs=c.max_num_seqs, pages=p,
                                max_q=chunk), n) for p in pages for n in multi]
  # Shortest contexts first: where the warm-up stops early (`Engine.warmup`'s
  # memory-map share) it has compiled what most traffic runs.
  if eng.cfg.backend.attention_library() is not None:  # prompt steps of fresh chunks: the library's
    shapes += [(dataclasses.replace(s, fresh=True), n) for s, n in shapes if s.max_q > 1]
  shapes.sort(key=lambda sn: (sn[0].pages, sn[0].max_q == 1, sn[0].tokens, sn[0].seqs, sn[1],
                              sn[0].fresh))
  return [(s, n, greedy, k_cap) for s, n in shapes for greedy, k_cap in samplers]
