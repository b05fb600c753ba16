"""python -m native_kernels: builds the C++ CPU kernels for this machine
now (they build on first use otherwise) and says where they are, or why they
cannot be built (exit status 1)."""

import sys

import native_kernels as cpu

if __name__ == "__main__":
  ok = cpu.build()
  print(f"{cpu.status()}: {cpu.library_path()}" if ok else cpu.status())
  sys.exit(0 if ok else 1)
