"""Repository contracts: README's commands match CI; the installed library holds
no benchmark code (that is experiments/benchlib). The layers' imports are
tests/repo/test_imports.py's, from docs/design.md's table."""

import ast
import configparser
import fnmatch
import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[2]

def test_readme_test_command_is_what_ci_runs():
  readme = (ROOT / "README.md").read_text()
  block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
  commands = [l for l in block.splitlines() if l and not l.startswith("#")]
  assert len(commands) == 2
  test_cmd = commands[1].split("&&")[-1].strip()
  install = commands[1].split("&&")[-2].strip()
  ci = (ROOT / ".ci" / "run").read_text()
  assert test_cmd in ci and install.replace("pip install", "pip install -q") in ci


def test_a_skipped_test_fails_the_suite(tmp_path):
  shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
  (tmp_path / "test_skips.py").write_text(
      "import pytest\n\ndef test_passes():\n  pass\n\n"
      "def test_skips():\n  pytest.importorskip('no_such_module_here')\n")
  out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
                        "addopts=", str(tmp_path)], capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stdout[-2000:]
  assert "1 failed, 1 passed" in out.stdout and "this suite never skips" in out.stdout


def _imported_names(f):
  """Every dotted name an import in `f` names (`from a import b`: a and a.b;
  relative imports keep their leading dots)."""
  for node in ast.walk(ast.parse(f.read_text())):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = "." * node.level + (node.module or "")
      sep = "." if node.module else ""
      yield base
      yield from (f"{base}{sep}{a.name}" for a in node.names)


def test_the_library_holds_no_benchmark_code():
  # Benchmarks live in experiments/benchlib (imported as `benchlib`), outside the
  # installed package: no package under jaxinfer/ or pallas_kernels/ is a bench
  # package, and no module there imports benchlib or a bench package.
  files = [f for top in ("jaxinfer", "pallas_kernels") for f in sorted((ROOT / top).rglob("*.py"))]
  assert len(files) > 50, "the check found too few modules to be looking at the library"
  benchy = lambda parts: any(p in ("bench", "benchlib") for p in parts)
  bad = [str(f.relative_to(ROOT)) for f in files if benchy(f.relative_to(ROOT).parts[:-1])]
  bad += [f"{f.relative_to(ROOT)} imports {n}" for f in files for n in _imported_names(f)
          if benchy(n.strip(".").split("."))]
  assert not bad, bad


def test_benchlib_is_not_installed_with_the_package():
  # setup.cfg's package list names the library's packages only.
  cfg = configparser.ConfigParser(interpolation=None)
  cfg.read(ROOT / "setup.cfg")
  include = cfg["options.packages.find"]["include"].split()
  assert include and all(p.split(".")[0] in ("jaxinfer", "pallas_kernels", "native_kernels")
                         for p in include), \
      include
  for name in ("benchlib", "benchlib.kernels", "experiments", "experiments.benchlib"):
    assert not any(fnmatch.fnmatch(name, p) for p in include), (name, include)
  assert (ROOT / "experiments" / "benchlib" / "__init__.py").exists()


def test_one_conftest():
  """A second conftest.py under tests/ shadows tests/conftest.py for every
  `from conftest import ...` (pytest imports each as the module `conftest`):
  shared fixtures go in a helper module the tests import (tests/wan_tiny.py)."""
  root = pathlib.Path(__file__).parents[2]
  assert sorted(root.glob("tests/**/conftest.py")) == [root / "tests" / "conftest.py"]
