"""The decode benchmark's accounting and plumbing (no timing asserts)."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from benchlib import decode, decode_roofline, hf_peer
from jaxinfer import ModelConfig, hf_config, models, presets
from conftest import subprocess_env

ROOT = pathlib.Path(__file__).parents[2]
FIXTURES = ROOT / "tests" / "fixtures"


def test_bytes_per_step_dense_hand_count():
  cfg = presets.get("tiny_dense")
  V, D, L, N, K, H, F = 256, 128, 4, 4, 2, 32, 384
  assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
          cfg.head_dim, cfg.ffn_dim) == (V, D, L, N, K, H, F)
  B, S = 3, 100
  b = decode_roofline.decode_bytes_per_step(cfg, B, S, 4)
  per_layer = 2 * D + D * N * H + 2 * D * K * H + N * H * D + 3 * D * F  # norms, q k v o, mlp
  assert b["weights"] == 4 * (D * V + D + L * per_layer)  # lm_head, final norm, blocks
  assert b["embed"] == 4 * B * D  # B rows of the table
  assert b["experts"] == 0
  assert b["kv"] == 4 * B * S * L * 2 * K * H
  assert b["total"] == b["weights"] + b["embed"] + b["kv"]
  # bfloat16 weights and cache halve everything.
  b16 = decode_roofline.decode_bytes_per_step(cfg, B, S, 2)
  assert b16["total"] == b["total"] / 2


def test_bytes_per_step_tied_embeddings_and_sliding_window():
  cfg = dataclasses.replace(presets.get("tiny_dense"), tie_embeddings=True, sliding_window=16)
  b = decode_roofline.decode_bytes_per_step(cfg, 1, 100, 4)
  assert b["weights"] == 4 * models.count_params(cfg)  # the table once, as the output head
  assert b["kv"] == 4 * 16 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim


def test_bytes_per_step_moe_mla():
  cfg = presets.get("tiny_moe")  # MLA, 8 experts top-2, 1 shared, layer 0 dense, 1 MTP module
  E, k, D, Fm = cfg.num_experts, cfg.num_experts_per_tok, cfg.d_model, cfg.moe_ffn_dim
  moe_layers = cfg.num_layers - len(cfg.dense_layers)
  B, S = 4, 50
  b = decode_roofline.decode_bytes_per_step(cfg, B, S, 4)
  touched = decode_roofline.expected_experts(E, k, B)
  assert b["experts"] == pytest.approx(4 * moe_layers * touched * 3 * D * Fm)
  # All experts + the table + what the step reads == the main model (MTP excluded).
  main = models.count_params(dataclasses.replace(cfg, num_mtp_layers=0))
  all_experts = b["experts"] / touched * E
  assert b["weights"] + all_experts + 4 * cfg.vocab_size * D == pytest.approx(4 * main)
  assert b["kv"] == 4 * B * S * cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def test_expected_experts():
  assert decode_roofline.expected_experts(64, 6, 1) == pytest.approx(6)
  assert decode_roofline.expected_experts(8, 2, 1) == pytest.approx(2)
  seq = [decode_roofline.expected_experts(64, 6, b) for b in (1, 2, 8, 32, 128, 1024)]
  assert all(a < b for a, b in zip(seq, seq[1:]))
  assert seq[-1] == pytest.approx(64, rel=1e-6)
  assert decode_roofline.expected_experts(64, 64, 1) == 64


@pytest.mark.parametrize("name", ["bench_dense", "bench_moe", "tiny_dense", "tiny_moe",
                                  "llama3_8b", "deepseek_v3"])
def test_hf_config_round_trips(name):
  cfg = presets.get(name)
  assert ModelConfig.from_hf(hf_config.to_hf(cfg)) == cfg


@pytest.mark.parametrize("name", ["bench_dense", "bench_moe"])
def test_hf_config_matches_reference_json(name):
  ref = json.loads((FIXTURES / "bench_configs" / f"{name}.json").read_text())
  ours = hf_config.to_hf(presets.get(name))
  assert {k: ref.get(k, "<missing>") for k in ours} == ours


def test_hf_config_rejects_what_it_cannot_express():
  with pytest.raises(ValueError, match="model_type"):
    hf_config.to_hf(presets.get("mixtral_8x7b"))
  with pytest.raises(ValueError, match="qk_norm"):
    hf_config.to_hf(dataclasses.replace(presets.get("tiny_dense"), qk_norm=True))
  with pytest.raises(ValueError, match="prefix"):
    hf_config.to_hf(dataclasses.replace(presets.get("tiny_moe"), dense_layers=(1,)))


@pytest.mark.parametrize("name", ["bench_dense", "bench_moe"])
def test_hf_model_has_our_param_count(name):
  # The full bench_moe allocates 3.2 GB in torch: 2 layers (1 dense, 1 MoE) and
  # a small vocabulary keep every kind of weight at its real shape.
  cfg = dataclasses.replace(presets.get(name), num_layers=2, vocab_size=512, num_mtp_layers=0)
  model = hf_peer.hf_model(hf_config.to_hf(cfg), threads=1)
  assert hf_peer.hf_param_count(model) == models.count_params(cfg)


def test_script_end_to_end(tmp_path):
  out = tmp_path / "bd"
  env = subprocess_env()  # one CPU device, as users run
  cmd = [sys.executable, str(ROOT / "experiments" / "bench_decode.py"), "--model=tiny_dense",
         "--batches=1,2", "--new_tokens=4", "--repeats=1", "--prefill_len=32", "--prompt_len=16",
         f"--bandwidth_bytes={1 << 24}", "--quant=int8", f"--out={out}"]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.loads((tmp_path / "bd.json").read_text())
  sides = ["jaxinfer", "hf"]  # the dev extra installs transformers and torch
  assert res["peer"] == "hf"
  bw = res["bandwidth"]
  assert bw["gbps"] == max(bw["start"]["gbps"], bw["end"]["gbps"]) > 0
  assert "bench_decode.py" in res["command"]
  got = {(r["phase"], r["side"], r["batch"]) for r in res["rows"]}
  want = {("decode", s, b) for s in sides + ["jaxinfer int8"] for b in (1, 2)}
  assert got == want | {("prefill", s, 1) for s in sides}
  for r in res["rows"]:
    assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
    if r["side"] == "jaxinfer":
      assert r["compiles_after"] == r["compiles_warm"]  # nothing compiled while timed
      assert r["xla_compiles_timed"] == 0
      assert r["ratio_vs_hf"] is not None
    if r["phase"] == "decode":
      assert r["roofline_tokens_per_s"] > 0 and r["fraction_of_roofline"] > 0
    if r["side"] == "jaxinfer int8":  # its roofline reads 1-byte weights
      base = next(b for b in res["rows"] if b["side"] == "jaxinfer" and b["phase"] == "decode"
                  and b["batch"] == r["batch"])
      assert r["bytes_per_step"]["weights"] < 0.3 * base["bytes_per_step"]["weights"]
      assert r["ratio_vs_float"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"])
  assert res["hf_params"] == res["params"]
  assert "| decode | jaxinfer | 1 | 16 |" in proc.stdout
