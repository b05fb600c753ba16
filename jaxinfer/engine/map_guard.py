"""Memory maps of compiled programs: what keeps a long-lived engine from
crashing inside XLA:CPU's compiler (docs/known_issues.md).

XLA:CPU maps each compiled kernel's machine code on its own (an executable,
a read-only and a writable map per kernel), and jax keeps every compiled
program alive. Linux refuses maps past `vm.max_map_count` (65,530 by
default), and a compile that cannot map its code fails ("LLVM compilation
error: Cannot allocate memory") and then segfaults the process. A step
program of `bench_dense` holds ~270-680 maps; one of `bench_moe` (64
experts x 7 layers, a loop each on CPU) over 1,000, so serve.py's 96
warm-up programs of it would need more maps than Linux allows.

`ProgramGuard` runs before each step program: a program new since the last
clear, in a process holding `fraction` of the limit or more, first drops
jax's compiled programs (`jax.clear_caches`; the programs traffic needs
compile again as it needs them, slower but alive). `room` says whether the
warm-up may compile another program and stay under its own fraction.
Linux only; elsewhere nothing is counted and nothing is dropped.
"""

from __future__ import annotations

import logging

import jax

_MAPS = "/proc/self/maps"
_LIMIT = "/proc/sys/vm/max_map_count"
_generation = 0  # jax.clear_caches calls made by guards: every guard's programs are gone


def memory_maps() -> tuple[int, int] | None:
  """(maps this process holds, vm.max_map_count), or None off Linux."""
  try:
    with open(_LIMIT) as f:
      limit = int(f.read())
    with open(_MAPS, "rb") as f:
      return sum(1 for _ in f), limit
  except (OSError, ValueError):
    return None


class ProgramGuard:
  """Drops jax's compiled programs before a new program's compile could
  cross `fraction` of vm.max_map_count (see the module docstring)."""

  def __init__(self, fraction: float = 0.85):
    if not 0.0 < fraction <= 1.0:
      raise ValueError(f"ProgramGuard: fraction must be in (0, 1], got {fraction}")
    self.fraction = fraction
    self.clears = 0  # caches this guard dropped
    self._live: set = set()
    self._generation = _generation

  def before(self, key) -> None:
    """Call before running the program `key` (any hashable naming it)."""
    global _generation
    if self._generation != _generation:  # another guard cleared: ours are gone too
      self._live.clear()
      self._generation = _generation
    if key in self._live:
      return
    maps = memory_maps()
    if maps is not None and maps[0] >= self.fraction * maps[1]:
      logging.warning("jaxinfer: %d memory maps of vm.max_map_count %d held by compiled "
                      "programs; dropping them (jax.clear_caches) before compiling another "
                      "(docs/known_issues.md)", *maps)
      jax.clear_caches()
      _generation += 1
      self._generation = _generation
      self._live.clear()
      self.clears += 1
    self._live.add(key)


def room(fraction: float) -> bool:
  """Whether the process holds fewer than `fraction` of vm.max_map_count maps
  (always True off Linux)."""
  maps = memory_maps()
  return maps is None or maps[0] < fraction * maps[1]
