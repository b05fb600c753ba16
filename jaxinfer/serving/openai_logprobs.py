"""Logprobs in OpenAI's response shapes, from the engine's `TokenLogprobs`.

Completions (the legacy object; `echo` puts the prompt's tokens first, the
first of them without a logprob):
  {"tokens": [str], "token_logprobs": [float | None],
   "top_logprobs": [{token: logprob} | None], "text_offset": [int]}
Chat:
  {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}

A token's text is its own decoding; with `return_tokens_as_token_ids` (vLLM's
extension) it is "token_id:<id>", unique where texts are not (byte-level
pieces of one character decode alike).
"""

from __future__ import annotations

from jaxinfer.tokenizer import HFTokenizer


class TokenText:
  """Token id -> its text in logprobs."""

  def __init__(self, tokenizer, as_ids: bool):
    self.tokenizer, self.as_ids = tokenizer, as_ids

  def __call__(self, token_id: int) -> str:
    if self.as_ids:
      return f"token_id:{token_id}"
    if isinstance(self.tokenizer, HFTokenizer):
      return self.tokenizer.decode([token_id], skip_special_tokens=False)
    return self.tokenizer.decode([token_id])


class CompletionLogprobs:
  """The completions logprobs object of one choice, built as tokens arrive
  (`add` returns the part to stream); `top`: the alternatives per token."""

  def __init__(self, text: TokenText, top: int):
    self.text, self.top = text, top
    self.offset = 0
    self.whole = dict(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])

  def add(self, token_ids, entries) -> dict:
    """token_ids with their `TokenLogprobs` (None: no logprob, the first
    prompt token) -> this part's object (also appended to `whole`)."""
    part = dict(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for tid, e in zip(token_ids, entries):
      piece = self.text(int(tid))
      part["tokens"].append(piece)
      part["text_offset"].append(self.offset)
      self.offset += len(piece)
      if e is None:
        part["token_logprobs"].append(None)
        part["top_logprobs"].append(None)
        continue
      part["token_logprobs"].append(e.logprob)
      # The chosen token and the top alternatives, most likely last so that
      # on a clash of texts the dict keeps the larger logprob.
      top = {piece: e.logprob}
      for alt, lp in reversed(e.top[:self.top]):
        top[self.text(alt)] = max(lp, top.get(self.text(alt), lp))
      part["top_logprobs"].append(top)
    for k, v in part.items():
      self.whole[k] += v
    return part


def chat_logprobs(text: TokenText, top: int, token_ids, entries) -> dict:
  """{"content": [...]} for the generated tokens with their `TokenLogprobs`."""
  def item(tid, lp):
    piece = text(int(tid))
    return {"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8"))}
  return {"content": [{**item(tid, e.logprob),
                       "top_logprobs": [item(alt, lp) for alt, lp in e.top[:top]]}
                      for tid, e in zip(token_ids, entries)]}
