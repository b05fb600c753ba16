"""What evaluation and benchmark tools written for vLLM send, against the
server on the default model, through the `openai` client and raw httpx:
logprobs (completions and chat, streamed and not) and echo with prompt
logprobs equal to a full forward's log-softmax, n copies and prompt lists
equal to `Engine.generate` with the copies' seeds, vLLM's tokenizer routes,
request-body schemas in /openapi.json, OpenAI errors on unknown paths, and
/metrics under vLLM's names with no NaN."""

import json
import re

import httpx
import jax
import numpy as np
import pytest

from lm_eval.models.openai_completions import LocalCompletionsAPI
from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

import jaxinfer
from jaxinfer import Engine, EngineConfig, SamplingParams, models
from jaxinfer.serving.http_server import make_app
from test_http_server import _client, _metric, _Server

PROMPT = "def add(a, b):\n"


@pytest.fixture(scope="module")
def served():
  """(server, engine's cfg and params, tokenizer)."""
  cfg, params, tok = jaxinfer.load_default_model()
  engine = Engine(cfg, params, EngineConfig(page_size=4, num_pages=256, max_num_seqs=8,
                                            max_num_batched_tokens=64))
  server = _Server(make_app(engine, tok, "default", max_queue=64))
  yield server, cfg, params, tok
  server.close()


def _log_softmax(cfg, params, ids) -> np.ndarray:
  """[len(ids), V] float64: position t's distribution of token t + 1."""
  logits = models.logits(cfg, params, np.asarray(ids, np.int32)[None])[0]
  return np.asarray(jax.nn.log_softmax(logits.astype(np.float32)), np.float64)


def test_echo_and_logprobs_equal_a_full_forward(served):
  """lm-eval's loglikelihood request: echo, logprobs=1, max_tokens=1, token ids."""
  server, cfg, params, tok = served
  prompt = tok.encode(PROMPT)
  r = httpx.post(server.url + "/v1/completions", timeout=60, json=dict(
      model="default", prompt=[prompt], echo=True, logprobs=3, max_tokens=2, temperature=0,
      return_token_ids=True))
  assert r.status_code == 200, r.text
  choice = r.json()["choices"][0]
  lp = choice["logprobs"]
  ids = prompt + choice["token_ids"]
  assert choice["text"].startswith(PROMPT) and len(lp["tokens"]) == len(prompt) + 2
  ref = _log_softmax(cfg, params, ids)
  assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
  want = [ref[t - 1, ids[t]] for t in range(1, len(ids))]
  np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=1e-4)
  for t in range(1, len(ids)):  # the top 3 (and the token itself) with their logprobs
    top = lp["top_logprobs"][t]
    best = np.argsort(-ref[t - 1])[:3]
    for b in best:
      np.testing.assert_allclose(top[tok.decode([int(b)])], ref[t - 1, b], atol=1e-4)
  assert lp["text_offset"] == list(np.cumsum([0] + [len(s) for s in lp["tokens"][:-1]]))


def test_streamed_echo_carries_the_prompts_logprobs_as_the_whole_response_does(served):
  """vLLM's streamed echo: the first chunk holds the prompt (text, tokens
  and logprobs, the first None) and the first generated token; the chunks
  add up to the non-streamed response."""
  server, _, _, tok = served
  prompt = "é = 'ü'\n"  # multi-byte characters: tokens that are not whole characters
  body = dict(model="default", prompt=prompt, echo=True, logprobs=2, max_tokens=4, temperature=0)
  whole = httpx.post(server.url + "/v1/completions", timeout=60, json=body).json()["choices"][0]
  with httpx.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True),
                    timeout=60) as r:
    chunks = [json.loads(line[6:]) for line in r.iter_lines()
              if line.startswith("data: ") and line != "data: [DONE]"]
  first = chunks[0]["choices"][0]
  n = len(tok.encode(prompt))
  assert first["text"].startswith(prompt) and len(first["logprobs"]["tokens"]) == n + 1
  assert first["logprobs"]["token_logprobs"][0] is None
  assert all(v is not None for v in first["logprobs"]["token_logprobs"][1:])
  parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
  streamed = {k: [v for p in parts for v in p[k]] for k in whole["logprobs"]}
  assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
  assert streamed["tokens"] == whole["logprobs"]["tokens"] and len(streamed["tokens"]) == n + 4
  assert streamed["text_offset"] == whole["logprobs"]["text_offset"]
  np.testing.assert_allclose(streamed["token_logprobs"][1:], whole["logprobs"]["token_logprobs"][1:],
                             atol=1e-5)
  for got, want in zip(streamed["top_logprobs"][1:], whole["logprobs"]["top_logprobs"][1:]):
    assert got.keys() == want.keys()
    np.testing.assert_allclose(list(got.values()), list(want.values()), atol=1e-5)


def test_echo_with_max_tokens_zero_is_a_named_400(served):
  """vLLM scores a prompt with max_tokens=0; here that is a 400 naming the field."""
  server, _, _, _ = served
  r = httpx.post(server.url + "/v1/completions", timeout=60, json=dict(
      model="default", prompt="abc", echo=True, logprobs=1, max_tokens=0))
  assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_and_top_logprobs(served, stream):
  server, _, _, _ = served
  r = _client(server).chat.completions.create(
      model="default", messages=[{"role": "user", "content": "def f(x):"}], max_tokens=5,
      temperature=0, logprobs=True, top_logprobs=4, stream=stream,
      extra_body={"return_tokens_as_token_ids": True})
  if stream:
    items = [i for ch in r for c in ch.choices if c.logprobs for i in c.logprobs.content]
  else:
    items = r.choices[0].logprobs.content
  assert len(items) == 5
  for it in items:  # greedy: the chosen token is the most likely
    assert len(it.top_logprobs) == 4 and it.token == it.top_logprobs[0].token
    assert it.logprob == pytest.approx(it.top_logprobs[0].logprob)
    assert [a.logprob for a in it.top_logprobs] == sorted((a.logprob for a in it.top_logprobs),
                                                          reverse=True)
    assert re.fullmatch(r"token_id:\d+", it.token)


def test_n_copies_and_prompt_lists_equal_engine_generate_with_their_seeds(served):
  server, cfg, params, tok = served
  prompts = ["import numpy as np\nimport os\n", "class Queue:\n    def"]
  hits = _metric(server, "vllm:prefix_cache_hits_total")
  r = _client(server).completions.create(model="default", prompt=prompts, n=3, max_tokens=6,
                                         temperature=1.0, seed=11,
                                         extra_body={"return_token_ids": True})
  assert [c.index for c in r.choices] == list(range(6))
  eng = Engine(cfg, params, EngineConfig(page_size=4, num_pages=64))
  for i, p in enumerate(prompts):
    refs = eng.generate([tok.encode(p)] * 3, [SamplingParams(max_tokens=6, temperature=1.0,
                                                             seed=11 + j) for j in range(3)])
    assert [r.choices[3 * i + j].token_ids for j in range(3)] == [o.token_ids for o in refs]
  assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
  assert r.usage.completion_tokens == 36
  # The copies after the first found their prompt's full pages cached: 2 x 2 copies.
  cached = sum((len(tok.encode(p)) - 1) // 4 * 4 for p in prompts)
  assert _metric(server, "vllm:prefix_cache_hits_total") - hits >= 2 * cached


def test_tokenizer_routes_as_vllm_serves_them(served):
  server, _, _, tok = served
  info = httpx.get(server.url + "/tokenizer_info").json()
  assert info["model_max_length"] > 0 and "chat_template" in info
  # The tokenizer's config as vLLM gives it: the byte tokenizer's document
  # token (NUL, id 0) is its BOS and EOS, as in its tokenizer_config.json.
  assert info["eos_token"] == info["bos_token"] == "\x00"
  assert info["tokenizer_class"] == "PreTrainedTokenizerFast" and info["vocab_size"] == 256
  # lm-eval's remote tokenizer reads them so, and so finds its
  # loglikelihood_rolling prefix token.
  assert check_remote_tokenizer_support(server.url + "/v1/completions")
  remote = RemoteTokenizer(server.url + "/v1/completions")
  assert remote.eos_token_id == remote.bos_token_id == 0
  lm = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model="default",
                           tokenizer_backend="remote", max_retries=1)
  assert lm.prefix_token_id == 0 and lm.eot_token_id == 0 and lm.eos_string == "\x00"
  ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()
  assert ids["tokens"] == tok.encode(PROMPT) and ids["count"] == len(PROMPT)
  back = httpx.post(server.url + "/detokenize", json={"tokens": ids["tokens"]}).json()
  assert back == {"prompt": PROMPT}
  chat = httpx.post(server.url + "/tokenize",
                    json={"messages": [{"role": "user", "content": "hi"}]}).json()
  assert tok.decode(chat["tokens"]) == "user: hi\nassistant: "
  for path, body in (("/tokenize", {}), ("/tokenize", {"prompt": "a", "messages": []}),
                     ("/detokenize", {"tokens": [300]}), ("/detokenize", {"tokens": [True]})):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400 and r.json()["error"]["message"], (path, body, r.text)


def test_openapi_has_request_schemas_and_every_path_answers_openai_errors(served):
  server, _, _, _ = served
  spec = httpx.get(server.url + "/openapi.json").json()
  body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
  schema = spec["components"]["schemas"][body["schema"]["$ref"].split("/")[-1]]
  assert {"prompt", "max_tokens", "logprobs", "echo", "n"} <= set(schema["properties"])
  assert "messages" in spec["components"]["schemas"]["ChatRequest"]["properties"]
  for method, path, status in (("GET", "/nope", 404), ("GET", "/v1/completions", 405),
                               ("DELETE", "/health", 405)):
    r = httpx.request(method, server.url + path)
    assert r.status_code == status and set(r.json()["error"]) >= {"message", "type"}, r.text


def test_metrics_under_vllm_names_and_no_nan(served):
  server, _, _, _ = served
  _client(server).completions.create(model="default", prompt="x = ", max_tokens=3)
  text = httpx.get(server.url + "/metrics").text
  assert "NaN" not in text and "spec_mean_accepted_length" not in text  # no speculation here
  for name in ("vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
               "vllm:time_to_first_token_seconds_count", "jaxinfer_e2e_request_latency_seconds_count",
               "vllm:num_requests_running", "vllm:num_requests_waiting",
               "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
               "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
               "vllm:kv_cache_usage_perc"):
    assert re.search(rf"^{re.escape(name)} ", text, re.M), name
  assert _metric(server, "vllm:e2e_request_latency_seconds_count") >= 1
  assert _metric(server, "vllm:request_success_total", '{finished_reason="length"}') >= 1
  assert json.loads(httpx.get(server.url + "/health").text)["status"] == "ok"


def test_vllm_sampling_extras_equal_engine_generate(served):
  """What guidellm and others send (ignore_eos, min_tokens, penalties,
  logit_bias, stop_token_ids) gives Engine.generate's tokens for the same
  SamplingParams."""
  server, cfg, params, tok = served
  extras = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4,
                min_tokens=3, ignore_eos=True, stop_token_ids=[ord("\n")])
  r = _client(server).completions.create(
      model="default", prompt=PROMPT, max_tokens=10, temperature=0,
      extra_body=dict(extras, logit_bias={str(ord("(")): 4.0}, return_token_ids=True))
  sp = SamplingParams(max_tokens=10, logit_bias={ord("("): 4.0},
                      **dict(extras, stop_token_ids=(ord("\n"),)))
  ref = Engine(cfg, params, EngineConfig(page_size=4, num_pages=64)).generate(
      [tok.encode(PROMPT)], sp)[0]
  plain = Engine(cfg, params, EngineConfig(page_size=4, num_pages=64)).generate(
      [tok.encode(PROMPT)], SamplingParams(max_tokens=10))[0]
  assert r.choices[0].token_ids == ref.token_ids != plain.token_ids
  assert r.choices[0].finish_reason == ref.finish_reason


@pytest.mark.parametrize("include_usage", [True, False])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(served, include_usage):
  """vLLM's stream_options.continuous_usage_stats (guidellm sends it on every
  streamed request): with include_usage every chunk carries the usage so
  far, the last (choices []) the whole; without include_usage no chunk does."""
  server, _, _, tok = served
  body = dict(model="default", prompt=PROMPT, max_tokens=4, temperature=0, ignore_eos=True,
              stream=True, stream_options=dict(include_usage=include_usage,
                                               continuous_usage_stats=True))
  with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
    assert r.status_code == 200
    chunks = [json.loads(line[6:]) for line in r.iter_lines()
              if line.startswith("data: ") and line != "data: [DONE]"]
  if not include_usage:
    assert chunks and not any("usage" in c for c in chunks)
    return
  usage = [c["usage"] for c in chunks]
  done = [u["completion_tokens"] for u in usage]
  assert done == sorted(done) and done[0] >= 1 and done[-1] == 4, done
  n = len(tok.encode(PROMPT))
  assert all(u["prompt_tokens"] == n and u["total_tokens"] == n + u["completion_tokens"]
             for u in usage)
  assert chunks[-1]["choices"] == [] and len(chunks) > 2
