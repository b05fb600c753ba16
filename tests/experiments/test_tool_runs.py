"""`benchlib.tool_runs` (experiments/tool_runs.py) without guidellm, aiperf
or the real server: each tool's result file as the tool wrote it is read
back into the summary, and a failed, incomplete or missing request fails
it; the commands are built with the local tokenizer and the load; aiperf's
tokenizer is found where aiperf looks offline (`hf_cache`); a tool that
fails, or writes no result, fails its row with its output; and `run`
drives stand-in tools (small scripts writing the captured files) against a
stand-in /health.

The fixtures (tests/experiments/fixtures/tool_runs/) are the tools' own
files from real runs against serve.py on the 2-core machine, trimmed to the
keys the parsers read (values untouched): guidellm 0.8.1's and aiperf
0.13.0's concurrent loads of experiments/tool_runs.py's run (32 of 32
requests each), guidellm before the continuous_usage_stats workaround
(every request a 400) and aiperf with --request-cancellation-rate 50 (2 of 6
requests cancelled; aiperf exits 0 all the same).
"""

from __future__ import annotations

import http.server
import json
import pathlib
import sys
import threading

import huggingface_hub
import pytest
from huggingface_hub.errors import HFValidationError

from benchlib import tool_runs

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "tool_runs"
TOKENIZER = tool_runs.ROOT / "jaxinfer" / "default_model"
LOAD = tool_runs.Load("concurrent", 4, 32, 64, 32)


def _fixture(name: str) -> dict:
  return json.loads((FIXTURES / name).read_text())


def test_guidellm_report_of_a_real_run_parses_and_passes():
  [s] = tool_runs.parse_guidellm(_fixture("guidellm_concurrent_ok.json"))
  assert s["tool"] == "guidellm" and s["version"] == "0.8.1" and s["strategy"] == "concurrent"
  assert (s["completed"], s["errored"], s["incomplete"]) == (32, 0, 0)
  assert s["request_throughput_rps"] == pytest.approx(16.994, rel=1e-3)
  assert s["ttft_ms_mean"] == pytest.approx(68.806, rel=1e-3)
  assert s["itl_ms_mean"] == pytest.approx(4.777, rel=1e-3)
  assert s["output_tokens_per_s"] == pytest.approx(561.358, rel=1e-3)
  assert s["request_latency_ms_mean"] == pytest.approx(218.871, rel=1e-3)  # seconds -> ms
  assert (s["prompt_tokens_mean"], s["output_tokens_mean"]) == (64.0, 32.0)
  assert tool_runs.check(s, 32) == []
  assert tool_runs.check(s, 33) == ["32 of 33 requests completed"]


def test_guidellm_report_with_every_request_refused_fails_naming_the_400():
  [s] = tool_runs.parse_guidellm(_fixture("guidellm_all_400.json"))
  assert (s["completed"], s["errored"]) == (0, 5)
  why = tool_runs.check(s, 5)
  assert len(why) == 2, why
  assert why[0].startswith("5 failed requests") and "400 Bad Request" in why[0]
  assert why[1] == "0 of 5 requests completed"


def test_aiperf_report_of_a_real_run_parses_and_passes():
  s = tool_runs.parse_aiperf(_fixture("aiperf_concurrent_ok.json"))
  assert s["tool"] == "aiperf" and s["version"] == "0.13.0"
  assert (s["completed"], s["errored"], s["incomplete"]) == (32, 0, 0)
  assert s["request_throughput_rps"] == pytest.approx(16.80, rel=1e-3)
  assert s["ttft_ms_mean"] == pytest.approx(74.48, rel=1e-3)
  assert s["itl_ms_mean"] == pytest.approx(4.782, rel=1e-3)
  assert s["output_tokens_per_s"] == pytest.approx(537.58, rel=1e-3)
  assert (s["prompt_tokens_mean"], s["output_tokens_mean"]) == (64.0, 32.0)
  assert tool_runs.check(s, 32) == []


def test_aiperf_report_with_failed_requests_fails_though_aiperf_exited_0():
  s = tool_runs.parse_aiperf(_fixture("aiperf_cancelled.json"))
  assert (s["completed"], s["errored"]) == (4, 2)
  why = tool_runs.check(s, 6)
  assert why[0].startswith("2 failed requests") and "RequestCancellationError" in why[0]
  assert why[1:] == ["4 of 6 requests completed"]


@pytest.mark.parametrize("change, reason", [
    (dict(errored=1), "1 failed requests"),
    (dict(incomplete=2), "2 incomplete requests"),
    (dict(incomplete=None), "the run was cancelled or did not finish"),
    (dict(completed=31), "31 of 32 requests completed"),
])
def test_one_failed_or_missing_request_fails_a_passing_summary(change, reason):
  s = tool_runs.parse_aiperf(_fixture("aiperf_concurrent_ok.json"))
  assert tool_runs.check(s, 32) == []
  why = tool_runs.check({**s, **change}, 32)
  assert why and why[0].startswith(reason), why


def test_an_unfinished_aiperf_run_has_no_incomplete_count():
  report = {**_fixture("aiperf_concurrent_ok.json"), "was_cancelled": True}
  assert tool_runs.parse_aiperf(report)["incomplete"] is None
  report = {**_fixture("aiperf_concurrent_ok.json"), "is_complete": False}
  assert tool_runs.check(tool_runs.parse_aiperf(report), 32) == [
      "the run was cancelled or did not finish"]


def _options(argv: list[str]) -> dict:
  """--flag value pairs of a command (flags without a value map to True)."""
  out, i = {}, 0
  while i < len(argv):
    if argv[i].startswith("--"):
      has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
      out[argv[i]] = argv[i + 1] if has_value else True
      i += 2 if has_value else 1
    else:
      i += 1
  return out


def test_guidellm_command_names_the_local_tokenizer_the_load_and_drops_continuous_usage():
  sync = tool_runs.loads(20, 3, 48, 16)[0]
  argv = tool_runs.guidellm_command("/v/bin/guidellm", "http://127.0.0.1:9", "/tok", sync,
                                    "/w/out.json")
  assert argv[:2] == ["/v/bin/guidellm", "run"]
  o = _options(argv)
  assert json.loads(o["--backend"]) == dict(
      kind="openai_http", target="http://127.0.0.1:9", model="default",
      request_format="/v1/completions",
      extras={"body": {"stream_options": {"continuous_usage_stats": None}}})
  assert o["--profile"] == "kind=synchronous"
  assert o["--constraint"] == "kind=max_requests,count=20"
  assert o["--data"] == "kind=synthetic_text,prompt_tokens=48,output_tokens=16"
  assert o["--tokenizer"] == "kind=huggingface_auto,model=/tok"
  assert o["--output"] == "kind=json,path=/w/out.json"
  conc = tool_runs.guidellm_command("g", "u", "/tok", LOAD, "o", continuous_usage=True)
  assert _options(conc)["--profile"] == "kind=concurrent,streams=4"
  assert "extras" not in json.loads(_options(conc)["--backend"])


def test_aiperf_command_names_the_cached_tokenizer_id_and_the_load():
  argv = tool_runs.aiperf_command("/v/bin/aiperf", "http://127.0.0.1:9", LOAD, "/w/a")
  assert argv[:2] == ["/v/bin/aiperf", "profile"]
  o = _options(argv)
  assert o["--tokenizer"] == tool_runs.REPO_ID == "jaxinfer/default_model"
  assert (o["--model"], o["--url"], o["--endpoint-type"]) == (
      "default", "http://127.0.0.1:9", "completions")
  assert o["--streaming"] is True and o["--extra-inputs"] == "ignore_eos:true"
  assert (o["--concurrency"], o["--request-count"]) == ("4", "32")
  assert (o["--synthetic-input-tokens-mean"], o["--synthetic-input-tokens-stddev"]) == ("64", "0")
  assert (o["--output-tokens-mean"], o["--output-tokens-stddev"]) == ("32", "0")
  assert o["--artifact-dir"] == "/w/a" and o["--no-gpu-telemetry"] is True


def test_loads_are_synchronous_then_concurrent():
  assert [(x.name, x.concurrency) for x in tool_runs.loads(8, 1, 4, 4)] == [("synchronous", 1)]
  assert [(x.name, x.concurrency) for x in tool_runs.loads(8, 2, 4, 4)] == [
      ("synchronous", 1), ("concurrent", 2)]
  with pytest.raises(ValueError, match="requests"):
    tool_runs.loads(0, 2, 4, 4)


def test_hf_cache_is_where_an_offline_snapshot_download_finds_the_tokenizer(tmp_path):
  # aiperf offline calls snapshot_download(name, local_files_only=True): a
  # directory path is no repo id ...
  with pytest.raises(HFValidationError):
    huggingface_hub.snapshot_download(str(TOKENIZER), local_files_only=True,
                                      cache_dir=str(tmp_path / "hub"))
  # ... and the laid-out cache resolves the repo id to the same files.
  snapshot = tool_runs.hf_cache(str(TOKENIZER), str(tmp_path / "hub"))
  found = huggingface_hub.snapshot_download(tool_runs.REPO_ID, local_files_only=True,
                                            cache_dir=str(tmp_path / "hub"))
  assert pathlib.Path(found) == pathlib.Path(snapshot)
  for name in tool_runs.TOKENIZER_FILES:
    assert (pathlib.Path(found) / name).read_bytes() == (TOKENIZER / name).read_bytes()


def test_tool_env_is_offline_with_its_own_hf_home():
  env = tool_runs.tool_env("/w/hf", {"PATH": "/bin", "HF_HUB_CACHE": "/elsewhere"})
  assert env == {"PATH": "/bin", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                 "HF_HOME": "/w/hf"}


# A stand-in tool: `--version` prints one; a run writes FIXTURE where the
# command asks for the tool's result (or nothing when FIXTURE is empty),
# records the offline variables it saw, prints a line and exits with RC.
_FAKE = """#!{python}
import json, os, pathlib, shutil, sys
args = sys.argv[1:]
if args == ["--version"]:
  print("{name} version: 9.8.7")
  sys.exit({version_rc})
opts = dict(zip(args, args[1:]))
if "{fixture}":
  if "--output" in opts:
    dst = pathlib.Path(opts["--output"].split("path=")[1])
  else:
    dst = pathlib.Path(opts["--artifact-dir"]) / "profile_export_aiperf.json"
  dst.parent.mkdir(parents=True, exist_ok=True)
  shutil.copyfile("{fixture}", dst)
seen = {{k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME")}}
pathlib.Path("{name}_env.json").write_text(json.dumps(seen))
print("{name} says: a line of its own output")
sys.exit({rc})
"""


def _fake(tmp_path, name, fixture="", rc=0, version_rc=0) -> str:
  path = tmp_path / f"fake_{name}"
  path.write_text(_FAKE.format(python=sys.executable, name=name, rc=rc, version_rc=version_rc,
                               fixture=fixture and str(FIXTURES / fixture)))
  path.chmod(0o755)
  return str(path)


def _run_one(tmp_path, tool, exe):
  return tool_runs.run_one(tool, exe, LOAD, url="http://127.0.0.1:9", tokenizer_dir="/tok",
                           work=tmp_path, env=tool_runs.tool_env(str(tmp_path / "hf")),
                           env_added={"HF_HUB_OFFLINE": "1"}, timeout_s=60)


def test_a_tool_that_exits_non_zero_fails_its_row_with_its_output(tmp_path):
  row = _run_one(tmp_path, "aiperf", _fake(tmp_path, "aiperf", "aiperf_concurrent_ok.json", rc=3))
  assert row["rc"] == 3 and row["summary"] is None
  [why] = row["failures"]
  assert why.startswith("exited with 3") and "aiperf says: a line of its own output" in why


def test_a_tool_that_exits_0_without_its_result_file_fails(tmp_path):
  row = _run_one(tmp_path, "guidellm", _fake(tmp_path, "guidellm"))
  assert row["rc"] == 0 and row["summary"] is None
  assert row["failures"][0].startswith("exited 0 but wrote no guidellm_concurrent.json")


def test_a_tool_past_its_time_limit_is_stopped_and_fails(tmp_path):
  slow = tmp_path / "slow_tool"
  slow.write_text(f"#!{sys.executable}\nimport time\nprint('started', flush=True)\n"
                  "time.sleep(60)\n")
  slow.chmod(0o755)
  ran = tool_runs.run_tool([str(slow)], {}, str(tmp_path), str(tmp_path / "slow.log"), 1.0)
  assert ran["rc"] is None and ran["seconds"] < 30 and "started" in ran["log_tail"]


def test_version_reads_the_number_and_fails_on_an_error(tmp_path):
  assert tool_runs.version(_fake(tmp_path, "guidellm"), {}) == "9.8.7"
  with pytest.raises(RuntimeError, match="--version: exit 2"):
    tool_runs.version(_fake(tmp_path, "aiperf", version_rc=2), {})


class _Health(http.server.BaseHTTPRequestHandler):
  """/health: "warming" for the first `warming` answers, then `final`."""
  warming, final = 2, "ok"

  def do_GET(self):
    server = self.server
    server.calls += 1
    status = "warming" if server.calls <= self.warming else self.final
    body = json.dumps(dict(status=status)).encode()
    self.send_response(200)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)

  def log_message(self, *args):
    pass


@pytest.fixture
def health():
  """A stand-in server's /health on a free port: its URL and handler class."""
  handler = type("Health", (_Health,), {})
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  server.calls = 0
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield f"http://127.0.0.1:{server.server_address[1]}", handler
  server.shutdown()
  server.server_close()


def test_wait_ready_waits_out_the_warm_up_and_refuses_a_server_not_ok(health):
  url, handler = health
  ready = tool_runs.wait_ready(url, timeout_s=30, wait_warm=True)
  assert ready["health"] == {"status": "ok"} and ready["warm_s"] >= ready["port_s"]
  handler.final = "degraded"
  with pytest.raises(RuntimeError, match="degraded"):
    tool_runs.wait_ready(url, timeout_s=30, wait_warm=True)


def test_run_drives_each_tool_at_each_load_and_collects_the_failures(tmp_path, health):
  url, handler = health
  handler.warming = 0
  tools = dict(guidellm=_fake(tmp_path, "guidellm", "guidellm_concurrent_ok.json"),
               aiperf=_fake(tmp_path, "aiperf", "aiperf_cancelled.json"))
  r = tool_runs.run(tools=tools, loads_=[LOAD], work=tmp_path, tokenizer_dir=str(TOKENIZER),
                    server=tool_runs.External(url, timeout_s=30), timeout_s=60)
  assert r["tools"] == {name: dict(executable=exe, version="9.8.7") for name, exe in tools.items()}
  assert [(row["tool"], row["load"]) for row in r["rows"]] == [
      ("guidellm", "concurrent"), ("aiperf", "concurrent")]
  guidellm, aiperf = r["rows"]
  assert guidellm["failures"] == [] and guidellm["summary"]["completed"] == 32
  assert guidellm["command"].startswith(
      f"HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME={tmp_path / 'hf_home'} {tools['guidellm']}"
      " run --backend")
  assert [f.split(":")[0] for f in r["failures"]] == ["aiperf concurrent"] * 2
  assert "2 failed requests" in r["failures"][0] and "4 of 32" in r["failures"][1]
  # The tools ran offline, with the run's own HF_HOME holding the tokenizer as a cache.
  for name in tools:
    seen = json.loads((tmp_path / f"{name}_env.json").read_text())
    assert seen == dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                        HF_HOME=str(tmp_path / "hf_home"))
  assert (tmp_path / "hf_home" / "hub" / "models--jaxinfer--default_model" / "refs" /
          "main").read_text() == "local"


def test_a_tool_not_given_is_skipped_and_said_so(tmp_path, health):
  url, handler = health
  handler.warming = 0
  tools = dict(guidellm=_fake(tmp_path, "guidellm", "guidellm_concurrent_ok.json"), aiperf=None)
  r = tool_runs.run(tools=tools, loads_=[LOAD], work=tmp_path, tokenizer_dir=str(TOKENIZER),
                    server=tool_runs.External(url, timeout_s=30), timeout_s=60)
  assert r["tools"]["aiperf"] == dict(skipped="no --aiperf given")
  assert [row["tool"] for row in r["rows"]] == ["guidellm"] and r["failures"] == []


def test_run_with_no_tool_given_refuses_before_starting_anything(tmp_path):
  with pytest.raises(ValueError, match="nothing to run"):
    tool_runs.run(tools=dict(guidellm=None, aiperf=None), loads_=[LOAD], work=tmp_path,
                  tokenizer_dir=str(TOKENIZER), server=None, timeout_s=60)
  assert not (tmp_path / "hf_home").exists()
