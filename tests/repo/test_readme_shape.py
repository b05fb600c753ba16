"""A README a newcomer reads in five minutes (issue 72): at most 300 lines; the
two commands first (install and run the main job, install and run the tests),
then what jaxinfer is, then the map of the code, which names every folder under
jaxinfer/ and the repository's other parts. Everything longer lives in docs/
(the dated CPU benchmark log: docs/performance.md)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).parents[2]
README = ROOT / "README.md"
MAX_LINES = 300
# The repository's parts besides jaxinfer/'s folders, as the map names them.
PARTS = ["jaxinfer/ops.py", "jaxinfer/backend.py", "jaxinfer/sharding.py", "pallas_kernels/",
         "experiments/", "experiments/benchlib/", "configs/", "colab/", "tests/", "docs/"]


def _sections(text: str) -> list[tuple[str, str]]:
  """The README's `## ` sections, in order: (title, body)."""
  parts = re.split(r"^## (.+)$", text, flags=re.M)
  return list(zip(parts[1::2], parts[2::2]))


def _folders() -> list[str]:
  """Every folder directly under jaxinfer/ (packages and data folders)."""
  return sorted(d.name for d in (ROOT / "jaxinfer").iterdir()
                if d.is_dir() and d.name != "__pycache__" and not d.name.startswith("."))


def test_at_most_300_lines():
  lines = README.read_text().splitlines()
  assert len(lines) <= MAX_LINES, (
      f"README.md has {len(lines)} lines, over {MAX_LINES}: move the detail to docs/ "
      "(dated benchmark runs to docs/performance.md) and link it")


def test_the_two_commands_then_what_it_is_come_first():
  text = README.read_text()
  head = text[:text.index("\n## ")]
  assert head.startswith("# jaxinfer\n\n```bash\n"), "the README opens with its two commands"
  block = re.search(r"```bash\n(.*?)```", head, re.S).group(1)
  commands = [l for l in block.splitlines() if l and not l.startswith("#")]
  assert len(commands) == 2 and commands[0].endswith("python experiments/generate.py")
  assert commands[1].endswith("python -m pytest -n 2 tests")
  intro = head[head.index(block) + len(block) + 3:]
  assert "JAX research library" in intro, "what jaxinfer is follows the commands"


def test_the_map_comes_second():
  titles = [title for title, _ in _sections(README.read_text())]
  assert titles[0] == "Map of the code", titles


def test_the_map_names_every_folder_and_part():
  body = dict(_sections(README.read_text()))["Map of the code"]
  folders = _folders()
  packages = [f for f in folders if (ROOT / "jaxinfer" / f / "__init__.py").exists()]
  assert {"engine", "kv", "models", "serving", "sim", "checkpoint"} <= set(packages), packages
  missing = [f"jaxinfer/{f}/" for f in folders if f"jaxinfer/{f}/" not in body]
  missing += [p for p in PARTS if f"`{p}" not in body]
  assert not missing, f"the README's map does not name {missing}"
  assert all((ROOT / p).exists() for p in PARTS), [p for p in PARTS if not (ROOT / p).exists()]
