"""Two processes on localhost form one 8-device mesh (4 CPU devices each) and
reproduce the single-process logits and greedy tokens. Bounded: a hung or
failed worker fails the test, never the suite."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
from conftest import subprocess_env

WORKER = pathlib.Path(__file__).parent / "multihost_worker.py"
TIMEOUT_S = 300


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_process_mesh_matches_single_process(tmp_path):
  port = _free_port()
  env = subprocess_env(JAX_PLATFORMS="cpu")
  outs = [tmp_path / f"p{i}.json" for i in range(2)]
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port), str(outs[i])],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for i in range(2)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=TIMEOUT_S)[0].decode(errors="replace"))
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail(f"multi-process workers did not finish within {TIMEOUT_S} s")
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  for out in outs:
    r = json.loads(out.read_text())
    assert r["num_devices"] == 8 and r["local_devices"] == 4
    assert r["max_rel"] < 1e-5, r
    assert r["tokens_equal"], r
