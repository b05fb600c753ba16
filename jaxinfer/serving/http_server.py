"""An OpenAI-compatible HTTP front end over an `Engine` or a `Cluster`
(FastAPI; run it with uvicorn, as `experiments/serve.py` does).

  app = make_app(engine, tokenizer, "default")
  uvicorn.run(app, port=8000)

Routes: POST /v1/completions and /v1/chat/completions (JSON, or SSE with
"stream": true: `data: {chunk}` events, then `data: [DONE]`), GET
/v1/models, /health (ok, degraded or dead: `EngineLoop.health`) and
/metrics (Prometheus text), and vLLM's tokenizer routes GET /tokenizer_info,
POST /tokenize and /detokenize. /openapi.json describes every route as the
server checks it (`openapi_schema`: request bodies, statuses, error bodies,
content types). One thread owns the backend (`EngineLoop`); handlers hand
it requests and read their tokens (`http_generate`).

Completions take a prompt or a list of them (strings or token ids), n
copies of each; logprobs (top 0-20 alternatives) and echo (the prompt,
with its logprobs when logprobs are asked: lm-eval's loglikelihood), and
vLLM's prompt_logprobs, return_token_ids and return_tokens_as_token_ids.
Chat takes n, logprobs and top_logprobs.

A bad request gets a 400 with an OpenAI error body naming the field: an
unknown model, prompt + max_tokens over the context or max_tokens over
max_tokens_cap, bad sampling values, n or prompts over their caps, numbers the step's arrays
cannot hold (int32 counts and token ids, float32 values), booleans other
than JSON true / false, a body that is not JSON as the API defines it
(`openai_protocol.read_json`: not UTF-8, truncated, a string with a lone
surrogate, nesting over MAX_JSON_DEPTH, an integer over MAX_INT_DIGITS
digits), a body over max_body_bytes, max_tokens=0
(vLLM's prompt-only echo: ask max_tokens=1 with echo and logprobs, and read
the prompt's logprobs), logprobs from a Cluster backend (its workers keep
them). Unknown paths and methods get
OpenAI error bodies too (404; 405 with Allow). When max_queue
requests are held, or a Cluster's queue is full, a request gets 429 at
once. With api_key, as vLLM's --api-key: every path under /v1 (the
completions, chat and /v1/models) needs `Authorization: Bearer <api_key>`
(else 401, before the body is read); the others (/health, /metrics,
/tokenize, /detokenize, /tokenizer_info, /openapi.json) and OPTIONS stay
open. A client that disconnects
aborts its request, freeing its KV pages; one that disconnects while
sending its body gets nothing and counts no error (an info line).

Vision models (an `Engine` whose cfg has a vision tower): chat messages may
carry image_url parts, base64 data URLs or files under image_root
(`chat_images`; http(s) URLs, paths outside the root and undecodable
images get a 400).
"""

from __future__ import annotations

import contextlib
import logging
import secrets

import fastapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from jaxinfer.serving import chat_images
from jaxinfer.serving import openai_protocol as proto
from jaxinfer.serving import openapi_schema
from jaxinfer.serving.engine_loop import EngineLoop
from jaxinfer.serving.flow import Flow
from jaxinfer.serving.http_generate import Choice, Generation, Shape, collect, sse
from jaxinfer.serving.http_metrics import CONTENT_TYPE, HttpMetrics
from jaxinfer.serving.openai_logprobs import CompletionLogprobs, TokenText
from jaxinfer.serving.openai_protocol import ApiError

log = logging.getLogger("jaxinfer.serving")

__all__ = ["make_app"]


def make_app(backend, tokenizer, model_name: str, *, max_queue: int = 256,
             max_body_bytes: int = 1 << 20, max_tokens_cap: int | None = None,
             api_key: str | None = None,
             chat_template: str | proto.ChatTemplate | None = None,
             image_root: str | None = None, gather_s: float = 0.0,
             gather_tokens: int | None = None) -> fastapi.FastAPI:
  """The app over backend (an `Engine` or a `serving.Cluster`, stepped only
  by the app's engine thread from startup to shutdown). tokenizer: encode /
  decode (`jaxinfer.tokenizer`). max_tokens_cap: the most tokens one request
  may ask for (None: the context). chat_template: a jinja2 source or a
  `ChatTemplate` (None: the built-in "role: content" lines). image_root:
  the directory chat image paths may be read from (None: data URLs only).
  gather_s, gather_tokens: `EngineLoop`'s (a burst waking an idle engine
  steps together, up to a step's worth of prompt tokens)."""
  h = _Handlers(backend, tokenizer, model_name, max_queue=max_queue,
                max_body_bytes=max_body_bytes, max_tokens_cap=max_tokens_cap,
                chat_template=chat_template, gather_s=gather_s, gather_tokens=gather_tokens)
  h.images = chat_images.ImageLoader(image_root)

  @contextlib.asynccontextmanager
  async def lifespan(_):
    h.loop.start()
    yield
    h.loop.stop()

  app = fastapi.FastAPI(title="jaxinfer", lifespan=lifespan)
  app.state.engine_loop = h.loop
  if api_key is not None:
    app.add_middleware(_ApiKey, api_key=api_key, refused=h.metrics.refused)
  app.add_exception_handler(ApiError, h.api_error)
  app.add_exception_handler(StarletteHTTPException, h.http_error)  # unknown paths, methods
  app.add_exception_handler(ClientDisconnect, h.client_gone)
  app.add_exception_handler(Exception, h.internal_error)
  for path, route in (("/v1/completions", h.completions),
                      ("/v1/chat/completions", h.chat_completions),
                      ("/tokenize", h.tokenize), ("/detokenize", h.detokenize)):
    app.add_api_route(path, route, methods=["POST"])
  app.add_api_route("/v1/models", h.models, methods=["GET"])
  app.add_api_route("/tokenizer_info", h.tokenizer_info, methods=["GET"])
  app.add_api_route("/health", h.health, methods=["GET"])
  app.add_api_route("/metrics", h.metrics_text, methods=["GET"])
  doc = openapi_schema.document(h.limits(api_key=api_key is not None), title=app.title,
                                version=app.version)
  app.openapi = lambda: doc
  return app


class _ApiKey:
  """vLLM's --api-key check (ASGI middleware): a path starting with /v1
  (after the app's root_path), by any method but OPTIONS, needs
  `Authorization: Bearer <api_key>`, else a 401 OpenAI error."""

  def __init__(self, app, *, api_key: str, refused):
    self.app, self.want, self.refused = app, f"Bearer {api_key}".encode(), refused

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http" and scope["method"] != "OPTIONS":
      path, root = scope["path"], scope.get("root_path", "")
      if root and path.startswith(root):
        path = path[len(root):]
      got = dict(scope["headers"]).get(b"authorization", b"")
      if path.startswith("/v1") and not secrets.compare_digest(got, self.want):
        self.refused.labels("401").inc()
        e = ApiError(401, "a valid API key is needed: Authorization: Bearer <key>",
                     code="invalid_api_key", kind="authentication_error")
        await JSONResponse(e.body(), status_code=401)(scope, receive, send)
        return
    await self.app(scope, receive, send)


class _Handlers:
  """The routes of one app (see `make_app`)."""

  def __init__(self, backend, tokenizer, model_name, *, max_queue, max_body_bytes,
               max_tokens_cap, chat_template, gather_s, gather_tokens):
    self.metrics = HttpMetrics()
    self.loop = EngineLoop(backend, max_queue=max_queue, on_finish=self.metrics.finished,
                           gather_s=gather_s, gather_tokens=gather_tokens)
    self.cap = max_tokens_cap or self.loop.max_model_len
    if self.cap < 1:
      raise ValueError(f"max_tokens_cap must be >= 1, got {self.cap}")
    if max_body_bytes < 1:
      raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if not isinstance(chat_template, proto.ChatTemplate):
      chat_template = proto.ChatTemplate(chat_template or proto.BUILTIN_CHAT_TEMPLATE)
    self.special_tokens = chat_template.special_tokens
    self.tokenizer, self.model_name, self.chat_template = tokenizer, model_name, chat_template
    self.max_body_bytes = max_body_bytes

  def limits(self, *, api_key: bool) -> openapi_schema.Limits:
    """What /openapi.json says of this server (`openapi_schema`)."""
    return openapi_schema.Limits(
        model=self.model_name, vocab_size=self.loop.vocab_size,
        tokenizer_vocab=getattr(self.tokenizer, "vocab_size", None),
        max_model_len=self.loop.max_model_len, max_tokens_cap=self.cap,
        max_body_bytes=self.max_body_bytes,
        empty_prompt=bool(proto.encode(self.tokenizer, "", special=True)),
        logprobs=not isinstance(self.loop.backend, Flow),
        images=getattr(getattr(self.loop.backend, "cfg", None), "vision", None) is not None,
        api_key=api_key)

  async def api_error(self, _, e: ApiError):
    self.metrics.refused.labels(str(e.status)).inc()
    return JSONResponse(e.body(), status_code=e.status)

  async def http_error(self, request, e: StarletteHTTPException):
    """Starlette's own errors (404 unknown path, 405 method) in OpenAI's
    body, with their headers (a 405's Allow: the path's methods)."""
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "api_error")
    response = await self.api_error(request, ApiError(
        e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind=kind,
        code=str(e.status_code)))
    response.headers.update(e.headers or {})
    return response

  async def internal_error(self, request, e: Exception):
    """A bug (never a bad request): logged with its traceback, a 500 body."""
    log.error("%s %s failed", request.method, request.url.path, exc_info=e)
    return await self.api_error(request, ApiError(
        500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))

  async def client_gone(self, request, _: ClientDisconnect):
    """The client closed its connection before its body was read: nothing
    to answer (no one reads it), nothing counted, one info line."""
    log.info("%s %s: the client disconnected while sending its body", request.method,
             request.url.path)

  async def _body(self, request: fastapi.Request, model: type, *,
                  check_model: bool = True) -> proto._Request:
    """The request's body as `model` (`proto.parse`), read up to
    max_body_bytes; a client that leaves mid-body raises ClientDisconnect
    (`client_gone`)."""
    too_big = ApiError(400, f"the request body is over max_body_bytes={self.max_body_bytes}",
                       code="request_too_large")
    length = request.headers.get("content-length") or "0"
    if not (length.isascii() and length.isdigit()):
      raise ApiError(400, f"Content-Length: not a byte count, got {length!r:.40}",
                     param="Content-Length")
    if len(length) > 18 or int(length) > self.max_body_bytes:
      raise too_big
    data = bytearray()
    async for chunk in request.stream():
      data += chunk
      if len(data) > self.max_body_bytes:
        raise too_big
    req = proto.parse(model, bytes(data))
    if check_model and req.model != self.model_name:
      raise ApiError(400, f"model: unknown model {req.model!r}; this server serves "
                     f"{self.model_name!r}", param="model", code="model_not_found")
    return req

  def _choices(self, req, prompts, default_max_tokens, *, echo: bool = False) -> list:
    """prompts x n `Choice`s, each prompt's sampling checked against its length."""
    counts = proto.logprob_counts(req)
    if isinstance(self.loop.backend, Flow) and any(v is not None for v in counts.values()):
      raise ApiError(400, "logprobs: not served by a cluster backend; serve an Engine",
                     param="logprobs")
    stops = proto.stop_strings(req)
    choices = []
    for prompt in prompts:
      sp = proto.sampling_params(req, prompt_len=len(prompt),
                                 max_model_len=self.loop.max_model_len, max_tokens_cap=self.cap,
                                 default_max_tokens=default_max_tokens,
                                 vocab_size=self.loop.vocab_size)
      for copy in proto.copies(sp, req.n):
        lp = None if req.chat else (None if counts["logprobs"] is None else
                                    CompletionLogprobs(self._text(req), counts["logprobs"]))
        choices.append(Choice(
            index=len(choices), prompt=prompt, sampling=copy,
            detok=proto.Detokenizer(self.tokenizer, stops), lp=lp,
            echo=self.tokenizer.decode(prompt) if echo else "",
            chat_top=counts["logprobs"] if req.chat else None))
    return choices

  def _text(self, req) -> TokenText:
    return TokenText(self.tokenizer, req.return_tokens_as_token_ids)

  async def completions(self, request: fastapi.Request):
    req = await self._body(request, proto.CompletionRequest)
    prompts = proto.completion_prompts(req, self.tokenizer)
    choices = self._choices(req, prompts, 16, echo=req.echo)
    return await self._serve(request, req, choices, chat=False)

  async def chat_completions(self, request: fastapi.Request):
    req = await self._body(request, proto.ChatRequest)
    vision = getattr(getattr(self.loop.backend, "cfg", None), "vision", None)
    text = self.chat_template.render(req.messages, chat_images.MARKER if vision else None)
    images = [self.images.load(u) for u in chat_images.image_urls(req.messages)] or None
    prompt = (chat_images.prompt_ids(text, self.tokenizer, vision) if images else
              proto.encode(self.tokenizer, text, special=False))
    if not prompt:
      raise ApiError(400, "messages: the rendered chat prompt is empty", param="messages")
    return await self._serve(request, req, self._choices(req, [prompt], None), chat=True,
                             images=images)

  async def _serve(self, request, req, choices, *, chat: bool, images=None):
    gen = Generation(self.loop, request, choices, req.n, images)
    shape = Shape(chat=chat, model=self.model_name, choices=choices, text=self._text(req),
                  token_ids=req.return_token_ids, prompt_logprobs=req.prompt_logprobs is not None)
    if not req.stream:
      return await collect(gen, shape)
    await gen.start()  # refusals (429, 400 from the backend) before the headers
    opts = req.stream_options
    include_usage = opts is not None and opts.include_usage
    continuous = include_usage and opts.continuous_usage_stats
    return StreamingResponse(sse(gen, shape, include_usage, continuous),
                             media_type="text/event-stream")

  # ---------------------------------------------------------------- tokenizer (vLLM's routes)

  async def tokenizer_info(self):
    """vLLM's GET /tokenizer_info: the tokenizer's config (its
    tokenizer_config.json: special tokens as their text), its class, the
    server's chat template, vocab_size and model_max_length. lm-eval's
    remote tokenizer reads eos_token and bos_token (None: none) and
    tokenizes them (POST /tokenize) for their ids."""
    config = dict(getattr(self.tokenizer, "config", None) or {})
    for name in ("bos_token", "eos_token", "pad_token"):
      config[name] = config.get(name) or self.special_tokens.get(name) or None
    return {**config, "tokenizer_class": config.get("tokenizer_class",
                                                    type(self.tokenizer).__name__),
            "vocab_size": getattr(self.tokenizer, "vocab_size", None),
            "chat_template": self.chat_template.source,
            "model_max_length": self.loop.max_model_len}

  async def tokenize(self, request: fastapi.Request):
    req = await self._body(request, proto.TokenizeRequest, check_model=False)
    if req.prompt is not None:
      ids = proto.encode(self.tokenizer, req.prompt, special=req.add_special_tokens)
    else:
      ids = proto.encode(self.tokenizer, self.chat_template.render(req.messages), special=False)
    return {"tokens": ids, "count": len(ids), "max_model_len": self.loop.max_model_len}

  async def detokenize(self, request: fastapi.Request):
    req = await self._body(request, proto.DetokenizeRequest, check_model=False)
    vocab = getattr(self.tokenizer, "vocab_size", None)
    if vocab is not None and any(t >= vocab for t in req.tokens):
      raise ApiError(400, f"tokens: token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": self.tokenizer.decode(req.tokens)}

  async def models(self):
    return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                        "owned_by": "jaxinfer",
                                        "max_model_len": self.loop.max_model_len}]}

  async def health(self):
    """200 while the engine serves ("ok", or "degraded" after a recent step
    failure); 503 once it is dead (`EngineLoop.health`)."""
    health = self.loop.health()
    return JSONResponse(health, status_code=503 if health["status"] == "dead" else 200)

  async def metrics_text(self):
    return Response(self.metrics.render(await self.loop.stats()), media_type=CONTENT_TYPE)
