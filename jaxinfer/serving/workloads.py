"""Request arrival workloads for serving benchmarks.

Every workload is open-loop and built ahead of time: a sorted list of `Item`s
with arrival times, so a run's offered load does not depend on how fast the
server answers, and the same seed gives the same requests on any system.
Their prefix structure is what a KV-aware router feeds on:

  independent           random prompts, nothing shared (a router's floor)
  shared_system_prompt  a few long system prompts, each before many requests
  multi_turn            conversations whose every turn extends the last one
  from_mooncake_trace   a replay of Mooncake's production traces, whose
                        hash_ids encode the real prefix sharing

and `read_prompts`, a JSONL dataset of prompts (with images, for vision
models) as the MLPerf harness takes it.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import math
import os

import numpy as np


@dataclasses.dataclass(frozen=True)
class Item:
  arrival_s: float          # seconds from the run's start
  prompt: tuple[int, ...]   # token ids
  max_tokens: int
  session: int = -1         # conversation id (multi-turn), -1 otherwise
  turn: int = 0


def _check_range(lo_name: str, lo, hi_name: str, hi) -> None:
  _check_positive(lo_name, lo)
  if hi < lo:
    raise ValueError(f"{hi_name} ({hi}) must be >= {lo_name} ({lo})")


def _check_positive(name: str, value, allow_zero: bool = False) -> None:
  if allow_zero:
    if not value >= 0:
      raise ValueError(f"{name} must be >= 0, got {value}")
  elif not value >= 1:
    raise ValueError(f"{name} must be >= 1, got {value}")


def _check_rate(rate) -> None:
  if not rate > 0:  # also rejects NaN
    raise ValueError(f"rate must be > 0 (requests per second, inf for all at once), got {rate}")


def _check_vocab(vocab_size) -> None:
  if not vocab_size >= 2:
    raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")


def _tokens(rng: np.random.Generator, vocab_size: int, n: int) -> tuple[int, ...]:
  return tuple(rng.integers(0, vocab_size, n).tolist())


def poisson_times(n, rate, *, seed=0, start=0.0) -> np.ndarray:
  """n arrival times of a Poisson process: exponential gaps of mean 1/rate.
  The first request arrives at `start` (no idle lead-in), so the n - 1 gaps
  span the run; rate=inf puts every arrival at `start` (a burst)."""
  _check_positive("n", n)
  _check_rate(rate)
  if math.isinf(rate):
    return np.full(n, float(start))
  gaps = np.random.default_rng(seed).exponential(1.0 / rate, n - 1)
  return start + np.concatenate([[0.0], np.cumsum(gaps)])


def independent(n, rate, *, vocab_size, min_len, max_len, max_tokens, seed=0) -> list[Item]:
  """Random prompts of uniform length in [min_len, max_len]: no shared prefixes."""
  _check_vocab(vocab_size)
  _check_range("min_len", min_len, "max_len", max_len)
  _check_positive("max_tokens", max_tokens)
  times = poisson_times(n, rate, seed=seed)
  rng = np.random.default_rng([seed, 1])
  lens = rng.integers(min_len, max_len + 1, n)
  return [Item(float(t), _tokens(rng, vocab_size, int(k)), max_tokens) for t, k in zip(times, lens)]


def shared_system_prompt(n, rate, *, vocab_size, num_system_prompts, system_len, user_min,
                         user_max, max_tokens, seed=0) -> list[Item]:
  """Each request: one of `num_system_prompts` system prompts (uniformly
  chosen) followed by a user message of uniform length in [user_min, user_max]."""
  _check_vocab(vocab_size)
  _check_positive("num_system_prompts", num_system_prompts)
  _check_positive("system_len", system_len)
  _check_range("user_min", user_min, "user_max", user_max)
  _check_positive("max_tokens", max_tokens)
  times = poisson_times(n, rate, seed=seed)
  rng = np.random.default_rng([seed, 2])
  systems = [_tokens(rng, vocab_size, system_len) for _ in range(num_system_prompts)]
  which = rng.integers(0, num_system_prompts, n)
  lens = rng.integers(user_min, user_max + 1, n)
  return [Item(float(t), systems[s] + _tokens(rng, vocab_size, int(k)), max_tokens)
          for t, s, k in zip(times, which, lens)]


def multi_turn(num_sessions, turns, rate, *, vocab_size, system_len, user_len, reply_len,
               think_s, max_tokens, seed=0) -> list[Item]:
  """Conversations start as a Poisson process at `rate`, all behind one
  system prompt (system_len may be 0). Turn t's prompt is turn t-1's
  prompt + a reply of reply_len tokens + user_len new tokens, arriving think_s
  after turn t-1. The reply is synthetic, not what the server generated (the
  workload is built ahead of time), so a server's cache of turn t-1 covers
  turn t's prompt only up to turn t-1's prompt. Sorted by arrival."""
  _check_positive("num_sessions", num_sessions)
  _check_positive("turns", turns)
  _check_vocab(vocab_size)
  _check_positive("system_len", system_len, allow_zero=True)
  _check_positive("user_len", user_len)
  _check_positive("reply_len", reply_len, allow_zero=True)
  _check_positive("think_s", think_s, allow_zero=True)
  _check_positive("max_tokens", max_tokens)
  starts = poisson_times(num_sessions, rate, seed=seed)
  rng = np.random.default_rng([seed, 3])
  system = _tokens(rng, vocab_size, system_len)
  items = []
  for s, t0 in enumerate(starts):
    prompt = system + _tokens(rng, vocab_size, user_len)
    for t in range(turns):
      if t:
        prompt = prompt + _tokens(rng, vocab_size, reply_len + user_len)
      items.append(Item(float(t0 + t * think_s), prompt, max_tokens, session=s, turn=t))
  return sorted(items, key=lambda it: it.arrival_s)  # stable: ties keep conversation, turn order


def _read_rows(rows):
  if isinstance(rows, (str, os.PathLike)):
    with open(rows) as f:
      return [json.loads(line) for line in f if line.strip()]
  return list(rows)


def from_mooncake_trace(rows, *, vocab_size, block_size=512, time_scale=1.0,
                        max_tokens_cap=None) -> list[Item]:
  """Mooncake trace rows ({"timestamp": ms, "input_length", "output_length",
  "hash_ids"}, or a JSONL path) as Items. Block i of a prompt is block_size
  tokens drawn from a generator seeded by hash_ids[i], so rows that share
  hash ids share token prefixes; the prompt is cut to input_length. Tokens
  past the given blocks (a row with too few hash ids) are unique to the row.
  max_tokens is output_length, at least 1 (a server emits one token at the
  least) and at most max_tokens_cap. Sorted by arrival."""
  _check_vocab(vocab_size)
  _check_positive("block_size", block_size)
  if not time_scale >= 0:
    raise ValueError(f"time_scale must be >= 0, got {time_scale}")
  if max_tokens_cap is not None:
    _check_positive("max_tokens_cap", max_tokens_cap)
  blocks: dict[int, tuple[int, ...]] = {}

  def block(hash_id: int) -> tuple[int, ...]:
    if hash_id not in blocks:
      rng = np.random.default_rng([hash_id, 0x6D6F6F6E])  # a tag apart from the other seeds
      blocks[hash_id] = _tokens(rng, vocab_size, block_size)
    return blocks[hash_id]

  items = []
  for r, row in enumerate(_read_rows(rows)):
    try:
      ts, isl, osl = row["timestamp"], row["input_length"], row["output_length"]
      ids = row["hash_ids"]
    except KeyError as e:
      raise ValueError(f"trace row {r} lacks the field {e.args[0]!r}") from None
    if isl < 1:
      raise ValueError(f"trace row {r}: input_length must be >= 1, got {isl}")
    if any(h < 0 for h in ids):
      raise ValueError(f"trace row {r}: hash_ids must be >= 0, got {ids}")
    used = ids[:math.ceil(isl / block_size)]
    prompt = tuple(itertools.chain.from_iterable(block(h) for h in used))
    if len(prompt) < isl:
      prompt += _tokens(np.random.default_rng([r, 0x726F77]), vocab_size, isl - len(prompt))
    max_tokens = max(1, int(osl))
    if max_tokens_cap is not None:
      max_tokens = min(max_tokens, max_tokens_cap)
    items.append(Item(ts / 1000 * time_scale, prompt[:isl], max_tokens))
  return sorted(items, key=lambda it: it.arrival_s)


def scaled(items, factor) -> list[Item]:
  """Arrival times divided by `factor`: the same requests at factor x the load."""
  if not factor > 0:
    raise ValueError(f"factor must be > 0, got {factor}")
  return [dataclasses.replace(it, arrival_s=it.arrival_s / factor) for it in items]


def _common_prefix(a: tuple, b: tuple) -> int:
  """Length of the common prefix: compares C-speed slices a chunk at a time,
  then bisects inside the first chunk that differs."""
  n, step, i = min(len(a), len(b)), 256, 0
  while i < n:
    j = min(i + step, n)
    if a[i:j] != b[i:j]:
      lo, hi = i, j  # a[:lo] == b[:lo], a[:hi] != b[:hi]
      while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[i:mid] == b[i:mid]:
          lo = mid
        else:
          hi = mid
      return lo
    i = j
  return n


def _shared_prefix_tokens(prompts: list[tuple]) -> int:
  """Sum over prompts of the longest prefix shared with any earlier prompt.

  In lexicographic order the common prefix of two prompts is the minimum over
  the neighbouring pairs between them, so among the earlier prompts the best
  match is one of the two nearest in that order: each prompt costs two
  comparisons instead of one per earlier prompt."""
  order = sorted(range(len(prompts)), key=prompts.__getitem__)
  rank = [0] * len(prompts)
  for r, i in enumerate(order):
    rank[i] = r
  seen, total = [], 0
  for i, p in enumerate(prompts):
    pos = bisect.bisect(seen, rank[i])
    best = 0
    for j in (pos - 1, pos):
      if 0 <= j < len(seen):
        best = max(best, _common_prefix(p, prompts[order[seen[j]]]))
    total += best
    seen.insert(pos, rank[i])
  return total


def summary(items) -> dict:
  """count; duration (first to last arrival, s); mean prompt length and
  max_tokens; offered rate (arrivals per second after the first; inf for a
  burst); shared_prefix_fraction: of all prompt tokens, those that prefix an
  earlier-arriving prompt, the most any prefix cache could reuse."""
  items = sorted(items, key=lambda it: it.arrival_s)
  if not items:
    raise ValueError("items is empty")
  times = [it.arrival_s for it in items]
  duration = times[-1] - times[0]
  prompts = [tuple(it.prompt) for it in items]
  total = sum(len(p) for p in prompts)
  return {
      "count": len(items),
      "duration_s": duration,
      "mean_prompt_len": total / len(items),
      "mean_max_tokens": sum(it.max_tokens for it in items) / len(items),
      "offered_rate": (len(items) - 1) / duration if duration > 0 else math.inf,
      "shared_prefix_fraction": _shared_prefix_tokens(prompts) / total if total else 0.0,
  }


IMAGE_MARKER = "<image>"  # in a JSONL row's text: where one of its images goes


def read_prompts(path: str, *, encode=None, vision=None) -> tuple[list[list[int]], list]:
  """A JSONL file of prompts -> (token ids per row, images per row or None).

  A row is {"tokens": [...]} or {"text": "..."} (encoded with `encode`),
  plus, for a vision model (vision: its `VisionConfig`), "images": [paths]
  (relative ones from the file's folder): the tokens hold one image
  placeholder id per image, or the text one "<image>" per image (each
  becomes vision start, image placeholder, vision end)."""
  prompts, images = [], []
  folder = os.path.dirname(os.path.abspath(path))
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      row = json.loads(line)
      where = f"{path}:{n}"
      paths = row.get("images")
      if paths is not None and (vision is None or not isinstance(paths, list) or not paths):
        raise ValueError(f"{where}: 'images' needs a vision model and a non-empty list of paths")
      if "tokens" in row:
        ids = [int(t) for t in row["tokens"]]
      elif "text" in row:
        if encode is None:
          raise ValueError(f"{where}: a 'text' row needs a tokenizer")
        pieces = row["text"].split(IMAGE_MARKER) if paths else [row["text"]]
        ids = list(encode(pieces[0]))
        for piece in pieces[1:]:
          ids += [vision.vision_start_token_id, vision.image_token_id,
                  vision.vision_end_token_id] + list(encode(piece))
      else:
        raise ValueError(f"{where}: a row needs 'tokens' or 'text'")
      if paths and ids.count(vision.image_token_id) != len(paths):
        raise ValueError(f"{where}: {ids.count(vision.image_token_id)} image placeholders "
                         f"for {len(paths)} images")
      prompts.append(ids)
      images.append([os.path.join(folder, p) for p in paths] if paths else None)
  if not prompts:
    raise ValueError(f"{path}: no prompts")
  return prompts, images
