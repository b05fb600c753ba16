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
max_tokens_cap, bad sampling values, n != 1, malformed JSON, a body over
max_body_bytes. When max_queue requests are held, or a Cluster's queue is
full, a request gets 429 at once. With api_key, /v1/ routes need
`Authorization: Bearer <api_key>` (else 401). A client that disconnects
aborts its request, freeing its KV pages.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
import uuid

import fastapi
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxinfer.serving import openai_protocol as proto
from jaxinfer.serving.engine_loop import EngineLoop
from jaxinfer.serving.http_metrics import CONTENT_TYPE, HttpMetrics
from jaxinfer.serving.openai_protocol import ApiError

__all__ = ["make_app"]


def make_app(backend, tokenizer, model_name: str, *, max_queue: int = 256,
             max_body_bytes: int = 1 << 20, max_tokens_cap: int | None = None,
             api_key: str | None = None,
             chat_template: str | proto.ChatTemplate | None = None) -> fastapi.FastAPI:
  """The app over backend (an `Engine` or a `serving.Cluster`, stepped only
  by the app's engine thread from startup to shutdown). tokenizer: encode /
  decode (`jaxinfer.tokenizer`). max_tokens_cap: the most tokens one request
  may ask for (None: the context). chat_template: a jinja2 source or a
  `ChatTemplate` (None: the built-in "role: content" lines)."""
  metrics = HttpMetrics()
  loop = EngineLoop(backend, max_queue=max_queue, on_finish=metrics.finished)
  cap = max_tokens_cap or loop.max_model_len
  if cap < 1:
    raise ValueError(f"max_tokens_cap must be >= 1, got {cap}")
  if max_body_bytes < 1:
    raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
  if not isinstance(chat_template, proto.ChatTemplate):
    chat_template = proto.ChatTemplate(chat_template or proto.BUILTIN_CHAT_TEMPLATE)

  @contextlib.asynccontextmanager
  async def lifespan(_):
    loop.start()
    yield
    loop.stop()

  app = fastapi.FastAPI(title="jaxinfer", lifespan=lifespan)
  app.state.engine_loop = loop

  @app.exception_handler(ApiError)
  async def api_error(_, e: ApiError):
    metrics.refused.labels(str(e.status)).inc()
    return JSONResponse(e.body(), status_code=e.status)

  async def body(request: fastapi.Request, model: type) -> proto._Request:
    if api_key is not None:
      got = request.headers.get("authorization", "")
      if not secrets.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
        raise ApiError(401, "a valid API key is needed: Authorization: Bearer <key>",
                       code="invalid_api_key", kind="authentication_error")
    too_big = ApiError(400, f"the request body is over max_body_bytes={max_body_bytes}",
                       code="request_too_large")
    if int(request.headers.get("content-length") or 0) > max_body_bytes:
      raise too_big
    data = bytearray()
    async for chunk in request.stream():
      data += chunk
      if len(data) > max_body_bytes:
        raise too_big
    req = proto.parse(model, bytes(data))
    if req.model != model_name:
      raise ApiError(400, f"model: unknown model {req.model!r}; this server serves "
                     f"{model_name!r}", param="model", code="model_not_found")
    return req

  def sampling(req, prompt, default_max_tokens):
    return proto.sampling_params(req, prompt_len=len(prompt), max_model_len=loop.max_model_len,
                                 max_tokens_cap=cap, default_max_tokens=default_max_tokens)

  @app.post("/v1/completions")
  async def completions(request: fastapi.Request):
    req = await body(request, proto.CompletionRequest)
    prompt = proto.completion_prompt(req, tokenizer)
    return await serve(request, req, prompt, sampling(req, prompt, 16), chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: fastapi.Request):
    req = await body(request, proto.ChatRequest)
    prompt = proto.encode(tokenizer, chat_template.render(req.messages), special=False)
    if not prompt:
      raise ApiError(400, "messages: the rendered chat prompt is empty", param="messages")
    return await serve(request, req, prompt, sampling(req, prompt, None), chat=True)

  async def serve(request, req, prompt, sp, *, chat: bool):
    detok = proto.Detokenizer(tokenizer, proto.stop_strings(req))
    stream = loop.submit(prompt, sp)
    kind, payload = await stream.get()  # "accepted", or the backend refused it
    if kind == "error":
      raise payload
    events = _events(loop, request, stream, detok)
    shape = _Shape(chat=chat, model=model_name, prompt_tokens=len(prompt), detok=detok,
                   token_ids=req.return_token_ids)
    if req.stream:
      include_usage = bool((req.stream_options or {}).get("include_usage"))
      return StreamingResponse(_sse(shape, events, include_usage), media_type="text/event-stream")
    text, finish = [], None
    async for delta, finish, _ in events:
      text.append(delta)
    return shape.whole("".join(text), finish)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                        "owned_by": "jaxinfer",
                                        "max_model_len": loop.max_model_len}]}

  @app.get("/health")
  async def health():
    if loop.error is not None:
      return JSONResponse({"status": "error", "error": repr(loop.error)}, status_code=503)
    return {"status": "ok"}

  @app.get("/metrics")
  async def prometheus():
    return Response(metrics.render(await loop.stats()), media_type=CONTENT_TYPE)

  return app


async def _events(loop: EngineLoop, request, stream, detok):
  """-> (text delta, finish reason or None, new token ids) until the
  request ends; a
  client that went away, or a stop string, aborts it in the engine."""
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
