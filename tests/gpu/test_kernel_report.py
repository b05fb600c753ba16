"""The per-kernel resource report: shape formulas on hand-counted examples,
the executable reader on a real H100 compile, the issue's bytes goal on the
decode cases, and the simulator charging what the report says kernels read."""

import pytest

from benchlib import gpu_cases, gpu_executable, kernel_report, traffic
from jaxinfer import gpu_compile, presets
from jaxinfer.sim.cost import RooflineCost, StepShape, device


def test_visible_keys_and_flops_by_hand():
  # q = 2 tokens at positions 3, 4 of kv = 5: 4 + 5 pairs, each 2 (D + Dv) FLOPs per head.
  assert traffic.attention_flops([(2, 5)], N=1, D=4, Dv=4) == 9 * 2 * 8
  assert traffic.visible_keys(9, 10, window=4) == 4
  assert traffic.min_kv_tokens(4, 100, window=8) == 11


def test_split_pages_loads_whole_compute_blocks():
  # 40 keys = 3 pages of 16; blocks of 2 pages -> 2 blocks = 4 pages (one masked).
  assert traffic.split_pages(40, 39, 0, ps=16, pages_per_split=4, ppcb=2) == 4
  # window 8 from position 39: first key 32 = page 2 = second block -> 1 block.
  assert traffic.split_pages(40, 39, 0, ps=16, pages_per_split=4, ppcb=2, window=8) == 2
  # the second split of 2 pages starts at page 2: only page 2 is visible, 1 block of 2.
  assert traffic.split_pages(40, 39, 1, ps=16, pages_per_split=2, ppcb=2) == 2


def test_paged_traffic_by_hand():
  # 2 decode sequences of 32 keys, N=2 q heads on K=1 KV head, D = Dv = 16, bf16:
  # block_q 1, rows max(16, 2) = 16 (one row block), W = 2 items, 2 pages each.
  t = traffic.paged_traffic([(1, 32)] * 2, N=2, K=1, D=16, Dv=16, ps=16, pages_per_seq=2)
  assert t.tiling["rows"] == 16 and t.tiling["row_blocks"] == 1 and t.tiling["items"] == 2
  assert t.planned["kv"] == 4 * 16 * 32 * 2 == t.minimum["kv"]
  assert t.planned["q"] == 2 * 2 * 16 * 2 + 2 * 16 * 16 * 2 + 2 * 16 * 16 * 2
  # one split: no f32 partials; the kernel writes [W, K, rows, Dv], gathered to [T, N, Dv].
  assert t.planned["partials"] == 0
  assert t.minimum["out"] == 2 * 2 * 16 * 2
  assert t.planned["out"] == t.minimum["out"] + 2 * (2 * 1 * 16 * 16 * 2)
  split = traffic.paged_traffic([(1, 32)] * 2, N=2, K=1, D=16, Dv=16, ps=16, pages_per_seq=2,
                                splits=2)
  assert split.planned["partials"] == 2 * 2 * 2 * 16 * 18 * 4  # acc + m + l, written and read
  assert split.planned["out"] == split.minimum["out"]
  assert t.flops == 2 * 32 * 2 * 2 * 32
  assert t.ratio == t.planned_bytes / t.minimum_bytes > 1


def test_mla_with_128_heads_reads_the_latent_twice():
  t = traffic.paged_traffic([(1, 4096)] * 4, N=128, K=1, D=576, Dv=512, ps=64,
                            pages_per_seq=64, v_from_k=True)
  assert t.tiling["row_blocks"] == 2
  assert t.planned["kv"] == 2 * t.minimum["kv"] == 2 * 4 * 4096 * 576 * 2


def test_mosaic_traffic_by_hand():
  # GQA 4 (N=8, K=2), pages of 16 -> blocks of 64 keys. Decode of 100 keys: one item,
  # 2 blocks = 128 keys per KV head. A 40-token chunk ending at key 100: items of 16
  # tokens ending at 76, 92, 100 -> 2 + 2 + 2 blocks.
  t = traffic.mosaic_traffic([(1, 100), (40, 100)], N=8, K=2, D=64, Dv=64, ps=16)
  assert t.tiling["items"] == 4 and t.tiling["keys_per_block"] == 64
  assert t.planned["kv"] == 2 * (128 + 3 * 128) * 128 * 2
  assert t.minimum["kv"] == 2 * 200 * 128 * 2
  # MLA, 128 heads: two 64-row blocks each read the latent (32-key steps).
  m = traffic.mosaic_traffic([(1, 4096)], N=128, K=1, D=576, Dv=512, ps=64, latent=True)
  assert m.planned["kv"] == 2 * m.minimum["kv"]
  # As one cluster the two row blocks read it once; 4 verify tokens x 128 heads are 8
  # row blocks, one cluster; 16 heads are one block, nothing to share.
  for q, n in ((1, 128), (4, 128), (1, 16)):
    c = traffic.mosaic_traffic([(q, 4096)], N=n, K=1, D=576, Dv=512, ps=64, latent=True,
                               cluster=True)
    assert c.planned["kv"] == c.minimum["kv"]
  # Wide GQA items: a 128-token chunk at G 4 is 8 items of 16 tokens, or 4 of 32.
  seqs = [(128, 1024)]
  narrow = traffic.mosaic_traffic(seqs, N=32, K=8, D=128, Dv=128, ps=16)
  wide = traffic.mosaic_traffic(seqs, N=32, K=8, D=128, Dv=128, ps=16, wide=True)
  assert narrow.tiling["items"] == 8 and wide.tiling["items"] == 4
  assert wide.planned["kv"] < narrow.planned["kv"]
  # In clusters: the chunk is 2 items of 4 tiles (64 tokens), one cluster reading the
  # union of their blocks once; a decode's single item is no cluster.
  c = traffic.mosaic_traffic(seqs + [(1, 1024)], N=32, K=8, D=128, Dv=128, ps=16, wide=True,
                             cluster=True)
  assert c.tiling["items"] == 3 and c.planned["kv"] == c.minimum["kv"]
  # 16 row blocks are more than a cluster holds (8): each block reads it.
  c = traffic.mosaic_traffic([(8, 4096)], N=128, K=1, D=576, Dv=512, ps=64, latent=True,
                             cluster=True)
  assert c.planned["kv"] == 16 * c.minimum["kv"]


def test_mosaic_beside_triton_in_the_report():
  row = kernel_report.mosaic_report(gpu_cases.get("llama8b_decode_ps16"))
  assert row["kernel"] in ("mosaic_gqa", None)
  if row["kernel"]:  # jax >= 0.11: decode reads each KV byte once per KV head
    assert row["kv_over_minimum"] == 1.0 and row["smem_bytes"] <= 227 * 1024
  else:
    assert "jax >= 0.11" in row["why"]
  mla = kernel_report.mosaic_report(gpu_cases.get("dsv3_mla_dp_decode_ps64"))
  if mla["kernel"]:  # 128 heads: 2x, or as one cluster of 2 programs within 1.1x
    assert mla["kv_over_minimum"] == 2.0 and mla["cluster"]["programs"] == 2
    assert mla["cluster"]["planned_over_minimum"] <= 1.1
  gqa = kernel_report.mosaic_report(gpu_cases.get("llama8b_mixed_512p_63d"))
  if gqa["kernel"]:  # wide items read the chunk's KV half as often, within shared memory
    extra, wide_extra = gqa["planned_over_minimum"] - 1, gqa["wide"]["planned_over_minimum"] - 1
    assert 0 < wide_extra <= 0.55 * extra and gqa["wide"]["smem_bytes"] <= 227 * 1024
  # Items of 4 tiles in clusters of 8: every GQA mixed case of the gate within 1.1x
  # of the minimum (each KV byte once per KV head), within shared memory.
  checked = []
  for case in gpu_cases.CASES:
    if case.kernel == "ragged" and case.D == case.Dv and not case.kv_dtype:
      row = kernel_report.mosaic_report(case)
      if row["kernel"]:
        cluster = row["wide_cluster"]
        assert cluster["programs"] == 8 and cluster["smem_bytes"] <= 227 * 1024
        assert 1 <= cluster["planned_over_minimum"] <= 1.1, (case.name, cluster)
        checked.append(case.model)
  assert len(checked) == (4 if gqa["kernel"] else 0), checked
  mixed = kernel_report.mosaic_report(gpu_cases.get("dsv3_mla_mixed_512p_31d"))
  assert mixed["kernel"] is None and "takes decode and verify steps" in mixed["why"]


def test_flash_traffic_by_hand():
  # T = S = 128, blocks of 64: query block 0 sees key block 0, block 1 sees both.
  t = traffic.flash_traffic(B=1, T=128, S=128, N=1, K=1, D=64, Dv=64)
  assert t.tiling["key_blocks_per_head"] == 3
  assert t.planned["kv"] == 3 * 64 * 128 * 2
  assert t.minimum["kv"] == 128 * 128 * 2
  assert t.flops == 128 * 129 // 2 * 2 * 128
  assert traffic.roofline_s(2e12, 1e9, peak_flops=1e12, bandwidth=1e9) == 2.0


def test_paged_traffic_rejects_bad_shapes():
  with pytest.raises(ValueError, match="multiple of K"):
    traffic.paged_traffic([(1, 8)], N=3, K=2, D=16, Dv=16, ps=16, pages_per_seq=1)
  with pytest.raises(ValueError, match="1 <= q <= kv"):
    traffic.paged_traffic([(4, 2)], N=2, K=1, D=16, Dv=16, ps=16, pages_per_seq=1)


def test_planned_never_below_minimum_and_decode_gqa_within_ten_percent():
  for case in gpu_cases.CASES:
    assert kernel_report.case_traffic(case).ratio >= 1, case.name
  decode = [c for c in gpu_cases.CASES if c.kernel == "paged" and c.Q == 1 and not c.window]
  assert len(decode) >= 5
  for case in decode:
    assert kernel_report.case_traffic(case).ratio <= 1.10, case.name


def test_executable_facts_of_a_compiled_decode_case(tmp_path):
  case = gpu_cases.get("llama8b_decode_ps16")
  compiled = kernel_report.compile_case(case, str(tmp_path))
  facts = kernel_report.executable_facts(compiled, "paged_attention", gpu="h100",
                                         dump_dir=str(tmp_path))
  t = kernel_report.case_traffic(case)
  assert 1 <= facts["registers"] <= 255
  assert 0 < facts["dynamic_smem_bytes"] <= facts["smem_bytes"] <= 232448
  assert facts["smem_limit_bytes"] == gpu_compile.target("h100").smem_per_block
  assert facts["threads"] == 4 * 32  # num_warps = 4
  grid = facts["grid"]
  assert grid[0] * grid[1] * grid[2] == t.tiling["programs"]
  assert facts["spill_store_bytes"] == 0 and facts["ptxas_registers"] == facts["registers"]
  assert facts["unavailable"] == {}


def test_elf_and_snappy_readers_reject_garbage():
  with pytest.raises(ValueError, match="ELF"):
    gpu_executable.elf_sections(b"not an elf at all" * 4)
  assert gpu_executable.snappy_decompress(b"\x05\x10hello") == b"hello"
  # a back-reference copying its own output: "ab" then 4 more bytes from offset 2.
  assert gpu_executable.snappy_decompress(b"\x06\x04ab\x01\x02") == b"ababab"
  # an IFRT header of 1 byte, then neither a Riegeli file nor a proto holding one.
  with pytest.raises(gpu_executable.ExecutableFormatError, match="Riegeli"):
    gpu_executable.executable_records(b"\x01\x00\x0a\x03abc")


def _report(ratio):
  row = dict(model="llama3_1_8b", kernel="paged", gpu="h100", shapes=dict(N=32),
             planned_over_minimum=ratio)
  return dict(cases=[row, dict(row, planned_over_minimum=1.0)])


def test_kv_read_factor_picks_the_worst_decode_case():
  assert kernel_report.kv_read_factor(_report(1.5), model="llama3_1_8b") == 1.5
  assert kernel_report.kv_read_factor(_report(1.5), model="llama3_1_8b",
                                      heads_per_device=32) == 1.5
  with pytest.raises(ValueError, match="no decode case"):
    kernel_report.kv_read_factor(_report(1.5), model="llama3_1_8b", heads_per_device=8)


def test_simulator_charges_the_reported_kv_reads():
  cfg = presets.get("llama3_8b")
  shape = [StepShape(decode_seqs=64, kv_read_tokens=64 * 8192, pairs_decode=64 * 8192)]
  kw = dict(cfg=cfg, device=device("h100"), weight_dtype="bf16", layer_floor_s=0.0)
  base = RooflineCost(**kw).step_time(shape).parts["attention"]
  factor = kernel_report.kv_read_factor(_report(2.0), model="llama3_1_8b")
  with_report = RooflineCost(**kw, attn_kv_factor=factor).step_time(shape).parts["attention"]
  assert with_report == pytest.approx(2.0 * base)
  with pytest.raises(ValueError, match="attn_kv_factor"):
    RooflineCost(**kw, attn_kv_factor=0.5)
