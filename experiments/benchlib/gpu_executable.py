"""What a compiled GPU executable says about its kernels: launch shape, shared
memory, registers, stack frame (spills live there), read from the bytes.

Where each number comes from (jax 0.10 + the CUDA 12 PJRT plugin; found by
reading a compile-only H100 executable, not from a spec):

  `compiled._executable._unloaded_executable.xla_executable.serialize()`
      = varint-prefixed IFRT header, then
        jax 0.10: a proto whose field 1 is a Riegeli file: 64 KiB blocks with
          24-byte block headers, chunks of 40-byte headers; one simple chunk
          ('r') of snappy-compressed records.
        jax 0.12: the Riegeli file itself (no proto around it; parsing it as
          one fails with "wire type 3"), one uncompressed record per chunk: a
          metadata record naming `xla.ExecutableAndOptionsProto`, the
          executable as a nested Riegeli file laid out as in jax 0.10, and the
          compile options.
        Every Riegeli file opens with the same 64-byte signature, so the reader
        detects the layout: the body if it is a Riegeli file, else field 1 of
        the body; records that are Riegeli files are expanded in place.
        Neither: `ExecutableFormatError`.
  records  the GpuExecutableProto split into pieces; the one holding field 13
        (`repeated ThunkProto thunks`) carries every kernel launch.
  ThunkProto.custom_kernel_thunk (36) -> CustomKernelProto: name (1),
        kernel_spec (2, holds the kernel's own CUDA ELF cubin), block_dims (3,
        the grid), thread_dims (4), shared_memory_bytes (6: the DYNAMIC shared
        memory the launch requests; Triton kernels declare none statically).
        Field numbers checked against the descriptor compiled into
        xla_cuda_plugin.so (xla/backends/gpu/codegen/kernels/custom_kernel.proto).
  cubin `.nv.info` (EIATTR, format 4 = sized value):
        0x2f REGCOUNT (symbol, registers per thread), 0x11 FRAME_SIZE (symbol,
        bytes of per-thread local frame: spills and local arrays),
        0x12 MIN_STACK_SIZE, 0x23 MAX_STACK_SIZE; `.nv.info.<kernel>` 0x10
        REQNTID (threads per block); `.nv.shared.<kernel>` the static shared
        memory (sm_90 cubins show 1 KiB here: the system-reserved block).

The cubin does not record ptxas's spill-store / spill-load byte counts; those
come from `ptxas -v` over the kernel's PTX (`ptxas_spills`), which needs an XLA
dump of the PTX (jax 0.12 writes it only for emitters matching
`xla_dump_emitter_re`, which `kernel_report.compile_case` sets) and the ptxas
binary of the `gpu-compile` extra.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import struct
import subprocess
import tempfile

from jaxinfer import gpu_compile

_BLOCK = 1 << 16  # Riegeli block size
# The first block header and the signature chunk ('s', no data) of every
# Riegeli file (riegeli/records/README: "file signature").
_RIEGELI_SIGNATURE = bytes.fromhex(
    "83af70d10d884a3f" "0000000000000000" "4000000000000000"
    "91bac23c9287e1a9" "0000000000000000" "e19f13c0e9b1c372" "7300000000000000"
    "0000000000000000")
_BLOCK_HEADER = 24
_CHUNK_HEADER = 40
_THUNKS_FIELD = 13  # GpuExecutableProto.thunks
# ThunkProto kinds that hold thunks: kind -> (field, True if that field is a
# ThunkSequenceProto wrapping them in its field 1, False if it is a ThunkProto).
_NESTED_THUNKS = {2: ((1, False),), 47: ((2, False),), 6: ((2, True),),
                  7: ((2, True), (3, True)), 18: ((1, True),), 57: ((3, True),)}
_CUSTOM_KERNEL_THUNK = 36
EIATTR = {"regcount": 0x2F, "frame_size": 0x11, "min_stack_size": 0x12,
          "max_stack_size": 0x23}
_EIATTR_REQNTID = 0x10


# ------------------------------------------------------------ protobuf wire

def _varint(b: bytes, i: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    c = b[i]
    i += 1
    value |= (c & 0x7F) << shift
    shift += 7
    if c < 0x80:
      return value, i


def proto_fields(b: bytes) -> list[tuple[int, object]]:
  """(field number, value) pairs of a serialized message, without a schema:
  varints as int, length-delimited fields as bytes, fixed ones as bytes.
  Raises ValueError where `b` is not a well-formed message."""
  out, i = [], 0
  try:
    while i < len(b):
      key, i = _varint(b, i)
      field, wire = key >> 3, key & 7
      if wire == 0:
        value, i = _varint(b, i)
      elif wire in (1, 5):
        n = 8 if wire == 1 else 4
        value, i = b[i:i + n], i + n
      elif wire == 2:
        n, i = _varint(b, i)
        value, i = b[i:i + n], i + n
      else:
        raise ValueError(f"wire type {wire}")
      if field == 0 or i > len(b):
        raise ValueError("field 0 or truncated")
      out.append((field, value))
  except IndexError as e:
    raise ValueError("truncated message") from e
  return out


def _field(fields, number, default=None):
  return next((v for f, v in fields if f == number), default)


# ---------------------------------------------------------- snappy, riegeli

def snappy_decompress(b: bytes) -> bytes:
  """Raw snappy (google/snappy format_description.txt): a varint length, then
  literal and back-reference elements."""
  n, i = _varint(b, 0)
  out = bytearray()
  while i < len(b):
    tag = b[i]
    i += 1
    kind = tag & 3
    if kind == 0:  # literal
      length = tag >> 2
      if length >= 60:
        extra = length - 59
        length, i = int.from_bytes(b[i:i + extra], "little"), i + extra
      out += b[i:i + length + 1]
      i += length + 1
      continue
    if kind == 1:
      length, offset, i = ((tag >> 2) & 7) + 4, ((tag >> 5) << 8) | b[i], i + 1
    else:
      width = 2 if kind == 2 else 4
      length, offset = (tag >> 2) + 1, int.from_bytes(b[i:i + width], "little")
      i += width
    start = len(out) - offset
    if offset <= 0 or start < 0:
      raise ValueError(f"snappy: bad back-reference offset {offset}")
    for j in range(length):  # may overlap its own output
      out.append(out[start + j])
  if len(out) != n:
    raise ValueError(f"snappy: decoded {len(out)} bytes, header says {n}")
  return bytes(out)


def _riegeli_block(b: bytes, compression: int) -> bytes:
  if compression == 0:
    return b
  if compression != ord("s"):
    raise ValueError(f"riegeli compression {chr(compression)!r} not supported (snappy only)")
  _, i = _varint(b, 0)  # decompressed size, repeated inside the snappy stream
  return snappy_decompress(b[i:])


def riegeli_records(f: bytes) -> list[bytes]:
  """Records of a Riegeli file made of simple chunks (riegeli/records docs:
  block headers every 64 KiB are dropped first, then 40-byte chunk headers)."""
  data = b"".join(f[p + _BLOCK_HEADER:p + _BLOCK] for p in range(0, len(f), _BLOCK))
  records, i = [], 0
  while i + _CHUNK_HEADER <= len(data):
    size = struct.unpack_from("<Q", data, i + 8)[0]
    kind = data[i + 24]
    chunk = data[i + _CHUNK_HEADER:i + _CHUNK_HEADER + size]
    i += _CHUNK_HEADER + size
    if kind != ord("r"):  # signature ('s'), padding ('p'), metadata: no records
      continue
    sizes_len, j = _varint(chunk, 1)
    sizes = _riegeli_block(chunk[j:j + sizes_len], chunk[0])
    values = _riegeli_block(chunk[j + sizes_len:], chunk[0])
    k = offset = 0
    while k < len(sizes):
      n, k = _varint(sizes, k)
      records.append(values[offset:offset + n])
      offset += n
  return records


# ----------------------------------------------------------------- thunks

@dataclasses.dataclass(frozen=True)
class KernelLaunch:
  """One custom-kernel launch of an executable (a Pallas/Triton kernel)."""

  name: str
  grid: tuple[int, int, int]
  threads: tuple[int, int, int]
  dynamic_smem_bytes: int
  cubin: bytes | None


def executable_bytes(compiled) -> bytes:
  """The serialized executable of a `jax.stages.Compiled` (the bytes
  `jax.experimental.serialize_executable` pickles)."""
  return compiled._executable._unloaded_executable.xla_executable.serialize()


class ExecutableFormatError(ValueError):
  """The serialized executable has neither known layout (module docstring)."""


def is_riegeli(b: bytes) -> bool:
  """Whether `b` starts with a Riegeli file signature."""
  return b[:len(_RIEGELI_SIGNATURE)] == _RIEGELI_SIGNATURE


def _flat_records(f: bytes) -> list[bytes]:
  """Records of a Riegeli file, nested Riegeli files replaced by their records."""
  out = []
  for record in riegeli_records(f):
    out.extend(_flat_records(record) if is_riegeli(record) else [record])
  return out


def executable_records(serialized: bytes) -> list[bytes]:
  """Records of the GpuExecutableProto: the body after the IFRT header is the
  Riegeli file (jax 0.12) or a proto holding it in field 1 (jax 0.10)."""
  header_len, i = _varint(serialized, 0)
  body = serialized[i + header_len:]
  if not is_riegeli(body):
    try:
      body = _field(proto_fields(body), 1, b"")
    except ValueError:
      body = b""
  if not isinstance(body, bytes) or not is_riegeli(body):
    raise ExecutableFormatError(
        "serialized executable: after the IFRT header neither a Riegeli file "
        "nor a proto whose field 1 is one")
  return _flat_records(body)


def _dim3(message: bytes, coordinates_field: int) -> tuple[int, int, int]:
  dims = proto_fields(_field(proto_fields(message), coordinates_field, b""))
  return tuple(int(_field(dims, k, 0)) for k in (1, 2, 3))


def _find_elf(b: bytes, depth: int = 0) -> bytes | None:
  if b[:4] == b"\x7fELF":
    return b
  if depth > 4:
    return None
  try:
    fields = proto_fields(b)
  except ValueError:
    return None
  for _, v in fields:
    if isinstance(v, bytes) and len(v) > 4:
      found = _find_elf(v, depth + 1)
      if found:
        return found
  return None


def _launch(custom_kernel: bytes) -> KernelLaunch:
  f = proto_fields(custom_kernel)
  return KernelLaunch(name=_field(f, 1, b"").decode(), grid=_dim3(_field(f, 3, b""), 2),
                      threads=_dim3(_field(f, 4, b""), 1),
                      dynamic_smem_bytes=int(_field(f, 6, 0)),
                      cubin=_find_elf(_field(f, 2, b"")))


def _walk_thunks(thunk: bytes, out: list):
  for kind, value in proto_fields(thunk):
    if kind == _CUSTOM_KERNEL_THUNK:
      out.append(_launch(_field(proto_fields(value), 3, b"")))
    for nested_field, wrapped in _NESTED_THUNKS.get(kind, ()):
      for f, inner in proto_fields(value):
        if f != nested_field:
          continue
        for g, t in (proto_fields(inner) if wrapped else [(1, inner)]):
          if g == 1:
            _walk_thunks(t, out)


def kernel_launches(compiled) -> list[KernelLaunch]:
  """Every custom-kernel launch (Pallas/Triton kernels) of a compiled GPU
  program, in thunk order, read from its serialized executable."""
  launches = []
  for record in executable_records(executable_bytes(compiled)):
    try:
      fields = proto_fields(record)
    except ValueError:
      continue  # the PTX text and the cubin of XLA's own kernels
    for f, thunk in fields:
      if f == _THUNKS_FIELD and isinstance(thunk, bytes):
        _walk_thunks(thunk, launches)
  return launches


# -------------------------------------------------------------------- ELF

def elf_sections(elf: bytes) -> dict[str, tuple[int, int, int]]:
  """name -> (type, offset, size) of a 64-bit little-endian ELF's sections."""
  if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
    raise ValueError("not a 64-bit little-endian ELF")
  shoff = struct.unpack_from("<Q", elf, 0x28)[0]
  entsize, count, strndx = struct.unpack_from("<HHH", elf, 0x3A)
  headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + k * entsize) for k in range(count)]
  names_at = headers[strndx][4]
  name = lambda o: elf[names_at + o:elf.index(b"\0", names_at + o)].decode()
  return {name(h[0]): (h[1], h[4], h[5]) for h in headers}


def nv_info(section: bytes) -> list[tuple[int, object]]:
  """(EIATTR code, value) entries of a `.nv.info*` section: format 4 carries
  a u16 size and that many bytes, format 3 a u16, formats 1-2 two bytes."""
  out, i = [], 0
  while i + 2 <= len(section):
    fmt, attr = section[i], section[i + 1]
    i += 2
    if fmt == 4:
      n = struct.unpack_from("<H", section, i)[0]
      out.append((attr, section[i + 2:i + 2 + n]))
      i += 2 + n
    else:
      out.append((attr, struct.unpack_from("<H", section, i)[0]))
      i += 2
  return out


def _symbols(elf: bytes, sections) -> list[str]:
  _, symtab_at, symtab_size = sections[".symtab"]
  _, str_at, _ = sections[".strtab"]
  names = []
  for k in range(symtab_size // 24):
    st_name = struct.unpack_from("<I", elf, symtab_at + 24 * k)[0]
    names.append(elf[str_at + st_name:elf.index(b"\0", str_at + st_name)].decode())
  return names


@dataclasses.dataclass(frozen=True)
class CubinResources:
  """Per-kernel facts of a cubin; None where the cubin has no such entry."""

  registers: int | None  # per thread (EIATTR_REGCOUNT)
  frame_bytes: int | None  # per-thread local frame (EIATTR_FRAME_SIZE)
  max_stack_bytes: int | None  # EIATTR_MAX_STACK_SIZE
  static_smem_bytes: int  # `.nv.shared.<kernel>`
  threads: tuple[int, ...] | None  # EIATTR_REQNTID
  local_sections: tuple[str, ...]  # `.nv.local.*` sections (local memory), if any


def cubin_resources(elf: bytes, kernel: str) -> CubinResources:
  """Registers, frame, stack and shared memory of `kernel` in a CUDA cubin."""
  sections = elf_sections(elf)
  if ".nv.info" not in sections:
    raise ValueError("cubin has no .nv.info section")
  symbols = _symbols(elf, sections)
  _, at, size = sections[".nv.info"]
  per_symbol = {}
  for attr, value in nv_info(elf[at:at + size]):
    if isinstance(value, bytes) and len(value) == 8:
      sym, v = struct.unpack("<II", value)
      if sym < len(symbols) and symbols[sym] == kernel:
        per_symbol[attr] = v
  threads = None
  if f".nv.info.{kernel}" in sections:
    _, at, size = sections[f".nv.info.{kernel}"]
    for attr, value in nv_info(elf[at:at + size]):
      if attr == _EIATTR_REQNTID and isinstance(value, bytes):
        threads = struct.unpack(f"<{len(value) // 4}I", value)
  shared = sections.get(f".nv.shared.{kernel}", (0, 0, 0))[2]
  return CubinResources(
      registers=per_symbol.get(EIATTR["regcount"]),
      frame_bytes=per_symbol.get(EIATTR["frame_size"]),
      max_stack_bytes=per_symbol.get(EIATTR["max_stack_size"]),
      static_smem_bytes=shared, threads=threads,
      local_sections=tuple(n for n in sections if n.startswith(".nv.local")))


# ------------------------------------------------------------------ ptxas

_PTXAS_INFO = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads.*?Used (\d+) registers", re.S)


def ptxas_binary() -> pathlib.Path | None:
  """The ptxas of the `gpu-compile` extra (CUDA 13's or 12's), or None."""
  return gpu_compile.ptxas_path()


def ptx_of(dump_dir: str | pathlib.Path, kernel: str) -> str | None:
  """The PTX that defines `.entry <kernel>` among an XLA dump's *.ptx files."""
  entry = re.compile(rf"\.entry\s+{re.escape(kernel)}\s*\(")
  for path in sorted(pathlib.Path(dump_dir).glob("*.ptx")):
    text = path.read_text()
    if entry.search(text):
      return text
  return None


def ptxas_spills(ptx: str, arch: str) -> dict:
  """`ptxas -v` over one kernel's PTX -> {stack_frame_bytes, spill_store_bytes,
  spill_load_bytes, registers}. arch: e.g. "sm_90a" (the PTX's .target).
  Raises RuntimeError when ptxas is missing or fails."""
  ptxas = ptxas_binary()
  if ptxas is None:
    raise RuntimeError(f"ptxas not found: {gpu_compile.INSTALL_HINT}")
  with tempfile.TemporaryDirectory() as tmp:
    src = pathlib.Path(tmp) / "kernel.ptx"
    src.write_text(ptx)
    run = subprocess.run([str(ptxas), "-v", f"-arch={arch}", str(src), "-o",
                          str(pathlib.Path(tmp) / "kernel.cubin")],
                         capture_output=True, text=True, timeout=300)
  m = _PTXAS_INFO.search(run.stderr + run.stdout)
  if run.returncode or not m:
    raise RuntimeError(f"ptxas failed (rc {run.returncode}): {run.stderr[-500:]}")
  frame, stores, loads, regs = map(int, m.groups())
  return dict(stack_frame_bytes=frame, spill_store_bytes=stores, spill_load_bytes=loads,
              registers=regs)


_MOSAIC_DUMPS = ("MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_TO")


def mosaic_kernels(compile_fn) -> list[dict]:
  """Runs compile_fn() (lowering and compiling a program that holds Mosaic
  GPU kernels: their cubins are built inside the custom calls, out of the
  executable's kernel list) with Mosaic GPU's dumps on -> per kernel built,
  in build order: registers, stack frame and spill bytes (its ptxas -v). A
  kernel this process built before (Mosaic GPU caches them) is not listed.
  (Its resource dumps are numbered on their own count, so shared memory is
  left to the kernels' formulas.)"""
  saved = {k: os.environ.get(k) for k in _MOSAIC_DUMPS}
  with tempfile.TemporaryDirectory() as tmp:
    os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=tmp)
    try:
      compile_fn()
    finally:
      for k, v in saved.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v
    order = lambda p: re.sub(r"\d+", lambda m: m.group().zfill(9), p.stem)  # _2 before _10
    out = []
    for path in sorted(pathlib.Path(tmp).glob("*.ptxas"), key=order):
      m = _PTXAS_INFO.search(path.read_text())
      if m is None:
        raise RuntimeError(f"no ptxas figures in Mosaic GPU's dump {path.name}")
      frame, stores, loads, regs = map(int, m.groups())
      out.append(dict(kernel=path.stem, registers=regs, stack_frame_bytes=frame,
                      spill_store_bytes=stores, spill_load_bytes=loads))
  return out


def ptx_target(ptx: str) -> str | None:
  m = re.search(r"^\.target\s+(\w+)", ptx, re.M)
  return m.group(1) if m else None
