"""The C++ CPU kernels say what they do: `Engine(...)` builds and times
nothing (the kernels build on first use or when asked, the weight-layout
probe is read from disk); without a compiler the Engine runs XLA with one
warning naming why, the same greedy tokens, and `stats()` saying so."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import jaxinfer
from jaxinfer import ops
from jaxinfer.engine import Engine, EngineConfig, SamplingParams, weight_layout
import native_kernels as cpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(page_size=16, num_pages=48, max_num_seqs=4, max_num_batched_tokens=64)
NATIVE_RUN = dict(unroll_layers=True, cpu_weight_layout="in_out", **SMALL)  # split experts: C++
PROMPTS = ["def main(", "import os\n", "class Pool:"]


def _greedy(engine, tokenizer):
  sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
  return [o.token_ids for o in engine.generate([tokenizer.encode(p) for p in PROMPTS], sp)]


def _forbid(monkeypatch):
  """Counts every way `Engine(...)` could build or time: the kernels' build
  and load, the layout probe's timing."""
  calls = []
  for mod, name in ((cpu, "_load"), (cpu, "_build"), (weight_layout, "measure"),
                    (weight_layout, "probe")):
    monkeypatch.setattr(mod, name, lambda *a, _n=name, **k: calls.append(_n))
  return calls


def test_the_engine_builds_and_times_nothing(monkeypatch, tmp_path):
  monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path))  # no probe on disk
  monkeypatch.setattr(weight_layout, "MIN_PROBE_BYTES", 0)  # the tiny model would be probed
  monkeypatch.setattr(cpu, "_state", {"reason": None, "tiled": False, "loaded": False})
  calls = _forbid(monkeypatch)
  cfg, params, _ = jaxinfer.load_default_model()
  auto = Engine(cfg, params, EngineConfig(unroll_layers=True, **SMALL))
  assert auto._form.out_major and weight_layout.UNPROBED == "out_major"  # no probe: untimed
  panels = Engine(cfg, params, EngineConfig(unroll_layers=True, cpu_weight_layout="panels", **SMALL))
  assert panels._form.panels
  for eng in (auto, panels):
    kernels = eng.stats()["kernels"]
    assert kernels["cpu_kernels"] == kernels["cpu_experts"] == "native on first use"
  # A probe on disk (this machine's key) decides "auto", still with no timing.
  d_in, d_out = weight_layout.probe_shape(cfg)
  ms = {k: {r: (1.0 if k == "out_in" else 2.0) for r in weight_layout.PROBE_ROWS}
        for k in ("in_out", "out_in", "out_major", "panels")}
  weight_layout.probe_path().parent.mkdir(parents=True)
  weight_layout.probe_path().write_text(json.dumps({f"{d_in}x{d_out}": {"ms": ms}}))
  probed = Engine(cfg, params, EngineConfig(unroll_layers=True, **SMALL))._form
  assert probed.transposed and not (probed.out_major or probed.floats_in_out or probed.panels)
  assert calls == []


def test_the_probe_is_kept_beside_the_library_under_its_key(monkeypatch, tmp_path):
  monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path))
  cfg = jaxinfer.presets.get("bench_dense")
  fake = {"layout": "out_in", "ms": {k: {r: 1.0 + (k != "out_in") for r in (1, 8, 32)}
                                     for k in ("in_out", "out_in", "out_major")}}
  monkeypatch.setattr(weight_layout, "measure", lambda d_in, d_out: fake)
  monkeypatch.setattr(cpu, "build", lambda: True)
  assert weight_layout.resolve(cfg, "auto") == weight_layout.UNPROBED
  assert weight_layout.probe(cfg) == fake
  path = weight_layout.probe_path()
  assert path.parent == cpu.library_path().parent and path.name.startswith(
      cpu.library_path().stem)
  assert weight_layout.resolve(cfg, "auto") == "out_in"
  monkeypatch.setenv("CXX", sys.executable)  # another compiler: another key, the probe unseen
  assert weight_layout.probe_path() != path
  assert weight_layout.resolve(cfg, "auto") == weight_layout.UNPROBED


_NO_COMPILER = textwrap.dedent("""
    import json, warnings
    import jaxinfer
    from jaxinfer.engine import Engine, EngineConfig, SamplingParams
    import native_kernels as cpu
    cfg, params, tok = jaxinfer.load_default_model()
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter("always")
      eng = Engine(cfg, params, EngineConfig(**{config}))
      before = eng.stats()["kernels"]
      sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
      outs = eng.generate([tok.encode(p) for p in {prompts}], sp)
      cpu.available()
      after = eng.stats()["kernels"]
    print(json.dumps(dict(tokens=[o.token_ids for o in outs], before=before, after=after,
                          warnings=[str(w.message) for w in seen if "native_kernels" in str(w.message)])))
""")


def _no_compiler_env(tmp_path):
  empty = tmp_path / "bin"
  empty.mkdir()
  env = {k: v for k, v in os.environ.items() if k not in ("CXX", "JAXINFER_NATIVE")}
  return dict(env, PATH=str(empty), JAXINFER_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu",
              PYTHONPATH=ROOT)


def test_without_a_compiler_the_engine_runs_xla_with_one_warning(tmp_path):
  env = _no_compiler_env(tmp_path)
  script = _NO_COMPILER.format(config=NATIVE_RUN, prompts=PROMPTS)
  done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True,
                        text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  got = json.loads(done.stdout.strip().splitlines()[-1])
  reason = cpu.NO_COMPILER
  assert got["warnings"] == [f"native_kernels: the C++ CPU kernels are unavailable "
                             f"({reason}); their ops run on XLA instead"]
  assert got["before"]["cpu_kernels"] == got["after"]["cpu_kernels"] == f"xla: {reason}"
  assert got["after"]["cpu_experts"] == f"xla: {reason}"
  # The same greedy tokens as the native kernels give, here.
  assert cpu.available(), cpu.unavailable_reason()
  cfg, params, tok = jaxinfer.load_default_model()
  native = Engine(cfg, params, EngineConfig(**NATIVE_RUN))
  assert native.stats()["kernels"]["cpu_kernels"] == "native"
  assert got["tokens"] == _greedy(native, tok)
  # The explicit build says the same, and fails.
  built = subprocess.run([sys.executable, "-m", "native_kernels"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
  assert built.returncode == 1 and built.stdout.strip() == f"xla: {reason}", built.stdout


@pytest.mark.parametrize("disabled", [True, False])
def test_status_and_precheck_build_nothing(monkeypatch, tmp_path, disabled):
  monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path))
  monkeypatch.setattr(cpu, "_state", {"reason": None, "tiled": False, "loaded": False})
  calls = _forbid(monkeypatch)
  if disabled:
    monkeypatch.setenv("JAXINFER_NATIVE", "0")
    assert cpu.status() == "xla: JAXINFER_NATIVE=0" == f"xla: {cpu.precheck()}"
    assert ops.cpu_experts_choice(True) == "xla: JAXINFER_NATIVE=0"
    with pytest.raises(ValueError, match="panels.*JAXINFER_NATIVE=0"):
      weight_layout.resolve(jaxinfer.presets.get("tiny_moe"), "panels")
  else:
    monkeypatch.delenv("JAXINFER_NATIVE", raising=False)
    assert cpu.status() == "native on first use" and cpu.precheck() is None
    assert weight_layout.resolve(jaxinfer.presets.get("tiny_moe"), "panels") == "panels"
  assert ops.cpu_experts_choice(False) == "xla"
  assert calls == []
