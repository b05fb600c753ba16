"""A decode step a newcomer can follow: from `Engine.step` to the attention
kernel and back to the sampled tokens in at most 9 files (issue 40).

Measured, not listed: a profiler records the call stack each time the step
reaches one of its four stations (the scheduler choosing the chunks, the
attention kernel, the sampler, the scheduler taking the sampled tokens), and
the files on those stacks are the path a reader follows. Leaf helpers called
along the way and returning at once (config accessors, layer math, pool
accessors, sampling-extras bookkeeping) are not on any station's stack, so
they are not counted. The step is the first decode step of a fresh engine, so
the jitted program is traced and its model code runs in Python.
"""

import os
import sys

import jax

import jaxinfer
from jaxinfer import models, presets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(jaxinfer.__file__)))
STATIONS = {("scheduler.py", "schedule"), ("xla_attention.py", "dense_kmajor"),
            ("sampling.py", "argmax"), ("scheduler.py", "apply")}
MAX_FILES = 9


def _ours(filename: str) -> str | None:
  if filename.startswith("<"):  # frozen and generated code
    return None
  path = os.path.abspath(filename)
  inside = path.startswith(ROOT + os.sep) and "site-packages" not in path
  return os.path.relpath(path, ROOT) if inside else None


def _decode_path(eng) -> tuple[set, set]:
  """One `eng.step()` -> (the files on the stations' stacks, stations reached)."""
  files, reached = set(), set()

  def profile(frame, event, arg):
    if event != "call":
      return
    code = frame.f_code
    station = (os.path.basename(code.co_filename), code.co_name)
    if station not in STATIONS or _ours(code.co_filename) is None:
      return
    reached.add(station)
    f = frame
    while f is not None:
      name = _ours(f.f_code.co_filename)
      if name is not None and not name.startswith("tests"):
        files.add(name)
      f = f.f_back

  sys.setprofile(profile)
  try:
    eng.step()
  finally:
    sys.setprofile(None)
  return files, reached


def test_a_decode_step_crosses_at_most_nine_files():
  cfg = presets.get("tiny_dense")
  eng = jaxinfer.Engine(cfg, models.init_params(cfg, jax.random.key(0)),
                        jaxinfer.EngineConfig(max_num_seqs=2, num_pages=32, page_size=8,
                                              max_num_batched_tokens=32,
                                              async_scheduling=False))
  eng.submit([1, 2, 3, 4, 5], jaxinfer.SamplingParams(max_tokens=4))
  eng.step()  # the prompt
  files, reached = _decode_path(eng)  # the first decode step: traced, so the model runs here
  assert reached == STATIONS, f"the step did not reach {STATIONS - reached}"
  assert "jaxinfer/engine/engine.py" in files and "jaxinfer/xla_attention.py" in files
  assert len(files) <= MAX_FILES, f"{len(files)} files: {sorted(files)}"
