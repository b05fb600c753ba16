"""The OpenAI-compatible HTTP server over a Ray cluster: two worker processes
(Ray actors, the bundled default model each) behind one uvicorn in this
process, driven by the real `openai` client. Completions, streamed and not,
equal `Engine.generate`; a client that disconnects aborts its request on
the remote worker, whose pages are freed (seen on /metrics, which reads the
workers' own stats). Ray runs locally on 2 CPUs and is shut down after."""

import os
import time

import httpx
import pytest
import ray

import jaxinfer
from jaxinfer import Engine, EngineConfig, SamplingParams
from jaxinfer.serving.cluster import Cluster
from jaxinfer.serving.http_server import make_app
from jaxinfer.serving.ray_worker import WorkerSpec
from test_http_server import _client, _metric, _Server

CONFIG = EngineConfig(page_size=16, num_pages=64, max_num_seqs=8, max_num_batched_tokens=64)
ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # one CPU device per worker process
PROMPTS = ["def add(a, b):\n", "import os\nimport sys\n", "class Stack:\n", "for i in range("]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def ray_server():
  """(server, cluster, tokenizer, greedy reference token ids per prompt)."""
  cfg, params, tok = jaxinfer.load_default_model()
  ids = [tok.encode(p) for p in PROMPTS]
  refs = [o.token_ids for o in Engine(cfg, params, CONFIG).generate(
      ids, SamplingParams(max_tokens=MAX_TOKENS))]
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
  cluster = server = None
  try:
    cluster = Cluster([WorkerSpec(config=CONFIG, name=f"w{k}", num_cpus=0.5, env=ENV)
                       for k in range(2)], backend="ray", router="round_robin",
                      step_timeout_s=120, start_timeout_s=300)
    server = _Server(make_app(cluster, tok, "default", max_queue=16))
    yield server, cluster, tok, refs
  finally:
    if server is not None:
      server.close()
    if cluster is not None:
      cluster.shutdown()
    ray.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_completions_over_two_worker_processes_equal_engine_generate(ray_server, stream):
  server, cluster, tok, refs = ray_server
  pids = cluster.pids()
  assert len(set(pids)) == 2 and os.getpid() not in pids
  c = _client(server)
  for prompt, ref in zip(PROMPTS, refs, strict=True):  # round robin: both workers serve
    r = c.completions.create(model="default", prompt=prompt, max_tokens=MAX_TOKENS,
                             temperature=0, stream=stream, extra_body={"return_token_ids": True})
    if stream:
      chunks = list(r)
      text = "".join(ch.choices[0].text for ch in chunks)
      ids = [t for ch in chunks for t in ch.choices[0].token_ids]
    else:
      text, ids = r.choices[0].text, r.choices[0].token_ids
    assert ids == ref and text == tok.decode(ref)
  served = cluster.stats()["requests_per_worker"]
  assert min(served) > 0 and sum(served) % len(PROMPTS) == 0


def test_disconnect_aborts_on_the_remote_worker(ray_server):
  server, cluster, _, _ = ray_server
  aborted = _metric(server, "jaxinfer_requests_total", '{finish_reason="abort"}', missing=0.0)
  body = dict(model="default", prompt=PROMPTS[3], max_tokens=900, temperature=0, stream=True)
  with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
    assert r.status_code == 200
    lines = r.iter_lines()  # kept: a dropped iterator closes the connection
    for _ in range(3):
      assert next(lines).startswith("data: ") and next(lines) == ""
    time.sleep(0.5)  # tokens keep coming: the request still runs in a worker process
    assert _metric(server, "jaxinfer_running") == 1 and _metric(server, "jaxinfer_kv_pages_used") > 0
  deadline = time.monotonic() + 30
  while _metric(server, "jaxinfer_kv_pages_used") > 0 or _metric(server, "jaxinfer_running") > 0:
    assert time.monotonic() < deadline, "the disconnected request still holds pages"
    time.sleep(0.1)
  assert _metric(server, "jaxinfer_requests_total", '{finish_reason="abort"}') == aborted + 1
  assert _metric(server, "jaxinfer_held") == 0
  # The workers' own engines say the same (the abort reached the remote process).
  stats = [w.engine.stats() for w in cluster.workers]
  assert [s["kv_pages_used"] for s in stats] == [0, 0] and [s["running"] for s in stats] == [0, 0]
