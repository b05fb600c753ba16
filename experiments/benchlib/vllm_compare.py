"""jaxinfer against vLLM's CPU build on this machine, in one run: offline
batches and a streaming server, the same random-weight HF checkpoint, the
same prompts (token ids), greedy, alternating repeats
(`experiments/bench_vs_vllm.py` is the command line).

vLLM runs from its own virtualenv (`experiments/peers/vllm_peer.py`, started
with that venv's Python and a clean environment); jaxinfer runs in this
process (offline) or as `experiments/serve.py` (served).

What is measured, per run:
  seconds      wall time of the batch (offline: one `generate` / `LLM.generate`
               call; served: the first request sent -> the last stream closed)
  cpu_seconds  busy CPU time of the whole machine over the same interval
               (/proc/stat: user + nice + system + irq + softirq), so every
               process of a side counts (vLLM's engine core and workers, our
               server's threads); nothing else of ours runs meanwhile
  tokens       the generated token ids, compared across sides (`identical`)
  ttft         served: per request, first streamed token - request sent

vLLM's CPU build binds its compute threads to cores and, by default, keeps
one core for its front end (`cores="default"`); `cores="all"` binds compute
to every core (VLLM_CPU_OMP_THREADS_BIND=0-(n-1), no reserved core), the
same cores jaxinfer computes on.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

import httpx

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
PEER = os.path.join(HERE, "peers", "vllm_peer.py")
MARK = "@@vllm_peer "


def cpu_seconds() -> float:
  """Busy CPU seconds of the whole machine since boot (/proc/stat)."""
  with open("/proc/stat") as f:
    v = [int(x) for x in f.readline().split()[1:8]]
  user, nice, system, _idle, _iowait, irq, softirq = v
  return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def peer_env(cores: str) -> dict:
  """The environment vLLM's venv runs in: ours without venv or path
  variables (its torch must not see our site-packages), and its core binding."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("VIRTUAL_ENV", "PYTHONPATH", "XLA_FLAGS", "JAX_PLATFORMS")}
  if cores == "all":
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
  elif cores != "default":
    raise ValueError(f"cores must be 'default' or 'all', got {cores!r}")
  return env


def make_checkpoint(hf_config: dict, out_dir: str, vllm_python: str, seed: int = 0) -> str:
  """config.json + random float32 safetensors + tokenizer.json in out_dir,
  written by transformers in vLLM's venv (kept when out_dir has one made from
  the same config)."""
  cfg_path = os.path.join(out_dir, "source_config.json")
  if os.path.exists(os.path.join(out_dir, "model.safetensors")) and os.path.exists(cfg_path):
    with open(cfg_path) as f:
      if json.load(f) == hf_config:
        return out_dir
  os.makedirs(out_dir, exist_ok=True)
  with open(cfg_path, "w") as f:
    json.dump(hf_config, f, indent=1)
  subprocess.run([vllm_python, PEER, "checkpoint", f"--config_json={cfg_path}",
                  f"--out={out_dir}", f"--seed={seed}"], check=True, env=peer_env("default"),
                 stdout=subprocess.DEVNULL)
  return out_dir


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
  """n prompts of `length` ids, avoiding the first three (special) ids."""
  rng = random.Random(seed)
  return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


class VllmOffline:
  """`vllm.LLM` in a child process, fed one batch at a time."""

  def __init__(self, vllm_python: str, model_dir: str, *, dtype: str, max_tokens: int,
               cores: str, log_path: str, memory_utilization: float):
    self._log = open(log_path, "a")
    self._proc = subprocess.Popen(
        [vllm_python, PEER, "offline", f"--model={model_dir}", f"--dtype={dtype}",
         f"--max_tokens={max_tokens}", f"--memory_utilization={memory_utilization}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
        env=peer_env(cores))
    self._read()  # {"ready": true}

  def _read(self) -> dict:
    for line in self._proc.stdout:
      if line.startswith(MARK):
        return json.loads(line[len(MARK):])
      self._log.write(line)
    raise RuntimeError(f"vLLM peer exited ({self._proc.wait()}); see {self._log.name}")

  def generate(self, prompts) -> tuple[float, list[list[int]]]:
    self._proc.stdin.write(json.dumps({"prompts": prompts}) + "\n")
    self._proc.stdin.flush()
    r = self._read()
    return r["seconds"], r["tokens"]

  def close(self) -> None:
    if self._proc.poll() is None:
      self._proc.stdin.write("quit\n")
      self._proc.stdin.flush()
      try:
        self._proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self._proc.kill()
    self._log.close()


def timed(fn) -> dict:
  """fn() -> (seconds, tokens) with the machine's CPU seconds around it."""
  c0 = cpu_seconds()
  seconds, tokens = fn()
  return dict(seconds=seconds, cpu_seconds=cpu_seconds() - c0, tokens=tokens)


# ----------------------------------------------------------------------------- served


def start_server(argv: list[str], env: dict, port: int, log_path: str,
                 timeout_s: float = 900.0) -> subprocess.Popen:
  """Starts a server process and waits for GET /health to answer 200."""
  log = open(log_path, "a")
  proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"server exited with {proc.returncode} before serving; see {log_path}")
    try:
      if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
        return proc
    except httpx.HTTPError:
      pass
    time.sleep(1.0)
  proc.kill()
  raise TimeoutError(f"server on :{port} not healthy after {timeout_s} s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
  proc.terminate()
  try:
    proc.wait(timeout=30)
  except subprocess.TimeoutExpired:
    proc.kill()


async def _stream_one(client, url: str, model: str, prompt, max_tokens: int) -> dict:
  body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
              stream=True, ignore_eos=True, return_token_ids=True)
  t0 = time.perf_counter()
  ttft, tokens = None, []
  async with client.stream("POST", url, json=body) as resp:
    if resp.status_code != 200:
      raise RuntimeError(f"{url}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
    async for line in resp.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      chunk = json.loads(line[6:])
      for choice in chunk.get("choices", []):
        ids = choice.get("token_ids") or []
        if ids and ttft is None:
          ttft = time.perf_counter() - t0
        tokens += ids
  return dict(ttft=ttft, tokens=tokens)


async def _stream_all(port: int, model: str, prompts, max_tokens: int, concurrency: int):
  url = f"http://127.0.0.1:{port}/v1/completions"
  gate = asyncio.Semaphore(concurrency)
  async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
    async def one(p):
      async with gate:
        return await _stream_one(client, url, model, p, max_tokens)
    return await asyncio.gather(*(one(p) for p in prompts))


def serve_run(port: int, model: str, prompts, max_tokens: int, concurrency: int) -> dict:
  """All prompts as streaming completions, `concurrency` in flight -> {seconds,
  cpu_seconds, tokens, ttft}."""
  c0, t0 = cpu_seconds(), time.perf_counter()
  outs = asyncio.run(_stream_all(port, model, prompts, max_tokens, concurrency))
  seconds = time.perf_counter() - t0
  return dict(seconds=seconds, cpu_seconds=cpu_seconds() - c0,
              tokens=[o["tokens"] for o in outs], ttft=[o["ttft"] for o in outs])


def our_server_argv(model_dir: str, port: int, extra: list[str]) -> list[str]:
  return [sys.executable, os.path.join(HERE, "serve.py"), f"--hf_dir={model_dir}",
          f"--port={port}", "--model_name=bench", "--compilation_cache_dir=", *extra]


def vllm_server_argv(vllm_python: str, model_dir: str, port: int, dtype: str,
                     memory_utilization: float) -> list[str]:
  return [vllm_python, PEER, "serve", f"--model={model_dir}", f"--dtype={dtype}",
          f"--port={port}", f"--memory_utilization={memory_utilization}"]


# ----------------------------------------------------------------------------- results


def summarize(rows) -> list[dict]:
  """Medians per (workload, vllm_cores, side) and ours / vLLM."""
  out = []
  keys = sorted({(r["workload"], r["vllm_cores"]) for r in rows})
  for w, cores in keys:
    med = {}
    for side in ("jaxinfer", "vllm"):
      sel = [r for r in rows if (r["workload"], r["vllm_cores"], r["side"]) == (w, cores, side)]
      med[side] = {k: statistics.median(r[k] for r in sel) for k in sel[0]
                   if k in ("tokens_per_s", "tokens_per_cpu_s", "ttft_median_s", "seconds",
                            "cpu_seconds")}
      med[side]["identical"] = f"{sum(r['identical'] for r in sel)}/{sum(r['sequences'] for r in sel)}"
    s = dict(workload=w, vllm_cores=cores, ours=med["jaxinfer"], vllm=med["vllm"],
             throughput_ratio=med["jaxinfer"]["tokens_per_s"] / med["vllm"]["tokens_per_s"],
             per_cpu_second_ratio=(med["jaxinfer"]["tokens_per_cpu_s"]
                                   / med["vllm"]["tokens_per_cpu_s"]))
    if "ttft_median_s" in med["vllm"]:
      s["ttft_ratio"] = med["jaxinfer"]["ttft_median_s"] / med["vllm"]["ttft_median_s"]
    out.append(s)
    print(f"{w:8s} vllm_cores={cores:7s} ours / vLLM: {s['throughput_ratio']:.2f}x tokens/s, "
          f"{s['per_cpu_second_ratio']:.2f}x per CPU-second"
          + (f", TTFT {s['ttft_ratio']:.2f}x" if "ttft_ratio" in s else "")
          + f"; identical {med['jaxinfer']['identical']}")
  return out


def plot(summary, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8, 4))
  labels = [f"{s['workload']}\nvLLM cores: {s['vllm_cores']}" for s in summary]
  xs = range(len(summary))
  ax.bar([x - 0.2 for x in xs], [s["ours"]["tokens_per_s"] for s in summary], 0.4,
         label="jaxinfer")
  ax.bar([x + 0.2 for x in xs], [s["vllm"]["tokens_per_s"] for s in summary], 0.4, label="vLLM")
  ax.set_xticks(list(xs), labels, fontsize=8)
  ax.set_ylabel("output tokens/s (median)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path)
