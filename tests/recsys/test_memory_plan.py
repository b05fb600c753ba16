"""The ~1 TB DLRMv3 configuration compiled (deviceless, from abstract params) for
64 H100s fits, with its per-device memory printed; on 8 it says what does not fit."""

import pytest

from jaxinfer.recsys import config, memory


@pytest.fixture(scope="module")
def cfg():
  cfg = config.dlrm_v3()
  assert (cfg.num_layers, cfg.num_heads, cfg.embed_dim) == (5, 4, 512)
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


def test_on_8_h100s_bf16_tables_do_not_fit_and_say_so(cfg):
  p = memory.plan(cfg, devices=8)
  print(p.summary())
  assert not p.fits
  assert p.memory.argument_bytes > memory.table_bytes(cfg) / 8 > 80e9
  assert "DOES NOT FIT" in p.summary() and "GB over" in p.summary()
  assert "the embedding tables alone are 128.8 GB a device" in p.summary()
  # int8 rows halve the tables: 8 H100s then hold them (checked without compiling).
  assert memory.per_device_table_bytes(cfg, 8, "int8") < 0.85 * 80e9


def test_bad_device_count_raises(cfg):
  with pytest.raises(ValueError, match="devices must be"):
    memory.plan(cfg, devices=12)
