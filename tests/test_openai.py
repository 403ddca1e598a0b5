"""The OpenAI adapter through the real `openai` client against a real daemon.

The daemon is `mtplxd start` as a subprocess (API key on) on a tiny MiMo
checkpoint, reached over a loopback socket. States a running daemon cannot be
steered into (still loading, load failed, queue full, engine failing
mid-stream) are in test_openai_states.py.
"""

from __future__ import annotations

import base64
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import engine  # noqa: F401  (BLAS before mlx)
from engine.engine import load_tokenizer
from engine.prompts import chat_prompt_ids, fim_prompt_ids, healed_fim_prompt_ids
from tests.checkpoints import write
from tests.daemon_fixture import running_daemon
from tests.engine_helpers import assert_batched_greedy_agree, assert_served_greedy_agree
from tests.floats import FEW_OPS_ULPS, PATHS_ULPS, assert_close

KEY = "sk-test-key"
HI = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write("mimo", tmp_path_factory.mktemp("ck") / "mimo", mtp_heads=1)


@pytest.fixture(scope="module")
def daemon(checkpoint, tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("state"), checkpoint, "--api-key", KEY) as info:
        yield info


@pytest.fixture(scope="module")
def client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(daemon):
    with httpx.Client(base_url=daemon.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_tokenizer(checkpoint)


def health(http) -> dict:
    return http.get("/health").json()


def metrics(http) -> dict[str, list]:
    text = http.get("/metrics").text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def wait_idle(http, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while (queue := health(http)["queue"])["active"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return queue


# -- the happy paths ------------------------------------------------------------------


def test_models_and_health(client, daemon):
    assert [m.id for m in client.models.list().data] == ["mimo"]
    assert client.models.retrieve("mimo").id == "mimo"
    r = httpx.get(daemon.base_url + "/health")  # open without the key
    body = r.json()
    assert r.status_code == 200 and body["status"] == "ok" and body["model"] == "mimo"
    assert body["uptime_s"] >= 0 and body["queue"]["state"] == "ready"
    assert body["memory"]["active_bytes"] >= 0 and body["memory"]["peak_bytes"] >= 0


def test_chat_usage_and_mtp_fields(client, tokenizer):
    r = client.chat.completions.create(model="mimo", messages=HI, max_tokens=8, **GREEDY)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.finish_reason == "length"
    prompt_tokens = len(chat_prompt_ids(tokenizer, HI))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        prompt_tokens, 8, prompt_tokens + 8)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    mtp = r.model_extra["mtp"]
    assert mtp["depth"] == 2 and mtp["drafted"] > 0 and 0 <= mtp["accepted"] <= mtp["drafted"]
    assert len(mtp["acceptance_by_depth"]) == 2


def test_chat_stream_matches_non_stream(client):
    full = client.chat.completions.create(model="default", messages=HI, max_tokens=12, **GREEDY)
    chunks = list(client.chat.completions.create(
        model="mimo", messages=HI, max_tokens=12, stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].model_extra["mtp"]["depth"] == 2
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_stream_and_not(client):
    full = client.completions.create(model="mimo", prompt="def add(a, b):", max_tokens=10, **GREEDY)
    assert full.object == "text_completion" and full.usage.completion_tokens == 10
    stream = client.completions.create(model="mimo", prompt=["def add(a, b):"], max_tokens=10, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in stream) == full.choices[0].text


def test_fim_with_suffix(client, tokenizer):
    fim = client.completions.create(model="mimo", prompt="def f(", suffix="):\n    return x\n",
                                    max_tokens=8, **GREEDY)
    healed, heal = healed_fim_prompt_ids(tokenizer, "def f(", "):\n    return x\n")
    assert fim.usage.prompt_tokens == len(healed) and heal.text == "("  # the prefix's last token healed
    assert healed == fim_prompt_ids(tokenizer, "def f", "):\n    return x\n")
    # One-character tokens: the healed "(" can only come back as itself, first in the middle;
    # the text leaves it out, and the rest is what follows it there.
    (paren,) = heal.first_tokens
    same = client.completions.create(model="mimo", prompt=healed + [paren], max_tokens=7, **GREEDY)
    assert fim.choices[0].text == same.choices[0].text


def test_stop_strings_end_the_text_and_never_leak(client):
    base = client.completions.create(model="mimo", prompt="abc", max_tokens=40, **GREEDY).choices[0].text
    stops = [base[24:27], base[12:14]]
    cut = min(base.index(s) for s in stops)
    r = client.completions.create(model="mimo", prompt="abc", max_tokens=40, stop=stops, **GREEDY)
    assert r.choices[0].text == base[:cut] and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="mimo", prompt="abc", max_tokens=40, stop=stops, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == base[:cut]


def test_same_seed_same_output(client):
    def sample(seed, stream=False):
        r = client.completions.create(model="mimo", prompt="x = ", max_tokens=24, temperature=1.0, top_p=1.0,
                                      seed=seed, stream=stream)
        return "".join(c.choices[0].text for c in r) if stream else r.choices[0].text

    first = sample(1234)
    assert sample(1234) == first and sample(1234, stream=True) == first
    assert len({sample(seed) for seed in (1, 2, 3)} | {first}) > 1


def test_ar_and_mtp_agree_at_temperature_zero(client, checkpoint):
    def run(mode):
        return client.completions.create(model="mimo", prompt="def f(x):", max_tokens=40,
                                         extra_body={"generation_mode": mode, "depth": 2}, **GREEDY)

    ar, mtp = run("ar"), run("mtp")
    assert_served_greedy_agree(checkpoint, "def f(x):", ar.choices[0].text, mtp.choices[0].text, 40, depth=2)
    assert ar.model_extra["mtp"] == {"depth": 0, "drafted": 0, "accepted": 0, "acceptance_by_depth": []}
    assert mtp.model_extra["mtp"]["drafted"] > 0


def test_embeddings(client, http):
    r = client.embeddings.create(model="mimo", input=["hello", "world"])  # openai asks for base64
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == 10
    vectors = np.array([d.embedding for d in r.data])
    assert vectors.shape == (2, 32)
    assert_close(np.linalg.norm(vectors, axis=1), np.ones(2), FEW_OPS_ULPS, "norms")
    floats = http.post("/v1/embeddings", json={"input": "hello", "encoding_format": "float",
                                               "dimensions": 32}).json()
    # one input alone against two in one batch: another path through the trunk
    assert_close(floats["data"][0]["embedding"], vectors[0], PATHS_ULPS, "batched and alone")
    b64 = http.post("/v1/embeddings", json={"input": [[14, 15]], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert decoded.shape == (32,)


def test_priority_header(client, http):
    urgent = client.with_options(default_headers={"X-Mtplx-Priority": "interactive"})
    assert urgent.completions.create(model="mimo", prompt="a", max_tokens=2).usage.completion_tokens == 2
    r = http.post("/v1/completions", json={"prompt": "a"}, headers={"X-Mtplx-Priority": "urgent"})
    assert r.status_code == 400 and "X-Mtplx-Priority" in r.json()["error"]["message"]


# -- bad requests -----------------------------------------------------------------------

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
OK = {"model": "mimo", "messages": HI}
BAD = [
    (CHAT, b"{not json", 400, None, None),
    (CHAT, [1, 2], 400, None, None),
    (CHAT, {"messages": "hi"}, 400, "messages", None),
    (CHAT, {"messages": []}, 400, "messages", None),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages", None),
    (CHAT, {**OK, "temperature": "hot"}, 400, "temperature", None),
    (CHAT, {**OK, "temperature": 3}, 400, "temperature", None),
    (CHAT, {**OK, "top_p": 0}, 400, "top_p", None),
    (CHAT, {**OK, "min_p": 1.5}, 400, "min_p", None),
    (CHAT, {**OK, "max_tokens": 0}, 400, "max_tokens", None),
    (CHAT, {**OK, "max_tokens": "5"}, 400, "max_tokens", None),
    (CHAT, {**OK, "max_completion_tokens": 5000}, 400, "max_completion_tokens", "context_length_exceeded"),
    (CHAT, {**OK, "n": 2}, 400, "n", None),
    (CHAT, {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    (CHAT, {**OK, "stop": 5}, 400, "stop", None),
    (CHAT, {**OK, "seed": 1.5}, 400, "seed", None),
    (CHAT, {**OK, "stream": "yes"}, 400, "stream", None),
    (CHAT, {**OK, "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    (CHAT, {**OK, "generation_mode": "fast"}, 400, "generation_mode", None),
    (CHAT, {**OK, "depth": 99}, 400, "depth", None),
    (CHAT, {**OK, "logprobs": True}, 400, "logprobs", None),
    (CHAT, {**OK, "model": "gpt-4o"}, 404, "model", "model_not_found"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": 5}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": [10**9]}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": "x" * 5000}, 400, "prompt", "context_length_exceeded"),
    (COMPLETIONS, {"prompt": "a", "suffix": 3}, 400, "suffix", None),
    (EMBEDDINGS, {"input": ""}, 400, "input", None),
    (EMBEDDINGS, {"input": []}, 400, "input", None),
    (EMBEDDINGS, {"input": "a", "encoding_format": "int8"}, 400, "encoding_format", None),
    (EMBEDDINGS, {"input": "a", "dimensions": 16}, 400, "dimensions", None),
]


def test_bad_requests_get_openai_errors_and_the_daemon_keeps_serving(http, client):
    for path, body, status, param, code in BAD:
        raw = {"content": body, "headers": {"Content-Type": "application/json"}}
        r = http.post(path, **raw) if isinstance(body, bytes) else http.post(path, json=body)
        error = r.json()["error"]
        assert r.status_code == status, (path, body, r.text)
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param and (code is None or error["code"] == code), (body, error)
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", CHAT, 405)]:
        r = http.request(method, path)
        assert r.status_code == status and r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="mimo", messages=HI, temperature=3)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=HI)
    assert client.chat.completions.create(model="mimo", messages=HI, max_tokens=2).choices[0].message.content


def test_api_key_is_required_except_for_health(daemon):
    wrong = openai.OpenAI(base_url=daemon.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(daemon.base_url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(daemon.base_url + "/health").status_code == 200


# -- load, cancellation, metrics ------------------------------------------------------------


def test_sixteen_concurrent_streams(client, http, checkpoint):
    prompts = [f"item {i}:" for i in range(16)]

    def stream(prompt):
        chunks = list(client.completions.create(model="mimo", prompt=prompt, max_tokens=16, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY))
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(stream, prompts))
    for prompt, (text, tokens) in zip(prompts, results):
        assert tokens == 16
        alone = client.completions.create(model="mimo", prompt=prompt, max_tokens=16, **GREEDY)
        if text != alone.choices[0].text:  # batched matmuls round differently: only a near-tie may part them
            assert_batched_greedy_agree(checkpoint, prompt, alone.choices[0].text, text)
    samples = metrics(http)  # they decoded in batched steps (engine/batch.py)
    alone_steps = _value(samples, "mtplxd_batch_rows_bucket", le="1.0")
    assert _value(samples, "mtplxd_batch_rows_count") - alone_steps >= 16 * 8


LONG_CHAT = {"model": "mimo", "messages": HI, "max_tokens": 3000, **GREEDY}


def test_disconnect_mid_stream_frees_the_engine(daemon, http):
    before = wait_idle(http)
    with httpx.Client(base_url=daemon.base_url, headers={"Authorization": f"Bearer {KEY}"}) as gone:
        with gone.stream("POST", CHAT, json={**LONG_CHAT, "stream": True}) as r:
            data_lines = (line for line in r.iter_lines() if line.startswith("data:"))
            for _ in range(5):
                next(data_lines)
            assert health(http)["queue"]["active"] == 1
    after = wait_idle(http, 5)
    assert after["active"] == 0 and after["cancelled"] == before["cancelled"] + 1
    assert after["completed"] == before["completed"]
    assert after["steps"] - before["steps"] < 500, "the 3000-token job must stop early"
    samples = metrics(http)
    assert _value(samples, "mtplxd_active_generations") == 0
    assert _value(samples, "mtplxd_cancelled_requests_total", endpoint=CHAT) >= 1


def test_disconnect_while_waiting_for_a_non_streamed_reply(daemon, http):
    before = wait_idle(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(daemon.base_url + CHAT, json=LONG_CHAT, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5)
    after = wait_idle(http, 5)
    assert after["active"] == 0 and after["cancelled"] == before["cancelled"] + 1


def test_metrics_is_prometheus_text(http):
    samples = metrics(http)
    for name in ("mtplxd_requests", "mtplxd_queue_depth", "mtplxd_active_generations",
                 "mtplxd_time_to_first_token_seconds", "mtplxd_decode_tokens_per_second",
                 "mtplxd_mtp_drafted_tokens", "mtplxd_mtp_accepted_tokens", "mtplxd_mtp_acceptance_ratio",
                 "mtplxd_cancelled_requests", "mtplxd_model_state", "mtplxd_batch_rows", "mtplxd_step_tokens",
                 "mtplxd_batch_depth", "mtplxd_queue_wait_seconds"):
        assert name in samples, name
    assert _value(samples, "mtplxd_requests_total", endpoint=CHAT, status="200") >= 1
    assert _value(samples, "mtplxd_requests_total", endpoint=CHAT, status="400") >= 1
    assert {s.labels["class"] for s in samples["mtplxd_queue_depth"]} == {"interactive", "normal", "background"}
    assert _value(samples, "mtplxd_time_to_first_token_seconds_count") >= 1
    assert _value(samples, "mtplxd_decode_tokens_per_second_count") >= 1
    assert _value(samples, "mtplxd_queue_wait_seconds_count", **{"class": "normal"}) >= 1  # per class (shares)
    assert 0 <= _value(samples, "mtplxd_mtp_acceptance_ratio", depth="1") <= 1
    depth = health(http)["decoding"]["batched_depth"]
    assert {rows: _value(samples, "mtplxd_batch_depth", rows=rows) for rows in depth} == depth


def _value(samples: dict, sample_name: str, **labels) -> float:
    """Sum of the samples called `sample_name` (family names drop _total, _count...)."""
    matches = [s.value for family in samples.values() for s in family
               if s.name == sample_name and labels.items() <= s.labels.items()]
    assert matches, (sample_name, labels)
    return sum(matches)
