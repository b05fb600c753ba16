"""Every command in the README runs in a test, and every experiment command
in the README and docs/ names flags its script defines.

`COMMANDS` maps each command of README.md (its bash blocks, and inline code
that runs python) to how it is checked: `Run` runs it here with settings
that shorten it, `Covered` names the test elsewhere that runs it (shortened
too), `NotHere` says why no CPU test can (GPU only, or the CI command
itself). A command that moved from the README to a docs/ page (the README
keeps to 300 lines: tests/repo/test_readme_shape.py) keeps its entry and its
check. A README command without an entry, or an entry whose command is on
neither the README nor a docs/ page, fails
`test_every_readme_command_has_a_check`, so the README cannot gain a command
no test runs, nor keep one the tests dropped.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from benchlib import cold_start
from conftest import subprocess_env

ROOT = pathlib.Path(__file__).parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


@dataclasses.dataclass(frozen=True)
class Run:
  """Run the command's python part here, with `extra` flags appended;
  `needles` must be in its stdout."""
  extra: tuple[str, ...] = ()
  needles: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Covered:
  """`test` ("path::name") runs the command (shortened); `needles` (its
  script, flags or values) must be in that test's source."""
  test: str
  needles: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class NotHere:
  why: str


_MESH_SHORT = ("--max_tokens=8", "--num_pages=32", "--max_num_seqs=4")
COMMANDS = {
    # The first command: its install is CI's (.ci/run); the script's run is
    # tests/models/test_default_model.py, the whole command, output checked.
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && "
    "python experiments/generate.py": Covered(
        "tests/models/test_default_model.py::test_readme_first_command_reads_clean",
        ("experiments/generate.py",)),
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e \".[dev,gpu-compile]\" && "
    "python -m pytest -n 2 tests": NotHere("the CI command itself (.ci/run runs it)"),
    "python experiments/generate.py": Covered(
        "tests/models/test_default_model.py::test_readme_first_command_reads_clean",
        ("experiments/generate.py",)),
    "pip install -e \".[hf]\" && python experiments/check_hf.py": Covered(
        "tests/repo/test_newcomer_commands.py::test_check_hf_matches_transformers",
        ("experiments/check_hf.py",)),
    "python experiments/generate.py --cpu_devices=8 --mesh=data=2,expert=4 --layout=dp_attn_ep":
        Covered("tests/repo/test_newcomer_commands.py::test_generate_sharded_on_simulated_devices",
                ("--cpu_devices=8", "--mesh=data=2,expert=4", "--layout=dp_attn_ep",
                 "MTP drafts per step (K)")),
    "python experiments/generate.py --cpu_devices=8 --mesh=data=2,tensor=4 --layout=tp": Run(
        _MESH_SHORT, ("layout tp", "MTP drafts per step (K)", "mean accepted length")),
    "pip install -e \".[mlperf]\" && python experiments/mlperf_harness.py --scenarios=Server":
        Covered("tests/repo/test_newcomer_commands.py::test_mlperf_harness_short_run",
                ("experiments/mlperf_harness.py", "--scenarios=Server")),
    "pip install -e \".[serve]\" && python experiments/serve.py": Covered(
        "tests/repo/test_readme_commands.py::test_serve_answers_a_completion_while_it_warms_up"),
    "python experiments/cold_start.py --wait_warm": Covered(
        "tests/repo/test_readme_commands.py::test_serve_answers_a_completion_while_it_warms_up",
        ("cold_start.start",)),
    "python experiments/serve.py": Covered(
        "tests/repo/test_readme_commands.py::test_serve_answers_a_completion_while_it_warms_up"),
    "pip install -e \".[dev]\" && python -m pytest tests/repo/test_notebooks.py": NotHere(
        "a test file of the suite: CI runs tests/repo/test_notebooks.py"),
    "python -m pytest tests/models/test_hf_parity.py": NotHere(
        "a test file of the suite: CI runs tests/models/test_hf_parity.py"),
    "pip install -e \".[dev,hf]\" && python -m pytest tests/models/test_hf_random_configs.py":
        NotHere("a test file of the suite: CI runs tests/models/test_hf_random_configs.py"),
    "python -m native_kernels": Covered(
        "tests/engine/test_native_cpu.py::"
        "test_without_a_compiler_the_engine_runs_xla_with_one_warning",
        ('"-m", "native_kernels"',)),
    "python experiments/bench_speculative.py": Run(
        ("--batches=1", "--draft_tokens=0,2", "--max_tokens=8", "--num_prompts=1",
         "--repeats=1", "--out={tmp}/bench_speculative"),
        ("accepted length", "exact True")),
    "python experiments/serve_bench.py": Run(
        ("--experiments=routing", "--routers=kv", "--rates=4", "--sessions=2", "--turns=2",
         "--think_s=0.1", "--workers=2", "--max_tokens=2", "--nowarmup",
         "--out={tmp}/serve_bench"), ()),
    "python experiments/mlperf_harness.py": Run(
        ("--num_samples=4", "--max_tokens=4", "--min_duration_ms=500", "--min_query_count=4",
         "--out={tmp}"), ("Offline", "Server", "Interactive", "first tokens match True")),
    "python experiments/mlperf_harness.py --scenarios=Server --server_url=...": Covered(
        "tests/serving/test_http_server.py::test_mlperf_harness_over_http",
        ("experiments/mlperf_harness.py", "--scenarios=Server", "--server_url=")),
    "python experiments/train_tiny.py": Run(
        ("--steps=2", "--warmup=1", "--batch=2", "--seq_len=32", "--num_layers=1",
         "--distill_steps=1", "--eval_windows=2", "--log_every=1", "--out={tmp}/model",
         "--log={tmp}/train_tiny.json"), ()),
    "python experiments/bench_decode.py --model=bench_dense --batches=1,8,32 --repeats=3 "
    "--new_tokens=32": Covered("tests/experiments/test_bench_decode.py::test_script_end_to_end",
                               ("experiments", "bench_decode.py", "--batches=", "--repeats=",
                                "--new_tokens=")),
    "python experiments/bench_vs_vllm.py --vllm_python=... --vllm_cores=all --repeats=3": NotHere(
        "needs vLLM's CPU build in a venv of its own (3.5 GB with its torch; CI installs none); "
        "tests/experiments/test_bench_vs_vllm.py runs its streaming client against our server, "
        "its summary and its peer protocol"),
    "python experiments/simulate_cluster.py --mode=mlperf": Run(
        ("--out={tmp}/mlperf_sim",), ("ablation, DeepSeek-R1 Server", "mlperf_sim.json")),
    "python experiments/simulate_cluster.py --mode=calibrate_check": NotHere(
        "6 minutes at its shortest (--check_rounds=1, measured on the 2-core machine): its check "
        "workloads replay real time (multi-turn think time); tests/sim/test_sim.py tests the "
        "calibrated cost it fits"),
    "PYTHONPATH=. python3 experiments/gpu_day.py --out_dir=/tmp/gpu_day": NotHere(
        "GPU only (it refuses a machine without one); its CPU dry run is the command below"),
    "PYTHONPATH=. python3 experiments/gpu_day.py --parts=kernels --budget_s=300": NotHere(
        "GPU only; tests/gpu/test_gpu_day.py checks the parts and their deadlines"),
    "PYTHONPATH=. python3 experiments/gpu_day.py --dry_run --out_dir=/tmp/dry": Covered(
        "tests/gpu/test_gpu_day.py::test_dry_run_writes_every_part",
        ("experiments/gpu_day.py", "--dry_run")),
    "python experiments/sharding_report.py --model deepseek_v3 --mesh data=8,expert=32 "
    "--layout dp_attn_ep --kv_tokens 1000000": Run((), ("GiB/device",)),
    "python experiments/gpu_plan.py --model=deepseek_v3 --mesh=data=4,expert=8 "
    "--layout=dp_attn_ep --hosts=4 --batch=8": Covered(
        "tests/gpu/test_gpu_compile_engine.py::"
        "test_deepseek_v3_4x8_dp_attn_ep_matches_committed_report_and_sharding_report",
        ("gpu_plan.gpu_plan(model=\"deepseek_v3\"", "hosts=4")),
    "python experiments/kernel_report.py": Run(  # one case of all, compiled for the H100
        ("--cases=llama8b_decode_ps16", "--noptxas", "--json_out="), ("llama8b_decode_ps16",)),
    "python experiments/kernel_bench.py --kernels=flash": Covered(
        "tests/experiments/test_kernel_bench.py::test_tiny_run_writes_json_with_every_kernel",
        ("run_kernel_bench(kernels=",)),
}


def commands(text: str) -> list[str]:
  """The shell commands of a markdown text: lines of its bash blocks
  (without trailing comments), and inline code that runs python."""
  found = []
  for block in re.findall(r"```bash\n(.*?)```", text, re.S):
    for line in block.splitlines():
      line = re.sub(r"\s+#.*$", "", line).strip()
      if line and not line.startswith("#"):
        found.append(line)
  prose = re.sub(r"```.*?```", "", text, flags=re.S)
  for span in re.findall(r"`([^`\n]+)`", prose):
    if re.match(r"(pip install .*&& )?(PYTHONPATH=\S+ )?python3? ", span):
      found.append(span.strip())
  return list(dict.fromkeys(found))


def test_every_readme_command_has_a_check():
  found = set(commands(README.read_text()))
  documented = found | {c for page in DOCS for c in commands(page.read_text())}
  assert found <= set(COMMANDS) and set(COMMANDS) <= documented, dict(
      unchecked=sorted(found - set(COMMANDS)), stale=sorted(set(COMMANDS) - documented))


@pytest.mark.parametrize("command", [c for c, how in COMMANDS.items() if isinstance(how, Covered)])
def test_covered_commands_have_their_test(command):
  how = COMMANDS[command]
  path, name = how.test.split("::")
  tree = ast.parse((ROOT / path).read_text())
  funcs = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
  assert name in funcs, (command, how.test)
  source = ast.get_source_segment((ROOT / path).read_text(), funcs[name])
  for needle in how.needles:
    assert needle in source, (command, how.test, needle)


def _python_part(command: str) -> list[str]:
  """The command's last `&&` part, which runs python, as argv for this interpreter."""
  argv = shlex.split(command.split("&&")[-1])
  argv = [a for a in argv if not a.startswith("PYTHONPATH=")]
  assert argv[0] in ("python", "python3"), command
  return [sys.executable, *argv[1:]]


@pytest.mark.parametrize("command", [c for c, how in COMMANDS.items() if isinstance(how, Run)])
def test_readme_command_runs(command, tmp_path):
  how = COMMANDS[command]
  argv = _python_part(command) + [a.format(tmp=tmp_path) for a in how.extra]
  # As users run it: one CPU device unless the command asks for more.
  env = subprocess_env(drop=("XLA_FLAGS", "JAX_PLATFORMS"))
  out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
  assert out.returncode == 0, (argv, out.stdout[-2000:], out.stderr[-3000:])
  for needle in how.needles:
    assert needle in out.stdout, (needle, out.stdout[-3000:])


def test_serve_answers_a_completion_while_it_warms_up(tmp_path):
  # `python experiments/serve.py` as the README runs it, on a free port and
  # an empty compilation cache (`benchlib.cold_start`): the port opens at
  # once, a completion is served while the background warm-up compiles, and
  # /health says "warming" with its progress.
  env = subprocess_env(drop=("XLA_FLAGS", "JAX_PLATFORMS"))
  r = cold_start.start(str(tmp_path), timeout_s=300, cwd=str(ROOT), env=env)
  assert r["text"]
  first = r["first"]
  assert first["health"]["status"] == "warming", first["health"]
  assert first["health"]["warm_up"]["left"] > 0
  assert first["compiles"] >= 2 and first["maps"] > 0  # the request's prompt and decode steps
  assert r["port_s"] < first["s"]
  assert "serving 'default' on http://127.0.0.1:" in r["stdout"]


def _script_flags(script: pathlib.Path) -> set[str]:
  """The flags a script defines: its own `DEFINE_*("name"`, the shared model
  flags it takes, --config, and absl's."""
  text = script.read_text()
  names = set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", text))
  if "model_flags.define(" in text:
    names |= {"model", "hf_dir", "checkpoint_dir", "model_dir"}
  if "model_flags.define_preset(" in text:
    names |= {"model", "preset"}
  return names | {"config", "v", "verbosity", "help", "helpfull", "helpshort", "logtostderr",
                  "alsologtostderr"}


def _doc_commands():
  for page in [README, *DOCS]:
    for command in commands(page.read_text()):
      yield pytest.param(page.name, command, id=f"{page.stem}:{command[:60]}")
  # Script docstrings' usage lines (quoted into docs/experiments.md).
  for script in sorted((ROOT / "experiments").glob("*.py")):
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    for line in doc.splitlines():
      line = re.sub(r"\s+#.*$", "", line).strip()
      if re.match(r"(PYTHONPATH=\S+ )?python3? experiments/", line):
        yield pytest.param(script.name, line, id=f"{script.stem}:{line[:60]}")


@pytest.mark.parametrize("where, command", list(_doc_commands()))
def test_documented_commands_use_defined_flags(where, command):
  for part in command.split("&&"):
    words = part.replace("\\", " ").split()
    scripts = [w for w in words if re.fullmatch(r"experiments/\w+\.py", w)]
    if not scripts:
      continue
    defined = _script_flags(ROOT / scripts[0])
    for word in words[words.index(scripts[0]) + 1:]:
      if not word.startswith("--") or word in ("--", "--..."):
        continue
      name = word[2:].split("=")[0].split(".")[0]
      ok = name in defined or (name.startswith("no") and name[2:] in defined)
      assert ok, (where, command, name)
