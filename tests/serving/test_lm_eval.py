"""The EleutherAI lm-evaluation-harness, as users run it against vLLM: its
`local-completions` model with the server's own tokenizer routes
(`tokenizer_backend=remote`), on a loglikelihood (multiple choice) task and
a generate_until task read from small jsonl files under
tests/fixtures/lm_eval/ (no hub). The harness's loglikelihoods equal a full
forward's to 1e-4, and its generations equal `Engine.generate`'s."""

import json

import jax
import lm_eval
import numpy as np
import pytest
from lm_eval.tasks import TaskManager

import jaxinfer
from jaxinfer import Engine, EngineConfig, SamplingParams, models
from jaxinfer.serving.http_server import make_app
from conftest import FIXTURES
from test_http_server import _Server

DATA = FIXTURES / "lm_eval"
MAX_GEN = 12


def _tasks(tmp_path) -> list[str]:
  """The two tasks' YAML (JSON is YAML) in tmp_path, over the shipped jsonl."""
  def data(name):
    return {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(DATA / name)}},
            "test_split": "test"}
  tasks = {
      "jaxinfer_loglikelihood": {**data("loglikelihood.jsonl"), "output_type": "multiple_choice",
                                 "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
                                 "doc_to_target": "{{label}}", "target_delimiter": "",
                                 "metric_list": [{"metric": "acc"}]},
      "jaxinfer_generate": {**data("generate.jsonl"), "output_type": "generate_until",
                            "doc_to_text": "{{prompt}}", "doc_to_target": "{{target}}",
                            "target_delimiter": "",
                            "generation_kwargs": {"until": ["\n\n"], "max_gen_toks": MAX_GEN,
                                                  "do_sample": False, "temperature": 0},
                            "metric_list": [{"metric": "exact_match"}]},
  }
  for name, spec in tasks.items():
    (tmp_path / f"{name}.yaml").write_text(json.dumps({"task": name, **spec}, indent=1))
  return list(tasks)


def test_lm_eval_loglikelihood_and_generate_until(tmp_path, monkeypatch):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
  cfg, params, tok = jaxinfer.load_default_model()
  engine = Engine(cfg, params, EngineConfig(page_size=8, num_pages=256, max_num_seqs=8,
                                            max_num_batched_tokens=128))
  server = _Server(make_app(engine, tok, "default"))
  try:
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": server.url + "/v1/completions", "model": "default",
                    "tokenizer_backend": "remote", "num_concurrent": 1, "max_retries": 1,
                    "max_length": 256},
        tasks=_tasks(tmp_path), task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True, bootstrap_iters=0)
  finally:
    server.close()
  samples = out["samples"]
  scored = 0
  for s in samples["jaxinfer_loglikelihood"]:
    for (context, continuation), ((ll, greedy),) in zip(s["arguments"], s["resps"]):
      ctx, cont = tok.encode(context), tok.encode(continuation)
      ids = np.asarray(ctx + cont, np.int32)
      logp = jax.nn.log_softmax(models.logits(cfg, params, ids[None])[0].astype(np.float32))
      rows = np.asarray(logp)[len(ctx) - 1:-1]
      want = rows[np.arange(len(cont)), cont]
      assert ll == pytest.approx(float(want.sum()), abs=1e-4), (context, continuation)
      assert greedy == bool((rows.argmax(-1) == cont).all())
      scored += 1
  assert scored == 12  # 4 docs x 3 choices
  assert "acc,none" in out["results"]["jaxinfer_loglikelihood"]
  gen = samples["jaxinfer_generate"]
  refs = Engine(cfg, params, EngineConfig(page_size=8, num_pages=64)).generate(
      [tok.encode(s["arguments"][0][0]) for s in gen], SamplingParams(max_tokens=MAX_GEN))
  for s, ref in zip(gen, refs):
    text = tok.decode(ref.token_ids).split("\n\n")[0]
    assert s["resps"][0][0] == text, (s["arguments"][0][0], s["resps"], text)
  assert len(gen) == 3 and "exact_match,none" in out["results"]["jaxinfer_generate"]
