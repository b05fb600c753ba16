"""The ~1 TB DLRMv3 model as MLPerf runs it (`dlrm_v3`: fp16 tables of 1B items,
10M users, 128 categories) compiled (deviceless, from abstract params) for 64
H100s fits, with its per-device memory printed; on 8 it says what does not fit,
and with int8 rows it fits."""

import pytest

from jaxinfer.recsys import dlrm_config, family, memory


@pytest.fixture(scope="module")
def cfg():
  cfg = family.get("dlrm_v3")
  assert isinstance(cfg, dlrm_config.DlrmV3Config)
  assert (cfg.num_layers, cfg.num_heads, cfg.transducer_dim, cfg.table_dtype) == (
      5, 4, 512, "float16")
  assert 1.0e12 <= memory.table_bytes(cfg) <= 1.1e12  # the ~1 TB checkpoint
  return cfg


def test_dlrm_v3_compiles_for_64_h100s_and_fits(cfg):
  p = memory.plan(cfg, devices=64)
  print(p.summary())
  assert p.fits
  # Each device holds 1/64 of the tables (the compiled arguments), plus small dense params.
  share = memory.table_bytes(cfg) / 64
  assert share <= p.memory.argument_bytes <= share * 1.01
  assert 0 < p.memory.temp_bytes < 2e9


def test_on_8_h100s_fp16_tables_do_not_fit_and_int8_rows_do(cfg):
  p = memory.plan(cfg, devices=8)
  print(p.summary())
  assert not p.fits
  assert p.memory.argument_bytes > memory.table_bytes(cfg) / 8 > 80e9
  assert "DOES NOT FIT" in p.summary() and "GB over" in p.summary()
  assert "the embedding tables alone are 129.3 GB a device" in p.summary()
  q = memory.plan(cfg, devices=8, quant="int8")
  print(q.summary())
  assert q.fits and q.memory.argument_bytes < 0.85 * 80e9


def test_bad_device_count_raises(cfg):
  with pytest.raises(ValueError, match="devices must be"):
    memory.plan(cfg, devices=12)
