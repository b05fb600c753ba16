"""An OpenAI-compatible HTTP front end over an `Engine` or a `Cluster`
(FastAPI; run it with uvicorn, as `experiments/serve.py` does).

  app = make_app(engine, tokenizer, "default")
  uvicorn.run(app, port=8000)

Routes: POST /v1/completions and /v1/chat/completions (JSON, or SSE with
"stream": true: `data: {chunk}` events, then `data: [DONE]`), GET
/v1/models, /health and /metrics (Prometheus text). One thread owns the
backend (`EngineLoop`); handlers hand it requests and read their tokens.

A bad request gets a 400 with an OpenAI error body naming the field: an
unknown model, prompt + max_tokens over the context or max_tokens over
max_tokens_cap, bad sampling values, n != 1, numbers the step's arrays
cannot hold (int32 counts and token ids, float32 values) or booleans given
as numbers, malformed JSON, a body over max_body_bytes. When max_queue
requests are held, or a Cluster's queue is full, a request gets 429 at
once. With api_key, /v1/ routes need `Authorization: Bearer <api_key>`
(else 401). A client that disconnects
aborts its request, freeing its KV pages.

Vision models (an `Engine` whose cfg has a vision tower): chat messages may
carry image_url parts, base64 data URLs or files under image_root
(`chat_images`; http(s) URLs, paths outside the root and undecodable
images get a 400).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
import uuid

import fastapi
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxinfer.serving import chat_images
from jaxinfer.serving import openai_protocol as proto
from jaxinfer.serving.engine_loop import EngineLoop
from jaxinfer.serving.http_metrics import CONTENT_TYPE, HttpMetrics
from jaxinfer.serving.openai_protocol import ApiError

__all__ = ["make_app"]


def make_app(backend, tokenizer, model_name: str, *, max_queue: int = 256,
             max_body_bytes: int = 1 << 20, max_tokens_cap: int | None = None,
             api_key: str | None = None,
             chat_template: str | proto.ChatTemplate | None = None,
             image_root: str | None = None) -> fastapi.FastAPI:
  """The app over backend (an `Engine` or a `serving.Cluster`, stepped only
  by the app's engine thread from startup to shutdown). tokenizer: encode /
  decode (`jaxinfer.tokenizer`). max_tokens_cap: the most tokens one request
  may ask for (None: the context). chat_template: a jinja2 source or a
  `ChatTemplate` (None: the built-in "role: content" lines). image_root:
  the directory chat image paths may be read from (None: data URLs only)."""
  h = _Handlers(backend, tokenizer, model_name, max_queue=max_queue,
                max_body_bytes=max_body_bytes, max_tokens_cap=max_tokens_cap, api_key=api_key,
                chat_template=chat_template)
  h.images = chat_images.ImageLoader(image_root)

  @contextlib.asynccontextmanager
  async def lifespan(_):
    h.loop.start()
    yield
    h.loop.stop()

  app = fastapi.FastAPI(title="jaxinfer", lifespan=lifespan)
  app.state.engine_loop = h.loop
  app.add_exception_handler(ApiError, h.api_error)
  app.add_api_route("/v1/completions", h.completions, methods=["POST"])
  app.add_api_route("/v1/chat/completions", h.chat_completions, methods=["POST"])
  app.add_api_route("/v1/models", h.models, methods=["GET"])
  app.add_api_route("/health", h.health, methods=["GET"])
  app.add_api_route("/metrics", h.metrics_text, methods=["GET"])
  return app


class _Handlers:
  """The routes of one app (see `make_app`)."""

  def __init__(self, backend, tokenizer, model_name, *, max_queue, max_body_bytes,
               max_tokens_cap, api_key, chat_template):
    self.metrics = HttpMetrics()
    self.loop = EngineLoop(backend, max_queue=max_queue, on_finish=self.metrics.finished)
    self.cap = max_tokens_cap or self.loop.max_model_len
    if self.cap < 1:
      raise ValueError(f"max_tokens_cap must be >= 1, got {self.cap}")
    if max_body_bytes < 1:
      raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if not isinstance(chat_template, proto.ChatTemplate):
      chat_template = proto.ChatTemplate(chat_template or proto.BUILTIN_CHAT_TEMPLATE)
    self.tokenizer, self.model_name, self.chat_template = tokenizer, model_name, chat_template
    self.max_body_bytes, self.api_key = max_body_bytes, api_key

  async def api_error(self, _, e: ApiError):
    self.metrics.refused.labels(str(e.status)).inc()
    return JSONResponse(e.body(), status_code=e.status)

  async def _body(self, request: fastapi.Request, model: type) -> proto._Request:
    if self.api_key is not None:
      got = request.headers.get("authorization", "")
      if not secrets.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
        raise ApiError(401, "a valid API key is needed: Authorization: Bearer <key>",
                       code="invalid_api_key", kind="authentication_error")
    too_big = ApiError(400, f"the request body is over max_body_bytes={self.max_body_bytes}",
                       code="request_too_large")
    if int(request.headers.get("content-length") or 0) > self.max_body_bytes:
      raise too_big
    data = bytearray()
    async for chunk in request.stream():
      data += chunk
      if len(data) > self.max_body_bytes:
        raise too_big
    req = proto.parse(model, bytes(data))
    if req.model != self.model_name:
      raise ApiError(400, f"model: unknown model {req.model!r}; this server serves "
                     f"{self.model_name!r}", param="model", code="model_not_found")
    return req

  def _sampling(self, req, prompt, default_max_tokens):
    return proto.sampling_params(req, prompt_len=len(prompt),
                                 max_model_len=self.loop.max_model_len, max_tokens_cap=self.cap,
                                 default_max_tokens=default_max_tokens)

  async def completions(self, request: fastapi.Request):
    req = await self._body(request, proto.CompletionRequest)
    prompt = proto.completion_prompt(req, self.tokenizer)
    return await self._serve(request, req, prompt, self._sampling(req, prompt, 16), chat=False)

  async def chat_completions(self, request: fastapi.Request):
    req = await self._body(request, proto.ChatRequest)
    vision = getattr(getattr(self.loop.backend, "cfg", None), "vision", None)
    text = self.chat_template.render(req.messages, chat_images.MARKER if vision else None)
    images = [self.images.load(u) for u in chat_images.image_urls(req.messages)] or None
    prompt = (chat_images.prompt_ids(text, self.tokenizer, vision) if images else
              proto.encode(self.tokenizer, text, special=False))
    if not prompt:
      raise ApiError(400, "messages: the rendered chat prompt is empty", param="messages")
    return await self._serve(request, req, prompt, self._sampling(req, prompt, None), chat=True,
                             images=images)

  async def _serve(self, request, req, prompt, sp, *, chat: bool, images=None):
    detok = proto.Detokenizer(self.tokenizer, proto.stop_strings(req))
    stream = self.loop.submit(prompt, sp, images)
    kind, payload = await stream.get()  # "accepted", or the backend refused it
    if kind == "error":
      raise payload
    events = _events(self.loop, request, stream, detok)
    shape = _Shape(chat=chat, model=self.model_name, prompt_tokens=len(prompt), detok=detok,
                   token_ids=req.return_token_ids)
    if req.stream:
      include_usage = bool((req.stream_options or {}).get("include_usage"))
      return StreamingResponse(_sse(shape, events, include_usage), media_type="text/event-stream")
    text, finish = [], None
    async for delta, finish, _ in events:
      text.append(delta)
    return shape.whole("".join(text), finish)

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


async def _events(loop: EngineLoop, request, stream, detok):
  """-> (text delta, finish reason or None, new token ids) until the
  request ends; a client that went away, or a stop string, aborts it in
  the engine."""
  try:
    while True:
      kind, payload = await stream.get()
      if kind == "error":
        raise payload
      if kind == "done":
        if payload.finish_reason == "error":
          raise ApiError(500, f"the request failed: {payload.error}", kind="server_error")
        yield detok.add([], final=True), payload.finish_reason, []
        return
      delta = detok.add(payload)
      if detok.stopped:
        loop.abort(stream, reason="stop")
        yield delta, "stop", payload
        return
      yield delta, None, payload
      if await request.is_disconnected():
        return
  finally:
    loop.abort(stream)  # a no-op once it ended


class _Shape:
  """OpenAI response and chunk objects of one request."""

  def __init__(self, *, chat: bool, model: str, prompt_tokens: int, detok, token_ids: bool):
    self.chat, self.model, self.prompt_tokens, self.detok = chat, model, prompt_tokens, detok
    self.token_ids = token_ids
    self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    self.created = int(time.time())

  def _head(self, obj: str) -> dict:
    return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

  def usage(self) -> dict:
    n = len(self.detok.ids)
    return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
            "total_tokens": self.prompt_tokens + n}

  def whole(self, text: str, finish: str) -> dict:
    choice = ({"message": {"role": "assistant", "content": text}} if self.chat else
              {"text": text, "logprobs": None})
    if self.token_ids:
      choice["token_ids"] = list(self.detok.ids)
    return {**self._head("chat.completion" if self.chat else "text_completion"),
            "choices": [{"index": 0, **choice, "finish_reason": finish}], "usage": self.usage()}

  def chunk(self, delta: str | None, finish: str | None, ids=(), *, role: bool = False) -> dict:
    if self.chat:
      d = {} if delta is None and not role else {"content": delta or ""}
      choice = {"delta": {"role": "assistant", **d} if role else d}
    else:
      choice = {"text": delta or "", "logprobs": None}
    if self.token_ids:
      choice["token_ids"] = list(ids)
    return {**self._head("chat.completion.chunk" if self.chat else "text_completion"),
            "choices": [{"index": 0, **choice, "finish_reason": finish}]}


def _data(obj) -> str:
  return f"data: {json.dumps(obj)}\n\n"


async def _sse(shape: _Shape, events, include_usage: bool):
  if shape.chat:
    yield _data(shape.chunk("", None, role=True))
  try:
    async for delta, finish, ids in events:
      if delta or finish or (shape.token_ids and ids):
        yield _data(shape.chunk(delta if not (shape.chat and finish and not delta) else None,
                                finish, ids))
  except ApiError as e:  # after the headers went out: an error event ends the stream
    yield _data(e.body())
  if include_usage:
    yield _data({**shape._head("chat.completion.chunk" if shape.chat else "text_completion"),
                 "choices": [], "usage": shape.usage()})
  yield "data: [DONE]\n\n"
