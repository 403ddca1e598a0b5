"""The session bank through the real daemon (`mtplxd start`), the `openai` client and httpx:
reuse with exact outputs, workspaces, /v1/sessions, /metrics, clean restarts and warm-ups of
watched files. The faults (kill -9 during a write, bad files, another model) are in
tests/reliability/test_bank_faults.py."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.checkpoints import write
from tests.daemon_fixture import running_daemon

FAST_WRITES = {"MTPLXD_SESSION_WRITE_DELAY_MS": "0"}
TEXT = "".join(f"def f{i}(a, b):\n    return (a + {i}) * b\n\n" for i in range(16))  # ~530 chars
HEADER = "X-Mtplx-Workspace"


@pytest.fixture(scope="module")
def mimo(tmp_path_factory) -> Path:
    return write("mimo", tmp_path_factory.mktemp("ck") / "mimo", mtp_heads=1)


@pytest.fixture(scope="module")
def mimo_other(tmp_path_factory) -> Path:  # same architecture, other weights
    return write("mimo", tmp_path_factory.mktemp("ck") / "mimo_b", mtp_heads=1, seed=1)


def clients(daemon) -> tuple[openai.OpenAI, httpx.Client]:
    return (openai.OpenAI(base_url=daemon.base_url + "/v1", api_key="x", max_retries=0, timeout=60),
            httpx.Client(base_url=daemon.base_url, timeout=60))


def complete(client: openai.OpenAI, prompt: str, workspace: str | None, **kw) -> tuple[str, int]:
    """(text, cached tokens); the prompt's token count goes to LAST["prompt_tokens"]."""
    headers = {HEADER: workspace} if workspace else {}
    r = client.completions.create(model="default", prompt=prompt, max_tokens=kw.pop("max_tokens", 16),
                                  temperature=1.0, seed=kw.pop("seed", 5), extra_headers=headers, **kw)
    LAST["prompt_tokens"] = r.usage.prompt_tokens
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


LAST: dict = {}


def sessions(http: httpx.Client) -> dict:
    body = http.get("/v1/sessions").json()
    body["by_ws"] = {d["workspace"]: d for d in body["data"]}
    return body


def wait_until(check, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def written(http: httpx.Client) -> bool:
    s = sessions(http)
    return s["disk"]["pending_writes"] == 0 and s["disk"]["entries"] > 0


def metric(http: httpx.Client, name: str, **labels) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


def test_reuse_workspaces_listing_metrics_and_a_clean_restart(tmp_path, mimo):
    state, ws_a, ws_b = tmp_path / "state", tmp_path / "a", tmp_path / "b"
    ws_a.mkdir()
    ws_b.mkdir()
    longer = TEXT + "# and one more line\n"
    with running_daemon(state, mimo, env=FAST_WRITES) as d:
        client, http = clients(d)
        text, cached = complete(client, TEXT, str(ws_a))
        n = LAST["prompt_tokens"]
        assert cached == 0
        warm, cached = complete(client, longer, str(ws_a))
        assert cached >= n
        cold, cached = complete(client, longer, str(ws_b))  # another workspace never sees a's entries
        assert cached == 0 and warm == cold
        # metadata.workspace names it too (chat)
        history = [{"role": "user", "content": TEXT}]
        chat = client.chat.completions.create(model="default", messages=history, max_tokens=8, seed=2,
                                              metadata={"workspace": str(ws_b)})
        history += [{"role": "assistant", "content": chat.choices[0].message.content},
                    {"role": "user", "content": "and now?"}]
        chat = client.chat.completions.create(model="default", messages=history, max_tokens=8, seed=2,
                                              metadata={"workspace": str(ws_b)})
        assert chat.usage.prompt_tokens_details.cached_tokens > n
        bad = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={HEADER: "relative/path"})
        assert bad.status_code == 400 and "absolute" in bad.json()["error"]["message"]

        listing = sessions(http)
        a, b = listing["by_ws"][str(ws_a)], listing["by_ws"][str(ws_b)]
        assert a["entries"] >= 1 and a["hits"] == 1 and a["misses"] == 1 and a["cached_tokens"] >= n
        assert b["hits"] >= 1 and b["ram_bytes"] > 0
        wait_until(lambda: sessions(http)["by_ws"][str(ws_a)]["watched"], what="the watcher")
        assert metric(http, "mtplxd_session_hits_total", tier="ram") >= 2
        assert metric(http, "mtplxd_session_misses_total") >= 2
        assert metric(http, "mtplxd_session_bytes", tier="ram") > 0
        assert metric(http, "mtplxd_session_evictions_total", tier="ram") == 0
        wait_until(lambda: written(http), what="background writes")
        assert metric(http, "mtplxd_session_bytes", tier="disk") > 0

        assert http.delete("/v1/sessions").status_code == 400
        gone = http.delete("/v1/sessions", params={"workspace": str(ws_b)}).json()
        assert gone["deleted"] >= 1 and str(ws_b) not in {d["workspace"] for d in sessions(http)["data"]
                                                        if d["entries"]}
    with running_daemon(state, mimo) as d:  # SIGTERM flushed the bank; the disk serves
        client, http = clients(d)
        again, cached = complete(client, longer, str(ws_a))
        assert cached >= n and again == warm
        assert sessions(http)["by_ws"][str(ws_a)]["hits_disk"] == 1
        _, cached = complete(client, longer, str(ws_b))
        assert cached == 0  # cleared before the restart, also on disk


def test_a_changed_file_is_warmed_for_the_next_completion(tmp_path, mimo):
    state, ws = tmp_path / "state", tmp_path / "project"
    ws.mkdir()
    with running_daemon(state, mimo) as d:
        client, http = clients(d)
        complete(client, "hello", str(ws), max_tokens=1)  # names (registers) the workspace
        wait_until(lambda: sessions(http)["by_ws"].get(str(ws), {}).get("watched"), what="the watcher")
        (ws / "module.py").write_text(TEXT)
        wait_until(lambda: sessions(http).get("warmups", {}).get("done", 0) >= 1, what="the warm-up")
        cursor = 400
        complete(client, TEXT[:cursor], None, max_tokens=1)
        n = LAST["prompt_tokens"]
        r = client.completions.create(model="default", prompt=TEXT[:cursor], suffix=TEXT[cursor:], max_tokens=4,
                                      extra_headers={HEADER: str(ws)})
        assert r.usage.prompt_tokens_details.cached_tokens >= n  # the FIM prefix up to the cursor
        shutil.rmtree(ws)  # a deleted workspace's entries are dropped
        wait_until(lambda: not sessions(http)["by_ws"].get(str(ws), {}).get("entries"), what="the drop")


def test_hybrid_model_reuses_a_conversation(tmp_path):
    checkpoint = write("qwen3_next", tmp_path / "qwen3_next", mtp_heads=1)
    with running_daemon(tmp_path / "state", checkpoint) as d:
        client, http = clients(d)
        history = [{"role": "user", "content": TEXT}]
        for turn in range(3):
            kw = dict(model="default", messages=history, max_tokens=12, temperature=1.0, seed=turn)
            warm = client.chat.completions.create(**kw, extra_headers={HEADER: str(tmp_path / "w")})
            cold = client.chat.completions.create(**kw, extra_headers={HEADER: str(tmp_path / f"cold{turn}")})
            assert warm.choices[0].message.content == cold.choices[0].message.content
            assert cold.usage.prompt_tokens_details.cached_tokens == 0
            if turn:
                assert warm.usage.prompt_tokens_details.cached_tokens > 300
            history += [{"role": "assistant", "content": warm.choices[0].message.content},
                        {"role": "user", "content": f"turn {turn}"}]
        listing = sessions(http)["by_ws"][str(tmp_path / "w")]
        assert listing["hits"] == 2 and listing["misses"] == 1
