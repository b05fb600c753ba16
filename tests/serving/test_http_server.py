"""The OpenAI-compatible HTTP server on localhost, driven by the real
`openai` client and raw httpx: greedy tokens equal `Engine.generate`,
concurrent clients, stop strings, a disconnect aborts its request and frees
its pages (seen on /metrics), bad requests get a 400 OpenAI error, a full
queue a 429 at once, the API key, and LoadGen Server runs over HTTP (the
SUT in-process, and experiments/mlperf_harness.py --server_url).

One server over the default model's Engine and one over a Cluster of a tiny
random model, each uvicorn in a thread on a free port."""

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import openai
import pytest
import uvicorn

import jaxinfer
from jaxinfer import Engine, EngineConfig, SamplingParams, models, presets
from jaxinfer.serving import openai_protocol as proto
from jaxinfer.serving.cluster import Cluster
from jaxinfer.serving.http_server import make_app
from jaxinfer.serving.worker import Worker
from jaxinfer.tokenizer import ByteTokenizer
from conftest import subprocess_env

ROOT = pathlib.Path(__file__).parents[2]
PROMPTS = ["def add(a, b):\n", "import os\nimport sys\n", "class Stack:\n", "for i in range("]
MAX_TOKENS = 12
BODY_LIMIT = 8192


class _Server:
  def __init__(self, app):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    self.port = s.getsockname()[1]
    s.close()
    self.url = f"http://127.0.0.1:{self.port}"
    self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                log_level="warning"))
    self.thread = threading.Thread(target=self.server.run, daemon=True)
    self.thread.start()
    deadline = time.monotonic() + 30
    while not self.server.started:
      assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
      time.sleep(0.02)

  def close(self):
    self.server.should_exit = True
    self.thread.join(timeout=30)
    assert not self.thread.is_alive(), "uvicorn did not stop"


@pytest.fixture(scope="module")
def default():
  """(server, tokenizer, greedy reference token ids per prompt)."""
  cfg, params, tok = jaxinfer.load_default_model()
  engine = Engine(cfg, params, EngineConfig(page_size=16, num_pages=256, max_num_seqs=8,
                                            max_num_batched_tokens=64))
  chat_prompt = proto.ChatTemplate(proto.BUILTIN_CHAT_TEMPLATE).render(
      [proto.ChatMessage(role="user", content=PROMPTS[0])])
  ids = [tok.encode(p) for p in PROMPTS] + [tok.encode(chat_prompt)]
  refs = [o.token_ids for o in engine.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))]
  server = _Server(make_app(engine, tok, "default", max_queue=16, max_body_bytes=BODY_LIMIT))
  yield server, tok, refs
  server.close()


@pytest.fixture(scope="module")
def cluster_server():
  """A Cluster of one tiny random worker, an API key and max_queue=1."""
  cfg = dataclasses.replace(presets.get("tiny_dense", num_layers=1), dtype="float32")
  worker = Worker(cfg, models.init_params(cfg, jax.random.key(0)),
                  EngineConfig(page_size=8, num_pages=256, max_num_seqs=4))
  server = _Server(make_app(Cluster([worker]), ByteTokenizer(), "tiny", max_queue=1,
                            api_key="secret"))
  yield server
  server.close()


def _client(server, key="none", timeout=60):
  return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def _metric(server, name, labels="", missing=None) -> float:
  text = httpx.get(server.url + "/metrics", timeout=30).text
  m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
  if m is None and missing is not None:
    return missing
  assert m, f"{name}{labels} is not on /metrics"
  return float(m.group(1))


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_engine_generate(default, stream):
  server, tok, refs = default
  c = _client(server)
  for prompt, ref in [(PROMPTS[0], refs[0]), (tok.encode(PROMPTS[1]), refs[1])]:  # text, ids
    r = c.completions.create(model="default", prompt=prompt, max_tokens=MAX_TOKENS,
                             temperature=0, stream=stream, extra_body={"return_token_ids": True})
    if stream:
      chunks = list(r)
      text = "".join(ch.choices[0].text for ch in chunks)
      ids = [t for ch in chunks for t in ch.choices[0].token_ids]
      finish = chunks[-1].choices[0].finish_reason
    else:
      text, ids, finish = r.choices[0].text, r.choices[0].token_ids, r.choices[0].finish_reason
      assert r.usage.completion_tokens == len(ref) and r.object == "text_completion"
    assert ids == ref
    assert text == tok.decode(ref)
    assert finish == ("length" if len(ref) == MAX_TOKENS else "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_engine_generate(default, stream):
  server, tok, refs = default
  r = _client(server).chat.completions.create(
      model="default", messages=[{"role": "user", "content": PROMPTS[0]}],
      max_tokens=MAX_TOKENS, temperature=0, stream=stream)
  if stream:
    chunks = list(r)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
  else:
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
  assert text == tok.decode(refs[-1])


def test_concurrent_clients(default):
  server, tok, refs = default
  def one(k):
    r = _client(server).completions.create(model="default", prompt=PROMPTS[k % len(PROMPTS)],
                                           max_tokens=MAX_TOKENS, temperature=0,
                                           stream=k % 2 == 1)
    return "".join(ch.choices[0].text for ch in r) if k % 2 else r.choices[0].text
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    texts = list(pool.map(one, range(8)))
  assert texts == [tok.decode(refs[k % len(PROMPTS)]) for k in range(8)]


def test_stop_string_cuts_the_text(default):
  server, tok, refs = default
  full = tok.decode(refs[2])
  stop = full[5:8]
  r = _client(server).completions.create(model="default", prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                         temperature=0, stop=[stop])
  assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


def disconnect_mid_stream(server, prompt: str, max_tokens: int) -> None:
  """Streams a long completion, drops the connection after 3 chunks while
  it runs, and checks /metrics: the request is aborted (counted once) and
  its pages are freed within 30 s."""
  aborted = _metric(server, "jaxinfer_requests_total", '{finish_reason="abort"}', missing=0.0)
  body = dict(model="default", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
  with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
    assert r.status_code == 200
    lines = r.iter_lines()  # kept: a dropped iterator closes the connection
    for _ in range(3):
      assert next(lines).startswith("data: ") and next(lines) == ""
    time.sleep(0.5)  # tokens keep coming: the request still runs
    assert _metric(server, "jaxinfer_running") == 1 and _metric(server, "jaxinfer_kv_pages_used") > 0
  deadline = time.monotonic() + 30
  while _metric(server, "jaxinfer_kv_pages_used") > 0 or _metric(server, "jaxinfer_running") > 0:
    assert time.monotonic() < deadline, "the disconnected request still holds pages"
    time.sleep(0.1)
  assert _metric(server, "jaxinfer_requests_total", '{finish_reason="abort"}') == aborted + 1
  assert _metric(server, "jaxinfer_held") == 0


def test_disconnect_aborts_and_frees_pages(default):
  disconnect_mid_stream(default[0], PROMPTS[3], max_tokens=1500)


BAD = {
    "unknown model": (dict(model="gpt-4"), "model", "model_not_found"),
    "max_tokens over the context": (dict(max_tokens=2047), "max_tokens", "context_length_exceeded"),
    "temperature": (dict(temperature=-1.0), "temperature", None),
    "top_p": (dict(top_p=0.0), "top_p", None),
    "n over its cap": (dict(n=129), "n", None),
    "n x prompts over the cap": (dict(n=100, prompt=["a", "b", "c"]), "n", None),
    "top_logprobs over 20": (dict(logprobs=21), "logprobs", None),
    "empty prompt": (dict(prompt=""), "prompt", None),
    "token id type": (dict(prompt=[1, "x"]), "prompt", None),
    "token id out of the vocabulary": (dict(prompt=[1, 300]), "", None),  # the engine's check
    "presence_penalty over 2": (dict(presence_penalty=3.0), "presence_penalty", None),
    "repetition_penalty 0": (dict(repetition_penalty=0.0), "repetition_penalty", None),
    "logit_bias key": (dict(logit_bias={"x": 1.0}), "logit_bias", None),
    "logit_bias over 100": (dict(logit_bias={"7": 101.0}), "logit_bias", None),
    "best_of": (dict(best_of=2), "best_of", None),
    "unknown field": (dict(best_of_everything=3), "best_of_everything", None),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_gets_a_400_json_error(default, case):
  server, _, _ = default
  fields, param, code = BAD[case]
  body = dict(dict(model="default", prompt="def f():", max_tokens=4), **fields)
  r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
  assert r.status_code == 400, r.text
  err = r.json()["error"]
  assert set(err) == {"message", "type", "param", "code"} and err["message"]
  assert (err["param"] or "").startswith(param) and (code is None or err["code"] == code), err


# Values no step array holds (int32 counts, float32 values, uint32 seeds),
# booleans as numbers, and numbers as strings: each a 400 naming its field.
HOSTILE = {
    "max_tokens": [2**31, 2**63, -1, 0, True, 1.5, "4"],
    "temperature": [1e308, -1e308, True, "1", float("inf"), float("nan")],
    "top_p": [1e308, True, float("nan")],
    "top_k": [2**31, 2**63, -2, True],
    "seed": [2**64, -2**63 - 1, True, 1.5],
    "n": [2**63, 0, True],
    "frequency_penalty": [1e308, True], "presence_penalty": [1e308, "0"],
    "logprobs": [2**63, -1, 21, True], "prompt_logprobs": [21, False], "best_of": [2**63, 0],
    "prompt": [[[False]], [True], [-1], [2**31], [[2**40]]],
    "echo": [1, "yes"],
    "logit_bias": [{"1": 1e308}, {"1": True}, {"300": 1.0}, {"99999999999": 1.0}],
    "min_tokens": [-1, 2**31, True], "repetition_penalty": [1e308, -1.0, True],
    "ignore_eos": [1, "true"], "stop_token_ids": [[-1], [2**31], [True]],
}


def test_hostile_values_get_400s_and_the_engine_keeps_serving(default):
  server, _, _ = default
  for field, values in HOSTILE.items():
    for v in values:
      body = dict(model="default", prompt="def f():", max_tokens=4)
      body[field] = v
      r = httpx.post(server.url + "/v1/completions", content=json.dumps(body), timeout=30,
                     headers={"Content-Type": "application/json"})
      assert r.status_code == 400, (field, v, r.text)
      assert (r.json()["error"]["param"] or "").startswith(field), (field, v, r.json())
  chat = dict(model="default", messages=[{"role": "user", "content": "hi"}],
              max_completion_tokens=2**63)
  r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=30)
  assert r.status_code == 400 and r.json()["error"]["param"].startswith("max_completion_tokens")
  # In range and served: the widest seed, top_k and vLLM's top_k=-1 (off).
  for extra in (dict(seed=2**64 - 1, top_k=2**31 - 1), dict(seed=-2**63, top_k=-1)):
    r = httpx.post(server.url + "/v1/completions", timeout=60, json=dict(
        model="default", prompt="def f():", max_tokens=4, temperature=0.7, **extra))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
  assert httpx.get(server.url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("raw,code", [(b'{"model": "default", "prompt": ', "invalid_json"),
                                      (b"[1, 2]", None),
                                      (json.dumps(dict(model="default", prompt="x" * BODY_LIMIT))
                                       .encode(), "request_too_large")])
def test_malformed_or_oversized_body_gets_a_400(default, raw, code):
  server, _, _ = default
  r = httpx.post(server.url + "/v1/completions", content=raw, timeout=30,
                 headers={"Content-Type": "application/json"})
  assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
  with pytest.raises(openai.BadRequestError, match="unknown model"):  # the real client too
    _client(server).chat.completions.create(model="nope", messages=[{"role": "user",
                                                                     "content": "hi"}])


def test_models_health_metrics(default):
  server, _, _ = default
  models_ = _client(server).models.list()
  assert [m.id for m in models_.data] == ["default"]
  assert httpx.get(server.url + "/health").json()["status"] == "ok"
  assert _metric(server, "jaxinfer_time_to_first_token_seconds_count") > 0
  assert _metric(server, "jaxinfer_time_per_output_token_seconds_count") > 0
  assert _metric(server, "jaxinfer_kv_pages_total") == 255
  assert _metric(server, "jaxinfer_requests_total", '{finish_reason="length"}') > 0


def test_api_key_and_cluster_backend(cluster_server):
  for key in ("none", "wrong"):
    with pytest.raises(openai.AuthenticationError):
      _client(cluster_server, key).completions.create(model="tiny", prompt="ab", max_tokens=2)
  r = _client(cluster_server, "secret").completions.create(model="tiny", prompt="ab",
                                                           max_tokens=3, temperature=0)
  assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
  assert httpx.get(cluster_server.url + "/health").status_code == 200  # no key needed
  # Unknown paths under /v1 are refused before routing, as vLLM's are; OPTIONS passes.
  assert httpx.get(cluster_server.url + "/v1/nope").status_code == 401
  assert httpx.options(cluster_server.url + "/v1/completions").status_code == 405


# vLLM's --api-key: every path under /v1 needs the key, the others do not.
_KEYED = [("POST", "/v1/completions", dict(model="tiny", prompt="ab", max_tokens=2)),
          ("POST", "/v1/chat/completions",
           dict(model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=2)),
          ("GET", "/v1/models", None)]
_OPEN = [("POST", "/tokenize", dict(prompt="ab")), ("POST", "/detokenize", dict(tokens=[97])),
         ("GET", "/tokenizer_info", None), ("GET", "/health", None), ("GET", "/metrics", None),
         ("GET", "/openapi.json", None)]


@pytest.mark.parametrize("method, path, body", _KEYED + _OPEN, ids=lambda v: str(v)[:20])
def test_api_key_covers_the_v1_routes_as_vllm_does(cluster_server, method, path, body):
  def call(**headers):
    return httpx.request(method, cluster_server.url + path, json=body, headers=headers,
                         timeout=60)
  refused = _metric(cluster_server, "jaxinfer_requests_refused_total", '{status="401"}', missing=0)
  assert call(Authorization="Bearer secret").status_code == 200
  for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}):
    r = call(**headers)
    if (method, path, body) in _OPEN:
      assert r.status_code == 200, (headers, r.text)
    else:
      assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
  got = _metric(cluster_server, "jaxinfer_requests_refused_total", '{status="401"}', missing=0)
  assert got - refused == (0 if (method, path, body) in _OPEN else 3)


def test_full_queue_gets_a_429_at_once(cluster_server):
  headers = {"Authorization": "Bearer secret"}
  body = dict(model="tiny", prompt="ab", max_tokens=2000, stream=True)  # seconds of decoding
  with httpx.stream("POST", cluster_server.url + "/v1/completions", json=body, headers=headers,
                    timeout=60) as held:  # holds the one place (max_queue=1)
    assert held.status_code == 200
    lines = held.iter_lines()  # kept: a dropped iterator closes the connection
    assert next(lines).startswith("data: ")
    start = time.monotonic()
    r = httpx.post(cluster_server.url + "/v1/completions", headers=headers, timeout=30,
                   json=dict(model="tiny", prompt="cd", max_tokens=2))
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
    assert time.monotonic() - start < 5
    assert next(lines) == "" and next(lines).startswith("data: ")  # the held one still streams
  deadline = time.monotonic() + 30
  while _metric(cluster_server, "jaxinfer_held") > 0:  # the disconnect aborts the held one
    assert time.monotonic() < deadline
    time.sleep(0.05)
  r = _client(cluster_server, "secret").completions.create(model="tiny", prompt="cd", max_tokens=2)
  assert r.usage.completion_tokens == 2  # the place is free again


def _failing_server(fail_steps: int):
  """A tiny engine whose next fail_steps steps run, then consume the page
  pool (as a device error after donation would) and raise."""
  cfg = dataclasses.replace(presets.get("tiny_dense", num_layers=1), dtype="float32")
  engine = Engine(cfg, models.init_params(cfg, jax.random.key(0)),
                  EngineConfig(page_size=8, num_pages=16, max_num_seqs=4))
  real_step, left = engine.step, [fail_steps]
  def step():
    if left[0] <= 0:
      return real_step()
    left[0] -= 1
    real_step()
    jax.tree.map(lambda a: a.delete(), engine.pool)
    raise RuntimeError("device lost")
  engine.step = step
  return engine, _Server(make_app(engine, ByteTokenizer(), "tiny"))


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on():
  engine, server = _failing_server(fail_steps=1)
  try:
    body = dict(model="tiny", prompt="ab", max_tokens=3, temperature=0)
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 500 and "device lost" in r.json()["error"]["message"], r.text
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "degraded" and health["step_failures"] == 1, health
    assert "device lost" in health["last_error"]
    r = httpx.post(server.url + "/v1/completions", json=dict(body, return_token_ids=True),
                   timeout=30)  # served on the rebuilt pool, as a fresh engine would
    assert r.status_code == 200, r.text
    fresh = Engine(engine.cfg, engine.params, EngineConfig(page_size=8, num_pages=16))
    ref = fresh.generate([list(b"ab")], SamplingParams(max_tokens=3))[0].token_ids
    assert r.json()["choices"][0]["token_ids"] == ref
    assert _metric(server, "jaxinfer_requests_total", '{finish_reason="error"}') == 1
    assert _metric(server, "jaxinfer_kv_pages_used") == 0
  finally:
    server.close()


def test_an_engine_failing_every_step_is_dead_then_503():
  _, server = _failing_server(fail_steps=10**6)
  try:
    body = dict(model="tiny", prompt="ab", max_tokens=2)
    for _ in range(3):  # MAX_CONSECUTIVE_FAILURES
      r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
      assert r.status_code == 500 and "device lost" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 503 and "device lost" in r.json()["error"]["message"], r.text
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "dead"
    assert "jaxinfer_requests_total" in httpx.get(server.url + "/metrics", timeout=10).text
  finally:
    server.close()


def test_detokenizer_holds_back_partial_utf8_and_stop_prefixes():
  d = proto.Detokenizer(ByteTokenizer(), ["END"])
  euro = list("€".encode())
  assert d.add(euro[:2]) == ""  # an incomplete character
  assert d.add(euro[2:] + list(b"aE")) == "€a"  # "E" may begin the stop string
  assert d.add(list(b"N")) == "" and not d.stopped
  assert d.add(list(b"Dxyz")) == "" and d.stopped and d.text == "€a"


def test_chat_template_from_the_model_dir(tmp_path):
  source = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
            "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": source, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
  template = proto.ChatTemplate(*proto.load_chat_template(str(tmp_path)))
  msgs = [proto.ChatMessage(role="system", content="be brief"),
          proto.ChatMessage(role="user", content=[{"type": "text", "text": "hi"}])]
  assert template.render(msgs) == "<s>[system]be brief[user]hi[assistant]"
  assert proto.load_chat_template(None)[0] == proto.BUILTIN_CHAT_TEMPLATE


def test_loadgen_server_run_over_http(default, tmp_path):
  from jaxinfer.serving import mlperf
  from jaxinfer.serving.mlperf_http import HttpSUT
  server, tok, refs = default
  prompts = [tok.encode(p) for p in PROMPTS]
  sut = HttpSUT(server.url, "default", prompts, max_tokens=MAX_TOKENS, concurrency=8)
  summary = mlperf.run_loadgen(sut, scenario="Server", outdir=str(tmp_path), target_qps=10.0,
                               ttft_ms=10_000, tpot_ms=2000, min_duration_ms=500,
                               min_query_count=12)
  comp = sut.compliance()
  assert comp["completed"] >= 12 and not comp["first_token_mismatches"] and not sut.errors, comp
  assert all(tokens == refs[i] for i, tokens in sut.completed.values())
  assert summary["Scenario"] == "Server" and summary["Completed tokens per second"] > 0


def test_mlperf_harness_over_http(default, tmp_path):
  server, _, _ = default
  env = subprocess_env()
  out = subprocess.run(
      [sys.executable, "experiments/mlperf_harness.py", "--scenarios=Server", "--num_samples=4",
       "--max_tokens=4", "--min_duration_ms=1000", "--min_query_count=8", "--server_qps=4",
       f"--server_url={server.url}", f"--out={tmp_path}"],
      cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "first tokens match True" in out.stdout, out.stdout[-2000:]
  rows = json.loads((tmp_path / "scenarios_performance.json").read_text())
  assert rows["server_url"] == server.url and rows["rows"][0]["compliance"]["completed"] >= 8


class _SmallTokenizer:
  """Bytes folded into the tiny VL fixture's vocabulary (128)."""

  def encode(self, text: str) -> list[int]:
    return [b % 100 for b in text.encode()]

  def decode(self, ids) -> str:
    return "".join(chr(97 + int(i) % 26) for i in ids)


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
  """The tiny Qwen3-VL fixture's Engine, chat images from data URLs and from
  files under an image root (holding one PNG, with a secret PNG beside it)."""
  import jax.numpy as jnp
  from vl_inputs import A, PROC, VL
  from jaxinfer import checkpoint
  cfg, params = checkpoint.load_hf(str(VL / "qwen3_vl"), dtype=jnp.float32)
  engine = Engine(cfg, params, EngineConfig(page_size=4, num_pages=64, max_num_seqs=4,
                                            max_num_batched_tokens=32, image_processor=PROC))
  base = tmp_path_factory.mktemp("vl")
  (base / "root").mkdir()
  (base / "root" / "a.png").write_bytes(A)
  (base / "secret.png").write_bytes(A)
  (base / "root" / "link.png").symlink_to(base / "secret.png")
  tok = _SmallTokenizer()  # the chat prompt: the image as vision start, pad, end
  ids = tok.encode("user: look ") + [122, 120, 123] + tok.encode(" now\nassistant: ")
  ref = engine.generate([ids], SamplingParams(max_tokens=4), images=[[A]])[0].token_ids
  server = _Server(make_app(engine, tok, "vl", image_root=str(base / "root")))
  yield server, ref, base
  server.close()


def _vl_chat(server, url):
  body = {"model": "vl", "max_tokens": 4, "temperature": 0, "return_token_ids": True,
          "messages": [{"role": "user", "content": [
              {"type": "text", "text": "look "},
              {"type": "image_url", "image_url": {"url": url}},
              {"type": "text", "text": " now"}]}]}
  return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def test_chat_image_equals_engine_generate(vl_server):
  import base64
  from vl_inputs import A
  server, ref, _ = vl_server
  for url in ("data:image/png;base64," + base64.b64encode(A).decode(), "a.png"):
    r = _vl_chat(server, url)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == ref


@pytest.mark.parametrize("url, match", [
    ("http://example.com/a.png", "http\\(s\\) URLs are not fetched"),
    ("https://example.com/a.png", "http\\(s\\) URLs are not fetched"),
    ("../secret.png", "outside the server's image root"),
    ("link.png", "outside the server's image root"),  # a symlink out of the root
    ("ABSOLUTE", "outside the server's image root"),
    ("data:image/png;base64,bm90IGFuIGltYWdl", "cannot decode image"),  # "not an image"
])
def test_chat_image_refused(vl_server, url, match):
  server, _, base = vl_server
  url = str(base / "secret.png") if url == "ABSOLUTE" else url
  r = _vl_chat(server, url)
  assert r.status_code == 400, r.text
  assert re.search(match, r.json()["error"]["message"]), r.json()


def test_chat_image_to_text_only_model(default):
  server, _, _ = default
  body = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": [
      {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
  r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
  assert r.status_code == 400 and "need a vision model" in r.json()["error"]["message"], r.text
