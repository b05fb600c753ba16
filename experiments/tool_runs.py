"""guidellm and aiperf against the default model with local files only
(`benchlib.tool_runs`): `experiments/serve.py` started on a free port and
warmed up, then each tool (from its own virtualenv, given by path) runs a
short synchronous and a concurrent load of streamed completions of
synthetic text, counted by the tokenizer files in jaxinfer/default_model/,
with HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1. Each tool's own result
file is read back: requests completed and failed, request throughput, TTFT
and ITL means, output tokens/s. A tool that fails, or any failed,
incomplete or missing request, exits non-zero with the reason.

  python experiments/tool_runs.py --guidellm=/tmp/venv_guidellm/bin/guidellm --aiperf=/tmp/venv_aiperf/bin/aiperf
  python experiments/tool_runs.py --aiperf=/tmp/venv_aiperf/bin/aiperf --requests=20 --concurrency=2
  python experiments/tool_runs.py --guidellm=... --server_url=http://127.0.0.1:8000   # a running server

The tools install into virtualenvs of their own, e.g.
`python3.12 -m venv /tmp/venv_guidellm && /tmp/venv_guidellm/bin/pip install guidellm`
(and the same for aiperf). A tool not given is skipped, and the result says so.

Writes experiments/results/tool_runs_<machine>_<date>.json (a failed run:
..._failed.json).
"""

import datetime
import os
import pathlib
import tempfile

from absl import flags

from benchlib import cli, flag_config, results, tool_runs
from benchlib.results import machine_info

_GUIDELLM = flags.DEFINE_string("guidellm", None, "the guidellm executable (its virtualenv's "
                                "bin/guidellm; None: guidellm is skipped)")
_AIPERF = flags.DEFINE_string("aiperf", None, "the aiperf executable (its virtualenv's "
                              "bin/aiperf; None: aiperf is skipped)")
_REQUESTS = flags.DEFINE_integer("requests", 32, "requests per tool and load")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 4, "requests at once in the concurrent load "
                                    "(1: the synchronous load only)")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 64, "tokens per synthetic prompt")
_OUTPUT = flags.DEFINE_integer("output_tokens", 32, "tokens generated per request (ignore_eos)")
_TOKENIZER = flags.DEFINE_string("tokenizer_dir", "jaxinfer/default_model", "the Hugging Face "
                                 "tokenizer files the tools count tokens with (relative to the "
                                 "repository)")
_SERVE_FLAGS = flags.DEFINE_list("serve_flags", [], "flags passed on to serve.py")
_SERVER_URL = flags.DEFINE_string("server_url", None, "a server already running there instead "
                                  "of starting serve.py")
_WAIT_WARM = flags.DEFINE_bool("wait_warm", True, "start the tools once /health says ok (the "
                               "background warm-up done), not while it says warming")
_START_TIMEOUT = flags.DEFINE_float("start_timeout_s", 1800.0, "longest wait for the server's "
                                    "port and warm-up")
_TIMEOUT = flags.DEFINE_float("timeout_s", 600.0, "longest run of one tool at one load")
_CONTINUOUS = flags.DEFINE_bool("guidellm_continuous_usage", True, "let guidellm send "
                                "stream_options.continuous_usage_stats (vLLM's per-chunk "
                                "usage, which serve.py serves); off: the command drops it (for "
                                "a server that refuses the field)")
_ARTIFACTS = flags.DEFINE_string("artifacts_dir", None, "keep the tools' own files and logs "
                                 "and the server's log here (default: a temporary folder, "
                                 "removed)")
_MACHINE = flags.DEFINE_string("machine", "epyc2c", "short machine name for the output file")
_OUT = flags.DEFINE_string("out", None, "output prefix (default "
                           "experiments/results/tool_runs_<machine>_<date>)")
_CONFIG = flag_config.define_config(__file__)


def _fmt(v, spec: str) -> str:
  return "-" if v is None else format(v, spec)


def _print(r: dict) -> None:
  for name, t in r["tools"].items():
    print(f"{name}: {t.get('version') or t['skipped']}")
  print("| tool | load | completed | errored | req/s | TTFT ms | ITL ms | output tok/s |")
  print("|---|---|---|---|---|---|---|---|")
  for row in r["rows"]:
    s = row["summary"] or {}
    print(f"| {row['tool']} | {row['load']} ({row['concurrency']}) | "
          f"{s.get('completed', '-')}/{row['requests']} | {s.get('errored', '-')} | "
          f"{_fmt(s.get('request_throughput_rps'), '.2f')} | "
          f"{_fmt(s.get('ttft_ms_mean'), '.1f')} | {_fmt(s.get('itl_ms_mean'), '.2f')} | "
          f"{_fmt(s.get('output_tokens_per_s'), '.1f')} |")


def _run(work: pathlib.Path) -> dict:
  loads = tool_runs.loads(_REQUESTS.value, _CONCURRENCY.value, _PROMPT.value, _OUTPUT.value)
  tokenizer = tool_runs.ROOT / _TOKENIZER.value
  if _SERVER_URL.value:
    server = tool_runs.External(_SERVER_URL.value, timeout_s=_START_TIMEOUT.value,
                                wait_warm=_WAIT_WARM.value)
  else:
    server = tool_runs.Server(_SERVE_FLAGS.value, log_path=str(work / "serve.log"),
                              timeout_s=_START_TIMEOUT.value, wait_warm=_WAIT_WARM.value)
  return tool_runs.run(tools=dict(guidellm=_GUIDELLM.value, aiperf=_AIPERF.value),
                       loads_=loads, work=work, server=server, tokenizer_dir=str(tokenizer),
                       timeout_s=_TIMEOUT.value, continuous_usage=_CONTINUOUS.value)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  load_before = os.getloadavg()
  if _ARTIFACTS.value:
    os.makedirs(_ARTIFACTS.value, exist_ok=True)
    r = _run(pathlib.Path(_ARTIFACTS.value).resolve())
  else:
    with tempfile.TemporaryDirectory(prefix="tool_runs_") as work:
      r = _run(pathlib.Path(work))
  _print(r)
  today = datetime.date.today().isoformat()
  prefix = _OUT.value or f"experiments/results/tool_runs_{_MACHINE.value}_{today}"
  results.write(prefix + ("_failed" if r["failures"] else ""), r["rows"], None,
                ok=not r["failures"], failures=r["failures"], tools=r["tools"],
                server=r["server"], tokenizer_dir=_TOKENIZER.value,
                environment=dict(tool_runs.OFFLINE, HF_HOME="a folder of the run's own "
                                 "(its hub/ holds only the tokenizer, as aiperf's cache)"),
                machine=machine_info(),
                load_average=dict(before=load_before, after=os.getloadavg()),
                note="per row: the exact command (the temporary folder it ran in named in "
                     "it) and the tool's own figures read from its result file: completed, "
                     "errored, incomplete requests; request throughput (req/s), TTFT, ITL, "
                     "TPOT and request latency means (ms) and output tokens/s; guidellm's "
                     "are its successful requests' statistics. The tools ran on the same "
                     "2 cores as the server.")
  if r["failures"]:
    raise SystemExit("tool_runs failed:\n- " + "\n- ".join(r["failures"]))


if __name__ == "__main__":
  cli.run(main)
