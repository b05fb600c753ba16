"""guidellm and aiperf, each from its own virtualenv, against `experiments/serve.py`
(the default model) with local files only: the tokenizer is
`jaxinfer/default_model/`'s Hugging Face files, the prompts are each tool's
synthetic text, and the tools run with HF_HUB_OFFLINE=1,
TRANSFORMERS_OFFLINE=1 and an HF_HOME of their own (an empty hub cache but
for the one below), so nothing is downloaded nor read from a cache.

Per tool and load (synchronous: one request at a time; concurrent: C at
once), a fixed count of streamed /v1/completions requests with a fixed
prompt and output length (ignore_eos); each tool's own result file is read
back (`parse_guidellm`, `parse_aiperf`) into one summary: requests
completed, errored and incomplete, request throughput, TTFT and ITL means,
output tokens/s. `check` lists what makes a run fail: the tool's exit
status, a missing result file, any errored or incomplete request, fewer
completed requests than sent. Neither tool fails on failed requests by
itself (both exit 0), so the summary is the check.

What each tool needs, from its source:
- guidellm 0.8.1 sends `stream_options: {include_usage, continuous_usage_stats}`
  on every streamed completion (backends/openai/request_handlers.py); a
  server that refuses the unknown `continuous_usage_stats` fails every
  request with a 400 (serve.py serves it, as vLLM does). Unless
  `continuous_usage` is set, the command drops it through the backend's
  `extras` (guidellm merges them into the body, then removes None values).
- aiperf 0.13.0 with HF_HUB_OFFLINE set loads a tokenizer only from the hub
  cache: `Tokenizer._from_pretrained_local` calls
  `snapshot_download(name, local_files_only=True)`, which refuses a
  directory path as a repo id (common/tokenizer.py). `hf_cache` lays the
  tokenizer files out as the cached snapshot of a repo id (REPO_ID) in the
  tools' private HF_HOME, and aiperf is given that id.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from benchlib.cold_start import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
REPO_ID = "jaxinfer/default_model"  # the id aiperf loads the tokenizer by (hf_cache)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
MODEL = "default"
AIPERF_RESULT = "profile_export_aiperf.json"


@dataclasses.dataclass(frozen=True)
class Load:
  """One run of a tool: `requests` requests, `concurrency` at a time."""
  name: str  # "synchronous" or "concurrent"
  concurrency: int
  requests: int
  prompt_tokens: int
  output_tokens: int


def loads(requests: int, concurrency: int, prompt_tokens: int, output_tokens: int) -> list[Load]:
  """Synchronous, then (concurrency > 1) concurrent."""
  if requests < 1 or concurrency < 1:
    raise ValueError(f"requests ({requests}) and concurrency ({concurrency}) must be >= 1")
  out = [Load("synchronous", 1, requests, prompt_tokens, output_tokens)]
  if concurrency > 1:
    out.append(Load("concurrent", concurrency, requests, prompt_tokens, output_tokens))
  return out


# ----------------------------------------------------------------------------- commands


def guidellm_command(exe: str, url: str, tokenizer_dir: str, load: Load, out_json: str, *,
                     continuous_usage: bool = False) -> list[str]:
  """`guidellm run` (0.8's CLI): streamed /v1/completions of synthetic text
  counted by the local tokenizer, `load.requests` requests, the result as
  JSON at out_json. continuous_usage=False drops guidellm's
  stream_options.continuous_usage_stats (see the module's docstring)."""
  backend = dict(kind="openai_http", target=url, model=MODEL, request_format="/v1/completions")
  if not continuous_usage:
    backend["extras"] = {"body": {"stream_options": {"continuous_usage_stats": None}}}
  profile = ("kind=synchronous" if load.name == "synchronous" else
             f"kind=concurrent,streams={load.concurrency}")
  return [exe, "run", "--backend", json.dumps(backend, separators=(",", ":")),
          "--profile", profile,
          "--constraint", f"kind=max_requests,count={load.requests}",
          "--data", f"kind=synthetic_text,prompt_tokens={load.prompt_tokens},"
                    f"output_tokens={load.output_tokens}",
          "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
          "--output", f"kind=json,path={out_json}",
          "--disable-console-interactive"]


def aiperf_command(exe: str, url: str, load: Load, artifact_dir: str, *,
                   tokenizer: str = REPO_ID) -> list[str]:
  """`aiperf profile`: streamed /v1/completions of synthetic prompts of
  exactly load.prompt_tokens tokens (the tokenizer by its cached repo id:
  `hf_cache`), load.output_tokens each (ignore_eos), results under
  artifact_dir. No GPU telemetry (a CPU server); the server's /metrics is
  scraped as aiperf does by default."""
  return [exe, "profile", "--model", MODEL, "--url", url,
          "--endpoint-type", "completions", "--streaming",
          "--tokenizer", tokenizer,
          "--synthetic-input-tokens-mean", str(load.prompt_tokens),
          "--synthetic-input-tokens-stddev", "0",
          "--output-tokens-mean", str(load.output_tokens), "--output-tokens-stddev", "0",
          "--extra-inputs", "ignore_eos:true",
          "--concurrency", str(load.concurrency), "--request-count", str(load.requests),
          "--random-seed", "0", "--ui-type", "none", "--no-gpu-telemetry", "--no-auto-plot",
          "--artifact-dir", artifact_dir]


def hf_cache(tokenizer_dir: str, hub_dir: str, repo_id: str = REPO_ID) -> str:
  """Lays the tokenizer files out in hub_dir (an HF_HUB_CACHE) as the
  cached snapshot of repo_id at revision "main", which is where
  `snapshot_download(repo_id, local_files_only=True)` finds them.
  -> the snapshot's directory."""
  repo = pathlib.Path(hub_dir) / ("models--" + repo_id.replace("/", "--"))
  snapshot = repo / "snapshots" / "local"
  snapshot.mkdir(parents=True, exist_ok=True)
  (repo / "refs").mkdir(exist_ok=True)
  (repo / "refs" / "main").write_text("local")
  for name in TOKENIZER_FILES:
    shutil.copyfile(pathlib.Path(tokenizer_dir) / name, snapshot / name)
  return str(snapshot)


def tool_env(hf_home: str, base: dict | None = None) -> dict:
  """The tools' environment: offline, with an HF_HOME of their own."""
  env = dict(os.environ if base is None else base)
  env.update(OFFLINE, HF_HOME=hf_home)
  env.pop("HF_HUB_CACHE", None)  # the hub cache is HF_HOME/hub
  return env


def version(exe: str, env: dict) -> str:
  """`exe --version`'s version number ("guidellm version: 0.8.1" -> "0.8.1")."""
  out = subprocess.run([exe, "--version"], capture_output=True, text=True, env=env, timeout=120)
  found = re.findall(r"\d+\.\d+[\w.+-]*", out.stdout + out.stderr)
  if out.returncode or not found:
    raise RuntimeError(f"{exe} --version: exit {out.returncode}: {(out.stdout + out.stderr)[-500:]}")
  return found[-1]


# ----------------------------------------------------------------------------- results


def _mean(metrics: dict, name: str, scale: float = 1.0) -> float | None:
  dist = (metrics.get(name) or {}).get("successful") or {}
  return None if dist.get("mean") is None else dist["mean"] * scale


def parse_guidellm(report: dict) -> list[dict]:
  """guidellm's JSON report -> a summary per benchmark (latencies of the
  successful requests; rates: successful requests per second)."""
  out = []
  for b in report["benchmarks"]:
    m, totals = b["metrics"], b["metrics"]["request_totals"]
    errors = [r.get("info", {}).get("error") for r in b.get("requests", {}).get("errored", [])]
    out.append(dict(
        tool="guidellm", version=report.get("metadata", {}).get("guidellm_version"),
        strategy=b["config"]["strategy"].get("type_"),
        completed=totals["successful"], errored=totals["errored"],
        incomplete=totals["incomplete"], duration_s=b.get("duration"),
        request_throughput_rps=_mean(m, "requests_per_second"),
        ttft_ms_mean=_mean(m, "time_to_first_token_ms"),
        itl_ms_mean=_mean(m, "inter_token_latency_ms"),
        tpot_ms_mean=_mean(m, "time_per_output_token_ms"),
        request_latency_ms_mean=_mean(m, "request_latency", 1000.0),
        output_tokens_per_s=_mean(m, "output_tokens_per_second"),
        prompt_tokens_mean=_mean(m, "prompt_token_count"),
        output_tokens_mean=_mean(m, "output_token_count"),
        errors=sorted({e for e in errors if e})[:5]))
  return out


def _avg(report: dict, name: str) -> float | None:
  return (report.get(name) or {}).get("avg")


def parse_aiperf(report: dict) -> dict:
  """aiperf's profile_export_aiperf.json -> a summary (request_count:
  successful requests; error_request_count is absent when none failed)."""
  errors = report.get("error_summary") or []
  errored = int(_avg(report, "error_request_count") or 0)
  return dict(
      tool="aiperf", version=report.get("aiperf_version"),
      completed=int(_avg(report, "request_count") or 0), errored=errored,
      incomplete=0 if report.get("is_complete") and not report.get("was_cancelled") else None,
      duration_s=_avg(report, "benchmark_duration"),
      request_throughput_rps=_avg(report, "request_throughput"),
      ttft_ms_mean=_avg(report, "time_to_first_token"),
      itl_ms_mean=_avg(report, "inter_token_latency"),
      request_latency_ms_mean=_avg(report, "request_latency"),
      output_tokens_per_s=_avg(report, "output_token_throughput"),
      prompt_tokens_mean=_avg(report, "input_sequence_length"),
      output_tokens_mean=_avg(report, "output_sequence_length"),
      errors=[f"{e['count']} x {e['error_details']}" for e in errors][:5])


def check(summary: dict, expected: int) -> list[str]:
  """Why a run's summary fails, [] if it passes: any errored or
  incomplete request (aiperf: a cancelled or unfinished run), or fewer
  than `expected` requests completed."""
  why = []
  if summary["errored"]:
    why.append(f"{summary['errored']} failed requests: {summary['errors']}")
  if summary["incomplete"] is None:
    why.append("the run was cancelled or did not finish")
  elif summary["incomplete"]:
    why.append(f"{summary['incomplete']} incomplete requests")
  if summary["completed"] != expected:
    why.append(f"{summary['completed']} of {expected} requests completed")
  return why


# ----------------------------------------------------------------------------- running


def shell_line(argv: list[str], env_added: dict) -> str:
  """The command as one shell line, its added environment first."""
  return " ".join([*(f"{k}={shlex.quote(str(v))}" for k, v in env_added.items()),
                   shlex.join(argv)])


def run_tool(argv: list[str], env: dict, cwd: str, log_path: str, timeout_s: float) -> dict:
  """Runs a tool command in a process group of its own (output to
  log_path; the whole group ended after it exits or past timeout_s).
  -> {rc (None past the timeout), seconds, log_tail}."""
  t0 = time.perf_counter()
  with open(log_path, "w") as log:
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
      rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      rc = None
    try:  # the tool's leftover workers (aiperf runs services as processes)
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    proc.wait()
  with open(log_path, errors="replace") as log:
    tail = log.read()[-2000:]
  return dict(rc=rc, seconds=round(time.perf_counter() - t0, 2), log_tail=tail)


def _summarize(tool: str, result_path: pathlib.Path, ran: dict, timeout_s: float) -> tuple:
  """(summary or None, failures) of one tool run from its exit and result file."""
  if ran["rc"] is None:
    return None, [f"ran past {timeout_s} s; its output ended:\n{ran['log_tail']}"]
  if ran["rc"] != 0:
    return None, [f"exited with {ran['rc']}; its output ended:\n{ran['log_tail']}"]
  if not result_path.exists():
    return None, [f"exited 0 but wrote no {result_path.name}; its output ended:\n"
                  f"{ran['log_tail']}"]
  report = json.loads(result_path.read_text())
  if tool == "aiperf":
    return parse_aiperf(report), []
  summaries = parse_guidellm(report)
  if len(summaries) != 1:
    return None, [f"{len(summaries)} benchmarks in its report, not 1"]
  return summaries[0], []


def run_one(tool: str, exe: str, load: Load, *, url: str, tokenizer_dir: str,
            work: pathlib.Path, env: dict, env_added: dict, timeout_s: float,
            continuous_usage: bool = False) -> dict:
  """One tool at one load -> {tool, load, concurrency, requests, command,
  rc, seconds, summary, failures}."""
  stem = work / f"{tool}_{load.name}"
  if tool == "guidellm":
    result = stem.with_suffix(".json")
    argv = guidellm_command(exe, url, tokenizer_dir, load, str(result),
                            continuous_usage=continuous_usage)
  else:
    argv = aiperf_command(exe, url, load, str(stem))
    result = stem / AIPERF_RESULT
  print(f"{tool} {load.name} (concurrency {load.concurrency}, {load.requests} requests) ...",
        flush=True)
  ran = run_tool(argv, env, str(work), str(stem) + ".log", timeout_s)
  summary, failures = _summarize(tool, result, ran, timeout_s)
  if summary is not None:
    failures += check(summary, load.requests)
  return dict(tool=tool, load=load.name, concurrency=load.concurrency, requests=load.requests,
              prompt_tokens=load.prompt_tokens, output_tokens=load.output_tokens,
              command=shell_line(argv, env_added), argv=argv, rc=ran["rc"],
              seconds=ran["seconds"], summary=summary, failures=failures)


# ----------------------------------------------------------------------------- the server


def _health(url: str) -> dict:
  with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
    return json.loads(r.read())


def wait_ready(url: str, *, timeout_s: float, wait_warm: bool, proc=None,
               log_path: str | None = None) -> dict:
  """Waits for /health to answer and (wait_warm) to leave "warming" (the
  background warm-up compiled every plain step program, so no request of
  the runs waits on a compile); it must then say "ok". proc: the server
  process, whose exit ends the wait. -> {port_s, warm_s, health}."""
  t0 = time.perf_counter()
  out = {}
  while True:
    if proc is not None and proc.poll() is not None:
      tail = pathlib.Path(log_path).read_text(errors="replace")[-3000:] if log_path else ""
      raise RuntimeError(f"serve.py exited with {proc.returncode}:\n{tail}")
    if time.perf_counter() - t0 > timeout_s:
      raise TimeoutError(f"{url}: not ready after {timeout_s} s (last: {out})")
    try:
      health = _health(url)
    except (OSError, urllib.error.URLError, ValueError):
      time.sleep(0.2)
      continue
    out.setdefault("port_s", round(time.perf_counter() - t0, 2))
    out["health"] = health
    if not wait_warm or health.get("status") != "warming":
      break
    time.sleep(1.0)
  out["warm_s"] = round(time.perf_counter() - t0, 2)
  if wait_warm and out["health"].get("status") != "ok":
    raise RuntimeError(f"{url}/health: {out['health']} (not ok)")
  return out


class Server:
  """`experiments/serve.py` (the default model unless flags say otherwise)
  on a free port, its output in log_path; stopped on leaving the `with`."""

  def __init__(self, flags=(), *, log_path: str, timeout_s: float = 1800.0,
               wait_warm: bool = True, python: str = sys.executable):
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.argv = [python, "experiments/serve.py", f"--port={self.port}", *flags]
    self.log_path, self.timeout_s, self.wait_warm = log_path, timeout_s, wait_warm
    self.proc = None

  def __enter__(self) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "experiments"),
                                                      env.get("PYTHONPATH")]))
    # A file, not a pipe: a pipe nobody reads while the server runs can fill and stall it.
    with open(self.log_path, "w") as log:
      self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
      ready = wait_ready(self.url, timeout_s=self.timeout_s, wait_warm=self.wait_warm,
                         proc=self.proc, log_path=self.log_path)
    except BaseException:
      self.__exit__()
      raise
    return dict(argv=self.argv, command=shlex.join(self.argv), url=self.url, **ready)

  def __exit__(self, *exc) -> None:
    if self.proc is not None and self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()


class External:
  """A server already running at url (nothing started or stopped)."""

  def __init__(self, url: str, *, timeout_s: float = 1800.0, wait_warm: bool = True):
    self.url, self.timeout_s, self.wait_warm = url.rstrip("/"), timeout_s, wait_warm

  def __enter__(self) -> dict:
    return dict(url=self.url, external=True,
                **wait_ready(self.url, timeout_s=self.timeout_s, wait_warm=self.wait_warm))

  def __exit__(self, *exc) -> None:
    return None


def run(*, tools: dict, loads_: list[Load], work: pathlib.Path, server,
        tokenizer_dir: str, timeout_s: float, continuous_usage: bool = False) -> dict:
  """Each given tool ({name: executable or None}) at each load against the
  server (a `Server` or `External`), after laying out the tokenizer
  (`hf_cache`) in work's private HF_HOME. -> {tools: version or why
  skipped, server, rows, failures}."""
  given = {name: exe for name, exe in tools.items() if exe}
  if not given:
    raise ValueError("no tool given (--guidellm, --aiperf): nothing to run")
  tokenizer_dir = str(pathlib.Path(tokenizer_dir).resolve())
  hf_home = work / "hf_home"
  hf_cache(tokenizer_dir, str(hf_home / "hub"))
  env = tool_env(str(hf_home))
  env_added = {**OFFLINE, "HF_HOME": str(hf_home)}
  info = {name: (dict(executable=exe, version=version(exe, env)) if exe else
                 dict(skipped=f"no --{name} given")) for name, exe in tools.items()}
  with server as served:
    rows = [run_one(name, exe, load, url=served["url"], tokenizer_dir=tokenizer_dir,
                    work=work, env=env, env_added=env_added, timeout_s=timeout_s,
                    continuous_usage=continuous_usage)
            for name, exe in given.items() for load in loads_]
  failures = [f"{r['tool']} {r['load']}: {why}" for r in rows for why in r["failures"]]
  return dict(tools=info, server=served, rows=rows, failures=failures,
              tokenizer_dir=tokenizer_dir, hf_home=str(hf_home))
