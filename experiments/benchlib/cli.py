"""What every experiment script's command line shares: quiet logs, and
terminal-only colour.

Results go to stdout, diagnostics to stderr. A script runs `cli.run(main)`
instead of `app.run(main)`: absl raises an unset `--verbosity` to INFO, which
prints jax's backend probing and orbax's checkpointer chatter ahead of the
results; here an unset `--verbosity` stays at WARNING, and `-v=0` (INFO) or
`-v=1` (DEBUG) shows more:

  python experiments/generate.py          # results, and warnings or errors only
  python experiments/generate.py -v=0     # with jax's and orbax's INFO lines

On a machine with no NVIDIA driver but a CUDA plugin installed (the
`gpu-compile` extra on a CPU machine), jax's start of that plugin fails and
logs the failure with a traceback before falling back to the CPU; with
JAX_PLATFORMS unset such a script asks for the CPU directly (`-v=0` says so).
A GPU machine, or a JAX_PLATFORMS of one's own, is left as it is. The jaxlib
CUDA extensions still log `cudart_stub.cc` INFO lines when `import jax`
loads them there, before any script code runs; a plain `pip install -e .`
has no CUDA plugin, and neither those lines nor the traceback.

Colour (`bold`) is written only to a terminal, and never with `NO_COLOR` set
(https://no-color.org); piped or redirected output is plain text.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

from absl import app, flags
import jax

# Python loggers that log INFO on every run: jax's backend probing
# ("Unable to initialize backend 'tpu'"), orbax's checkpointer, metadata
# store and read throughput.
QUIET_LOGGERS = ("jax", "orbax", "absl")
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")
NVIDIA_DRIVER = ("/dev/nvidiactl", "/proc/driver/nvidia")


def parse_flags(argv: list[str]) -> list[str]:
  """`app.run`'s flag parser, with WARNING as the default log level: absl
  raises an unset --verbosity to INFO after parsing, so this sets it first."""
  args = app.parse_flags_with_usage(argv)
  if not flags.FLAGS["verbosity"].present:
    flags.FLAGS.verbosity = -1  # absl's WARNING; setting it keeps app.run from raising it
  level = logging.WARNING if flags.FLAGS.verbosity < 0 else logging.NOTSET
  for name in QUIET_LOGGERS:
    logging.getLogger(name).setLevel(level)
  _cpu_without_a_gpu_driver()
  return args


def _cpu_without_a_gpu_driver() -> None:
  """jax_platforms=cpu where a CUDA plugin is installed but no NVIDIA driver
  is visible and JAX_PLATFORMS is unset (before any backend starts)."""
  if os.environ.get("JAX_PLATFORMS") or any(os.path.exists(p) for p in NVIDIA_DRIVER):
    return
  if any(importlib.util.find_spec(m) for m in CUDA_PLUGINS):
    logging.info("a CUDA plugin is installed but no NVIDIA driver is visible: running on "
                 "the CPU (set JAX_PLATFORMS to choose)")
    jax.config.update("jax_platforms", "cpu")


def run(main) -> None:
  """`app.run(main)` with the default log level WARNING (`parse_flags`)."""
  app.run(main, flags_parser=parse_flags)


def use_color(stream=None) -> bool:
  """Whether to colour text for `stream` (default stdout): a terminal, and
  `NO_COLOR` unset or empty."""
  stream = sys.stdout if stream is None else stream
  isatty = getattr(stream, "isatty", None)
  return bool(isatty and isatty()) and not os.environ.get("NO_COLOR")


def bold(text: str, stream=None) -> str:
  """`text` in bold on a terminal (`use_color`), else as it is."""
  return f"\033[1m{text}\033[0m" if use_color(stream) else text
