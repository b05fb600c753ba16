"""The install guard: does every documented install line still resolve today?

For each interpreter given (--python, repeatable) and each install line (every
`pip install` of README.md, plus --line), runs

    PYTHON -m pip install --dry-run --ignore-installed --report ... LINE

in a copy of the project's packaging files (so runs in parallel never build
this checkout's metadata at once), each under --timeout seconds, several at
once. A line whose requirements are all among another line's (`-e ".[hf]"`
beside `-e ".[dev,gpu-compile]"`, with setup.cfg's extras expanded) is
resolved by that line and said so, except the README's first two commands,
which always resolve on their own. Prints what each line resolved to (jax, jaxlib, the CUDA plugin) or the
resolver's own reason, and exits 1 when any line fails or times out: an
upstream release that breaks installation is named in CI's first minutes, not
after an hour of tests. Standard library only: it runs before anything is
installed.

  python .ci/check_installs.py --python venv311/bin/python --python venv312/bin/python
  python .ci/check_installs.py --python python3.12 --line '-e .[dev]' --no-readme
"""

from __future__ import annotations

import argparse
import concurrent.futures
import configparser
import dataclasses
import json
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
# What pip reads to resolve `-e .[extras]`: the dependencies live in setup.cfg,
# the version in jaxinfer/__init__.py, the long description in README.md.
PACKAGING = ("setup.cfg", "pyproject.toml", "README.md", "jaxinfer/__init__.py",
             "pallas_kernels/__init__.py")
SHOWN = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "torch")
# pip's own lines that say nothing about the resolution.
_NOISE = re.compile(r"^(WARNING: Location .* is ignored|\s*$)")


@dataclasses.dataclass(frozen=True)
class Result:
  python: str  # "3.12.1 (path)"
  line: str
  ok: bool
  seconds: float
  detail: str  # the resolved versions, or the resolver's reason


def readme_lines(readme: pathlib.Path) -> list[str]:
  """The arguments of every `pip install` in `readme`'s code (bash blocks and
  inline code; prose is not read), in order, each once: `-e .`,
  `-e ".[dev,gpu-compile]"`, ..."""
  text = readme.read_text()
  code = re.findall(r"```bash\n(.*?)```", text, re.S)
  code += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
  found = [m.strip() for c in code for line in c.splitlines()
           for m in re.findall(r"\bpip install ([^&#]+)", line)]
  return list(dict.fromkeys(found))


def extras(setup_cfg: pathlib.Path) -> dict[str, frozenset[str]]:
  """setup.cfg's extras, each as the set of requirements it brings, with the
  project's own extras (`jaxinfer[test-core]`) expanded; "" is install_requires."""
  cfg = configparser.ConfigParser()
  cfg.read(setup_cfg)
  name = cfg["metadata"]["name"]

  def reqs(text: str) -> list[str]:
    return [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]

  raw = {"": reqs(cfg["options"]["install_requires"])}
  raw.update({k: reqs(v) for k, v in cfg["options.extras_require"].items()})

  def expand(extra: str, seen: frozenset[str] = frozenset()) -> frozenset[str]:
    out = set()
    for req in raw[extra]:
      own = re.fullmatch(rf"{re.escape(name)}\[([\w,-]+)\]", req.replace(" ", ""))
      if own:
        for e in own.group(1).split(","):
          if e in seen:
            raise ValueError(f"setup.cfg: extra {e!r} includes itself")
          out |= expand(e, seen | {e})
      else:
        out.add(req)
    return frozenset(out)

  return {k: expand(k, frozenset({k})) for k in raw}


def requirements(line: str, known: dict[str, frozenset[str]]) -> frozenset[str] | None:
  """The requirements `line` installs when it is just the project (`-e .[a,b]`),
  else None (a line with other packages or options is resolved on its own)."""
  args = [a for a in shlex.split(line) if a != "-e"]
  if len(args) != 1:
    return None
  m = re.fullmatch(r"\.(?:\[([\w,-]*)\])?", args[0])
  if not m:
    return None
  names = [e for e in (m.group(1) or "").split(",") if e]
  unknown = [e for e in names if e not in known]
  if unknown:
    raise SystemExit(f"install guard: `pip install {line}` names extras {unknown} that "
                     f"setup.cfg does not define (it has {sorted(k for k in known if k)})")
  return known[""].union(*(known[e] for e in names))


def plan(lines: list[str], always: list[str],
         known: dict[str, frozenset[str]]) -> dict[str, str | None]:
  """line -> None (resolve it) or the line whose requirements include all of its."""
  reqs = {l: requirements(l, known) for l in lines}
  # Widest first, so a line is covered by one that runs.
  order = sorted(lines, key=lambda l: -len(reqs[l] or ()))
  runs: list[str] = []
  out: dict[str, str | None] = {}
  for l in order:
    cover = next((r for r in runs if reqs[l] is not None and reqs[r] is not None
                  and reqs[l] <= reqs[r]), None)
    if l in always or cover is None:
      runs.append(l)
      out[l] = None
    else:
      out[l] = cover
  return {l: out[l] for l in lines}


def project_copy(dest: pathlib.Path) -> pathlib.Path:
  """The packaging files of this checkout under `dest`."""
  for rel in PACKAGING:
    (dest / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / rel, dest / rel)
  return dest


def pip_args(line: str, project: pathlib.Path) -> list[str]:
  """`line`'s arguments with the project (`.` or `.[extras]`) pointed at `project`.
  Lines that name no project (`pip install torch`) pass through as they are."""
  out = []
  for arg in shlex.split(line):
    if arg == "." or arg.startswith(".["):
      arg = str(project) + arg[1:]
    out.append(arg)
  return out


def interpreter(python: str) -> str:
  try:
    run = subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"],
                         capture_output=True, text=True, timeout=60)
  except OSError as e:
    raise SystemExit(f"install guard: {python} does not run: {e}")
  if run.returncode:
    raise SystemExit(f"install guard: {python} does not run: {run.stderr.strip()[-300:]}")
  return f"{run.stdout.strip()} ({python})"


def resolve(python: str, label: str, line: str, timeout: float) -> Result:
  """One dry run; the resolver's reason (its error lines) when it fails."""
  start = time.monotonic()
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    report = tmp / "report.json"
    argv = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
            "--report", str(report), *pip_args(line, project_copy(tmp / "project"))]
    try:
      run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
      tail = _reason((e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes)
                     else (e.stderr or ""))
      return Result(label, line, False, time.monotonic() - start,
                    f"did not resolve within {timeout:g} s (pip still backtracking?)"
                    + (f"; its last words:\n{tail}" if tail else ""))
    seconds = time.monotonic() - start
    if run.returncode:
      return Result(label, line, False, seconds,
                    _reason(run.stderr + run.stdout) or f"pip exited {run.returncode}")
    installs = json.loads(report.read_text())["install"]
  versions = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
              for i in installs}
  shown = ", ".join(f"{n} {versions[n]}" for n in SHOWN if n in versions)
  return Result(label, line, True, seconds, f"{shown} ({len(versions)} packages)")


def _reason(output: str, lines: int = 25) -> str:
  kept = [l for l in output.splitlines() if not _NOISE.match(l)]
  return "\n".join(kept[-lines:])


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--python", action="append", required=True,
                      help="an interpreter whose pip resolves the lines (repeatable)")
  parser.add_argument("--line", action="append", default=[],
                      help="pip install arguments to resolve besides the README's (repeatable)")
  parser.add_argument("--no-readme", action="store_true", help="only the --line lines")
  parser.add_argument("--timeout", type=float, default=240.0, help="seconds a dry run may take")
  parser.add_argument("--jobs", type=int, default=4, help="dry runs at once")
  args = parser.parse_args(argv)
  readme = [] if args.no_readme else readme_lines(ROOT / "README.md")
  # Each line once, however it is quoted.
  once: dict[tuple[str, ...], str] = {}
  for line in readme + args.line:
    once.setdefault(tuple(shlex.split(line)), line)
  lines = list(once.values())
  if not lines:
    parser.error("no install lines: the README has none and no --line was given")
  covered = plan(lines, readme[:2], extras(ROOT / "setup.cfg"))
  pythons = {p: interpreter(p) for p in args.python}
  start = time.monotonic()
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    futures = [pool.submit(resolve, p, label, line, args.timeout)
               for p, label in pythons.items() for line in lines if covered[line] is None]
    results = [f.result() for f in futures]
  for line, by in covered.items():
    if by is not None:
      print(f"covered pip install {line}: its requirements are among pip install {by}'s")
  for r in results:
    head = f"{'ok    ' if r.ok else 'FAILED'} Python {r.python}: pip install {r.line}"
    print(f"{head}  [{r.seconds:.0f} s]")
    print("       " + r.detail.replace("\n", "\n       "))
  failed = [r for r in results if not r.ok]
  print(f"install guard: {len(results) - len(failed)} of {len(results)} install lines resolve "
        f"({time.monotonic() - start:.0f} s)")
  if failed:
    print("install guard FAILED: these install lines do not resolve from today's package index:",
          *(f"  Python {r.python}: pip install {r.line}" for r in failed), sep="\n",
          file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
