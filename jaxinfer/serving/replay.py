"""Driving a cluster (`Cluster`, or its Ray backend) to the end of a batch or
of a workload replayed in real time. Both only need the flow's `submit`,
`has_unfinished`, `output`, `clock` and the cluster's `step`."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.serving.flow import QueueFull, ServeOutput


def generate(cluster, prompts, sampling: SamplingParams | Sequence[SamplingParams] | None = None
             ) -> list[ServeOutput]:
  """Submits every prompt at once and serves them to the end (outputs in order)."""
  if isinstance(sampling, SamplingParams) or sampling is None:
    sampling = [sampling] * len(prompts)
  cids = [cluster.submit(p, s) for p, s in zip(prompts, sampling, strict=True)]
  while cluster.has_unfinished():
    cluster.step()
  return [cluster.output(c) for c in cids]


def run(cluster, items, sampling: SamplingParams | Callable | None = None, *,
        on_step: Callable | None = None) -> list[ServeOutput]:
  """Replays a workload (`workloads.Item`s, arrival_s from now) in real
  time; outputs in item order. A request the bounded queue rejects ends
  with finish_reason "error" naming why. sampling: SamplingParams, or a
  function item -> SamplingParams (default: greedy, item.max_tokens).
  on_step(cluster, elapsed_s): called after every cluster step (faults,
  probes)."""
  order = sorted(range(len(items)), key=lambda k: items[k].arrival_s)
  start = cluster.clock()
  outputs: dict[int, ServeOutput | int] = {}
  nxt = 0
  while nxt < len(order) or cluster.has_unfinished():
    now = cluster.clock() - start
    while nxt < len(order) and items[order[nxt]].arrival_s <= now:
      k = order[nxt]
      item = items[k]
      sp = (sampling(item) if callable(sampling) else
            dataclasses.replace(sampling or SamplingParams(), max_tokens=item.max_tokens))
      try:
        outputs[k] = cluster.submit(list(item.prompt), sp, arrival_s=start + item.arrival_s)
      except QueueFull as e:
        outputs[k] = ServeOutput(
            request_id=-1, prompt_token_ids=list(item.prompt), token_ids=[],
            finish_reason="error", error=f"rejected: {e}", ttft_s=None, tpot_s=None,
            worker=None, prefill_worker=None, cached_prompt_tokens=0, retries=0, reroutes=0)
      nxt += 1
    if cluster.has_unfinished():
      cluster.step()
      if on_step:
        on_step(cluster, cluster.clock() - start)
    elif nxt < len(order):
      time.sleep(max(0.0, min(0.01, items[order[nxt]].arrival_s - (cluster.clock() - start))))
  return [outputs[k] if isinstance(outputs[k], ServeOutput) else cluster.output(outputs[k])
          for k in range(len(items))]
