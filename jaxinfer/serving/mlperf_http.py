"""A LoadGen SUT over HTTP: each query sample is one streaming
/v1/completions request to an OpenAI-compatible server (`http_server`,
`experiments/serve.py`), as MLPerf's reference LLM harnesses drive theirs.

  sut = HttpSUT("http://127.0.0.1:8000", "default", prompts, max_tokens=32)
  summary = mlperf.run_loadgen(sut, scenario="Server", ...)

The prompt goes as token ids, greedy, with "return_token_ids" so the
stream carries the generated ids: the first streamed token is reported
with `FirstTokenComplete`, the whole output with `QuerySamplesComplete`.
A request that fails (an HTTP error, an error event, a dropped
connection) is still completed to LoadGen, with no tokens, so the run
never hangs; it is kept in `errors` and `stop` raises naming it.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx

from jaxinfer.serving.mlperf import SUTRecord


class HttpSUT(SUTRecord):
  """LoadGen callbacks over HTTP; `concurrency` requests in flight at most
  (more wait in the thread pool's queue, their clock already running)."""

  def __init__(self, url: str, model: str, prompts, *, max_tokens: int,
               first_token_events: bool = True, concurrency: int = 64,
               timeout_s: float = 600.0, api_key: str | None = None):
    super().__init__(prompts)
    if max_tokens < 1 or concurrency < 1:
      raise ValueError(f"HttpSUT: max_tokens and concurrency must be >= 1, got {max_tokens}, "
                       f"{concurrency}")
    self.url = url.rstrip("/") + "/v1/completions"
    self.model, self.max_tokens = model, max_tokens
    self.first_token_events = first_token_events
    self.concurrency, self.timeout_s = concurrency, timeout_s
    self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    self._client: httpx.Client | None = None
    self.errors: dict[int, str] = {}  # query id -> what went wrong

  def start(self) -> None:
    limits = httpx.Limits(max_connections=self.concurrency,
                          max_keepalive_connections=self.concurrency)
    self._client = httpx.Client(limits=limits, timeout=self.timeout_s, headers=self._headers)
    self._pool = concurrent.futures.ThreadPoolExecutor(self.concurrency, thread_name_prefix="http-sut")

  def stop(self) -> None:
    self._pool.shutdown(wait=True)
    self._client.close()
    if self.errors:
      qid, why = next(iter(self.errors.items()))
      raise RuntimeError(f"{len(self.errors)} of {len(self.times)} queries failed over HTTP; "
                         f"query {qid}: {why}")

  # LoadGen callbacks (its threads): never block them.
  def issue(self, query_samples) -> None:
    now = time.perf_counter()
    for qs in query_samples:
      self.times[qs.id] = [now, None, None]
      self._pool.submit(self._query, qs.id, qs.index)

  def flush(self) -> None:
    pass

  def _query(self, qid: int, index: int) -> None:
    tokens: list[int] = []
    try:
      body = dict(model=self.model, prompt=self.prompts[index], max_tokens=self.max_tokens,
                  temperature=0.0, stream=True, return_token_ids=True)
      with self._client.stream("POST", self.url, json=body) as r:
        if r.status_code != 200:
          raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        for line in r.iter_lines():
          if not line.startswith("data: "):
            continue
          data = line[len("data: "):]
          if data == "[DONE]":
            break
          event = json.loads(data)
          if "error" in event:
            raise RuntimeError(f"error event: {event['error'].get('message')}")
          new = event["choices"][0].get("token_ids") or []
          if new and not tokens:
            self._first(qid, int(new[0]))
          tokens += [int(t) for t in new]
      if not tokens:
        raise RuntimeError("the stream ended with no tokens")
      self.completed[qid] = (index, tokens)
    except Exception as e:  # noqa: BLE001 - LoadGen still gets its completion
      self.errors[qid] = f"{type(e).__name__}: {e}"
    self.times[qid][2] = time.perf_counter()
    self._respond(qid, tokens, first=False)

  def _first(self, qid: int, token: int) -> None:
    self.reported_first[qid] = token
    self.times[qid][1] = time.perf_counter()
    if self.first_token_events:
      self._respond(qid, [token], first=True)
