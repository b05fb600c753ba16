"""One completions or chat request in the engine: its choices (each prompt
times n, choice index prompt * n + copy) as engine requests, their events
merged, and OpenAI's response and chunk objects.

The n copies of a prompt share its pages: the first copy is submitted
alone, the others once it has its first token, when the prompt's full pages
are in the prefix cache. Any refusal or failure aborts every choice of the
request; so does a client that goes away.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.serving import openai_protocol as proto
from jaxinfer.serving.engine_loop import EngineLoop, Result, Stream, Tokens
from jaxinfer.serving.openai_logprobs import CompletionLogprobs, TokenText, chat_logprobs
from jaxinfer.serving.openai_protocol import ApiError


@dataclasses.dataclass
class Choice:
  """One choice: an engine request, its text and logprobs so far."""
  index: int
  prompt: list[int]
  sampling: SamplingParams
  detok: proto.Detokenizer
  echo: str = ""  # completions with echo: the prompt's text, sent first
  lp: CompletionLogprobs | None = None  # completions with logprobs
  chat_top: int | None = None  # chat with logprobs: top_logprobs
  stream: Stream | None = None
  finish: str | None = None
  chat_items: list = dataclasses.field(default_factory=list)
  prompt_logprobs: list | None = None
  started: bool = False  # its first event arrived

  def on_tokens(self, t: Tokens, text: TokenText) -> tuple[str, dict | None, list[int]]:
    """-> (text delta, logprobs of this part or None, token ids)."""
    if self.finish is not None:  # cut by a stop string; tokens already in flight
      return "", None, []
    delta, part = self._prompt_part(t.prompt_logprobs)
    if self.lp is not None and t.logprobs is not None:
      part = _joined(part, self.lp.add(t.ids, t.logprobs))
    delta += self.detok.add(t.ids)
    if self.chat_top is not None and t.logprobs is not None:
      part = chat_logprobs(text, self.chat_top, t.ids, t.logprobs)
      self.chat_items += part["content"]
    if self.detok.stopped:
      self.finish = "stop"
    return delta, part, t.ids

  def _prompt_part(self, prompt_logprobs) -> tuple[str, dict | None]:
    """The echoed prompt, once (its first event): (its text, its logprobs'
    part when logprobs are asked, else None); later ("", None)."""
    if prompt_logprobs is not None and self.prompt_logprobs is None:
      self.prompt_logprobs = prompt_logprobs
    if self.started:
      return "", None
    self.started = True
    part = None
    if self.echo and self.lp is not None:
      part = self.lp.add(self.prompt, self.prompt_logprobs or [None] * len(self.prompt))
    return self.echo, part

  def on_done(self, r: Result) -> tuple[str, dict | None]:
    """-> (the last text delta, the echoed prompt's logprobs if not yet
    sent); ApiError 500 when its request failed."""
    if r.finish_reason == "error":
      raise ApiError(500, f"the request failed: {r.error}", kind="server_error")
    delta, part = self._prompt_part(r.prompt_logprobs)
    if self.finish is None:
      delta += self.detok.add([], final=True)
      self.finish = r.finish_reason
    return delta, part


def _joined(first: dict | None, then: dict) -> dict:
  """Two completions logprobs parts as one (the echoed prompt's, then the
  first generated tokens': vLLM's first streamed chunk)."""
  return then if first is None else {k: first[k] + then[k] for k in first}


class Generation:
  """A request's choices in the engine (see the module docstring)."""

  def __init__(self, loop: EngineLoop, request, choices: list[Choice], n: int, images=None):
    self.loop, self.request, self.choices, self.n, self.images = loop, request, choices, n, images
    self._queue: asyncio.Queue = asyncio.Queue()
    self._tasks: list[asyncio.Task] = []

  async def _submit(self, c: Choice) -> None:
    c.stream = self.loop.submit(c.prompt, c.sampling, self.images)
    kind, payload = await c.stream.get()  # "accepted", or the backend refused it
    if kind == "error":
      raise payload

  async def _pump(self, c: Choice, copies: list[Choice]) -> None:
    try:
      while True:
        kind, payload = await c.stream.get()
        self._queue.put_nowait((c, kind, payload))
        for copy in copies:  # the prompt's pages are cached now
          await self._submit(copy)
          self._tasks.append(asyncio.create_task(self._pump(copy, [])))
        copies = []
        if kind in ("done", "error"):
          return
    except Exception as e:  # noqa: BLE001 - raised to the request's handler
      self._queue.put_nowait(e)

  async def start(self) -> None:
    """Submits each prompt's first copy; raises the first refusal (429,
    400, 503), having aborted what it submitted."""
    try:
      for g in range(0, len(self.choices), self.n):
        await self._submit(self.choices[g])
        self._tasks.append(asyncio.create_task(self._pump(self.choices[g],
                                                          self.choices[g + 1:g + self.n])))
    except BaseException:
      self.abort()
      raise

  def abort(self) -> None:
    for t in self._tasks:
      t.cancel()
    for c in self.choices:
      if c.stream is not None:
        self.loop.abort(c.stream)  # a no-op once it ended

  async def events(self):
    """After `start`: -> (choice, "tokens" | "done", Tokens | Result) until
    every choice ended; raises the first ApiError."""
    try:
      live = len(self.choices)
      while live:
        item = await self._queue.get()
        if isinstance(item, BaseException):
          raise item
        c, kind, payload = item
        if kind == "error":
          raise payload
        live -= kind == "done"
        yield c, kind, payload
        if kind == "tokens" and c.finish == "stop":
          self.loop.abort(c.stream, reason="stop")
        if await self.request.is_disconnected():
          return
    finally:
      self.abort()


class Shape:
  """OpenAI response and chunk objects of one request."""

  def __init__(self, *, chat: bool, model: str, choices: list[Choice], text: TokenText,
               token_ids: bool, prompt_logprobs: bool):
    self.chat, self.model, self.choices, self.text = chat, model, choices, text
    self.token_ids, self.prompt_logprobs = token_ids, prompt_logprobs
    self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    self.created = int(time.time())
    self.object = ("chat.completion" if chat else "text_completion")

  def head(self, chunk: bool = False) -> dict:
    obj = "chat.completion.chunk" if self.chat and chunk else self.object
    return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

  def usage(self) -> dict:
    prompts = {id(c.prompt): len(c.prompt) for c in self.choices}  # each prompt once
    gen = sum(len(c.detok.ids) for c in self.choices)
    return {"prompt_tokens": sum(prompts.values()), "completion_tokens": gen,
            "total_tokens": sum(prompts.values()) + gen}

  def _extras(self, c: Choice, ids) -> dict:
    out = {}
    if self.token_ids:
      out["token_ids"] = list(ids)
    return out

  def _prompt_logprobs(self, c: Choice) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None or {id: {logprob, rank, decoded_token}}."""
    if c.prompt_logprobs is None:
      return None
    return [None if e is None else
            {str(tid): {"logprob": lp, "rank": rank + 1, "decoded_token": self.text(tid)}
             for rank, (tid, lp) in enumerate(e.top)} |
            {str(e.token_id): {"logprob": e.logprob, "rank": None,
                               "decoded_token": self.text(e.token_id)}}
            for e in c.prompt_logprobs]

  def whole(self, texts: dict[int, str]) -> dict:
    choices = []
    for c in self.choices:
      if self.chat:
        body = {"message": {"role": "assistant", "content": texts[c.index]},
                "logprobs": {"content": c.chat_items} if c.chat_top is not None else None}
      else:
        body = {"text": texts[c.index], "logprobs": c.lp.whole if c.lp is not None else None}
      if self.prompt_logprobs:
        body["prompt_logprobs"] = self._prompt_logprobs(c)
      choices.append({"index": c.index, **body, **self._extras(c, c.detok.ids),
                      "finish_reason": c.finish})
    return {**self.head(), "choices": choices, "usage": self.usage()}

  def chunk(self, c: Choice, delta: str | None, finish: str | None, part=None, ids=(), *,
            role: bool = False) -> dict:
    if self.chat:
      d = {} if delta is None and not role else {"content": delta or ""}
      body = {"delta": {"role": "assistant", **d} if role else d, "logprobs": part}
    else:
      body = {"text": delta or "", "logprobs": part}
    return {**self.head(chunk=True), "choices": [{"index": c.index, **body,
                                                  **self._extras(c, ids),
                                                  "finish_reason": finish}]}


def data(obj) -> str:
  return f"data: {json.dumps(obj)}\n\n"


async def collect(gen: Generation, shape: Shape) -> dict:
  """The whole (non-streamed) response."""
  texts = {c.index: "" for c in gen.choices}
  await gen.start()
  async for c, kind, payload in gen.events():
    texts[c.index] += (c.on_tokens(payload, shape.text) if kind == "tokens"
                       else c.on_done(payload))[0]
  return shape.whole(texts)


async def sse(gen: Generation, shape: Shape, include_usage: bool,
              continuous_usage: bool = False):
  """The streamed response: chunks per choice, then usage, then [DONE].
  continuous_usage (vLLM's continuous_usage_stats): every chunk also
  carries the usage so far."""
  def event(chunk: dict) -> str:
    return data({**chunk, "usage": shape.usage()} if continuous_usage else chunk)

  try:
    if shape.chat:
      for c in gen.choices:
        yield event(shape.chunk(c, "", None, role=True))
    async for c, kind, payload in gen.events():
      if kind == "tokens":
        delta, part, ids = c.on_tokens(payload, shape.text)
        if delta or part or (shape.token_ids and ids):
          yield event(shape.chunk(c, delta, None, part, ids))
      else:
        delta, part = c.on_done(payload)
        yield event(shape.chunk(c, delta or (None if shape.chat else ""), c.finish, part))
  except ApiError as e:  # after the headers went out: an error event ends the stream
    yield data(e.body())
  if include_usage:
    yield data({**shape.head(chunk=True), "choices": [], "usage": shape.usage()})
  yield "data: [DONE]\n\n"
