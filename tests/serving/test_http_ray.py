"""The OpenAI-compatible HTTP server over a Ray cluster: two worker processes
(Ray actors, the bundled default model each) behind one uvicorn in this
process, driven by the real `openai` client. Completions, streamed and not,
equal `Engine.generate`; a client that disconnects aborts its request on
the remote worker, whose pages are freed (seen on /metrics, which reads the
workers' own stats). Ray runs locally on 2 CPUs and is shut down after."""

import os

import pytest
import ray

import jaxinfer
from jaxinfer import Engine, EngineConfig, SamplingParams
from jaxinfer.serving.cluster import Cluster
from jaxinfer.serving.http_server import make_app
from jaxinfer.serving.ray_worker import WorkerSpec
from test_http_server import _client, _Server, disconnect_mid_stream
from conftest import TEST_ENV

CONFIG = EngineConfig(page_size=16, num_pages=64, max_num_seqs=8, max_num_batched_tokens=64)
ENV = {"JAX_PLATFORMS": "cpu", **TEST_ENV}  # one CPU device per worker process
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
    # Both workers compile their steps before any HTTP timeout runs (a loaded
    # 2-core machine took over a minute); every prompt once keeps round robin even.
    warm = [cluster.submit(i, SamplingParams(max_tokens=2)) for i in ids]
    while cluster.has_unfinished():
      cluster.step()
    assert all(cluster.output(c).finish_reason == "length" for c in warm)
    server = _Server(make_app(cluster, tok, "default", max_queue=16))
    yield server, cluster, tok, refs
  finally:
    try:
      if server is not None:
        server.close()
    finally:  # Ray stops even if uvicorn did not: later tests in this process start it again
      if cluster is not None:
        cluster.shutdown()
      ray.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_completions_over_two_worker_processes_equal_engine_generate(ray_server, stream):
  server, cluster, tok, refs = ray_server
  pids = cluster.pids()
  assert len(set(pids)) == 2 and os.getpid() not in pids
  c = _client(server, timeout=300)
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
  disconnect_mid_stream(server, PROMPTS[3], max_tokens=900)  # the request runs in a worker process
  # The workers' own engines say the same (the abort reached the remote process).
  stats = [w.engine.stats() for w in cluster.workers]
  assert [s["kv_pages_used"] for s in stats] == [0, 0] and [s["running"] for s in stats] == [0, 0]
