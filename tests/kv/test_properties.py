"""Property-based tests (hypothesis, a fixed seed and bounded example counts):
the page allocator and the engine's host core (scheduler, prefix cache,
preemption, aborts) against simple models under random operation sequences,
the tokenizers on arbitrary text and bytes, `ModelConfig.from_hf` on
malformed configs, and the HTTP server's request validation on arbitrary
bodies."""

import json
import zlib

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, invariant, precondition,
                                 rule)

from conftest import FIXTURES, HF_FIXTURES
from jaxinfer.config import ModelConfig
from jaxinfer.engine.core import HostCore
from jaxinfer.engine.engine import EngineConfig
from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.engine.scheduler import schedule_ranks
from jaxinfer.kv.allocator import PageAllocator, iter_page_hashes
from jaxinfer.tokenizer import ByteTokenizer

SETTINGS = settings(derandomize=True, deadline=None, max_examples=60, stateful_step_count=40,
                    suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- page allocator

class AllocatorMachine(RuleBasedStateMachine):
  """Sequences take pages (fresh or prefix hits), register their full pages'
  hashes and release them; the model: each page's owners and content."""

  PAGE = 2
  sequences = Bundle("sequences")

  def __init__(self):
    super().__init__()
    self.alloc = PageAllocator(9, self.PAGE)
    self.owners: dict[int, list[int]] = {}  # sequence -> pages it holds
    # page -> the tokens up to its end when registered (a page's K/V depends
    # on every token before it, not only on its own).
    self.content: dict[int, tuple] = {}
    self.next = 0

  @rule(target=sequences, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=8))
  def take(self, tokens):
    n = -(-len(tokens) // self.PAGE)
    hit, hashes = self.alloc.match_prefix(tokens, n)
    for i, page in enumerate(hit):  # a hit's K/V is of exactly this prefix
      assert self.content[page] == tuple(tokens[:(i + 1) * self.PAGE])
    rest = self.alloc.allocate(n - len(hit))
    if rest is None:
      assert self.alloc.num_available() < n - len(hit)
      self.alloc.release(hit)
      return None
    pages = hit + rest
    for i, h in enumerate(iter_page_hashes(tokens, self.PAGE)):
      if i >= len(hit):
        self.alloc.register(pages[i], h)
        if self.alloc.page_hash.get(pages[i]) == h:
          self.content[pages[i]] = tuple(tokens[:(i + 1) * self.PAGE])
    self.owners[self.next] = pages
    self.next += 1
    return self.next - 1

  @rule(seq=consumes(sequences))
  def release(self, seq):
    if seq is not None:
      self.alloc.release(self.owners.pop(seq))

  @invariant()
  def consistent(self):
    self.alloc.check_consistency()
    held = np.zeros(self.alloc.num_pages, np.int32)
    for pages in self.owners.values():
      np.add.at(held, pages, 1)
    np.testing.assert_array_equal(self.alloc.refcount, held)  # refcounts = live owners
    assert self.alloc.num_available() == self.alloc.usable_pages - np.count_nonzero(held)


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = SETTINGS


# ---------------------------------------------------------------- engine host core

VOCAB = 5


def _kv(seq, j: int) -> int:
  """The 'model's K/V at position j: a function of tokens 0..j (as a
  transformer's is, past its first layer)."""
  return zlib.crc32(bytes(seq[:j + 1]))


def _next_token(kv) -> int:
  """The 'model's next token: a function of every K/V it attends to."""
  return zlib.crc32(np.asarray(kv, np.int64).tobytes()) % VOCAB


def _reference(prompt, sampling: SamplingParams, max_len: int) -> list[int]:
  out = []
  while len(out) < sampling.max_tokens and len(prompt) + len(out) < max_len:
    seq = prompt + out
    out.append(_next_token([_kv(seq, j) for j in range(len(seq))]))
    if out[-1] in sampling.stop_token_ids:
      break
  return out


class HostEngine(HostCore):
  """The engine's host core stepped without devices: a step writes each
  chunk's tokens into a shadow page pool and samples from what the pool holds
  for the request's pages, so a request reading another's KV (a bad prefix
  hit, a page freed while in use) samples a different token."""

  def __init__(self, config: EngineConfig, num_pages: int, max_len: int):
    super().__init__(config, num_ranks=1, num_pages=num_pages, max_model_len=max_len,
                     vocab_size=VOCAB, eos_ids=())
    self.pool: dict[tuple[int, int], int] = {}

  def step(self):
    [scheduled] = schedule_ranks(self.schedulers, [0], self.config)
    if not scheduled:
      return []
    sch, ps = self.schedulers[0], self.config.page_size
    sch.on_dispatch(scheduled)
    sampled = []
    for s in scheduled:
      req, tokens = s.request, s.request.tokens
      for j in range(s.start, s.start + s.num_tokens):
        self.pool[req.pages[j // ps], j % ps] = _kv(tokens, j)
      seen = [self.pool.get((req.pages[j // ps], j % ps), -1) for j in range(s.start + s.num_tokens)]
      sampled.append(_next_token(seen) if min(seen) >= 0 else -1)
    return sch.apply(scheduled, sampled)


class EngineCoreMachine(RuleBasedStateMachine):
  """Random submits (shared prefixes: prefix-cache hits), aborts and steps on
  a pool small enough to preempt. Checked after every operation: pages are
  referenced exactly by the unfinished requests that hold them; every
  request's tokens are the model's greedy tokens (a prefix of them if
  aborted); a request finishes exactly once; draining frees every page."""

  MAX_LEN = 24

  def __init__(self):
    super().__init__()
    config = EngineConfig(page_size=2, num_pages=12, max_num_seqs=3, max_num_batched_tokens=8,
                          prefill_chunk_size=4, async_scheduling=False)
    self.core = HostEngine(config, 12, self.MAX_LEN)
    self.ids: list[int] = []
    self.finished_events: dict[int, int] = {}
    self.aborted: set[int] = set()

  # Prompts of page-sized chunks from a small set: shared prefixes (prefix-cache
  # hits) and the same page content at different positions (which must not hit).
  @rule(chunks=st.lists(st.sampled_from([(1, 2), (3, 4), (0, 0)]), min_size=1, max_size=5),
        odd=st.lists(st.integers(0, VOCAB - 1), max_size=1),
        max_tokens=st.integers(1, 6), stop=st.sets(st.integers(0, VOCAB - 1), max_size=1))
  def submit(self, chunks, odd, max_tokens, stop):
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=sorted(stop))
    self.ids.append(self.core.submit([t for c in chunks for t in c] + odd, sampling))

  @precondition(lambda self: self.ids)
  @rule(data=st.data())
  def abort(self, data):
    rid = data.draw(st.sampled_from(self.ids))
    if self.core.output(rid).finish_reason is None:
      self.aborted.add(rid)
    self.core.abort(rid)

  @rule(n=st.integers(1, 4))
  def step(self, n):
    for _ in range(n):
      self._collect(self.core.step())

  def _collect(self, events):
    for rid, _, finished in events:
      assert rid not in self.aborted or not finished, f"aborted request {rid} finished again"
      if finished:
        self.finished_events[rid] = self.finished_events.get(rid, 0) + 1

  @invariant()
  def pages_and_tokens(self):
    core = self.core
    alloc = core.allocators[0]
    alloc.check_consistency()
    held = np.zeros(alloc.num_pages, np.int32)
    for req in core.requests.values():
      if not req.finished:
        np.add.at(held, req.pages, 1)
    np.testing.assert_array_equal(alloc.refcount, held)
    for rid in self.ids:
      out = core.output(rid)
      req = core.requests[rid]
      want = _reference(out.prompt_token_ids, req.sampling, self.MAX_LEN)
      if out.finish_reason in ("stop", "length"):
        assert out.token_ids == want, (rid, out.token_ids, want)
      else:
        assert out.token_ids == want[:len(out.token_ids)], (rid, out.token_ids, want)
    assert all(n == 1 for n in self.finished_events.values()), self.finished_events

  def teardown(self):
    for _ in range(500):
      if not self.core.has_unfinished():
        break
      self._collect(self.core.step())
    assert not self.core.has_unfinished(), "the core did not drain"
    self.pages_and_tokens()
    done = {rid for rid in self.ids if rid not in self.aborted}
    assert set(self.finished_events) == done  # every request ends exactly once
    alloc = self.core.allocators[0]
    assert alloc.num_available() == alloc.usable_pages  # no page leaks


TestEngineCore = EngineCoreMachine.TestCase
TestEngineCore.settings = SETTINGS


# ---------------------------------------------------------------- tokenizers

@SETTINGS
@given(text=st.text(), raw=st.binary())
def test_byte_tokenizer_round_trips(text, raw):
  tok = ByteTokenizer()
  ids = tok.encode(text)
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids) == text
  # Arbitrary bytes decode, invalid UTF-8 replaced, never raising.
  assert tok.decode(list(raw)) == raw.decode("utf-8", errors="replace")


# ---------------------------------------------------------------- ModelConfig.from_hf

CONFIGS = {name: json.loads((FIXTURES / "hf" / name / "config.json").read_text())
           for name in HF_FIXTURES}
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 1 << 20),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                   st.lists(st.integers(-1, 4), max_size=3),
                   st.dictionaries(st.text(max_size=5), st.integers(-1, 4), max_size=2))


@settings(SETTINGS, max_examples=300)
@given(name=st.sampled_from(sorted(CONFIGS)), data=st.data())
def test_from_hf_on_malformed_configs_names_the_problem(name, data):
  """A config with keys dropped, retyped or added either maps, or raises a
  ValueError / TypeError with a message: never a crash deep inside (KeyError,
  AttributeError, ZeroDivisionError...)."""
  hf = dict(CONFIGS[name])
  for _ in range(data.draw(st.integers(1, 3))):
    key = data.draw(st.one_of(st.sampled_from(sorted(hf)), st.text(min_size=1, max_size=8)))
    if data.draw(st.booleans()) and key in hf:
      del hf[key]
    else:
      hf[key] = data.draw(VALUES)
  try:
    cfg = ModelConfig.from_hf(hf)
  except (ValueError, TypeError) as e:
    assert str(e), "an error without a message"
  else:
    assert isinstance(cfg, ModelConfig)


# ---------------------------------------------------------------- HTTP request validation

_FIELDS = {  # each request field with a strategy of plausible and hostile values
    "model": st.one_of(st.just("default"), VALUES),
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-2, 400), max_size=6),
                        st.lists(st.text(max_size=4), max_size=3), VALUES),
    "messages": st.one_of(st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "robot"]),
         "content": st.one_of(st.text(max_size=10), st.lists(st.dictionaries(
             st.sampled_from(["type", "text", "image_url"]), VALUES), max_size=2))}),
        max_size=3), VALUES),
    "max_tokens": VALUES, "max_completion_tokens": VALUES, "temperature": VALUES,
    "top_p": VALUES, "top_k": VALUES, "seed": VALUES, "stop": st.one_of(
        VALUES, st.lists(st.text(max_size=3), max_size=3)), "n": VALUES, "stream": VALUES,
    "presence_penalty": VALUES, "logprobs": VALUES, "best_of": VALUES, "echo": VALUES,
}


_OPTIONAL = {k: v for k, v in _FIELDS.items() if k not in ("model", "prompt", "messages")}
_GOOD = {"model": st.just("default"), "prompt": st.one_of(
    st.text(min_size=1, max_size=20), st.lists(st.integers(0, 255), min_size=1, max_size=6)),
    "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"),
                                                "content": st.text(max_size=10)}),
                         min_size=1, max_size=2),
    "max_tokens": st.one_of(st.none(), st.integers(-2, 80)), "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-2, 50)}


@st.composite
def _bodies(draw, chat: bool):
  """JSON text: the request's required fields (well-formed or not) plus any
  optional ones, sometimes an unknown key, or not an object at all."""
  kind = draw(st.integers(0, 9))
  if kind == 0:
    return draw(st.text(max_size=30))
  main = "messages" if chat else "prompt"
  pick = lambda k: draw(st.one_of(_GOOD[k], _FIELDS[k]) if kind < 5 else _GOOD.get(k, _FIELDS[k]))
  body = {"model": pick("model"), main: pick(main)}
  for k in draw(st.lists(st.sampled_from(sorted(_OPTIONAL)), max_size=4, unique=True)):
    body[k] = draw(_GOOD[k]) if k in _GOOD and draw(st.booleans()) else draw(_FIELDS[k])
  if draw(st.integers(0, 9)) == 0:
    body[draw(st.text(min_size=1, max_size=6))] = draw(VALUES)
  return json.dumps(body)


@settings(SETTINGS, max_examples=400)
@given(chat=st.booleans(), data=st.data(), prompt_len=st.integers(0, 70))
def test_http_request_validation_names_the_field_or_accepts(chat, data, prompt_len):
  """A request body of any shape is parsed and checked (`openai_protocol`)
  into SamplingParams and prompt text, or refused with a 400 `ApiError`
  whose message is set: never another exception (which the server would
  answer with a 500)."""
  from jaxinfer.serving import openai_protocol as op
  body = data.draw(_bodies(chat))
  try:
    req = op.parse(op.ChatRequest if chat else op.CompletionRequest, body.encode())
    op.stop_strings(req)
    params = op.sampling_params(req, prompt_len=prompt_len, max_model_len=64, max_tokens_cap=32,
                                default_max_tokens=None, vocab_size=256)
    if chat:
      [m.text() for m in req.messages]
  except op.ApiError as e:
    assert e.status == 400 and e.message and e.body()["error"]["message"] == e.message
  else:
    assert isinstance(params, SamplingParams)
    assert 1 <= params.max_tokens <= min(32, 64 - prompt_len)
