"""The OpenAPI 3.1 document of `http_server`'s app (/openapi.json), built
per app: its model name, vocabulary, context and max_tokens cap are in it.

For every route it gives the request body with the constraints the server
enforces on each field (types, ranges, lengths, enums, token ids in
[0, vocab_size), unknown fields refused), every status the route answers
with its body (the OpenAI error object for 4xx and 5xx) and the real content
types: application/json, text/event-stream for "stream": true (one schema
per event: `data:` a JSON chunk, an error object or "[DONE]") and text/plain
for /metrics (Prometheus text). A body the schema refuses gets a 4xx.

Rules across fields are beyond JSON Schema; each body's description names
them (`CROSS_FIELD_RULES`), and breaking one is a 400 naming the field.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.engine.sampling import FLOAT32_MAX, MAX_LOGIT_BIAS, MAX_LOGPROBS
from jaxinfer.serving.openai_protocol import MAX_N, MAX_PROMPTS

__all__ = ["CROSS_FIELD_RULES", "Limits", "document", "below"]

INT32_MAX = 2**31 - 1
# repetition_penalty must be nonzero in float32: over 2**-150, which rounds to 0.
FLOAT32_ROUNDS_TO_0 = 2.0**-150

CROSS_FIELD_RULES = {
    "CompletionRequest": (
        "each prompt's tokens + max_tokens fit the context (max_model_len) and the KV pool",
        f"n x the number of prompts is at most {MAX_PROMPTS}",
        "min_tokens is at most max_tokens (when max_tokens is left out: the least of 16, "
        "the room left in the context and max_tokens_cap)",
        "the body is at most max_body_bytes"),
    "ChatRequest": (
        "the rendered prompt's tokens + max_completion_tokens (else max_tokens) fit the "
        "context (max_model_len) and the KV pool",
        "min_tokens is at most max_completion_tokens (else max_tokens; left out: the room "
        "left in the context, at most max_tokens_cap)",
        "the chat template renders the messages to a non-empty prompt (a model's own template "
        "may refuse some, e.g. roles out of turn)",
        "image parts (vision models only) are data URLs or files under image_root that decode "
        "to images",
        "the body is at most max_body_bytes"),
    "TokenizeRequest": ("the body is at most max_body_bytes",),
    "DetokenizeRequest": ("the body is at most max_body_bytes",),
}


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the document says of one server. vocab_size: the engine's (prompt
  token ids, stop_token_ids, logit_bias keys); tokenizer_vocab: /detokenize's
  (None: unchecked); empty_prompt: "" is a prompt (it tokenizes to a BOS);
  logprobs: served (an Engine; a Cluster's workers keep them); images: chat
  image_url parts (a vision model); api_key: /v1 routes need one.
  max_body_bytes: the largest body (None: unlimited)."""
  model: str
  vocab_size: int
  tokenizer_vocab: int | None
  max_model_len: int
  max_tokens_cap: int
  max_body_bytes: int | None = None
  empty_prompt: bool = False
  logprobs: bool = True
  images: bool = False
  api_key: bool = False


def below(n: int) -> str:
  """A regex matching the decimal integers in [0, n) as written canonically
  (no sign, no leading zero): logit_bias keys."""
  if n < 1:
    raise ValueError(f"below: n must be >= 1, got {n}")
  s = str(n - 1)
  k = len(s)
  alts = [f"[0-{s}]"] if k == 1 else ["[0-9]"]
  if k > 2:
    alts.append(f"[1-9][0-9]{{1,{k - 2}}}")  # 2 to k - 1 digits
  for i, c in enumerate(s if k > 1 else ""):  # k digits, under s from digit i on
    lo, hi = 1 if i == 0 else 0, int(c) - 1
    if hi >= lo:
      digit = str(lo) if hi == lo else f"[{lo}-{hi}]"
      alts.append(s[:i] + digit + (f"[0-9]{{{k - i - 1}}}" if k - i - 1 else ""))
  if k > 1:
    alts.append(s)
  return "^(" + "|".join(alts) + ")$"


def _ref(name: str) -> dict:
  return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict) -> dict:
  return {"anyOf": [schema, {"type": "null"}]}


def _int(lo: int, hi: int, **extra) -> dict:
  return {"type": "integer", "minimum": lo, "maximum": hi, **extra}


def _real(lo: float = -FLOAT32_MAX, hi: float = FLOAT32_MAX, **extra) -> dict:
  return {"type": "number", "minimum": lo, "maximum": hi, **extra}


def _token_ids(vocab: int, max_items: int | None = None, min_items: int = 0) -> dict:
  out = {"type": "array", "items": _int(0, vocab - 1), "minItems": min_items}
  return out if max_items is None else {**out, "maxItems": max_items}


def _sampling_fields(lim: Limits) -> dict:
  """The fields completions and chat share, as `openai_protocol._Request` and
  `SamplingParams` check them."""
  most = min(lim.max_tokens_cap, lim.max_model_len - 1)
  stop = {"type": "string", "minLength": 1}
  logprobs = _int(0, MAX_LOGPROBS) if lim.logprobs else None
  return {
      "model": {"type": "string", "enum": [lim.model], "description": "the served model"},
      "max_tokens": _nullable(_int(1, most, description=(
          f"at most max_tokens_cap ({lim.max_tokens_cap}) and the context less one prompt "
          "token"))),
      "temperature": _real(0, description="0: greedy", default=1.0),
      "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1.0},
      "top_k": _int(-1, INT32_MAX, description="0 or -1: off", default=0),
      "seed": _nullable(_int(-2**63, 2**64 - 1, description="its low 32 bits are used")),
      "stop": {"anyOf": [stop, {"type": "array", "items": stop}, {"type": "null"}]},
      "n": _int(1, MAX_N, default=1),
      "stream": {"type": "boolean", "default": False,
                 "description": "true: text/event-stream of chunks, then data: [DONE]"},
      "stream_options": _nullable(_ref("StreamOptions")),
      "user": _nullable({"type": "string"}),
      "return_token_ids": {"type": "boolean", "default": False},
      "prompt_logprobs": _nullable(logprobs) if logprobs else {"type": "null"},
      "return_tokens_as_token_ids": {"type": "boolean", "default": False},
      "frequency_penalty": _real(-2, 2, default=0.0),
      "presence_penalty": _real(-2, 2, default=0.0),
      "repetition_penalty": {"type": "number", "exclusiveMinimum": FLOAT32_ROUNDS_TO_0,
                             "maximum": FLOAT32_MAX, "default": 1.0},
      "logit_bias": _nullable({
          "type": "object", "maxProperties": MAX_LOGIT_BIAS,
          "propertyNames": {"pattern": below(lim.vocab_size)},
          "additionalProperties": _real(-100, 100),
          "description": "token id (decimal, as a string) -> bias"}),
      "ignore_eos": {"type": "boolean", "default": False},
      "min_tokens": _int(0, most, default=0),
      "stop_token_ids": _nullable(_token_ids(lim.vocab_size)),
      "best_of": _nullable(_int(1, 1, description="not supported beyond 1")),
  }


def _body(name: str, required: list[str], properties: dict, about: str, **extra) -> dict:
  rules = "".join(f"\n- {r}" for r in CROSS_FIELD_RULES[name])
  return {"type": "object", "required": required, "properties": properties,
          "additionalProperties": False, **extra,
          "description": f"{about} Rules across fields (a 400 when broken):{rules}"}


def _completion_request(lim: Limits) -> dict:
  ctx = lim.max_model_len - 1
  text = {"type": "string", "minLength": 0 if lim.empty_prompt else 1}
  prompt = {"anyOf": [
      text, _token_ids(lim.vocab_size, ctx, 1),
      {"type": "array", "items": text, "minItems": 1, "maxItems": MAX_PROMPTS},
      {"type": "array", "items": _token_ids(lim.vocab_size, ctx, 1), "minItems": 1,
       "maxItems": MAX_PROMPTS}],
      "description": "a prompt (text or token ids) or a list of them"}
  logprobs = _nullable(_int(0, MAX_LOGPROBS)) if lim.logprobs else {"type": "null"}
  props = {**_sampling_fields(lim), "prompt": prompt,
           "echo": {"type": "boolean", "default": False}, "logprobs": logprobs}
  return _body("CompletionRequest", ["model", "prompt"], props, "POST /v1/completions.")


def _message(images: bool) -> dict:
  """A chat message: text, or parts (image_url parts for a vision model);
  other fields (name, ...) are ignored."""
  parts = [_ref("TextPart")] + ([_ref("ImagePart")] if images else [])
  part = parts[0] if len(parts) == 1 else {"oneOf": parts}
  return {"type": "object", "required": ["role", "content"], "properties": {
      "role": {"type": "string", "enum": ["system", "user", "assistant", "tool", "developer"]},
      "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}}}


def _chat_request(lim: Limits) -> dict:
  fields = _sampling_fields(lim)
  props = {**fields, "messages": {"type": "array", "minItems": 1,
                                  "items": _ref("ChatMessage")},
           "max_completion_tokens": fields["max_tokens"],
           "logprobs": {"type": "boolean", "default": False} if lim.logprobs else
                       {"type": "boolean", "enum": [False], "default": False},
           "top_logprobs": _nullable(_int(0, MAX_LOGPROBS, description="needs logprobs: "
                                          "true")) if lim.logprobs else {"type": "null"}}
  # top_logprobs (an integer) needs logprobs: true.
  needs = {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs":
                                                               {"type": "integer"}}},
           "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}
  return _body("ChatRequest", ["model", "messages"], props, "POST /v1/chat/completions.",
               **needs)


def _tokenize_request() -> dict:
  """Exactly one of prompt (a string) and messages (an array) is given."""
  props = {"model": _nullable({"type": "string"}), "prompt": _nullable({"type": "string"}),
           "messages": _nullable({"type": "array", "minItems": 1,
                                  "items": _ref("TextChatMessage")}),
           "add_special_tokens": {"type": "boolean", "default": True}}
  one_of = [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
            {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]
  return _body("TokenizeRequest", [], props, "POST /tokenize: a prompt, or chat messages "
               "rendered by the server's template (text parts only).", oneOf=one_of)


def _request_schemas(lim: Limits) -> dict:
  vocab = lim.tokenizer_vocab or INT32_MAX + 1
  return {
      "CompletionRequest": _completion_request(lim),
      "ChatRequest": _chat_request(lim),
      "TokenizeRequest": _tokenize_request(),
      "DetokenizeRequest": _body("DetokenizeRequest", ["tokens"], {
          "model": _nullable({"type": "string"}), "tokens": _token_ids(vocab)},
          "POST /detokenize: token ids of the tokenizer's vocabulary."),
      "ChatMessage": _message(lim.images),
      "TextChatMessage": _message(False),
      "TextPart": {"type": "object", "required": ["type", "text"], "properties": {
          "type": {"const": "text"}, "text": {"type": "string"}}},
      "ImagePart": {"type": "object", "required": ["type", "image_url"], "properties": {
          "type": {"const": "image_url"},
          "image_url": {"anyOf": [{"type": "string"}, {
              "type": "object", "required": ["url"], "properties": {
                  "url": {"type": "string"}, "detail": _nullable({"type": "string"})}}]}}},
      "StreamOptions": {"type": "object", "additionalProperties": False, "properties": {
          "include_usage": {"type": "boolean", "default": False},
          "continuous_usage_stats": {"type": "boolean", "default": False}}},
  }


def _object(required: dict, optional: dict | None = None, **extra) -> dict:
  return {"type": "object", "required": list(required),
          "properties": {**required, **(optional or {})}, **extra}


_STR, _COUNT = {"type": "string"}, {"type": "integer", "minimum": 0}
_FINISH = {"enum": ["stop", "length", None], "description": "null until the choice ends"}


def _logprob_schemas() -> dict:
  top = {"anyOf": [{"type": "object", "additionalProperties": {"type": "number"}},
                   {"type": "null"}]}
  item = _object({"token": _STR, "logprob": {"type": "number"},
                  "bytes": {"type": "array", "items": _int(0, 255)}})
  prompt_entry = {"type": "object", "additionalProperties": _object({
      "logprob": {"type": "number"}, "rank": _nullable(_int(1, INT32_MAX)),
      "decoded_token": _STR})}
  return {
      "CompletionLogprobs": _object({
          "tokens": {"type": "array", "items": _STR},
          "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
          "top_logprobs": {"type": "array", "items": top},
          "text_offset": {"type": "array", "items": _COUNT}}),
      "ChatLogprobs": _object({"content": {"type": "array", "items": {
          "allOf": [item], "required": ["top_logprobs"],
          "properties": {"top_logprobs": {"type": "array", "items": item}}}}}),
      "PromptLogprobs": {"type": "array", "items": _nullable(prompt_entry),
                         "description": "per prompt token (the first: null): {token id: "
                                        "{logprob, rank (null: the prompt's token), "
                                        "decoded_token}}"},
  }


def _choice(body: dict, whole: bool) -> dict:
  extra = {"token_ids": {"type": "array", "items": _COUNT}}
  if whole:
    extra["prompt_logprobs"] = _nullable(_ref("PromptLogprobs"))
  return _object({"index": _COUNT, **body, "finish_reason": _FINISH}, extra)


def _response_schemas() -> dict:
  usage = _object({"prompt_tokens": _COUNT, "completion_tokens": _COUNT,
                   "total_tokens": _COUNT})
  def response(kind: str, choice: dict, usage_required: bool) -> dict:
    head = {"id": _STR, "object": {"const": kind}, "created": _COUNT, "model": _STR,
            "choices": {"type": "array", "items": choice}}
    return (_object({**head, "usage": _ref("Usage")}) if usage_required else
            _object(head, {"usage": _ref("Usage")}, description="the last chunk with "
                    "stream_options.include_usage: choices [] and the usage"))
  lp = {"completion": _nullable(_ref("CompletionLogprobs")),
        "chat": _nullable(_ref("ChatLogprobs"))}
  message = _object({"role": {"const": "assistant"}, "content": _STR})
  delta = _object({}, {"role": {"const": "assistant"}, "content": _STR})
  special = {"anyOf": [_STR, {"type": "object"}, {"type": "null"}],
             "description": "its text (a config's own entry may be an object)"}
  error = _object({"error": _object({"message": _STR, "type": _STR,
                                     "param": _nullable(_STR), "code": _nullable(_STR)})},
                  description="OpenAI's error object")
  return {
      "Error": error, "Usage": usage, **_logprob_schemas(),
      "Completion": response("text_completion", _choice(
          {"text": _STR, "logprobs": lp["completion"]}, True), True),
      "CompletionChunk": response("text_completion", _choice(
          {"text": _STR, "logprobs": lp["completion"]}, False), False),
      "ChatCompletion": response("chat.completion", _choice(
          {"message": message, "logprobs": lp["chat"]}, True), True),
      "ChatCompletionChunk": response("chat.completion.chunk", _choice(
          {"delta": delta, "logprobs": lp["chat"]}, False), False),
      "ModelList": _object({"object": {"const": "list"}, "data": {"type": "array", "items": {
          "$ref": "#/components/schemas/Model"}}}),
      "Model": _object({"id": _STR, "object": {"const": "model"}, "created": _COUNT,
                        "owned_by": _STR, "max_model_len": _COUNT}),
      "Health": _object({"status": {"enum": ["ok", "warming", "degraded", "dead"]},
                         "step_failures": _COUNT}, description="`EngineLoop.health`"),
      "TokenizerInfo": _object({"tokenizer_class": _STR, "vocab_size": _nullable(_COUNT),
                                "chat_template": _STR, "model_max_length": _COUNT},
                               {name: special for name in ("bos_token", "eos_token",
                                                           "pad_token")},
                               description="and the tokenizer's config fields"),
      "Tokens": _object({"tokens": {"type": "array", "items": _COUNT}, "count": _COUNT,
                         "max_model_len": _COUNT}),
      "Text": _object({"prompt": _STR}),
  }


def _json(name: str, description: str) -> dict:
  return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


def _events(chunk: str) -> dict:
  """A text/event-stream's schema, one event each (OpenAPI 3.1 has no
  itemSchema): `data:` a chunk, an error (one that failed after the
  headers went out), or "[DONE]", the last."""
  payload = {"anyOf": [_ref(chunk), _ref("Error")]}
  return {"schema": _object({"data": {"anyOf": [
      {"const": "[DONE]"},
      {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}})}


def _errors(*statuses: int) -> dict:
  why = {400: "a bad request, naming the field (`param`)",
         401: "no valid API key (Authorization: Bearer <key>)",
         429: "the server holds max_queue requests, or a cluster's queue is full; retry later",
         500: "the request failed in the engine (a step failed; the server serves on)",
         503: "the engine is dead (/health)"}
  return {str(s): _json("Error", why[s]) for s in statuses}


def _operation(op_id: str, summary: str, responses: dict, secured: bool, body=None) -> dict:
  op = {"operationId": op_id, "summary": summary, "responses": responses}
  if body is not None:
    op["requestBody"] = {"required": True, "content": {"application/json": {
        "schema": _ref(body)}}}
  return {**op, "security": [{"apiKey": []}]} if secured else op


def _generation(op_id: str, body: str, whole: str, chunk: str, secured: bool) -> dict:
  ok = {"description": "the response (application/json), or with \"stream\": true its "
                       "chunks as server-sent events, then data: [DONE]",
        "content": {"application/json": {"schema": _ref(whole)},
                    "text/event-stream": _events(chunk)}}
  errors = _errors(400, *(401,) * secured, 429, 500, 503)
  return {"post": _operation(op_id, f"OpenAI's {op_id}", {"200": ok, **errors}, secured,
                             body)}


def _paths(lim: Limits) -> dict:
  key = lim.api_key
  text = {"description": "Prometheus text exposition", "content": {
      "text/plain": {"schema": {"type": "string"}}}}
  return {
      "/v1/completions": _generation("completions", "CompletionRequest", "Completion",
                                     "CompletionChunk", key),
      "/v1/chat/completions": _generation("chat_completions", "ChatRequest", "ChatCompletion",
                                          "ChatCompletionChunk", key),
      "/v1/models": {"get": _operation("models", "the model served", {
          "200": _json("ModelList", "one model"), **(_errors(401) if key else {})}, key)},
      "/tokenize": {"post": _operation("tokenize", "vLLM's tokenize", {
          "200": _json("Tokens", "the token ids"), **_errors(400)}, False, "TokenizeRequest")},
      "/detokenize": {"post": _operation("detokenize", "vLLM's detokenize", {
          "200": _json("Text", "the text"), **_errors(400)}, False, "DetokenizeRequest")},
      "/tokenizer_info": {"get": _operation("tokenizer_info", "vLLM's tokenizer_info", {
          "200": _json("TokenizerInfo", "the tokenizer's config")}, False)},
      "/health": {"get": _operation("health", "the engine's health", {
          "200": _json("Health", "ok, warming or degraded: serving"),
          "503": _json("Health", "dead: every request gets a 503")}, False)},
      "/metrics": {"get": _operation("metrics", "Prometheus metrics", {"200": text}, False)},
  }


def document(lim: Limits, *, title: str = "jaxinfer", version: str = "0.1.0") -> dict:
  """The OpenAPI document of a server with these limits."""
  this = (f"This server: model {lim.model!r}, vocab_size {lim.vocab_size}, max_model_len "
          f"{lim.max_model_len}, max_tokens_cap {lim.max_tokens_cap}, max_body_bytes "
          f"{lim.max_body_bytes}.")
  doc = {"openapi": "3.1.0",
         "info": {"title": title, "version": version, "description": f"{__doc__}\n{this}"},
         "paths": _paths(lim),
         "components": {"schemas": {**_request_schemas(lim), **_response_schemas()}}}
  if lim.api_key:
    doc["components"]["securitySchemes"] = {"apiKey": {
        "type": "http", "scheme": "bearer", "description": "make_app's api_key (vLLM's "
        "--api-key): paths under /v1 need it"}}
  return doc
