"""The OpenAI wire format of `http_server`: request models, their checks,
OpenAI-style errors, chat templates and streamed detokenization.

Every bad request becomes an `ApiError` carrying its HTTP status and the
OpenAI error body `{"error": {"message", "type", "param", "code"}}`, the
message naming the field and what it allows.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from typing import Annotated, Any, ClassVar, Literal

import pydantic

from jaxinfer.engine.sampling import FLOAT32_MAX, MAX_LOGPROBS, SamplingParams
from jaxinfer.tokenizer import BYTE_CHAT_TEMPLATE, HFTokenizer

# The default model's template (byte tokenizer, no special tokens): one
# "role: content" line per message, then the assistant's turn.
BUILTIN_CHAT_TEMPLATE = BYTE_CHAT_TEMPLATE


class ApiError(Exception):
  """A request the server refuses: HTTP status + the OpenAI error body."""

  def __init__(self, status: int, message: str, *, param: str | None = None,
               code: str | None = None, kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                      "code": self.code}}


def _number(v):
  """JSON numbers only: true / false and strings such as "inf" are refused."""
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise ValueError(f"must be a number, got {type(v).__name__}")
  return v


# Numeric fields hold what the step's arrays hold (int32 counts, float32
# values): anything else is a 400 naming the field, never an overflow in the
# engine. Booleans are not integers.
Int32 = Annotated[pydantic.StrictInt, pydantic.Field(ge=-2**31, le=2**31 - 1)]
Count = Annotated[pydantic.StrictInt, pydantic.Field(ge=1, le=2**31 - 1)]
TokenId = Annotated[pydantic.StrictInt, pydantic.Field(ge=0, le=2**31 - 1)]
Real = Annotated[float, pydantic.BeforeValidator(_number),
                 pydantic.Field(allow_inf_nan=False, ge=-FLOAT32_MAX, le=FLOAT32_MAX)]
# vLLM's seeds span int64; the step's are uint32 (the low 32 bits are used).
# n > 1 copies seed + i.
Seed = Annotated[pydantic.StrictInt, pydantic.Field(ge=-2**63, le=2**64 - 1)]
MAX_N = 128  # completions per prompt (each one an engine request)
MAX_PROMPTS = 256  # prompts in one completions request


TopLogprobs = Annotated[pydantic.StrictInt, pydantic.Field(ge=0, le=MAX_LOGPROBS)]


class StreamOptions(pydantic.BaseModel):
  """stream_options: include_usage sends a last chunk with the usage;
  continuous_usage_stats (vLLM's, with include_usage) puts the usage so far
  in every chunk too (guidellm asks for it, aiperf's --per-chunk-usage)."""
  model_config = pydantic.ConfigDict(extra="forbid")
  include_usage: pydantic.StrictBool = False
  continuous_usage_stats: pydantic.StrictBool = False


class _Request(pydantic.BaseModel):
  """Fields shared by completions and chat; unknown fields are refused.
  Booleans are JSON true / false only (never 1 or "yes")."""

  model_config = pydantic.ConfigDict(extra="forbid")

  model: str
  max_tokens: Count | None = None
  temperature: Real = 1.0
  top_p: Real = 1.0
  top_k: Int32 = 0  # an extension (vLLM's): 0 or -1 is off
  seed: Seed | None = None
  stop: str | list[str] | None = None
  n: Annotated[pydantic.StrictInt, pydantic.Field(ge=1, le=MAX_N)] = 1
  stream: pydantic.StrictBool = False
  stream_options: StreamOptions | None = None
  user: str | None = None
  # Extensions (vLLM's): the generated token ids, per chunk when streaming;
  # the prompt tokens' logprobs (top-k alternatives each); tokens in logprobs
  # as "token_id:<id>" (a token's text need not be unique nor valid UTF-8).
  return_token_ids: pydantic.StrictBool = False
  prompt_logprobs: TopLogprobs | None = None
  return_tokens_as_token_ids: pydantic.StrictBool = False
  # Penalties and biases (OpenAI's, and vLLM's extensions), applied in the
  # step: ranges are SamplingParams' (a 400 naming the field).
  frequency_penalty: Real = 0.0
  presence_penalty: Real = 0.0
  repetition_penalty: Real = 1.0
  logit_bias: dict[str, Real] | None = None  # token id (as a string) -> bias
  ignore_eos: pydantic.StrictBool = False
  min_tokens: Annotated[pydantic.StrictInt, pydantic.Field(ge=0, le=2**31 - 1)] = 0
  stop_token_ids: list[TokenId] | None = None
  # Not implemented: accepted at its neutral value only, so clients that
  # send the default work and others hear why not.
  best_of: Count | None = None


class CompletionRequest(_Request):
  chat: ClassVar[bool] = False
  prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
  echo: pydantic.StrictBool = False
  logprobs: TopLogprobs | None = None  # per token: its logprob and the top `logprobs`


class TextPart(pydantic.BaseModel):
  type: Literal["text"]
  text: str


class ImageUrl(pydantic.BaseModel):
  url: str
  detail: str | None = None


class ImagePart(pydantic.BaseModel):
  type: Literal["image_url"]
  image_url: ImageUrl | str

  @property
  def url(self) -> str:
    return self.image_url if isinstance(self.image_url, str) else self.image_url.url


ContentPart = Annotated[TextPart | ImagePart, pydantic.Field(discriminator="type")]


class ChatMessage(pydantic.BaseModel):
  role: Literal["system", "user", "assistant", "tool", "developer"]
  content: str | list[ContentPart]

  def text(self, image_marker: str | None = None) -> str:
    """The content as text; image_url parts as image_marker (None: refused,
    the model takes no images)."""
    if isinstance(self.content, str):
      return self.content
    out = []
    for p in self.content:
      if isinstance(p, TextPart):
        out.append(p.text)
      elif image_marker is None:
        raise ApiError(400, "messages: image_url content parts need a vision model; this one "
                       "takes text only", param="messages", code="invalid_image")
      else:
        out.append(image_marker)
    return "".join(out)


class ChatRequest(_Request):
  chat: ClassVar[bool] = True
  messages: list[ChatMessage]
  max_completion_tokens: Count | None = None
  logprobs: pydantic.StrictBool = False
  top_logprobs: TopLogprobs | None = None  # needs logprobs: true


class TokenizeRequest(pydantic.BaseModel):
  """vLLM's POST /tokenize: a prompt, or chat messages (rendered by the
  server's template)."""
  model_config = pydantic.ConfigDict(extra="forbid")
  model: str | None = None
  prompt: str | None = None
  messages: list[ChatMessage] | None = None
  add_special_tokens: pydantic.StrictBool = True

  @pydantic.model_validator(mode="after")
  def _one_of(self):
    if (self.prompt is None) == (self.messages is None):
      raise ValueError("give exactly one of prompt and messages")
    return self


class DetokenizeRequest(pydantic.BaseModel):
  """vLLM's POST /detokenize."""
  model_config = pydantic.ConfigDict(extra="forbid")
  model: str | None = None
  tokens: list[TokenId]


# Bodies are JSON as RFC 8259 exchanges it: UTF-8, every string valid
# Unicode (no lone surrogate: a JSON escape such as "\ud800" alone), nested
# at most MAX_JSON_DEPTH arrays and objects deep, integers of at most
# MAX_INT_DIGITS digits (the widest field, seed, takes 20). Anything else is
# a 400 naming the field, before the request model sees it. A number with a
# zero fraction (2.0, 1e3) is an integer, as JSON Schema has it (the
# /openapi.json document): the request model sees an int.
MAX_JSON_DEPTH = 64
MAX_INT_DIGITS = 100
_BIG = 10**MAX_INT_DIGITS - 1
_WHOLE_FLOATS = 2.0**64


class _LongInt(str):
  """An integer literal over MAX_INT_DIGITS digits, kept as its text until
  `_check_tree` names its field (`_loads`: only in a body with an integer
  over int()'s own limit of 4300 digits)."""


def _parse_int(text: str):
  return int(text) if len(text.lstrip("-")) <= MAX_INT_DIGITS else _LongInt(text)


def _field(path) -> str:
  return ".".join(str(p) for p in path)


def _check_str(s: str, path, what: str = "") -> None:
  """ApiError 400 if s holds a lone surrogate (it has no UTF-8 encoding)."""
  if s.isascii():
    return
  try:
    s.encode("utf-8")
  except UnicodeEncodeError as e:
    field = _field(path) or None
    raise ApiError(400, f"{field or 'the request body'}: {what}not valid Unicode: a lone "
                   f"surrogate {ascii(s[e.start])[1:-1]} at character {e.start} (a JSON "
                   "\\u escape of half a UTF-16 pair)", param=field,
                   code="invalid_unicode") from None


def _check_tree(data) -> None:
  """Walks the parsed body (iteratively: it may be deep): ApiError 400
  naming the field at the first array or object over MAX_JSON_DEPTH, string
  or key with a lone surrogate, or integer over MAX_INT_DIGITS digits.
  Numbers with a zero fraction become ints (up to 2**64: past it, no
  integer field holds them, and they stay floats)."""
  stack = [(data, ())]
  while stack:
    node, path = stack.pop()
    if len(path) >= MAX_JSON_DEPTH:
      raise _too_deep(path[0])
    if (isinstance(node, list) and set(map(type, node)) <= {int}
        and (not node or -_BIG <= min(node) and max(node) <= _BIG)):
      continue  # token ids, the long lists
    for key, value in node.items() if isinstance(node, dict) else enumerate(node):
      if isinstance(key, str):
        _check_str(key, path, what=f"the key {ascii(key):.60} is ")
      if isinstance(value, _LongInt) or type(value) is int and not -_BIG <= value <= _BIG:
        field = _field(path + (key,))
        raise ApiError(400, f"{field}: an integer of {len(str(value).lstrip('-'))} digits; at "
                       f"most {MAX_INT_DIGITS} are read", param=field, code="number_too_large")
      if isinstance(value, str):
        _check_str(value, path + (key,))
      elif isinstance(value, (dict, list)):
        stack.append((value, path + (key,)))
      elif type(value) is float and value.is_integer() and abs(value) <= _WHOLE_FLOATS:
        node[key] = int(value)


def _too_deep(field=None) -> ApiError:
  where = f"{field}: " if field is not None else "the request body: "
  return ApiError(400, f"{where}arrays and objects nested over MAX_JSON_DEPTH={MAX_JSON_DEPTH} "
                  "deep", param=None if field is None else str(field), code="json_too_deep")


_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.S)  # a string, or a bracket


def _deep_field(text: str):
  """The top-level key whose value nests over MAX_JSON_DEPTH (None when
  the body is no object). Only for a body json could not parse for its
  depth: the text up to that depth is JSON, strings there are closed."""
  depth, key = 0, None
  for m in _TOKEN.finditer(text):
    tok = m.group()
    if tok[0] == '"':
      key = tok if depth == 1 else key
      continue
    depth += 1 if tok in "[{" else -1
    if depth > MAX_JSON_DEPTH:
      return None if key is None or text.lstrip()[:1] != "{" else ascii(json.loads(key))[1:-1]
  return None


def _loads(text: str):
  """json.loads; a body with an integer over int()'s own digit limit is read
  again, such integers as `_LongInt`s (in the common case json's C reader
  makes the ints)."""
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    raise
  except ValueError:
    return json.loads(text, parse_int=_parse_int)


def read_json(body: bytes) -> dict:
  """Raw bytes -> the JSON object they hold, or ApiError 400 naming the
  problem (and the field, where there is one): not UTF-8, not JSON (a
  truncated body too), not an object, or over the limits above."""
  try:
    text = body.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ApiError(400, f"the request body is not UTF-8: {e}", code="invalid_json") from None
  try:
    data = _loads(text)
  except json.JSONDecodeError as e:
    raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
  except RecursionError:  # deeper than the interpreter's stack: far over MAX_JSON_DEPTH
    raise _too_deep(_deep_field(text)) from None
  if not isinstance(data, dict):
    kind = "int" if isinstance(data, _LongInt) else type(data).__name__
    raise ApiError(400, f"the request body must be a JSON object, got {kind}")
  _check_tree(data)
  return data


def parse(model: type[pydantic.BaseModel], body: bytes):
  """Raw JSON bytes -> the request model, or ApiError 400 naming the field."""
  data = read_json(body)
  try:
    return model.model_validate(data)
  except pydantic.ValidationError as e:
    err = e.errors()[0]
    field = _field(err["loc"]) or None
    raise ApiError(400, f"{field or 'the request body'}: {err['msg']} "
                   f"(got {err.get('input')!r:.80})", param=field) from None


def stop_strings(req: _Request) -> list[str]:
  stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
  if any(not s for s in stops):
    raise ApiError(400, "stop: stop strings must be non-empty", param="stop")
  return stops


def sampling_params(req: _Request, *, prompt_len: int, max_model_len: int, max_tokens_cap: int,
                    default_max_tokens: int | None, vocab_size: int) -> SamplingParams:
  """The request's sampling fields -> SamplingParams (of its first copy;
  `copies` gives the n); max_tokens must fit the context (prompt +
  max_tokens <= max_model_len) and the server's cap."""
  if req.best_of not in (None, 1):
    raise ApiError(400, f"best_of: not supported by this server (only 1), got {req.best_of!r}",
                   param="best_of")
  room = max_model_len - prompt_len
  if room < 1:
    raise ApiError(400, f"the prompt has {prompt_len} tokens, the model's context is "
                   f"{max_model_len}: no room to generate", param="prompt",
                   code="context_length_exceeded")
  max_tokens = _max_tokens(req, prompt_len, max_model_len, max_tokens_cap)
  if max_tokens is None:
    max_tokens = min(default_max_tokens or room, room, max_tokens_cap)
  seed = req.seed % 2**32 if req.seed is not None else random.getrandbits(31)
  extra = {k: v for k, v in logprob_counts(req).items() if v is not None}
  extra.update(_processors(req, vocab_size))
  try:
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                          top_k=0 if req.top_k == -1 else req.top_k, seed=seed, **extra)
  except ValueError as e:
    m = re.match(r"SamplingParams: (\w+)", str(e))
    raise ApiError(400, str(e), param=m.group(1) if m else None) from None


def _max_tokens(req: _Request, prompt_len: int, max_model_len: int, cap: int) -> int | None:
  """The request's max_tokens (chat: max_completion_tokens, else max_tokens;
  None: neither given), each one given within cap and the context."""
  given = [(name, getattr(req, name, None)) for name in ("max_completion_tokens", "max_tokens")]
  given = [(name, v) for name, v in given if v is not None]
  for name, v in given:
    if v > cap:
      raise ApiError(400, f"{name}: at most {cap} on this server, got {v}", param=name)
    if prompt_len + v > max_model_len:
      raise ApiError(400, f"{name}: the prompt ({prompt_len} tokens) + {name} ({v}) is over "
                     f"the model's context of {max_model_len} tokens", param=name,
                     code="context_length_exceeded")
  return given[0][1] if given else None


_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]*")  # logit_bias keys: one spelling per id


def _processors(req: _Request, vocab_size: int) -> dict:
  """The request's penalties, biases, min_tokens, ignore_eos and stop ids as
  SamplingParams fields (only those it sets); token ids within the vocabulary."""
  out = {}
  for name, neutral in (("frequency_penalty", 0), ("presence_penalty", 0),
                        ("repetition_penalty", 1), ("min_tokens", 0), ("ignore_eos", False)):
    if getattr(req, name) != neutral:
      out[name] = getattr(req, name)
  if req.stop_token_ids:
    out["stop_token_ids"] = tuple(req.stop_token_ids)
  if req.logit_bias:
    bad = [k for k in req.logit_bias if not _TOKEN_ID_KEY.fullmatch(k)]
    if bad:
      raise ApiError(400, "logit_bias: keys must be token ids written in decimal (no sign, "
                     f"space or leading zero), got {bad[:5]!r}", param="logit_bias")
    out["logit_bias"] = tuple(sorted((int(k), float(v)) for k, v in req.logit_bias.items()))
  for name, ids in (("logit_bias", [t for t, _ in out.get("logit_bias", ())]),
                    ("stop_token_ids", out.get("stop_token_ids", ()))):
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
      raise ApiError(400, f"{name}: token ids must be in [0, {vocab_size}), got {bad[:5]}",
                     param=name)
  return out


def logprob_counts(req: _Request) -> dict:
  """{"logprobs": top-k per generated token, "prompt_logprobs": per prompt
  token} (None: not asked). echo with logprobs asks the prompt's too."""
  if isinstance(req, ChatRequest):
    if req.top_logprobs is not None and not req.logprobs:
      raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    gen = (req.top_logprobs or 0) if req.logprobs else None
    return dict(logprobs=gen, prompt_logprobs=req.prompt_logprobs)
  prompt = req.prompt_logprobs
  if req.echo and req.logprobs is not None:
    prompt = max(prompt or 0, req.logprobs)
  return dict(logprobs=req.logprobs, prompt_logprobs=prompt)


def copies(sampling: SamplingParams, n: int) -> list[SamplingParams]:
  """n completions of one prompt: seeds seed, seed + 1, ... (mod 2**32)."""
  return [dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**32) for i in range(n)]


def completion_prompts(req: CompletionRequest, tokenizer) -> list[list[int]]:
  """The request's prompts (a string, a list of token ids, or a list of
  either) -> token ids per prompt."""
  p = req.prompt
  batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
  if len(batch) > MAX_PROMPTS:
    raise ApiError(400, f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(batch)}",
                   param="prompt")
  if len(batch) * req.n > MAX_PROMPTS:
    raise ApiError(400, f"n: {len(batch)} prompts x n={req.n} is over {MAX_PROMPTS} completions "
                   "per request", param="n")
  out = []
  for i, one in enumerate(batch):
    ids = encode(tokenizer, one, special=True) if isinstance(one, str) else list(one)
    if not ids:
      raise ApiError(400, f"prompt: prompt {i} is empty", param="prompt")
    out.append(ids)
  return out


def encode(tokenizer, text: str, *, special: bool) -> list[int]:
  if isinstance(tokenizer, HFTokenizer):
    return tokenizer.encode(text, add_special_tokens=special)
  return tokenizer.encode(text)


def load_chat_template(model_dir: str | None) -> tuple[str, dict]:
  """The model directory's chat template (tokenizer_config.json's
  "chat_template", or chat_template.jinja) and its special tokens; without
  one, the built-in template. -> (template source, {bos_token, eos_token})."""
  config, template = {}, None
  if model_dir:
    path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.exists(path):
      with open(path) as f:
        config = json.load(f)
      template = config.get("chat_template")
      if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if template is None and os.path.exists(jinja_path):
      with open(jinja_path) as f:
        template = f.read()
  tokens = {}
  for name in ("bos_token", "eos_token"):
    tok = config.get(name)
    tokens[name] = tok.get("content", "") if isinstance(tok, dict) else (tok or "")
  return template or BUILTIN_CHAT_TEMPLATE, tokens


class ChatTemplate:
  """A jinja2 chat template, rendered in a sandbox as transformers does."""

  def __init__(self, source: str, special_tokens: dict | None = None):
    import jinja2.sandbox  # the `serve` extra; only chat needs it
    def raise_exception(message):
      raise ApiError(400, f"messages: the chat template refused them: {message}",
                     param="messages")
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    self.source = source
    self._template = env.from_string(source)
    self.special_tokens = dict(special_tokens or {})

  def render(self, messages: list[ChatMessage], image_marker: str | None = None) -> str:
    msgs = [{"role": m.role, "content": m.text(image_marker)} for m in messages]
    if not msgs:
      raise ApiError(400, "messages: give at least one message", param="messages")
    return self._template.render(messages=msgs, add_generation_prompt=True, **self.special_tokens)


class Detokenizer:
  """Token ids -> text deltas as they stream, cut at the first stop string.

  A delta never ends inside a UTF-8 character (held back while decoding
  ends in U+FFFD) nor in a prefix of a stop string (held back until it
  cannot become one)."""

  def __init__(self, tokenizer, stops: list[str]):
    self.tokenizer, self.stops = tokenizer, stops
    self.ids: list[int] = []
    self.text, self.sent, self.stopped = "", 0, False

  def add(self, new_ids, final: bool = False) -> str:
    """Adds tokens; -> the text now safe to send (all of it when final)."""
    self.ids += [int(t) for t in new_ids]
    self.text = self.tokenizer.decode(self.ids)
    for s in self.stops:
      i = self.text.find(s)
      if i >= 0:
        self.text, self.stopped, final = self.text[:i], True, True
    end = len(self.text)
    if not final:
      if self.text.endswith("\ufffd"):
        end -= 1
      hold = max((k for s in self.stops for k in range(1, len(s))
                  if self.text[:end].endswith(s[:k])), default=0)
      end -= hold
    delta = self.text[self.sent:max(end, self.sent)]
    self.sent = max(end, self.sent)
    return delta
