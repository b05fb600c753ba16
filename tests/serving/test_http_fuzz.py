"""schemathesis against the server's own /openapi.json: request bodies that
fit the schemas (positive) and that break them (negative), for every route,
a bounded number each. No request gets a 5xx, and afterwards the server is
healthy and serves greedy tokens equal to `Engine.generate`'s."""

import dataclasses

import httpx
import hypothesis
import jax
import schemathesis
from schemathesis.generation.modes import GenerationMode

from jaxinfer import Engine, EngineConfig, SamplingParams, models, presets
from jaxinfer.serving.http_server import make_app
from jaxinfer.tokenizer import ByteTokenizer
from test_http_server import _Server

EXAMPLES = 20  # per route and mode


def _engine():
  cfg = dataclasses.replace(presets.get("tiny_dense", num_layers=1), dtype="float32",
                            max_position_embeddings=128)
  params = models.init_params(cfg, jax.random.key(0))
  return Engine(cfg, params, EngineConfig(page_size=8, num_pages=64, max_num_seqs=8,
                                          max_num_batched_tokens=64))


def test_fuzzed_requests_get_no_5xx_and_the_server_serves_on():
  engine = _engine()
  server = _Server(make_app(engine, ByteTokenizer(), "tiny", max_tokens_cap=8,
                            max_body_bytes=4096))
  seen = {}  # route -> statuses
  try:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions", "/tokenize"}
    for op in ops:  # GET routes take no input: nothing breaks their schema
      modes = [GenerationMode.POSITIVE] + [GenerationMode.NEGATIVE] * (op.method.upper() == "POST")
      for mode in modes:
        @hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                             database=None, suppress_health_check=list(hypothesis.HealthCheck))
        @hypothesis.given(case=op.as_strategy(generation_mode=mode))
        def run(case):
          response = case.call(base_url=server.url, timeout=60)
          seen.setdefault(op.path, []).append(response.status_code)
          assert response.status_code < 500, (case.as_curl_command(), response.text)
        run()
    # Bodies reached the engine and were refused: valid chat bodies are rare
    # (many fields, each of which may be out of range), so the two
    # generation routes are counted together.
    generation = seen["/v1/completions"] + seen["/v1/chat/completions"]
    assert {200, 400} <= set(generation), seen
    for path in ("/tokenize", "/detokenize"):
      assert {200, 400} <= set(seen[path]), (path, seen[path])
    assert sum(map(len, seen.values())) > 100
    health = httpx.get(server.url + "/health").json()
    assert health == {"status": "ok", "step_failures": 0}, health
    r = httpx.post(server.url + "/v1/completions", timeout=60, json=dict(
        model="tiny", prompt="abc", max_tokens=6, temperature=0, return_token_ids=True))
    ref = _engine().generate([list(b"abc")], SamplingParams(max_tokens=6))[0].token_ids
    assert r.json()["choices"][0]["token_ids"] == ref
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json=dict(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
  finally:
    server.close()
