"""Attention-DP step balance, measured in the real Engine: the same mixed
long/short workload under each `EngineConfig.dp_balance` policy, on one
`dp_attn_ep` mesh, warm (an identical untimed run compiles the programs).

Requests arrive in a timed stream (`arrival_s` apart, one long prompt in
`long_every`), each submitted when its time comes while the engine steps, so
TTFT counts queueing behind other ranks' prefill as a user would see it.
Policies run alternately over `rounds` so drift in this shared machine's
load hits them alike; each figure is the median over rounds.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from benchlib.decode import count_xla_compiles
from jaxinfer.engine.engine import Engine, EngineConfig
from jaxinfer.engine.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Workload:
  """num_requests prompts, one in long_every of long_len tokens, the rest
  short_len; max_tokens each; one arrival every arrival_s seconds."""
  num_requests: int = 32
  long_every: int = 8
  long_len: int = 384
  short_len: int = 24
  max_tokens: int = 24
  arrival_s: float = 0.05
  seed: int = 0

  def prompts(self, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(self.seed)
    return [rng.integers(1, vocab_size, self.long_len if i % self.long_every == 0
                         else self.short_len).tolist() for i in range(self.num_requests)]


def serve(engine: Engine, prompts, w: Workload) -> dict:
  """Submits prompts on the workload's clock while stepping -> measurements
  (xla_compiles: programs compiled during the run; a timed run should have none)."""
  with count_xla_compiles() as compiles:
    out = _serve(engine, prompts, w)
  return dict(out, xla_compiles=compiles[0])


def _serve(engine: Engine, prompts, w: Workload) -> dict:
  sampling = SamplingParams(max_tokens=w.max_tokens)
  t0 = time.perf_counter()
  ids, i = [], 0
  while i < len(prompts) or engine.has_unfinished():
    now = time.perf_counter() - t0
    while i < len(prompts) and i * w.arrival_s <= now:
      ids.append(engine.submit(prompts[i], sampling))
      i += 1
    if engine.has_unfinished():
      engine.step()
    else:
      time.sleep(max(0.0, i * w.arrival_s - now))
  wall = time.perf_counter() - t0
  outs = [engine.output(r) for r in ids]
  ttft = np.array([o.metrics.ttft_s for o in outs]) * 1e3
  long = np.array([len(o.prompt_token_ids) == w.long_len for o in outs])
  tpot = np.array([o.metrics.tpot_s for o in outs if o.metrics.tpot_s is not None]) * 1e3
  stats = engine.stats()
  return dict(wall_s=wall, tokens_per_s=sum(len(o.token_ids) for o in outs) / wall,
              mean_ttft_ms=float(ttft.mean()), p90_ttft_ms=float(np.percentile(ttft, 90)),
              mean_ttft_long_ms=float(ttft[long].mean()),
              mean_ttft_short_ms=float(ttft[~long].mean()),
              mean_tpot_ms=float(tpot.mean()), steps=stats["steps"],
              tokens_per_step=stats["tokens_per_step"],
              outputs=[o.token_ids for o in outs])


def compare(cfg, params, *, mesh, layout: str = "dp_attn_ep", config: EngineConfig,
            policies=("none", "split"), workload: Workload = Workload(), rounds: int = 3,
            log=print) -> dict:
  """Each policy's median measurements over `rounds` alternating runs."""
  prompts = workload.prompts(cfg.vocab_size)
  make = lambda policy: Engine(cfg, params, dataclasses.replace(config, dp_balance=policy),
                               mesh=mesh, layout=layout)
  for policy in policies:  # untimed, until a run compiles nothing new (at most 3)
    for _ in range(3):
      if not serve(make(policy), prompts, workload)["xla_compiles"]:
        break
  runs = {p: [] for p in policies}
  for r in range(rounds):
    for policy in policies:
      m = serve(make(policy), prompts, workload)
      runs[policy].append(m)
      log(f"round {r} {policy:>5}: {m['tokens_per_s']:6.1f} tok/s  TTFT mean "
          f"{m['mean_ttft_ms']:7.1f} p90 {m['p90_ttft_ms']:7.1f} ms (long "
          f"{m['mean_ttft_long_ms']:7.1f}, short {m['mean_ttft_short_ms']:7.1f})  TPOT "
          f"{m['mean_tpot_ms']:5.1f} ms  steps {m['steps']}  compiles {m['xla_compiles']}")
  same = all(m["outputs"] == runs[policies[0]][0]["outputs"] for ms in runs.values() for m in ms)
  rows = []
  for policy, ms in runs.items():
    row = dict(policy=policy, rounds=rounds)
    for key in ("tokens_per_s", "mean_ttft_ms", "p90_ttft_ms", "mean_ttft_long_ms",
                "mean_ttft_short_ms", "mean_tpot_ms", "steps", "tokens_per_step", "wall_s",
                "xla_compiles"):
      row[key] = float(np.median([m[key] for m in ms]))
      row[f"{key}_per_round"] = [m[key] for m in ms]
    rows.append(row)
  return dict(rows=rows, outputs_identical=same, workload=dataclasses.asdict(workload),
              engine_config={k: v for k, v in dataclasses.asdict(config).items()
                             if k != "speculative"})
