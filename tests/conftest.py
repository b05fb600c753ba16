"""Test setup: 8 simulated CPU devices (before jax is imported), float32.

Each compiled XLA:CPU program holds its machine code in memory maps of its
own, and jax keeps every program it compiled. A test worker that compiles a
thousand programs passes Linux's vm.max_map_count (65530): XLA:CPU's next
compile then fails to map memory and segfaults (docs/known_issues.md). So
between tests, a worker past half that many maps drops jax's compiled
programs (`jax.clear_caches`); later tests compile what they need again.

No persistent XLA compilation cache: reading executables back from it
segfaulted XLA:CPU inside `compilation_cache.get_executable_and_time`
(sharded engine programs, xdist workers sharing the cache).

Tests compile with LLVM's optimisation level 0: much of the suite's time
is XLA:CPU compiling small programs that then run a few steps. The jax flag
`jax_disable_most_optimizations` (TEST_ENV, JAX_DISABLE_MOST_OPTIMIZATIONS=1)
sets it; XLA's HLO passes are the same, only LLVM optimises the machine code
less. Full suite, `-n 2`, one run each on the 2-core machine: 35 min at level
0 (62 CPU-minutes), 49 min at level 1 (89). Tests whose time goes into
running many steps rather than compiling take the `optimized` fixture (the
recommender and video serving tests). The soaks and the MTP training tests
took it too until their compiles outgrew their steps (2026-11-29, each
alone: the speculative soak 125 s optimised, 74 s at level 0, 92 s of it
XLA compiling 59 programs when optimised; the multi-step soak 33 s at level
0; the MTP tests 34 + 30 + 12 s against 18 + 17 + 3 s), so they run at 0.
The speculative tests on the default model are compile-bound (22-38 s each
at level 0; 28-51 s optimised), so they stay at 0. The notebooks run at
level 0 too, but for colab/sharding.ipynb (54 s at the default, 100 s at
level 0; tests/repo/test_notebooks.py); benchmarks (experiments/) and users
keep XLA's default. Test subprocesses get TEST_ENV (`subprocess_env`).

On jax 0.10, XLA:CPU also compiles with its older loop fusion emitters
(TEST_ENV's XLA_FLAGS, `--xla_cpu_use_fusion_emitters=false`; jax 0.11
removed the flag): the MLIR fusion emitters, 0.10's default, took 12-14 s
to compile one speculative step of the tests' model where the older ones
took 5.2-5.5 s (`jax_log_compiles`, same program, same run)."""

import importlib.metadata
import os

TEST_ENV = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
if tuple(int(v) for v in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11):
  TEST_ENV["XLA_FLAGS"] = "--xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("XLA_FLAGS", " ".join(
    ["--xla_force_host_platform_device_count=8", TEST_ENV.get("XLA_FLAGS", "")]).strip())
os.environ.setdefault("JAX_PLATFORMS", "cpu")
for _k, _v in TEST_ENV.items():
  os.environ.setdefault(_k, _v)

import gc  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Kernel test classes run in interpret mode everywhere; their GPU subclasses
# (compiled kernels) are defined only where this process has a GPU, e.g.
# `JAX_PLATFORMS=cuda python -m pytest -k Gpu tests/kernels/test_kernels_*.py` (experiments/gpu_day.py).
ON_GPU = jax.default_backend() == "gpu"

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
HF_FIXTURES = ["llama", "llama_sharded", "mixtral", "qwen3_moe", "deepseek_v3",
               "deepseek_v2lite", "gpt_oss"]


def kernel_rel_err(out, ref) -> float:
  """max|out - ref| / max|ref| in float32, after asserting the kernel's
  output is finite (a NaN would otherwise compare as a small error)."""
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  assert np.isfinite(out).all(), "NaN/inf in kernel output"
  return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def float32_model(name: str, seed: int = 0):
  """A preset (`jaxinfer.presets`) in float32 with random weights -> (cfg, params)."""
  import dataclasses
  from jaxinfer import models, presets
  cfg = dataclasses.replace(presets.get(name), dtype="float32")
  return cfg, models.init_params(cfg, jax.random.key(seed))


def compile_moe_step_for_h100(model: str, mesh_axes: dict, layout: str, program: str,
                              **changes) -> dict:
  """A preset cut to one dense and one MoE layer (DeepSeek) or one sliding and
  one full attention layer (GPT-OSS), no MTP, `changes` applied (backend,
  quant), its step `program` compiled for H100s at a small workload ->
  `gpu_plan.compile_step`'s dict."""
  import dataclasses
  from benchlib import gpu_plan
  from jaxinfer import presets
  two = (dict(dense_layers=(0,)) if model == "deepseek_v3"
         else dict(layer_types=("sliding_attention", "full_attention")))
  cfg = dataclasses.replace(presets.get(model, num_layers=2, num_mtp_layers=0, **two), **changes)
  w = gpu_plan.Workload(batch=4, context=64, prefill_tokens=32)
  return gpu_plan.compile_step(gpu_plan.gpu_config(cfg, "bfloat16"), mesh_axes, layout, program,
                               workload=w)


def mosaic_kernels_for_h100(build, **variant) -> list[dict]:
  """Compile `build(sharding, **variant)`'s (fn, abstract args) for one H100
  (the lowering must hold a Mosaic GPU kernel) -> ptxas's figures per Mosaic
  kernel built (`gpu_executable.mosaic_kernels`)."""
  from benchlib import gpu_executable
  from jaxinfer import gpu_compile
  mesh = gpu_compile.mesh({"data": 1}, gpu="h100")
  fn, args = build(jax.sharding.SingleDeviceSharding(mesh.devices.flat[0]), **variant)

  def compile_it():
    with gpu_compile.lowering(mesh):
      lowered = jax.jit(fn).lower(*args)
    assert "mosaic_gpu" in lowered.as_text()
    lowered.compile()
  return gpu_executable.mosaic_kernels(compile_it)


def assert_greedy_is_f32_argmax(cfg, params, prompts, outs) -> None:
  """Every generated token is the argmax of a float32 full forward on XLA
  attention (quantized weights dequantized whole) up to bfloat16 rounding
  of the logits (0.1)."""
  import dataclasses
  import jax.numpy as jnp
  from jaxinfer import Backend, models
  f32 = dataclasses.replace(cfg, dtype="float32", backend=Backend(attention="xla"))
  up = lambda x: x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x
  p32 = jax.tree.map(up, params)
  for prompt, out in zip(prompts, outs):
    ids = prompt + out.token_ids
    logits = np.asarray(models.logits(f32, p32, np.asarray([ids], np.int32))[0])
    for t, tok in enumerate(out.token_ids):
      row = logits[len(prompt) - 1 + t]
      assert row[tok] >= row.max() - 0.1, (t, row[tok], row.max())


def random_prompts(cfg, lengths, seed: int = 0) -> list[list[int]]:
  """Random token-id prompts of the given lengths."""
  import numpy as np
  rng = np.random.default_rng(seed)
  return [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]


def assert_no_leak(eng) -> None:
  """Every rank's allocator is consistent and no page is held."""
  for a in eng.allocators:
    a.check_consistency()
  stats = eng.stats()
  assert stats["kv_pages_used"] == 0
  assert stats["kv_pages_free"] + stats["kv_pages_cached"] == sum(
      a.usable_pages for a in eng.allocators)


def subprocess_env(drop=("XLA_FLAGS",), **extra) -> dict:
  """This process's environment for a test subprocess: the `drop` keys removed
  (the 8 simulated devices, so the child runs on one CPU device as users do),
  TEST_ENV set, and `extra` added."""
  env = {k: v for k, v in os.environ.items() if k not in drop}
  env.update(TEST_ENV, **extra)
  return env


@pytest.fixture
def optimized():
  """XLA's full optimisation for the programs the test compiles: for tests
  whose time goes into running many steps of the default model rather than
  into compiling (see the module docstring)."""
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", True)


MAX_MAP_COUNT = int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())


def memory_maps() -> int:
  """The number of memory maps this process holds (lines of /proc/self/maps)."""
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)


@pytest.fixture(autouse=True)
def _bounded_memory_maps():
  yield
  if memory_maps() > MAX_MAP_COUNT // 2:
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def fixtures_dir():
  return FIXTURES


@pytest.fixture
def exact_xla_matmuls():
  """float32 XLA matmuls at full precision (XLA:GPU's default is TF32): the
  kernel tests' GPU subclasses compare against float32 math done in XLA."""
  with jax.default_matmul_precision("highest"):
    yield


def _stream_failure(report) -> None:
  """With JAXINFER_FAILURE_LOG set (experiments/gpu_day.py sets it), each failed
  test's id and error lines go to that file as they happen, so a run cut
  short still says why its tests failed."""
  path = os.environ.get("JAXINFER_FAILURE_LOG")
  if not path or not report.failed:
    return
  lines = [ln for ln in str(report.longrepr).splitlines() if ln.startswith("E ")][:6]
  import json
  with open(path, "a") as f:
    f.write(json.dumps(dict(test=report.nodeid, when=report.when, error=" | ".join(lines)[:600]))
            + "\n")


NEWEST_JAX = tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 11)


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "newest_jax: checks code meant for jax >= 0.11 only (experiments/gpu_day.py, "
      "for the lent GPU machine's jax 0.11.2); deselected on older jax")


def pytest_collection_modifyitems(config, items):
  """Tests marked `newest_jax` are deselected (not skipped) on jax < 0.11:
  they check code written for the newest jax line, and CI's Python 3.12 job
  (.ci/run, jax >= 0.11) runs them."""
  if NEWEST_JAX:
    return
  older = [item for item in items if item.get_closest_marker("newest_jax")]
  if older:
    config.hook.pytest_deselected(items=older)
    items[:] = [item for item in items if not item.get_closest_marker("newest_jax")]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  """The suite never skips: a skipped test (a missing tool, a skip mark) fails the run."""
  outcome = yield
  report = outcome.get_result()
  if report.skipped and not hasattr(report, "wasxfail"):
    report.outcome = "failed"
    report.longrepr = f"skipped, and this suite never skips: {report.longrepr}"
  _stream_failure(report)
