"""Wide-EP exchange bytes from compiled H100 programs (`benchlib.ep_bytes`):
the worst-case buffers moved n times the routed rows; the capacity exchange
moves 1.25x at larger batches; the ragged one moves exactly the routed rows."""

import pytest

from benchlib import ep_bytes
from jaxinfer import Backend, gpu_compile, presets


def test_collective_bytes_reads_sync_and_async_forms():
  hlo = "\n".join([
      "  %a = (bf16[8,2,128]{2,1,0}, s32[8,2]{1,0}) all-to-all(%x, %y), channel_id=1",
      "  %b = ((bf16[8,5,128]{2,1,0}), bf16[8,5,128]{2,1,0}) all-to-all-start(%z)",
      "  %c = bf16[8,5,128]{2,1,0} all-to-all-done(%b)",
      "  %d = ((bf16[16,128]{1,0}, bf16[128,128]{1,0}, s64[8]{0}), bf16[128,128]{1,0}) "
      "ragged-all-to-all-start(%p, %q, %r)",
      "  %e = ((s32[8]{0}), s32[64]{0}) all-gather-start(%s)",
  ])
  c = ep_bytes.collective_bytes(hlo)
  assert c["all_to_all"] == 8 * 2 * 128 * 2 + 8 * 2 * 4 + 8 * 5 * 128 * 2
  assert c["ragged_all_to_all_send"] == 16 * 128 * 2
  assert c["all_gather"] == 64 * 4 and c["all_reduce"] == 0


@pytest.mark.parametrize("t", [1, 64])
def test_exchange_bytes_against_routed_on_eight_h100s(t):
  cfg = presets.get("tiny_moe", dtype="bfloat16")  # 8 experts, top-2, D = 128
  mesh = gpu_compile.mesh({"data": 2, "expert": 4})
  (row,) = ep_bytes.report(cfg, mesh, (t,), backend=Backend(target="gpu"))
  assert row["routed_bytes"] == 2 * t * 2 * 128 * 2
  assert row["before"]["ratio"] == pytest.approx(8.0)  # n: every copy's worst case
  assert row["ragged"]["ratio"] == 1.0 and row["ragged"]["send_buffer_bytes"] > 0
  assert row["ragged"]["collectives"]["all_to_all"] == 0  # only ragged exchanges
  # Capacity C = ceil(1.25 t k / n) rows per destination: 1 row at t = 1 (4x
  # the 2 routed copies over 8 ranks), 1.25x from t = 64 on.
  assert row["capacity"]["ratio"] == pytest.approx(4.0 if t == 1 else 1.25)
