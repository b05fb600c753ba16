"""The vLLM comparison's plumbing (no vLLM here, no timing asserts): the
streaming client against our own server, the medians and ratios, the
peer's environment, and the peer protocol over a stand-in peer script."""

import os
import socket
import sys
import textwrap
import threading
import time

import jax
import pytest
import uvicorn

from benchlib import vllm_compare as vc
from jaxinfer import Engine, EngineConfig, SamplingParams, models, presets
from jaxinfer.serving.http_server import make_app
from jaxinfer.tokenizer import ByteTokenizer


def _free_port() -> int:
  s = socket.socket()
  s.bind(("127.0.0.1", 0))
  port = s.getsockname()[1]
  s.close()
  return port


def test_streaming_client_gets_the_engines_greedy_tokens_and_ttfts():
  cfg = presets.get("tiny_dense")
  params = models.init_params(cfg, jax.random.key(0))
  ref_engine = Engine(cfg, params, EngineConfig(num_pages=64, max_num_seqs=4,
                                                enable_prefix_caching=False))
  prompts = vc.random_prompts(5, 9, cfg.vocab_size, seed=1)
  want = [list(o.token_ids) for o in ref_engine.generate(
      prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))]
  ref_engine.release()
  engine = Engine(cfg, params, EngineConfig(num_pages=64, max_num_seqs=4,
                                            enable_prefix_caching=False))
  port = _free_port()
  server = uvicorn.Server(uvicorn.Config(make_app(engine, ByteTokenizer(), "bench"),
                                         host="127.0.0.1", port=port, log_level="warning"))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  try:
    deadline = time.monotonic() + 60
    while not server.started:
      assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
      time.sleep(0.05)
    run = vc.serve_run(port, "bench", prompts, 6, concurrency=2)
  finally:
    server.should_exit = True
    thread.join(timeout=30)
  assert run["tokens"] == want
  assert all(t is not None and 0 < t <= run["seconds"] for t in run["ttft"])
  assert run["cpu_seconds"] >= 0


def test_summary_medians_and_ratios():
  rows = []
  for r, (ours, theirs) in enumerate([(10.0, 20.0), (12.0, 18.0), (11.0, 30.0)]):
    for side, sec in (("jaxinfer", ours), ("vllm", theirs)):
      rows.append(dict(workload="batch32", side=side, vllm_cores="all", repeat=r,
                       seconds=sec, cpu_seconds=2 * sec, tokens_per_s=100 / sec,
                       tokens_per_cpu_s=50 / sec, identical=4, sequences=4))
  (s,) = vc.summarize(rows)
  assert s["ours"]["tokens_per_s"] == pytest.approx(100 / 11)
  assert s["vllm"]["tokens_per_s"] == pytest.approx(100 / 20)
  assert s["throughput_ratio"] == pytest.approx(20 / 11)
  assert s["per_cpu_second_ratio"] == pytest.approx(20 / 11)
  assert s["ours"]["identical"] == "12/12"


def test_peer_environment():
  env = vc.peer_env("all")
  assert "VIRTUAL_ENV" not in env and "PYTHONPATH" not in env
  assert env["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{os.cpu_count() - 1}"
  assert "VLLM_CPU_OMP_THREADS_BIND" not in vc.peer_env("default")
  with pytest.raises(ValueError, match="cores"):
    vc.peer_env("some")


def test_offline_peer_protocol_skips_log_lines(tmp_path, monkeypatch):
  """VllmOffline reads only marked lines (vLLM logs to stdout too) and
  names the log when the peer dies."""
  stub = tmp_path / "peer.py"
  stub.write_text(textwrap.dedent(f"""
      import json, sys
      print("INFO some vLLM log line", flush=True)
      print({vc.MARK!r} + json.dumps({{"ready": True}}), flush=True)
      for line in sys.stdin:
        if line.strip() == "quit":
          break
        p = json.loads(line)["prompts"]
        if p == [[666]]:
          sys.exit(3)
        print("INFO generating", flush=True)
        print({vc.MARK!r} + json.dumps({{"seconds": 0.5, "tokens": [x[::-1] for x in p]}}),
              flush=True)
      """))
  monkeypatch.setattr(vc, "PEER", str(stub))
  log = tmp_path / "peer.log"
  peer = vc.VllmOffline(sys.executable, "unused", dtype="float32", max_tokens=4,
                        cores="default", log_path=str(log), memory_utilization=0.4)
  assert peer.generate([[1, 2, 3], [4]]) == (0.5, [[3, 2, 1], [4]])
  with pytest.raises(RuntimeError, match="peer.log"):
    peer.generate([[666]])
  peer.close()
  assert "INFO generating" in log.read_text()
