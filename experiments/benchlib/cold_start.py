"""A server's start, timed from the command: `experiments/serve.py` run as a
user runs it, its first request sent as soon as the port answers.

Per start (`start`): seconds from the command to the port answering
(`/health`), to the first completed request, and (with `wait_warm`) to
`/health` saying "ok" (the background warm-up done); the step programs
compiled by then (`/metrics`' jaxinfer_compiles) and the warm-up's progress
(`/health`); the server process's memory maps (/proc/PID/maps lines) at
each point, and their growth per compiled program; the persistent cache's
files. `run` does a cold start (an empty compilation cache) and then a warm
one (the same cache).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

REQUEST = dict(model="default", prompt="def add(a, b):", max_tokens=16, temperature=0)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def map_count(pid: int) -> int:
  """The memory maps a process holds (what vm.max_map_count limits)."""
  with open(f"/proc/{pid}/maps") as f:
    return sum(1 for _ in f)


def _get(url: str, timeout: float = 120.0):
  with urllib.request.urlopen(url, timeout=timeout) as r:
    return r.read().decode()


def _compiles(url: str) -> int | None:
  m = re.search(r"^jaxinfer_compiles(?:\{[^}]*\})? (\S+)$", _get(f"{url}/metrics"), re.M)
  return int(float(m.group(1))) if m else None


def _point(url: str, pid: int, t0: float) -> dict:
  """The time since t0, /health, the programs compiled and the map count now."""
  return dict(s=time.perf_counter() - t0, health=json.loads(_get(f"{url}/health")),
              compiles=_compiles(url), maps=map_count(pid))


def _tail(f, n: int = 3000) -> str:
  f.seek(0)
  return f.read()[-n:]


def _wait_port(proc, url: str, deadline: float, log) -> None:
  while True:
    if proc.poll() is not None:
      raise RuntimeError(f"serve.py exited with {proc.returncode}:\n{_tail(log)}")
    if time.perf_counter() > deadline:
      raise TimeoutError("serve.py did not open its port in time")
    try:
      _get(f"{url}/health", timeout=2)
      return
    except (OSError, urllib.error.URLError):
      time.sleep(0.05)


def start(cache_dir: str, *, flags=(), wait_warm: bool = False, timeout_s: float = 1800.0,
          python: str = sys.executable, cwd: str = ".", env: dict | None = None) -> dict:
  """One start of serve.py on a free port with this compilation cache (env:
  the server's environment, default ours) -> {port_s, first: the point
  after the first completed request, warm (with wait_warm): the point once
  /health is ok, maps_per_program, text: the completion, stdout}."""
  port = free_port()
  url = f"http://127.0.0.1:{port}"
  argv = [python, "experiments/serve.py", f"--port={port}",
          f"--compilation_cache_dir={cache_dir}", *flags]
  env = dict(os.environ if env is None else env)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [".", "experiments", env.get("PYTHONPATH")]))
  t0 = time.perf_counter()
  # Files, not pipes: a pipe nobody reads while the server runs can fill and stall it.
  with tempfile.TemporaryFile("w+") as log, tempfile.TemporaryFile("w+") as stdout, \
      subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=log, text=True) as proc:
    try:
      deadline = t0 + timeout_s
      _wait_port(proc, url, deadline, log)
      out = dict(port_s=time.perf_counter() - t0)
      req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(REQUEST).encode(),
                                   headers={"Content-Type": "application/json"})
      with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out["text"] = json.loads(r.read())["choices"][0]["text"]
      out["first"] = _point(url, proc.pid, t0)
      if wait_warm:
        while json.loads(_get(f"{url}/health"))["status"] == "warming":
          if time.perf_counter() > deadline:
            raise TimeoutError("the background warm-up did not end in time")
          time.sleep(1.0)
        out["warm"] = w = _point(url, proc.pid, t0)
        f = out["first"]
        if w["compiles"] and w["compiles"] > f["compiles"]:
          out["maps_per_program"] = (w["maps"] - f["maps"]) / (w["compiles"] - f["compiles"])
    finally:
      proc.terminate()
      proc.wait(timeout=60)
    out["stdout"] = _tail(stdout, 2000)
  return out


def cache_files(cache_dir: str) -> int:
  return sum(len(files) for _, _, files in os.walk(cache_dir))


def run(cache_dir: str, *, flags=(), wait_warm: bool = False, timeout_s: float = 1800.0) -> dict:
  """A cold start (cache_dir emptied first) and a warm start from its cache."""
  if os.path.exists(cache_dir) and os.listdir(cache_dir):
    raise ValueError(f"{cache_dir}: not empty (a cold start needs an empty compilation cache)")
  cold = start(cache_dir, flags=flags, wait_warm=wait_warm, timeout_s=timeout_s)
  cold["cache_files"] = cache_files(cache_dir)
  warm = start(cache_dir, flags=flags, wait_warm=wait_warm, timeout_s=timeout_s)
  return dict(cold=cold, warm=warm, same_text=cold["text"] == warm["text"])
