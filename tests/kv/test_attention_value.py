"""`ModelConfig.attention` is an `Attention` value: made from its name,
hashable and static under jit as the name is, asked what it implies (the
cache entry, the pool layout) instead of compared as a string."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from jaxinfer import presets
from jaxinfer.checkpoint import orbax_io
from jaxinfer.config import Attention, ModelConfig
from jaxinfer.kv.pool import PoolLayout

MLA = presets.get("tiny_moe")
GQA = presets.get("tiny_dense")


def test_a_name_becomes_the_value():
  assert MLA.attention is Attention.MLA and GQA.attention is Attention.GQA
  assert MLA.attention.latent and not GQA.attention.latent
  by_name = dataclasses.replace(MLA, attention="mla")
  assert by_name.attention is Attention.MLA and by_name == MLA and hash(by_name) == hash(MLA)
  # Outside code comparing or printing the name keeps working.
  assert MLA.attention == "mla" and f"{MLA.attention}" == "mla" and str(GQA.attention) == "gqa"
  for bad in ("MLA", "mha", None, 1):
    with pytest.raises(ValueError, match=r"attention must be 'gqa' or 'mla'"):
      dataclasses.replace(GQA, attention=bad)


def test_static_under_jit_as_the_name():
  traces = []
  f = jax.jit(lambda cfg, x: traces.append(cfg.attention) or x + cfg.qk_head_dim,
              static_argnums=0)
  f(MLA, jnp.zeros(()))
  f(dataclasses.replace(MLA, attention="mla"), jnp.zeros(()))
  assert traces == [Attention.MLA]  # one trace: equal configs hash alike
  f(GQA, jnp.zeros(()))
  assert traces == [Attention.MLA, Attention.GQA]


def test_a_saved_config_holds_the_name_and_reads_back_the_value():
  text = json.dumps(orbax_io.config_to_dict(MLA))
  assert json.loads(text)["attention"] == "mla"
  back = orbax_io.config_from_dict(json.loads(text))
  assert back == MLA and back.attention is Attention.MLA


def test_the_cache_follows_the_value():
  assert MLA.cache_entry_shapes() == {"kv": (MLA.kv_lora_rank + MLA.qk_rope_head_dim,)}
  K, H = GQA.num_kv_heads, GQA.head_dim
  assert GQA.cache_entry_shapes() == {"k": (K, H), "v": (K, H)}
  for cfg in (MLA, GQA):
    layout = PoolLayout.for_attention(cfg.attention)
    assert layout == PoolLayout.for_attention(str(cfg.attention))  # or its name
    assert layout.latent == cfg.attention.latent
    assert set(layout.names) == set(cfg.cache_entry_shapes())
  assert PoolLayout.for_attention(Attention.MLA, jnp.float8_e4m3fn).scale_names == ("kv_scale",)
  with pytest.raises(ValueError, match="unknown attention kind"):
    PoolLayout.for_attention("mha")


def test_mla_fields_are_checked_for_the_value():
  with pytest.raises(ValueError, match="MLA needs kv_lora_rank > 0"):
    ModelConfig(vocab_size=8, d_model=8, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=4,
                ffn_dim=8, attention=Attention.MLA)
