"""/openapi.json's document (`openapi_schema`) without a server: it names
every field the protocol models take, refuses the bodies users found it
accepting (an empty prompt, no messages, token ids past the vocabulary),
follows the server it describes (API key, cluster, BOS tokenizer, vision),
and the protocol's fixes that made the server match it. The server itself is
checked against the document by tests/serving/test_http_fuzz.py."""

import dataclasses
import json
import re

import jsonschema_rs
import pytest

from jaxinfer.serving import openai_protocol as proto
from jaxinfer.serving import openapi_schema
from jaxinfer.serving.openai_protocol import ApiError

LIMITS = openapi_schema.Limits(model="tiny", vocab_size=256, tokenizer_vocab=256,
                               max_model_len=128, max_tokens_cap=8, max_body_bytes=4096)
BODY = dict(model="tiny", prompt="ab")
CHAT = dict(model="tiny", messages=[{"role": "user", "content": "hi"}])


def _valid(doc: dict, name: str, instance) -> bool:
  root = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
  return jsonschema_rs.Draft202012Validator(root).is_valid(instance)


@pytest.mark.parametrize("n", [1, 2, 9, 10, 11, 99, 100, 101, 256, 1000, 1001, 32000, 151936])
def test_below_matches_the_token_ids_under_n_as_written(n):
  pattern = re.compile(openapi_schema.below(n))
  ok = [i for i in range(n + 1100) if pattern.fullmatch(str(i))]
  assert ok == list(range(n))
  for spelling in ("01", "00", "+1", "-0", "-1", " 1", "1 ", "1\n", "1_0", "\u0663", "1.0", ""):
    assert not pattern.fullmatch(spelling), spelling
  doc = openapi_schema.document(dataclasses.replace(LIMITS, vocab_size=n))
  assert _valid(doc, "CompletionRequest", {**BODY, "logit_bias": {str(n - 1): 1}})
  for key in (str(n), "1\n", "01"):
    assert not _valid(doc, "CompletionRequest", {**BODY, "logit_bias": {key: 1}}), key


def test_request_bodies_name_every_field_the_protocol_models_take():
  doc = openapi_schema.document(LIMITS)["components"]["schemas"]
  for model in (proto.CompletionRequest, proto.ChatRequest, proto.TokenizeRequest,
                proto.DetokenizeRequest, proto.StreamOptions):
    assert set(doc[model.__name__]["properties"]) == set(model.model_fields), model.__name__
    assert doc[model.__name__]["additionalProperties"] is False
  roles = proto.ChatMessage.model_fields["role"].annotation.__args__
  assert doc["ChatMessage"]["properties"]["role"]["enum"] == list(roles)
  for name, rules in openapi_schema.CROSS_FIELD_RULES.items():
    assert all(rule in doc[name]["description"] for rule in rules)


@pytest.mark.parametrize("name,body", [
    ("CompletionRequest", dict(BODY, prompt="")),
    ("CompletionRequest", dict(BODY, prompt=[])),
    ("CompletionRequest", dict(BODY, prompt=[[]])),
    ("CompletionRequest", dict(BODY, prompt=[256])),
    ("CompletionRequest", dict(BODY, prompt=[[1], [256]])),
    ("CompletionRequest", dict(BODY, prompt=[1] * 128)),  # no room left in the context
    ("CompletionRequest", dict(BODY, prompt=["a", ""])),
    ("CompletionRequest", dict(BODY, prompt=["a"] * 257)),
    ("CompletionRequest", dict(BODY, stop="")),
    ("CompletionRequest", dict(BODY, stop=["a", ""])),
    ("CompletionRequest", dict(BODY, stop_token_ids=[256])),
    ("CompletionRequest", dict(BODY, logit_bias={"256": 1})),
    ("CompletionRequest", dict(BODY, logit_bias={"1": 101})),
    ("CompletionRequest", dict(BODY, max_tokens=9)),
    ("CompletionRequest", dict(BODY, max_tokens=0)),
    ("CompletionRequest", dict(BODY, min_tokens=9)),
    ("CompletionRequest", dict(BODY, n=129)),
    ("CompletionRequest", dict(BODY, best_of=2)),
    ("CompletionRequest", dict(BODY, temperature=-0.5)),
    ("CompletionRequest", dict(BODY, top_p=0)),
    ("CompletionRequest", dict(BODY, top_k=-2)),
    ("CompletionRequest", dict(BODY, repetition_penalty=1e-46)),  # 0 in float32
    ("CompletionRequest", dict(BODY, logprobs=21)),
    ("CompletionRequest", dict(BODY, stream=1)),
    ("CompletionRequest", dict(BODY, model="other")),
    ("CompletionRequest", dict(BODY, unknown=1)),
    ("ChatRequest", dict(CHAT, messages=[])),
    ("ChatRequest", dict(CHAT, messages=[{"role": "robot", "content": "x"}])),
    ("ChatRequest", dict(CHAT, top_logprobs=2)),  # needs logprobs: true
    ("ChatRequest", dict(CHAT, max_completion_tokens=9)),
    ("ChatRequest", dict(CHAT, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": "data:,"}]}])),  # not a vision model
    ("TokenizeRequest", {}),
    ("TokenizeRequest", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}),
    ("TokenizeRequest", {"messages": []}),
    ("DetokenizeRequest", {"tokens": [256]}),
])
def test_the_document_refuses_bodies_the_server_refuses(name, body):
  assert not _valid(openapi_schema.document(LIMITS), name, body)


@pytest.mark.parametrize("name,body", [
    ("CompletionRequest", BODY),
    ("CompletionRequest", dict(BODY, prompt=[255] * 127, max_tokens=1, logit_bias={"255": -100},
                               stop_token_ids=[0, 255], top_k=-1, n=128, seed=2**64 - 1)),
    ("CompletionRequest", dict(BODY, prompt=[[1], [2, 3]], stop=["a"], logprobs=20, echo=True,
                               repetition_penalty=1e-45, stream=True,
                               stream_options={"include_usage": True})),
    ("ChatRequest", dict(CHAT, logprobs=True, top_logprobs=20, max_completion_tokens=8)),
    ("ChatRequest", dict(CHAT, messages=[{"role": "tool", "content": [
        {"type": "text", "text": "x"}], "name": "ignored"}])),
    ("TokenizeRequest", {"prompt": ""}),
    ("TokenizeRequest", {"prompt": None, "messages": [{"role": "user", "content": "a"}]}),
    ("DetokenizeRequest", {"tokens": []}),
])
def test_the_document_takes_bodies_the_server_serves(name, body):
  assert _valid(openapi_schema.document(LIMITS), name, body)


def test_the_document_follows_the_server_it_describes():
  plain = openapi_schema.document(LIMITS)
  assert "securitySchemes" not in plain["components"]
  assert "401" not in plain["paths"]["/v1/completions"]["post"]["responses"]
  keyed = openapi_schema.document(dataclasses.replace(LIMITS, api_key=True))
  assert keyed["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
  for path, method in (("/v1/completions", "post"), ("/v1/chat/completions", "post"),
                       ("/v1/models", "get")):
    assert "401" in keyed["paths"][path][method]["responses"], path
  for path, op in keyed["paths"].items():  # the key guards /v1 alone
    assert ("security" in next(iter(op.values()))) == path.startswith("/v1"), path
  cluster = openapi_schema.document(dataclasses.replace(LIMITS, logprobs=False))
  assert not _valid(cluster, "CompletionRequest", dict(BODY, logprobs=1))
  assert not _valid(cluster, "ChatRequest", dict(CHAT, logprobs=True))
  assert _valid(cluster, "ChatRequest", dict(CHAT, logprobs=False))
  bos = openapi_schema.document(dataclasses.replace(LIMITS, empty_prompt=True))
  assert _valid(bos, "CompletionRequest", dict(BODY, prompt=""))
  vision = openapi_schema.document(dataclasses.replace(LIMITS, images=True))
  image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
  assert _valid(vision, "ChatRequest", dict(CHAT, messages=[image]))
  assert not _valid(vision, "TokenizeRequest", {"messages": [image]})
  ok = plain["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
  assert set(ok) == {"application/json", "text/event-stream"}
  assert set(plain["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
  assert json.loads(json.dumps(plain)) == plain  # plain JSON, as served


def test_numbers_with_a_zero_fraction_are_integers():
  """JSON Schema's integers: 2.0 and 1e3 are integers, 2.5 and true are not."""
  req = proto.parse(proto.CompletionRequest, json.dumps(dict(
      BODY, prompt=[1.0, 2e0], n=2.0, seed=1e3, top_k=-1.0)).encode())
  assert (req.prompt, req.n, req.seed, req.top_k) == ([1, 2], 2, 1000, -1)
  assert all(type(t) is int for t in req.prompt)
  for field, value in (("n", 2.5), ("n", True), ("prompt", [1.5]), ("seed", 2.0**64)):
    with pytest.raises(ApiError) as e:
      proto.parse(proto.CompletionRequest, json.dumps(dict(BODY, **{field: value})).encode())
    assert e.value.status == 400 and e.value.param.startswith(field), (field, value)


def _sampling(body: dict, model=proto.CompletionRequest):
  req = proto.parse(model, json.dumps(body).encode())
  return proto.sampling_params(req, prompt_len=4, max_model_len=128, max_tokens_cap=8,
                               default_max_tokens=16, vocab_size=256)


def test_logit_bias_keys_are_token_ids_spelled_one_way():
  assert _sampling(dict(BODY, logit_bias={"0": 1, "255": -2})).logit_bias == ((0, 1.0),
                                                                              (255, -2.0))
  for key in ("01", "+1", " 1", "1 ", "1_0", "\u0663", "-0"):
    with pytest.raises(ApiError) as e:
      _sampling(dict(BODY, logit_bias={key: 1}))
    assert e.value.status == 400 and e.value.param == "logit_bias", key


def test_chat_max_tokens_is_checked_beside_max_completion_tokens():
  assert _sampling(dict(CHAT, max_completion_tokens=2, max_tokens=8), proto.ChatRequest
                   ).max_tokens == 2
  for field, value in (("max_tokens", 9), ("max_tokens", 125), ("max_completion_tokens", 9)):
    body = dict(CHAT, max_completion_tokens=2, max_tokens=3) | {field: value}
    with pytest.raises(ApiError) as e:
      _sampling(body, proto.ChatRequest)
    assert e.value.status == 400 and e.value.param == field, (field, value)
