"""The status document and stream (GET /v1/status[/stream]), the page's files and the
`token_marks` stream extension, over HTTP against a real daemon on the embedded toy
model (two MTP heads: its answers carry accepted drafts). The page in a browser:
tests/test_page.py."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from typing import Iterator

import httpx
import openai
import pytest

from tests.daemon_fixture import daemon_env, mtplxd_command, running_daemon

KEY = "status-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 40, "temperature": 0, "seed": 1}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("state"), None, "--api-key", KEY) as info:
        yield info


@pytest.fixture(scope="module")
def http(daemon):
    with httpx.Client(base_url=daemon.base_url, headers=AUTH, timeout=60) as c:
        yield c


def sse_data(response: httpx.Response) -> Iterator[str]:
    return (line[5:].strip() for line in response.iter_lines() if line.startswith("data:"))


def test_status_document_describes_the_model_queue_bank_and_history(http):
    body = http.get("/v1/status").json()
    assert body["object"] == "mtplxd.status" and body["state"] == "ready"
    model = body["model"]
    assert model["family"] == "mimo" and model["mtp_heads"] == 2 and model["quantization"]
    assert model["decoding"]["t0"]["mode"] == "mtp" and model["profile"]
    assert set(body["queue"]["queued"]) == {"interactive", "normal", "background"}
    assert body["sessions"]["enabled"] is True and isinstance(body["sessions"]["workspaces"], list)
    assert isinstance(body["warnings"], list) and body["jobs"] == []
    assert body["history"] and set(body["history"][-1]) == {"t", "tokens_per_s", "batch", "acceptance", "queue_wait_s"}


def test_the_page_is_open_and_the_status_needs_the_key(daemon):
    page = httpx.get(daemon.base_url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert 'content="key"' in page.text  # the page asks for the key before its first call
    assert httpx.get(daemon.base_url + "/page/page.js").status_code == 200
    assert httpx.get(daemon.base_url + "/page/secret.txt", headers=AUTH).status_code == 404
    assert httpx.get(daemon.base_url + "/v1/status").status_code == 401
    assert httpx.get(daemon.base_url + "/v1/status/stream").status_code == 401
    # the same Host guard as the API: a rebinding page's Host is refused, the page included
    assert httpx.get(daemon.base_url + "/", headers={"Host": "evil.example"}).status_code == 421
    foreign = httpx.get(daemon.base_url + "/v1/status", headers={**AUTH, "Origin": "https://evil.example"})
    assert foreign.status_code == 403


def test_the_stream_sends_a_document_every_second_history_first(http):
    seen: list[dict] = []
    with http.stream("GET", "/v1/status/stream") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for data in sse_data(response):
            seen.append(json.loads(data))
            if len(seen) == 3:
                break
    assert "history" in seen[0] and "points" in seen[1] and "points" in seen[2]
    assert 1.5 <= seen[2]["time"] - seen[0]["time"] <= 4
    assert all(p["t"] > seen[0]["history"][-1]["t"] for p in seen[2]["points"])


def test_token_marks_say_how_each_token_was_made(http):
    body = {**CHAT, "stream": True, "token_marks": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        chunks = [json.loads(d) for d in sse_data(response) if d != "[DONE]"]
    marks = [m for c in chunks for m in c.get("token_marks", [])]
    usage = chunks[-1]["usage"]
    assert len(marks) == usage["completion_tokens"]
    sources = {m["source"] for m in marks}
    assert 0 in sources and 1 in sources and sources <= {0, 1, 2}
    mtp = chunks[-2]["mtp"]
    # every accepted draft is a token, but for those past max_tokens in the last cycle
    assert mtp["accepted"] - mtp["depth"] <= sum(m["source"] > 0 for m in marks) <= mtp["accepted"]
    assert "".join(m["text"] for m in marks).strip()
    completion = {"prompt": "def add(a, b):", "max_tokens": 20, "temperature": 0, "stream": True, "token_marks": True,
                  "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=completion) as response:
        chunks = [json.loads(d) for d in sse_data(response) if d != "[DONE]"]
    assert sum(len(c.get("token_marks", [])) for c in chunks) == 20


def test_token_marks_need_a_stream(http):
    r = http.post("/v1/chat/completions", json={**CHAT, "token_marks": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "token_marks"


def test_a_plain_openai_client_sees_the_chunks_it_always_saw(daemon, http):
    client = openai.OpenAI(base_url=daemon.base_url + "/v1", api_key=KEY, max_retries=0)
    chunks = list(client.chat.completions.create(model="default", stream=True, **CHAT))
    assert all("token_marks" not in (c.model_extra or {}) for c in chunks)
    # the raw chunks: exactly OpenAI's fields, plus `mtp` on the finishing one, as before
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        raw = [json.loads(d) for d in sse_data(response) if d != "[DONE]"]
    plain = {"id", "object", "created", "model", "choices"}
    assert all(set(c) == plain for c in raw[:-1]) and set(raw[-1]) == plain | {"mtp"}
    marked = {**CHAT, "stream": True, "token_marks": True}
    with http.stream("POST", "/v1/chat/completions", json=marked) as response:
        with_marks = [json.loads(d) for d in sse_data(response) if d != "[DONE]"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == "".join(c["choices"][0]["delta"].get("content") or "" for c in with_marks)


def test_jobs_show_a_running_stream_with_its_client_and_tokens(daemon, http):
    body = {**CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True, "temperature": 0.6}
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", daemon.base_url + "/v1/chat/completions", json=body, headers=AUTH,
                          timeout=60) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i == 5:
                    started.set()
                if i == 60:
                    return  # the client goes: its job is cancelled

    worker = threading.Thread(target=stream)
    worker.start()
    assert started.wait(30)
    jobs = http.get("/v1/status").json()["jobs"]
    worker.join(30)
    assert [j["client"] for j in jobs] == ["openai"]
    assert jobs[0]["running"] and jobs[0]["priority"] == "normal" and jobs[0]["tokens"] > 0
    deadline = time.monotonic() + 10
    while http.get("/v1/status").json()["jobs"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert http.get("/v1/status").json()["jobs"] == []


def test_status_prints_the_page_and_open_hands_it_to_the_browser(daemon, tmp_path):
    command = [*mtplxd_command()]
    status = subprocess.run([*command, "status", "--state-dir", str(daemon.state_dir)], env=daemon_env(),
                            capture_output=True, text=True, timeout=30)
    assert f"page: {daemon.base_url}/" in status.stdout
    opened = tmp_path / "opened"
    browser = tmp_path / "browser.sh"  # webbrowser runs $BROWSER with the address
    browser.write_text(f'#!/bin/sh\necho "$1" > {opened}\n')
    browser.chmod(0o755)
    run = subprocess.run([*command, "open", "--state-dir", str(daemon.state_dir)],
                         env=daemon_env({"BROWSER": str(browser)}), capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    deadline = time.monotonic() + 10
    while not opened.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert opened.read_text().strip() == daemon.base_url + "/"
    gone = subprocess.run([*command, "open", "--state-dir", str(tmp_path / "none")], env=daemon_env(),
                          capture_output=True, text=True, timeout=30)
    assert gone.returncode == 3 and "not running" in gone.stderr


def test_token_sources_of_one_step():
    from mtplxd.requests import token_sources

    assert token_sources(3, [True, True]) == (1, 2, 0)  # both drafts accepted, then the bonus token
    assert token_sources(2, [True, False]) == (1, 0)  # the second draft rejected: the trunk's correction
    assert token_sources(1, [False, True]) == (0,)  # nothing past a rejection counts
    assert token_sources(1, []) == (0,)  # an AR step
    assert token_sources(2, [True, True]) == (1, 2)  # max_tokens cut the cycle short
