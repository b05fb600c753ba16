"""Whatever bytes a client sends, the server answers with a 4xx naming the
problem, never a 5xx. To every POST route: a lone surrogate in a string
field, arrays nested 10,000 deep, a 10,000-digit integer, a truncated body,
and booleans given as numbers or strings each get a 400 OpenAI error naming
the field; afterwards each route serves a normal request and /health is ok.
A client that disconnects mid-body gets nothing and counts no error (the
app called directly over ASGI, and a socket closed mid-body on uvicorn).

One uvicorn server over a tiny random one-layer model."""

import asyncio
import dataclasses
import json
import logging
import socket
import time

import httpx
import jax
import pytest

from jaxinfer import Engine, EngineConfig, models, presets
from jaxinfer.serving import openai_protocol as proto
from jaxinfer.serving.http_server import make_app
from jaxinfer.tokenizer import ByteTokenizer
from test_http_server import _metric, _Server

DEEP = 10_000  # arrays nested this deep
DIGITS = 10_000  # digits of the long integer
CHAT = dict(model="tiny", messages=[{"role": "user", "content": "ab"}], max_tokens=2)

# POST route -> (a body it serves, its string field, a field for the long
# integer, its boolean fields). A field is a dotted path into the body.
ROUTES = {
    "/v1/completions": (dict(model="tiny", prompt="ab", max_tokens=2), "prompt", "max_tokens",
                        ["stream", "echo", "return_token_ids", "return_tokens_as_token_ids",
                         "ignore_eos", "stream_options.include_usage",
                         "stream_options.continuous_usage_stats"]),
    "/v1/chat/completions": (CHAT, "messages.0.content", "seed",
                             ["stream", "logprobs", "return_token_ids",
                              "return_tokens_as_token_ids", "ignore_eos",
                              "stream_options.include_usage"]),
    "/tokenize": (dict(prompt="ab"), "prompt", "prompt", ["add_special_tokens"]),
    "/detokenize": (dict(tokens=[97, 98]), "model", "tokens.1", []),
}
NOT_BOOLEANS = [1, 0, 1.0, "yes", "true", [True], {}]


@pytest.fixture(scope="module")
def served():
  """(server, its app)."""
  cfg = dataclasses.replace(presets.get("tiny_dense", num_layers=1), dtype="float32",
                            max_position_embeddings=128)
  engine = Engine(cfg, models.init_params(cfg, jax.random.key(0)),
                  EngineConfig(page_size=8, num_pages=64, max_num_seqs=8,
                               max_num_batched_tokens=64))
  app = make_app(engine, ByteTokenizer(), "tiny", max_tokens_cap=8, max_body_bytes=1 << 16)
  server = _Server(app)
  yield server, app
  server.close()


def _with(body: dict, field: str, value) -> dict:
  """A copy of body with the dotted field set to value."""
  body = json.loads(json.dumps(body))
  *parents, last = [int(p) if p.isdigit() else p for p in field.split(".")]
  node = body
  for p in parents:
    node = node.setdefault(p, {}) if isinstance(node, dict) else node[p]
  node[last] = value
  return body


def _post(server, path: str, raw: bytes) -> tuple[int, dict]:
  r = httpx.post(server.url + path, content=raw, timeout=60,
                 headers={"Content-Type": "application/json"})
  assert r.headers["content-type"] == "application/json", (path, raw[:80], r.text)
  return r.status_code, r.json()["error"] if r.status_code != 200 else r.json()


def _refused(server, path: str, raw: bytes, param, code, words: str) -> None:
  """A 400 with an OpenAI error body: its param and code, words in its message."""
  status, err = _post(server, path, raw)
  where = (path, raw[:60], err)
  assert status == 400 and set(err) == {"message", "type", "param", "code"}, where
  assert err["param"] == param and err["code"] == code and words in err["message"], where
  if param is not None:
    assert err["message"].startswith(param + ":"), where


def test_every_post_route_is_covered(served):
  _, app = served
  posts = {r.path for r in app.routes if "POST" in getattr(r, "methods", ())}
  assert posts == set(ROUTES)


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_bad_bytes_get_400s_naming_the_problem(served, path):
  server, _ = served
  body, text_field, int_field, booleans = ROUTES[path]
  top = text_field.split(".")[0]
  # A lone surrogate: json.dumps writes it as the escape "\ud800".
  raw = json.dumps(_with(body, text_field, "a\ud800b")).encode()
  assert b"\\ud800" in raw
  _refused(server, path, raw, text_field, "invalid_unicode", "lone surrogate \\ud800")
  raw = json.dumps(dict(body, **{"\udc00": 1})).encode()  # as a key
  _refused(server, path, raw, None, "invalid_unicode", "the key '\\udc00'")
  # Nested far past MAX_JSON_DEPTH: in a field, and as the whole body.
  deep = b"[" * DEEP + b"]" * DEEP
  raw = json.dumps(_with(body, top, "@")).encode().replace(b'"@"', deep)
  _refused(server, path, raw, top, "json_too_deep", f"MAX_JSON_DEPTH={proto.MAX_JSON_DEPTH}")
  _refused(server, path, deep, None, "json_too_deep", "the request body: arrays and objects")
  # Just past the depth limit, where json parses it and the check walks it.
  d = proto.MAX_JSON_DEPTH
  raw = json.dumps(_with(body, top, "@")).encode().replace(b'"@"', b"[" * d + b"]" * d)
  _refused(server, path, raw, top, "json_too_deep", "nested over")
  # Integers past MAX_INT_DIGITS digits (and past int()'s own 4300).
  for digits in (DIGITS, proto.MAX_INT_DIGITS + 1):
    raw = json.dumps(_with(body, int_field, "@")).encode().replace(b'"@"', b"9" * digits)
    _refused(server, path, raw, int_field, "number_too_large", f"an integer of {digits} digits")
  # Truncated bodies, bytes that are not UTF-8, and no object at all.
  whole = json.dumps(body).encode()
  for cut in (whole[:whole.rindex(b'"')], whole[:-1], b'{"prompt": "ab', b"", b"{"):
    _refused(server, path, cut, None, "invalid_json", "not valid JSON")
  _refused(server, path, whole.replace(b"}", b', "x": "\xff"}', 1), None, "invalid_json",
           "not UTF-8")
  _refused(server, path, b"-" + b"1" * DIGITS, None, None, "must be a JSON object, got int")
  # Booleans are JSON true / false only.
  for field in booleans:
    for value in NOT_BOOLEANS:
      _refused(server, path, json.dumps(_with(body, field, value)).encode(), field, None,
               "valid boolean")


def test_each_route_serves_after_the_bad_bytes(served):
  server, _ = served
  for path in ROUTES:  # the bad bytes again, then what each route serves
    body, text_field, _, _ = ROUTES[path]
    status, _ = _post(server, path, json.dumps(_with(body, text_field, "\ud800")).encode())
    assert status == 400
  status, out = _post(server, "/v1/completions", json.dumps(ROUTES["/v1/completions"][0]).encode())
  assert status == 200 and out["usage"]["completion_tokens"] == 2, out
  status, out = _post(server, "/v1/chat/completions",
                      json.dumps(dict(CHAT, stream=False, return_token_ids=True)).encode())
  assert status == 200 and len(out["choices"][0]["token_ids"]) == 2, out
  # Surrogate pairs are valid: one character, its UTF-8 bytes as tokens.
  status, out = _post(server, "/tokenize", json.dumps(dict(prompt="\U0001F600")).encode())
  assert b'"\\ud83d\\ude00"' in json.dumps("\U0001F600").encode()
  assert status == 200 and out["tokens"] == list("\U0001F600".encode()), out
  status, out = _post(server, "/detokenize", json.dumps(dict(tokens=[97, 98])).encode())
  assert status == 200 and out["prompt"] == "ab", out
  r = httpx.post(server.url + "/v1/completions", timeout=60, json=dict(
      ROUTES["/v1/completions"][0], stream=True, stream_options={"include_usage": True}))
  events = [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: {")]
  assert r.status_code == 200 and events[-1]["usage"]["completion_tokens"] == 2, r.text
  assert httpx.get(server.url + "/health").json() == {"status": "ok", "step_failures": 0}
  assert _metric(server, "jaxinfer_requests_refused_total", '{status="500"}', missing=0) == 0
  assert _metric(server, "jaxinfer_requests_refused_total", '{status="400"}') >= len(ROUTES)


def _refusals(server) -> str:
  return "\n".join(line for line in httpx.get(server.url + "/metrics", timeout=30).text
                   .splitlines() if line.startswith("jaxinfer_requests_refused_total"))


def _asgi_post_then_disconnect(app, path: str) -> list:
  """Calls the app over ASGI: part of a body, then the client disconnects.
  -> the messages the app sent."""
  sent, received = [], [{"type": "http.request", "body": b'{"model": "ti', "more_body": True},
                         {"type": "http.disconnect"}]

  async def receive():
    return received.pop(0) if received else {"type": "http.disconnect"}

  async def send(message):
    sent.append(message)

  scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
           "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
           "query_string": b"", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
           "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")]}
  asyncio.run(app(scope, receive, send))
  assert not received, "the app did not read the body to the disconnect"
  return sent


def test_client_disconnect_mid_body_over_asgi(served, caplog):
  server, app = served
  before = _refusals(server)
  caplog.set_level(logging.INFO)
  for path in ROUTES:
    assert _asgi_post_then_disconnect(app, path) == [], path  # nothing sent, nothing raised
  gone = [r for r in caplog.records if "disconnected while sending its body" in r.message]
  assert len(gone) == len(ROUTES) and all(r.levelno == logging.INFO for r in gone), gone
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
  assert _refusals(server) == before  # no 5xx, nor any other status, counted


def test_client_disconnect_mid_body_over_a_socket(served, caplog):
  server, _ = served
  before = _refusals(server)
  caplog.set_level(logging.INFO)
  uvicorn_log = logging.getLogger("uvicorn")  # it does not propagate to the root
  uvicorn_log.addHandler(caplog.handler)
  try:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
      s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: 1000\r\n\r\n" + b'{"model": "tiny", "prompt": "a')
      time.sleep(0.2)  # the app is reading the body
    deadline = time.monotonic() + 20
    while "disconnected while sending its body" not in caplog.text:
      assert time.monotonic() < deadline, caplog.text
      time.sleep(0.05)
    time.sleep(0.2)  # anything the server would log after the app returned
  finally:
    uvicorn_log.removeHandler(caplog.handler)
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
  assert _refusals(server) == before
  assert httpx.get(server.url + "/health").json()["status"] == "ok"
