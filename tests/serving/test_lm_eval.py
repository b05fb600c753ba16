"""The EleutherAI lm-evaluation-harness, as users run it against vLLM: its
`local-completions` model with the server's own tokenizer routes
(`tokenizer_backend=remote`), on a loglikelihood (multiple choice) task and
a generate_until task read from small jsonl files under
tests/fixtures/lm_eval/, and a loglikelihood_rolling (perplexity) task over
ROLLING (no hub). The harness's loglikelihoods equal a full forward's to
1e-4 (the rolling ones over its own windows, the first after the prefix
token /tokenizer_info's BOS gives: the byte tokenizer's NUL), and its
generations equal `Engine.generate`'s."""

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
MAX_LENGTH = 256
# Perplexity documents: a short one with non-ASCII text, and one longer
# than MAX_LENGTH (several rolling windows).
ROLLING = ["# café: naïve résumé\nx = 1\n",
           "".join(f"def f{i}(a, b):\n    return a * {i} + b\n\n" for i in range(12))]


def _tasks(tmp_path) -> list[str]:
  """The three tasks' YAML (JSON is YAML) in tmp_path, over the shipped
  jsonl and ROLLING."""
  rolling = tmp_path / "rolling.jsonl"
  rolling.write_text("".join(json.dumps({"text": t}) + "\n" for t in ROLLING))
  def data(name):
    path = rolling if name == rolling.name else DATA / name
    return {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(path)}},
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
      "jaxinfer_rolling": {**data(rolling.name), "output_type": "loglikelihood_rolling",
                           "doc_to_text": "", "doc_to_target": "{{text}}",
                           "metric_list": [{"metric": "word_perplexity"},
                                           {"metric": "bits_per_byte"}]},
  }
  for name, spec in tasks.items():
    (tmp_path / f"{name}.yaml").write_text(json.dumps({"task": name, **spec}, indent=1))
  return list(tasks)


def _loglikelihood(cfg, params, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
  """A full forward's log p(cont | ctx), and whether cont is greedy."""
  ids = np.asarray(ctx + cont, np.int32)
  logp = jax.nn.log_softmax(models.logits(cfg, params, ids[None])[0].astype(np.float32))
  rows = np.asarray(logp)[len(ctx) - 1:-1]
  return float(rows[np.arange(len(cont)), cont].sum()), bool((rows.argmax(-1) == cont).all())


def _check_rolling(samples, cfg, params, tok) -> None:
  """Each document's loglikelihood_rolling is the sum over lm-eval's own
  windows (prefix token 0, the byte tokenizer's BOS) of a full forward's."""
  assert sorted(s["doc"]["text"] for s in samples) == sorted(ROLLING)
  for s in samples:
    ids = tok.encode(s["doc"]["text"])
    # lm-eval's API models keep max_length - 1 tokens, and roll windows of one less.
    windows = [lm_eval.utils.make_disjoint_window(w) for w in lm_eval.utils.get_rolling_token_windows(
        token_list=ids, prefix_token=0, max_seq_len=MAX_LENGTH - 2, context_len=1)]
    assert len(windows) == (1 if len(ids) < MAX_LENGTH else 2)
    want = sum(_loglikelihood(cfg, params, list(ctx), list(cont))[0] for ctx, cont in windows)
    assert s["resps"][0][0] == pytest.approx(want, abs=1e-4), s["doc"]


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
                    "max_length": MAX_LENGTH},
        tasks=_tasks(tmp_path), task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True, bootstrap_iters=0)
  finally:
    server.close()
  samples = out["samples"]
  scored = 0
  for s in samples["jaxinfer_loglikelihood"]:
    for (context, continuation), ((ll, greedy),) in zip(s["arguments"], s["resps"]):
      want, want_greedy = _loglikelihood(cfg, params, tok.encode(context), tok.encode(continuation))
      assert ll == pytest.approx(want, abs=1e-4), (context, continuation)
      assert greedy == want_greedy
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
  _check_rolling(samples["jaxinfer_rolling"], cfg, params, tok)
  assert out["results"]["jaxinfer_rolling"]["word_perplexity,none"] > 1
