"""The install guard (.ci/check_installs.py) that CI runs before anything else:
it passes lines that resolve, fails with the resolver's reason on lines that do
not (a conflict like jax 0.12.1's missing CUDA 12 plugin) and on a time-out,
and it knows which README lines another line's resolution covers.

The dry runs here resolve against a local folder of tiny wheels (--no-index),
so these tests need no package index."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).parents[2]
GUARD = ROOT / ".ci" / "check_installs.py"


def _guard_module():
  spec = importlib.util.spec_from_file_location("check_installs", GUARD)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def _wheel(folder: pathlib.Path, name: str, version: str, requires: tuple[str, ...] = ()):
  """A minimal pure-Python wheel: METADATA, WHEEL and RECORD."""
  dist = f"{name.replace('-', '_')}-{version}"
  meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                  *(f"Requires-Dist: {r}\n" for r in requires)])
  files = {f"{dist}.dist-info/METADATA": meta,
           f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                      "Tag: py3-none-any\n"}
  files[f"{dist}.dist-info/RECORD"] = "".join(f"{p},,\n" for p in files) + \
      f"{dist}.dist-info/RECORD,,\n"
  with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
    for path, text in files.items():
      z.writestr(path, text)


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> pathlib.Path:
  """probe-app 1.0 needs probe-plugin>=2 (which exists); probe-app 2.0 needs
  probe-cuda12 2.0, which was never released: the shape of jax[cuda12-local]
  on jax 0.12.1."""
  folder = tmp_path_factory.mktemp("wheels")
  _wheel(folder, "probe-plugin", "2.0")
  _wheel(folder, "probe-cuda12", "1.0")
  _wheel(folder, "probe-app", "1.0", ("probe-plugin>=2",))
  _wheel(folder, "probe-app", "2.0", ("probe-cuda12==2.0",))
  return folder


def _run(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(GUARD), "--python", sys.executable, "--no-readme",
                         *args], capture_output=True, text=True, timeout=300)


def test_a_line_that_resolves_passes(index):
  out = _run("--line", f"--no-index --find-links {index} probe-app==1.0")
  assert out.returncode == 0, (out.stdout, out.stderr)
  assert "ok " in out.stdout and "1 of 1 install lines resolve" in out.stdout


def test_an_unsatisfiable_line_fails_with_the_resolvers_reason(index):
  out = _run("--line", f"--no-index --find-links {index} probe-app==1.0",
             "--line", f"--no-index --find-links {index} probe-app==2.0")
  assert out.returncode == 1, (out.stdout, out.stderr)
  assert "1 of 2 install lines resolve" in out.stdout
  failed = out.stdout[out.stdout.index("FAILED"):]
  # pip's own words: the conflict and the versions it saw.
  assert "probe-cuda12==2.0" in failed and "1.0" in failed, failed
  assert "install guard FAILED" in out.stderr and "probe-app==2.0" in out.stderr


def test_a_resolution_past_the_time_limit_fails(index):
  out = _run("--timeout", "0.05", "--line", f"--no-index --find-links {index} probe-app==1.0")
  assert out.returncode == 1, (out.stdout, out.stderr)
  assert "did not resolve within 0.05 s" in out.stdout


def test_a_python_that_does_not_run_is_named(tmp_path):
  out = subprocess.run([sys.executable, str(GUARD), "--python", str(tmp_path / "python9"),
                        "--line", "probe-app"], capture_output=True, text=True, timeout=60)
  assert out.returncode != 0 and "python9" in (out.stderr + out.stdout)


def test_readme_lines_are_covered_by_the_widest_and_the_first_two_always_run():
  guard = _guard_module()
  known = guard.extras(ROOT / "setup.cfg")
  # dev brings test-core's requirements through the project's own extra.
  assert known["test-core"] < known["dev"]
  lines = guard.readme_lines(ROOT / "README.md")
  assert lines[:2] == ["-e .", '-e ".[dev,gpu-compile]"'], lines
  covered = guard.plan(lines + ["-e .[test-core,gpu-compile]"], lines[:2], known)
  assert covered["-e ."] is None and covered[lines[1]] is None
  for line in ('-e ".[hf]"', '-e ".[serve]"', '-e ".[mlperf]"', "-e .[test-core,gpu-compile]"):
    assert covered[line] == lines[1], (line, covered)
  # A line with packages of its own is never covered; an unknown extra is named.
  assert guard.plan(["-e .[dev]", "-e .[dev] torch"], [], known)["-e .[dev] torch"] is None
  with pytest.raises(SystemExit, match="no-such-extra"):
    guard.requirements("-e .[no-such-extra]", known)
