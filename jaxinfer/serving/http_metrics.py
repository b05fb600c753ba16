"""`/metrics` of the HTTP server in Prometheus text format.

Per request (recorded when it ends): TTFT, TPOT, end-to-end latency and
queue time histograms, requests by finish reason, prompt and generated
tokens; refusals by HTTP status. Read from the engine at scrape time: the
requests held, waiting and running, KV pages, preemptions, prefix-cache
queries and hits (prompt tokens), compiled step programs and, with
speculation, the acceptance length. A gauge with no value (no speculation)
is left out, never NaN.

Every series is `jaxinfer_*`; those vLLM also exports are repeated under
vLLM's `vllm:` names, so dashboards and benchmark tools written for vLLM
read them. Each server has its own registry.
"""

from __future__ import annotations

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)

# Engine snapshot key (`EngineLoop.stats`) -> (help, vLLM's name or None).
GAUGES = {
    "held": ("requests the server holds (queued or generating)", None),
    "waiting": ("queue depth: requests accepted and waiting for their first token",
                "vllm:num_requests_waiting"),
    "running": ("requests the engine is running", "vllm:num_requests_running"),
    "kv_pages_used": ("KV cache pages held by requests", None),
    "kv_pages_free": ("KV cache pages free", None),
    "kv_pages_cached": ("KV cache pages holding prefix-cache entries", None),
    "kv_pages_total": ("KV cache pages in the pool", None),
    "kv_cache_usage_perc": ("fraction of the KV cache pages held by requests",
                            "vllm:kv_cache_usage_perc"),
    "compiles": ("distinct step programs compiled", None),
    "spec_mean_accepted_length": ("speculative decoding: mean tokens accepted per sequence per "
                                  "verify step", None),
}
# Engine snapshot key -> (name, help, vLLM's name): cumulative engine counters.
COUNTERS = {
    "preemptions": ("preemptions", "requests preempted (their KV recomputed later)",
                    "vllm:num_preemptions"),
    "prompt_tokens": ("prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                      "vllm:prefix_cache_queries"),
    "cached_prompt_tokens": ("prefix_cache_hits", "prompt tokens served from the prefix cache",
                             "vllm:prefix_cache_hits"),
}


class _Both:
  """One series under its jaxinfer_ name and vLLM's."""

  def __init__(self, kind, name: str, vllm: str, help_: str, registry, **kw):
    self.series = [kind(f"jaxinfer_{name}", help_, registry=registry, **kw),
                   kind(vllm, help_, registry=registry, **kw)]

  def observe(self, value: float) -> None:
    for s in self.series:
      s.observe(value)

  def inc(self, value: float = 1) -> None:
    for s in self.series:
      s.inc(value)


class _Snapshot:
  """A collector of the engine's scrape-time values (`render` sets them)."""

  def __init__(self):
    self.values: dict = {}

  def collect(self):
    for key, (help_, vllm) in GAUGES.items():
      if self.values.get(key) is not None:
        for name in (f"jaxinfer_{key}", vllm)[:2 if vllm else 1]:
          yield GaugeMetricFamily(name, help_, value=float(self.values[key]))
    for key, (name, help_, vllm) in COUNTERS.items():
      if self.values.get(key) is not None:
        for n in (f"jaxinfer_{name}", vllm):
          yield CounterMetricFamily(n, help_, value=float(self.values[key]))


class HttpMetrics:
  """The server's Prometheus series (thread-safe: the engine thread records)."""

  def __init__(self):
    self.registry = r = prom.CollectorRegistry()
    self.ttft = _Both(prom.Histogram, "time_to_first_token_seconds",
                      "vllm:time_to_first_token_seconds", "time to first token", r,
                      buckets=TTFT_BUCKETS)
    self.tpot = _Both(prom.Histogram, "time_per_output_token_seconds",
                      "vllm:time_per_output_token_seconds",
                      "mean time per output token after the first, per request", r,
                      buckets=TPOT_BUCKETS)
    self.e2e = _Both(prom.Histogram, "e2e_request_latency_seconds",
                     "vllm:e2e_request_latency_seconds",
                     "request latency in the server: handed to the engine -> ended", r,
                     buckets=LATENCY_BUCKETS)
    self.queue = _Both(prom.Histogram, "request_queue_time_seconds",
                       "vllm:request_queue_time_seconds",
                       "time waiting to be scheduled: submitted -> first step", r,
                       buckets=LATENCY_BUCKETS)
    self.requests = prom.Counter("jaxinfer_requests", "requests ended, by finish reason",
                                 ["finish_reason"], registry=r)
    self.vllm_requests = prom.Counter("vllm:request_success", "requests ended, by finish reason",
                                      ["finished_reason"], registry=r)
    self.refused = prom.Counter("jaxinfer_requests_refused", "requests refused, by HTTP status",
                                ["status"], registry=r)
    self.prompt_tokens = _Both(prom.Counter, "prompt_tokens", "vllm:prompt_tokens",
                               "prompt tokens of ended requests", r)
    self.generation_tokens = _Both(prom.Counter, "generation_tokens", "vllm:generation_tokens",
                                   "tokens generated by ended requests", r)
    self._snapshot = _Snapshot()
    r.register(self._snapshot)

  def finished(self, result) -> None:
    """A request ended (`engine_loop.Result`)."""
    self.requests.labels(result.finish_reason).inc()
    self.vllm_requests.labels(result.finish_reason).inc()
    self.prompt_tokens.inc(result.prompt_tokens)
    self.generation_tokens.inc(len(result.token_ids))
    for histogram, value in ((self.ttft, result.ttft_s), (self.tpot, result.tpot_s),
                             (self.e2e, result.e2e_s), (self.queue, result.queue_s)):
      if value is not None:
        histogram.observe(value)

  def render(self, snapshot: dict) -> bytes:
    """The text exposition, engine values from a snapshot (`EngineLoop.stats`)."""
    values = dict(snapshot)
    if values.get("kv_pages_total"):
      values["kv_cache_usage_perc"] = values["kv_pages_used"] / values["kv_pages_total"]
    self._snapshot.values = values
    return prom.generate_latest(self.registry)


CONTENT_TYPE = prom.CONTENT_TYPE_LATEST
