"""The top kernels of a profiler trace: a few steps of a warm program run
under `jax.profiler.trace`, the written `*.xplane.pb` read back with
`jax.profiler.ProfileData`, and the kernels ranked by the device time they
took (name, count, total ms, share of the traced device time).

Where the events come from (`select_events`):

  device  a "/device:GPU:N" (or other "/device:") plane: the events of its
          "Stream #..." lines (kernels, memcpys; where a plane has none of
          those lines, its "XLA Ops" line, else all its lines), innermost
          only (a CUDA graph's span and the kernels it ran are not both
          counted)
  host    no device plane with events (CPU): the "/host:CPU" plane's XLA op
          events (those with an "hlo_op" stat, the thunks the CPU runtime
          ran), innermost only (a loop and the ops inside it are not both
          counted)

`top_table` is the pure part: (plane, [(name, duration_ns)]) -> the table.
`trace_top` never raises: a jax without ProfileData, a profiler that will
not start or a trace without events gives status "unavailable" or "error"
with the reason. Standard library and jax only.
"""

from __future__ import annotations

import glob
import math
import os
import tempfile
from typing import Any, Callable, Iterable

import jax

TOP_K = 15
_NAME_CHARS = 200  # kernel names (mangled templates) are cut to this many characters
_STREAM_PREFIX = "Stream"
_XLA_OPS_LINE = "XLA Ops"
_HOST_PLANE = "/host:CPU"
_HLO_OP_STAT = "hlo_op"


def top_table(plane: str, events: Iterable[tuple[str, float]], k: int = TOP_K) -> dict:
  """The k kernels that took the most time among `events` ((name,
  duration_ns) pairs, one per kernel run) -> {plane, events, distinct,
  traced_ms, top_share, top: [{name, count, total_ms, share}]}, `top` sorted
  by total time descending (ties by name); share: the kernel's total / the
  total of every event (traced_ms), so the shares add up to top_share <= 1."""
  if not isinstance(k, int) or isinstance(k, bool) or k < 1:
    raise ValueError(f"top_table: k must be a positive int, got {k!r}")
  counts: dict[str, int] = {}
  totals: dict[str, float] = {}
  n = 0
  for name, duration_ns in events:
    if not isinstance(name, str):
      raise ValueError(f"top_table: event name must be a str, got {name!r}")
    if not isinstance(duration_ns, (int, float)) or not math.isfinite(duration_ns) \
        or duration_ns < 0:
      raise ValueError(f"top_table: duration_ns of {name!r} must be a finite number >= 0, "
                       f"got {duration_ns!r}")
    counts[name] = counts.get(name, 0) + 1
    totals[name] = totals.get(name, 0.0) + float(duration_ns)
    n += 1
  traced_ns = sum(totals.values())
  ranked = sorted(totals, key=lambda name: (-totals[name], name))[:k]
  top = [dict(name=name[:_NAME_CHARS], count=counts[name], total_ms=totals[name] / 1e6,
              share=totals[name] / traced_ns if traced_ns > 0 else 0.0) for name in ranked]
  return dict(plane=plane, events=n, distinct=len(totals), traced_ms=traced_ns / 1e6,
              top_share=sum(row["share"] for row in top), top=top)


def _stats(event) -> dict:
  try:
    return dict(event.stats)
  except Exception:  # noqa: BLE001  (a stat this jax cannot convert: no stats)
    return {}


def _innermost(spans: list[tuple[str, float, float]]) -> list[tuple[str, float]]:
  """(name, start_ns, duration_ns) of one thread -> (name, duration_ns) of the
  spans that contain no other span."""
  spans = sorted(spans, key=lambda s: (s[1], -s[2]))
  out = []
  for i, (name, start, dur) in enumerate(spans):
    nxt = spans[i + 1] if i + 1 < len(spans) else None
    if nxt is not None and nxt[1] < start + dur and nxt[1] + nxt[2] <= start + dur:
      continue  # the next span starts (and ends) inside this one
    out.append((name, dur))
  return out


def select_events(planes) -> tuple[str, str, list[tuple[str, float]]]:
  """(plane name(s), source "device" | "host", [(name, duration_ns)]) of a
  trace's planes (`ProfileData.planes`; each with .name and .lines, each line
  with .name and .events, each event with .name, .start_ns, .duration_ns
  and .stats), as the module docstring says."""
  planes = list(planes)
  names, events = [], []
  for plane in planes:
    if not plane.name.startswith("/device:"):
      continue
    lines = list(plane.lines)
    pick = ([ln for ln in lines if ln.name.startswith(_STREAM_PREFIX)]
            or [ln for ln in lines if ln.name == _XLA_OPS_LINE] or lines)
    got = [ev for ln in pick
           for ev in _innermost([(e.name, float(e.start_ns), float(e.duration_ns))
                                 for e in ln.events])]
    if got:
      names.append(plane.name)
      events += got
  if events:
    return ",".join(names), "device", events
  for plane in planes:
    if plane.name != _HOST_PLANE:
      continue
    for line in plane.lines:
      spans = [(e.name, float(e.start_ns), float(e.duration_ns)) for e in line.events
               if _HLO_OP_STAT in _stats(e)]
      events += _innermost(spans)
    return plane.name, "host", events
  return "", "none", []


def xplane_files(log_dir: str) -> list[str]:
  """The `*.xplane.pb` files a trace into log_dir wrote, newest last."""
  files = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.xplane.pb"))
  return sorted(files, key=os.path.getmtime)


def unavailable() -> str:
  """'' when this jax can read traces back, else why not."""
  profiler = getattr(jax, "profiler", None)
  missing = [name for name in ("trace", "ProfileData")
             if profiler is None or not hasattr(profiler, name)]
  if missing:
    return f"jax {jax.__version__} has no jax.profiler.{' / '.join(missing)}"
  if not hasattr(profiler.ProfileData, "from_file"):
    return f"jax {jax.__version__}: jax.profiler.ProfileData has no from_file"
  return ""


def _options():
  """No Python tracer and no HLO protos in the trace (cheaper to write and read)."""
  make = getattr(jax.profiler, "ProfileOptions", None)
  if make is None:
    return None
  options = make()
  options.python_tracer_level = 0
  options.enable_hlo_proto = False
  return options


def trace_top(run: Callable[[], Any], k: int = TOP_K) -> dict:
  """`run()` under jax.profiler.trace into a temporary directory, its trace
  read back -> {status "ok", source, trace_file_bytes, **top_table(...)}, or
  {status "unavailable" | "error", reason | error}. Never raises; `run`
  should block until its device work is done."""
  why = unavailable()
  if why:
    return dict(status="unavailable", reason=why)
  try:
    with tempfile.TemporaryDirectory(prefix="trace_top_") as log_dir:
      options = _options()
      kwargs = {"profiler_options": options} if options is not None else {}
      with jax.profiler.trace(log_dir, **kwargs):
        run()
      files = xplane_files(log_dir)
      if not files:
        return dict(status="error", error=f"the trace wrote no *.xplane.pb under {log_dir}")
      size = os.path.getsize(files[-1])
      profile = jax.profiler.ProfileData.from_file(files[-1])
      plane, source, events = select_events(profile.planes)
  except Exception as e:  # noqa: BLE001  (recorded: a trace must never end the run)
    return dict(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
  if not events:
    planes = [p.name for p in profile.planes]
    return dict(status="error", error=f"no kernel or XLA op events in the trace (planes {planes})")
  return dict(status="ok", source=source, trace_file_bytes=size, **top_table(plane, events, k))
