"""python -m pallas_kernels.cpu: builds the C++ CPU kernels for this machine
now (they build on first use otherwise) and says where they are, or why they
cannot be built (exit status 1)."""

import sys

from pallas_kernels import cpu

if __name__ == "__main__":
  ok = cpu.build()
  print(f"{cpu.status()}: {cpu.library_path()}" if ok else cpu.status())
  sys.exit(0 if ok else 1)
