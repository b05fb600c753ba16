"""The crash that reruns used to hide: XLA:CPU code lives in memory maps.

Every program jax compiles on CPU keeps memory maps of its own until the
program is dropped. Near vm.max_map_count, XLA:CPU's compile cannot map its
code and fails (a segfault inside `backend_compile_and_load` in a test
worker, an INTERNAL error in a small program). tests/conftest.py bounds the
maps per worker with `jax.clear_caches`; these tests check the mechanism it
relies on, in fresh processes (docs/known_issues.md)."""

import json
import subprocess
import sys
import textwrap

_PRELUDE = """
import json, mmap, os
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp

def maps():
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)

x = jnp.ones((32, 32))
jax.jit(lambda x: x + 1)(x).block_until_ready()   # client and thread pools up
def program(i):
  return jax.jit(lambda x, i=i: jnp.tanh(x @ x + i).sum(0) * jnp.exp(x).max())
"""


def _child(body: str, timeout: int = 240) -> subprocess.CompletedProcess:
  code = _PRELUDE + textwrap.dedent(body)
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=timeout)


def test_compiled_programs_hold_maps_until_caches_are_cleared():
  out = _child("""
    start = maps()
    keep = [program(i) for i in range(200)]
    for f in keep:
      f(x).block_until_ready()
    held = maps()
    jax.clear_caches()
    print(json.dumps({"start": start, "held": held, "cleared": maps()}))
  """)
  assert out.returncode == 0, out.stderr[-2000:]
  n = json.loads(out.stdout.strip().splitlines()[-1])
  assert n["held"] - n["start"] >= 200, n          # at least one map per live program
  assert n["cleared"] - n["start"] < 50, n         # dropped with the compiled programs


def test_compiles_fail_once_the_map_limit_is_reached():
  """Take all but 400 maps, then compile live programs: XLA:CPU fails before
  the 400th (the failure the test workers met at 65530 maps)."""
  out = _child("""
    limit = int(open("/proc/sys/vm/max_map_count").read())
    hold = []
    while maps() < limit - 400:
      hold.extend(mmap.mmap(-1, 4096) for _ in range(min(1000, limit - 400 - maps())))
    keep = []
    for i in range(400):
      keep.append(program(i))
      keep[-1](x).block_until_ready()
    print("compiled 400 programs at", maps(), "maps")
  """)
  assert out.returncode != 0, out.stdout[-500:]
  assert "compiled 400 programs" not in out.stdout
  assert "Cannot allocate memory" in out.stderr or out.returncode < 0, out.stderr[-2000:]
