"""Every loader error of a WanPipeline directory names the file it came from
(and the expert: transformer/ and transformer_2/ hold the same tensor
names), and the key or tensor: one broken copy of the tiny pipeline per case."""

import json
import shutil

import numpy as np
import pytest
import safetensors.numpy

from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.diffusion import loading
from wan_tiny import dit_dirs, tiny_vae, wan_pipeline_dir  # noqa: F401 (fixtures built once a run)


def _edit_json(name, edit):
  def apply(root):
    path = root / name
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
  return apply


def _write(name, text):
  return lambda root: (root / name).write_text(text)


def _edit_tensors(directory, edit):
  def apply(root):
    (path,) = (root / directory).glob("*.safetensors")
    tensors = safetensors.numpy.load_file(str(path))
    edit(tensors)
    safetensors.numpy.save_file(tensors, str(path))
  return apply


def _misshape(name):
  def edit(t):
    t[name] = np.ascontiguousarray(t[name][:, :-1])
  return edit


Q = "blocks.1.attn1.to_q.weight"
_without_d_kv = lambda c: {k: v for k, v in c.items() if k != "d_kv"}
CASES = {
    "text_encoder config without d_kv": (
        _edit_json("text_encoder/config.json", _without_d_kv),
        "text_encoder/config.json: required key 'd_kv' is missing"),
    "text_encoder config not JSON": (
        _write("text_encoder/config.json", "{\"d_model\": 32,"),
        "text_encoder/config.json: invalid JSON"),
    "vae config not JSON": (_write("vae/config.json", "not json"), "vae/config.json: invalid JSON"),
    "vae config a list": (_write("vae/config.json", "[1, 2]"),
                          "vae/config.json: a JSON object expected, got list"),
    "vae config rejected": (
        _edit_json("vae/config.json", lambda c: {**c, "temperal_downsample": [True]}),
        "vae/config.json: VaeConfig: temporal_upsample"),
    "transformer_2 tensor missing": (
        _edit_tensors("transformer_2", lambda t: t.pop(Q)),
        f"transformer_2: missing tensor '{Q}'"),
    "transformer tensor misshapen": (
        _edit_tensors("transformer", _misshape(Q)),
        f"/transformer: tensor '{Q}' has shape \\[24, 23\\], expected \\[24, 24\\]"),
    "transformer_2 tensor misshapen": (
        _edit_tensors("transformer_2", _misshape("proj_out.weight")),
        "/transformer_2: tensor 'proj_out.weight' has shape"),
    "transformer config rejected": (
        _edit_json("transformer/config.json", lambda c: {**c, "qk_norm": "layer_norm"}),
        "/transformer/config.json: WanConfig.from_diffusers: qk_norm"),
    "text_encoder tensor missing": (
        _edit_tensors("text_encoder", lambda t: t.pop("encoder.final_layer_norm.weight")),
        "text_encoder: missing tensor 'encoder.final_layer_norm.weight'"),
    "scheduler setting unsupported": (
        _edit_json("scheduler/scheduler_config.json", lambda c: {**c, "solver_type": "bh1"}),
        "scheduler/scheduler_config.json: FlowUniPC.from_diffusers: solver_type"),
    "tokenizer not a tokenizer.json": (
        _write("tokenizer/tokenizer.json", "{\"model\": 3}"),
        "tokenizer/tokenizer.json: not a tokenizer.json"),
    "pad token not in the vocabulary": (
        _edit_json("tokenizer/tokenizer_config.json", lambda c: {**c, "pad_token": "<nope>"}),
        "tokenizer/tokenizer.json: the pad token '<nope>'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_loader_errors_name_the_file(wan_pipeline_dir, tmp_path, case):
  edit, message = CASES[case]
  root = tmp_path / "p"
  shutil.copytree(wan_pipeline_dir[0], root)
  loading.load_pipeline(str(root), height=32, width=48, frames=9)  # the intact copy loads
  edit(root)
  with pytest.raises(CheckpointError, match=message) as e:
    loading.load_pipeline(str(root), height=32, width=48, frames=9)
  assert str(root) in str(e.value)
