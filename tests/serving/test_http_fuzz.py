"""schemathesis against the server's own /openapi.json, with every check it
has (not_a_server_error, status_code_conformance, content_type_conformance,
response_headers_conformance, response_schema_conformance, SSE events
included, negative_data_rejection, positive_data_acceptance,
missing_required_header, unsupported_method, allow_header_conformance,
use_after_free, ensure_resource_availability, ignored_auth,
object_level_authorization), on every route: its coverage phase (each
constraint's boundaries and violations, undeclared methods), then
hypothesis's positive and negative bodies, a bounded number each, and fixed
bodies asking for every response shape (SHAPES: streamed, logprobs, echo).
The server has an API key, so the /v1 routes' 401s are checked too.

A positive body that breaks a rule across fields, which the document lists
but JSON Schema cannot state (`openapi_schema.CROSS_FIELD_RULES`: prompt +
max_tokens over the context, n x prompts, min_tokens over max_tokens, the
body size), must get a 400: every check but positive_data_acceptance runs on
it. Afterwards the server is healthy and serves the greedy tokens its
engine's `Engine.generate` gave before serving.

The engine pads every step to one shape and holds a sequence in one page:
its programs differ only in the sampling features a body turns on, so the
coverage phase's hundreds of generations compile a handful of programs."""

import collections
import concurrent.futures
import dataclasses
import threading

import httpx
import hypothesis
import jax
import requests
import schemathesis
from schemathesis.generation.modes import GenerationMode

from jaxinfer import Engine, EngineConfig, SamplingParams, models, presets
from jaxinfer.serving import openai_protocol as proto
from jaxinfer.serving.http_server import make_app
from jaxinfer.tokenizer import ByteTokenizer
from test_http_server import _Server

EXAMPLES = 4  # hypothesis bodies per route and mode, after the coverage phase
WORKERS = 4  # coverage cases in flight at once (the engine steps them together)
CAP, CONTEXT, BODY_LIMIT = 4, 128, 4096
AUTH = {"Authorization": "Bearer secret"}
TEMPLATE = proto.ChatTemplate(proto.BUILTIN_CHAT_TEMPLATE)
GENERATION = ("/v1/completions", "/v1/chat/completions")
# Bodies every run sends besides the generated ones (each must get a 200):
# every kind of response the document describes, streamed and whole, with
# the optional parts (logprobs, echo, prompt_logprobs, token ids, usage).
_CHAT = [{"role": "system", "content": "be brief"},
         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
SHAPES = {
    "/v1/completions": [
        dict(model="tiny", prompt="ab", stream=True, n=2, echo=True, logprobs=2,
             return_token_ids=True, stream_options={"include_usage": True}, stop="\n"),
        dict(model="tiny", prompt=[[97, 98], [99]], echo=True, logprobs=0, prompt_logprobs=1,
             return_token_ids=True, return_tokens_as_token_ids=True)],
    "/v1/chat/completions": [
        dict(model="tiny", messages=_CHAT, stream=True, n=2, logprobs=True, top_logprobs=2,
             return_token_ids=True, stream_options={"include_usage": True}),
        dict(model="tiny", messages=_CHAT, logprobs=True, top_logprobs=1, prompt_logprobs=1,
             max_completion_tokens=CAP, return_token_ids=True)],
}


def _engine():
  cfg = dataclasses.replace(presets.get("tiny_dense", num_layers=1), dtype="float32",
                            max_position_embeddings=CONTEXT)
  params = models.init_params(cfg, jax.random.key(0))
  return Engine(cfg, params, EngineConfig(page_size=CONTEXT, num_pages=16, max_num_seqs=4,
                                          max_num_batched_tokens=32, fixed_step_shapes=True))


def _prompt_lengths(body: dict, chat: bool) -> list[int] | None:
  """The body's prompts' token counts (the byte tokenizer, the built-in
  template); None where the server refuses the prompt for its own reasons."""
  if chat:
    try:
      messages = [proto.ChatMessage.model_validate(m) for m in body["messages"]]
      return [len(TEMPLATE.render(messages).encode())]
    except Exception:  # noqa: BLE001 - the server's to refuse, the checks' to judge
      return None
  p = body["prompt"]
  batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
  return [len(one.encode()) if isinstance(one, str) else len(one) for one in batch]


def breaks_a_cross_field_rule(case, response) -> bool:
  """Whether a schema-valid body breaks a rule of CROSS_FIELD_RULES (the
  server's 400s beyond the schema), as the request went out."""
  if len(response.request.body or b"") > BODY_LIMIT:
    return True
  body, chat = case.body, case.path == "/v1/chat/completions"
  if case.path not in GENERATION or not isinstance(body, dict):
    return False
  lengths = _prompt_lengths(body, chat)
  if lengths is None:
    return False
  if len(lengths) * body.get("n", 1) > proto.MAX_PROMPTS:
    return True
  given = [v for v in (body.get("max_completion_tokens"), body.get("max_tokens")) if v]
  for length in lengths:
    room = CONTEXT - length
    max_tokens = given[0] if given else min(room if chat else 16, room, CAP)
    if room < 1 or any(v > room for v in given) or body.get("min_tokens", 0) > max_tokens:
      return True
  return False


@dataclasses.dataclass
class Seen:
  """What the server answered: route -> (status, media type) counts; the
  routes whose key enforcement ignored_auth confirmed. Shared by the
  threads sending coverage cases, each with its own `requests.Session`."""
  answers: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(
      collections.Counter))
  auth_checked: set = dataclasses.field(default_factory=set)
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
  local: threading.local = dataclasses.field(default_factory=threading.local)

  def http(self) -> requests.Session:
    if not hasattr(self.local, "http"):
      self.local.http = requests.Session()
    return self.local.http

  def record(self, case, response) -> None:
    media = (response.headers.get("content-type") or [""])[0].split(";")[0]
    with self.lock:
      self.answers[case.path][response.status_code, media] += 1
      if 200 <= response.status_code < 300:
        self.auth_checked.add(case.operation.label)


def _check(case, url: str, seen: Seen):
  """One request with every check; a positive body that breaks a cross-field
  rule must get a 400 instead of being accepted. ignored_auth resends a
  route's first accepted request without the key and with a wrong one (as
  schemathesis's runner does: once per route)."""
  kwargs = dict(base_url=url, session=seen.http(), headers=AUTH, timeout=60)
  response = case.call(**kwargs)
  positive = case.meta is None or case.meta.generation.mode.is_positive  # None: SHAPES
  refused = positive and breaks_a_cross_field_rule(case, response)
  excluded = [schemathesis.checks.positive_data_acceptance] * refused
  if case.operation.label in seen.auth_checked:
    excluded.append(schemathesis.checks.ignored_auth)
  case.validate_response(response, headers=AUTH, transport_kwargs=kwargs,
                         excluded_checks=excluded)
  if refused:
    assert response.status_code == 400, (case.as_curl_command(), response.text)
  seen.record(case, response)
  return response


def _fuzz(schema, url: str, seen: Seen) -> None:
  for op in (r.ok() for r in schema.get_all_operations()):
    for body in SHAPES.get(op.path, ()):
      response = _check(op.Case(body=body), url, seen)
      assert response.status_code == 200, (body, response.text)
    config = schema.config.generation_for(operation=op, phase="coverage")
    cases = schema.iter_coverage_cases(
        op, generation_modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
        generation_config=config)
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
      for done in [pool.submit(_check, case, url, seen) for case in cases]:
        done.result()
    modes = [GenerationMode.POSITIVE] + [GenerationMode.NEGATIVE] * (op.method.upper() == "POST")
    for mode in modes:  # GET routes take no input: nothing breaks their schema
      @hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                           database=None, suppress_health_check=list(hypothesis.HealthCheck))
      @hypothesis.given(case=op.as_strategy(generation_mode=mode))
      def run(case):
        _check(case, url, seen)
      run()


def test_schemathesis_with_every_check_finds_nothing_and_the_server_serves_on():
  engine = _engine()
  ref = engine.generate([list(b"abc")], SamplingParams(max_tokens=CAP))[0].token_ids
  server = _Server(make_app(engine, ByteTokenizer(), "tiny", max_tokens_cap=CAP,
                            max_body_bytes=BODY_LIMIT, api_key="secret",
                            max_queue=WORKERS * proto.MAX_PROMPTS))  # no 429s
  seen = Seen()
  try:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    assert {op.ok().path for op in schema.get_all_operations()} == {
        *GENERATION, "/v1/models", "/tokenize", "/detokenize", "/tokenizer_info", "/health",
        "/metrics"}
    _fuzz(schema, server.url, seen)
    # Bodies were served, refused and sent by undeclared methods on every
    # POST route; both kinds of generation response came back and checked.
    for path in (*GENERATION, "/tokenize", "/detokenize"):
      assert {200, 400, 405} <= {s for s, _ in seen.answers[path]}, (path, seen.answers[path])
    for path in GENERATION:
      assert {(200, "application/json"), (200, "text/event-stream")} <= set(seen.answers[path])
    assert (200, "text/plain") in seen.answers["/metrics"]
    assert seen.auth_checked >= {"POST /v1/completions", "POST /v1/chat/completions",
                                 "GET /v1/models"}
    assert sum(sum(c.values()) for c in seen.answers.values()) > 1000
    health = httpx.get(server.url + "/health").json()
    assert health == {"status": "ok", "step_failures": 0}, health
    r = httpx.post(server.url + "/v1/completions", timeout=60, headers=AUTH, json=dict(
        model="tiny", prompt="abc", max_tokens=CAP, temperature=0, return_token_ids=True))
    assert r.json()["choices"][0]["token_ids"] == ref
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, headers=AUTH, json=dict(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=CAP))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == CAP, r.text
  finally:
    server.close()
