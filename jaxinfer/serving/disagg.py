"""Disaggregated prefill/decode: the decode worker reserves KV pages first, a
prefill worker computes the prompt's K/V (reusing its own prefix cache), and
the pages move into the reservation across meshes, converting the layout
(`jax.device_put` onto the decode mesh, then one scatter into its pool) when
the two sides shard differently. Decode never blocks on a transfer: the
request joins its batch only once the copy has landed (`ready`). A transfer
that has not landed by its deadline frees the reservation, and the caller
retries the request.

Conditional disaggregation (Dynamo's rule): prefill remotely only when the
uncached part of the prompt is longer than `max_local_prefill_length` and
the remote prefill queue is shorter than `max_prefill_queue_size`.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxinfer.engine.engine import Engine

MODES = ("conditional", "always", "never")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DisaggConfig:
  """When to prefill remotely (`remote`), and how long a KV transfer may take.

  mode: "conditional" (Dynamo's rule, above), "always" (every fresh prompt
  on a prefill worker) or "never" (all prompts prefilled where they decode).
  transfer_timeout_s: a transfer that has not landed by then frees its
  reservation and the request is retried, at most max_retries times.
  """

  mode: str = "conditional"  # "always": every fresh prompt remote; "never": all local
  max_local_prefill_length: int = 1000  # Dynamo's default
  max_prefill_queue_size: int = 2  # Dynamo's default
  transfer_timeout_s: float = 120.0  # vLLM frees a stuck transfer's pages after 120 s
  max_retries: int = 2  # per request, after transfer timeouts

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"DisaggConfig: mode must be one of {MODES}, got {self.mode!r}")
    for name in ("max_local_prefill_length", "max_prefill_queue_size", "max_retries"):
      if getattr(self, name) < 0:
        raise ValueError(f"DisaggConfig: {name} must be >= 0, got {getattr(self, name)}")
    if not self.transfer_timeout_s >= 0:
      raise ValueError(f"DisaggConfig: transfer_timeout_s must be >= 0, "
                       f"got {self.transfer_timeout_s}")

  def remote(self, uncached_tokens: int, prefill_queue: int) -> bool:
    """Whether to prefill this prompt on a prefill worker."""
    if self.mode != "conditional":
      return self.mode == "always"
    return (uncached_tokens > self.max_local_prefill_length
            and prefill_queue < self.max_prefill_queue_size)


def check_compatible(prefill: Engine, decode: Engine) -> None:
  """Both sides must hold the same K/V: same model and page size, and the
  MTP modules' K/V on the prefill side when the decode side speculates."""
  if prefill.cfg != decode.cfg:
    raise ValueError("disaggregation: prefill and decode workers serve different models")
  if prefill.config.page_size != decode.config.page_size:
    raise ValueError(f"disaggregation: page sizes differ (prefill {prefill.config.page_size}, "
                     f"decode {decode.config.page_size})")
  if len(decode.pool) > len(prefill.pool):
    raise ValueError("disaggregation: the decode worker speculates (MTP K/V) and the prefill "
                     "worker does not compute MTP K/V; give both the same `speculative`")


@dataclasses.dataclass
class Transfer:
  """Prompt K/V on its way from a prefill engine into a decode reservation."""
  decode: Engine
  rank: int  # decode reservation: DP rank and its pages
  pages: list[int]
  blob: object  # K/V placed (or being placed) on the decode engine's devices
  deadline: float
  drafts: object = None  # the MTP drafts (`Engine.take_drafts`), placed like the K/V
  stalled: bool = False  # fault injection: never lands

  @classmethod
  def start(cls, prefill: Engine, prefill_rank: int, prefill_pages, decode: Engine,
            rank: int, pages: list[int], *, now: float, timeout_s: float,
            drafts=None) -> "Transfer":
    """Reads the prompt's pages on the prefill side and starts the copy onto
    the decode side (both asynchronous); the prefill pages can be released
    right after. drafts: the prefill's MTP drafts for the request (its MTP
    modules' K/V travels in the pages), copied along."""
    blob = prefill.read_pages(prefill_rank, prefill_pages[:len(pages)])
    placed = None if drafts is None else decode.place_pages(drafts)
    return cls(decode, rank, pages, decode.place_pages(blob), now + timeout_s, placed)

  def ready(self) -> bool:
    return not self.stalled and all(a.is_ready()
                                    for a in jax.tree.leaves((self.blob, self.drafts)))

  def land(self) -> None:
    """Writes the K/V into the reservation (the engine's next step follows it)."""
    self.decode.write_pages(self.rank, self.pages, self.blob)

  def cancel(self) -> None:
    """Frees the reservation (a timed-out or abandoned transfer)."""
    self.decode.release_pages(self.rank, self.pages)
    self.pages = []
