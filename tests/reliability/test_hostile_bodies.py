"""Hostile HTTP bodies against every route of a real daemon: each gets a 4xx with an error
in the route's own form (OpenAI's error object, Anthropic's, a JSON-RPC error on /mcp)
naming the problem, and a normal request right after it still succeeds.

The daemon runs with a small body limit (MTPLXD_MAX_BODY_BYTES) so that the 413 cases
stay cheap; the limit is the setting users change (mtplxd/config.py).
"""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest

from tests.checkpoints import write
from tests.daemon_fixture import running_daemon

KEY = "sk-hostile"
# Over the 600 KB of the 100,000-deep bodies, which must get a 400, and over the MCP SDK's own
# 4 MiB limit, which must not answer first.
LIMIT = 5 * 2**20
DEEP = 100_000

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
MESSAGES, COUNT = "/v1/messages", "/v1/messages/count_tokens"
MCP, SESSIONS = "/mcp", "/v1/sessions"
JSON_ROUTES = [CHAT, COMPLETIONS, EMBEDDINGS, MESSAGES, COUNT]
MCP_HEADERS = {"Accept": "application/json, text/event-stream"}


def chat(content) -> dict:
    return {"model": "mimo", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


def raw(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode()


def nested(depth: int, open_: str = "[", close: str = "]", inner: str = "0") -> bytes:
    return (open_ * depth + inner + close * depth).encode()


# Bodies sent to every JSON route: (name, bytes, expected status)
GENERIC = [
    ("array nested 100,000 deep", nested(DEEP), 400),
    ("object nested 100,000 deep", nested(DEEP, '{"a":', "}", "0"), 400),
    ("nesting 5,000 deep inside a field", b'{"model": "mimo", "messages": ' + nested(5000) + b"}", 400),
    ("cut short", b'{"model": "mimo", "messages": [', 400),
    ("empty", b"", 400),
    ("a list, not an object", b"[]", 400),
    ("a string, not an object", b'"hello"', 400),
    ("null", b"null", 400),
    ("UTF-16", json.dumps(chat("hi")).encode("utf-16"), 400),
    ("invalid UTF-8", b'{"model": "mimo", "prompt": "\xff\xfe\xfa"}', 400),
    ("NaN", b'{"model": "mimo", "temperature": NaN, "prompt": "x", "messages": [], "input": "x"}', 400),
    ("over the size limit", b'{"prompt": "' + b"a" * (LIMIT + 10) + b'"}', 413),
]

# Bodies aimed at one route's fields: (name, path, body, expected status)
SPECIFIC = [
    ("lone surrogate in content", CHAT, raw('{"model": "mimo", "messages": [{"role": "user", "content": "\\ud800"}]}'), 400),
    ("messages a string", CHAT, raw(json.dumps({"model": "mimo", "messages": "hi"})), 400),
    ("message a number", CHAT, raw(json.dumps({"model": "mimo", "messages": [1]})), 400),
    ("content an object", CHAT, raw(json.dumps(chat({"text": "hi"}))), 400),
    ("role a number", CHAT, raw(json.dumps({"model": "mimo", "messages": [{"role": 5, "content": "hi"}]})), 400),
    ("temperature 1e400", CHAT, raw('{"model": "mimo", "temperature": 1e400, "messages": [{"role": "user", "content": "hi"}]}'), 400),
    ("max_tokens 5,000 digits", CHAT, raw('{"model": "mimo", "max_tokens": ' + "9" * 5000 + ', "messages": []}'), 400),
    ("max_tokens a string", CHAT, raw(json.dumps({**chat("hi"), "max_tokens": "8"})), 400),
    ("tool schema 400 levels deep", CHAT, json.dumps(chat("hi"))[:-1].encode() + b', "tools": [{"type": "function", '
     b'"function": {"name": "f", "parameters": ' + nested(200, '{"type": "object", "properties": {"a": ', "}}", "{}")
     + b"}}]}", 400),
    ("10,000 stop strings", CHAT, raw(json.dumps({**chat("hi"), "stop": ["x"] * 10_000})), 400),
    ("prompt ids out of range", COMPLETIONS, raw(json.dumps({"model": "mimo", "prompt": [1, -5, 10**12]})), 400),
    ("prompt a number", COMPLETIONS, raw(json.dumps({"model": "mimo", "prompt": 3.5})), 400),
    ("suffix a list", COMPLETIONS, raw(json.dumps({"model": "mimo", "prompt": "a", "suffix": ["b"]})), 400),
    ("embedding input nested lists", EMBEDDINGS, raw(json.dumps({"model": "mimo", "input": [[[1]]]})), 400),
    ("embedding dimensions negative", EMBEDDINGS, raw(json.dumps({"model": "mimo", "input": "a", "dimensions": -1})), 400),
    ("messages without max_tokens", MESSAGES, raw(json.dumps({"model": "mimo", "messages": [{"role": "user", "content": "hi"}]})), 400),
    ("content block of a made-up type", MESSAGES, raw(json.dumps({"model": "mimo", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "hologram"}]}]})), 400),
    ("system a number", COUNT, raw(json.dumps({"model": "mimo", "system": 7, "messages": [{"role": "user", "content": "hi"}]})), 400),
]

MCP_BODIES = [
    ("not JSON", b"{]", 400),
    ("nested 100,000 deep", nested(DEEP), 400),
    ("object nested 100,000 deep", nested(DEEP, '{"a":', "}", "0"), 400),
    ("UTF-16", json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping"}).encode("utf-16"), 400),
    ("not a request", b'{"hello": "world"}', 400),
    ("over the size limit", b'{"jsonrpc": "2.0", "id": 1, "method": "' + b"a" * (LIMIT + 10) + b'"}', 413),
]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    checkpoint = write("mimo", tmp_path_factory.mktemp("ck") / "mimo", mtp_heads=1)
    env = {"MTPLXD_MAX_BODY_BYTES": str(LIMIT)}
    with running_daemon(tmp_path_factory.mktemp("state"), checkpoint, "--api-key", KEY, env=env) as info:
        yield info


@pytest.fixture(scope="module")
def http(daemon):
    with httpx.Client(base_url=daemon.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def assert_error_form(path: str, response: httpx.Response, status: int) -> str:
    """The status, and the error object of the route's protocol; returns its message."""
    assert response.status_code == status, response.text[:500]
    body = response.json()
    if path == MCP:
        assert body["jsonrpc"] == "2.0" and body["id"] is None
        assert body["error"]["code"] in (-32700, -32600, -32602), body  # parse, request, params
        return body["error"]["message"]
    if path.startswith(MESSAGES):
        assert body["type"] == "error" and body["error"]["type"], body
        return body["error"]["message"]
    assert body["error"]["type"] and "param" in body["error"], body
    return body["error"]["message"]


def still_serving(client: openai.OpenAI) -> None:
    r = client.completions.create(model="mimo", prompt="def f():", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


@pytest.mark.parametrize("path", JSON_ROUTES)
@pytest.mark.parametrize("name,body,status", GENERIC, ids=[g[0] for g in GENERIC])
def test_generic_hostile_bodies(http, client, path, name, body, status):
    r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert assert_error_form(path, r, status)
    still_serving(client)


@pytest.mark.parametrize("name,path,body,status", SPECIFIC, ids=[s[0] for s in SPECIFIC])
def test_hostile_fields(http, client, name, path, body, status):
    r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert assert_error_form(path, r, status)
    still_serving(client)


@pytest.mark.parametrize("name,body,status", MCP_BODIES, ids=[m[0] for m in MCP_BODIES])
def test_hostile_mcp_bodies(http, client, name, body, status):
    r = http.post(MCP, content=body, headers={"Content-Type": "application/json", **MCP_HEADERS})
    assert assert_error_form(MCP, r, status)
    still_serving(client)


def test_mcp_bodies_under_the_limit_are_served_whatever_the_sdk_default(http):
    """A 4.5 MiB `initialize` (over the MCP SDK's default of 4 MiB, under max_body_bytes) is
    served: one limit, the daemon's (before: a plain-text 413 from the SDK)."""
    params = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "big", "version": "0"},
              "_meta": {"pad": "a" * (9 * 2**19)}}
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params}).encode()
    r = http.post(MCP, content=body, headers={"Content-Type": "application/json", **MCP_HEADERS})
    assert r.status_code == 200 and '"serverInfo"' in r.text, r.text[:500]


def test_a_chunked_body_over_the_limit_is_cut_off(http, client):
    """No Content-Length to refuse up front: the count of received bytes decides."""
    def chunks():
        for _ in range(LIMIT // 4096 + 2):
            yield b"a" * 4096

    r = http.post(COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"})
    assert "limit" in assert_error_form(COMPLETIONS, r, 413)
    still_serving(client)


def test_a_declared_length_over_the_limit_is_refused_before_the_body(daemon, client):
    """A client announcing a huge body is answered at once, not after uploading it."""
    host, port = daemon.base_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {10**12}\r\n\r\n".encode())
        reply = b""
        while b"}}" not in reply and (chunk := s.recv(65536)):
            reply += chunk
    head, _, body = reply.decode(errors="replace").partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 413"), head
    assert "over the limit" in json.loads(body)["error"]["message"]
    still_serving(client)


def test_sessions_refuse_bad_queries_and_oversized_bodies(http, client):
    r = http.delete(SESSIONS, params={"workspace": "relative/path"})
    assert assert_error_form(SESSIONS, r, 400)
    r = http.request("DELETE", SESSIONS, params={"workspace": "/tmp"}, content=b"x" * (LIMIT + 1))
    assert assert_error_form(SESSIONS, r, 413)
    still_serving(client)


def test_the_limit_is_a_setting(tmp_path):
    from mtplxd.config import ConfigError, load_settings

    env = {"MTPLXD_HOME": str(tmp_path), "MTPLXD_MAX_BODY_BYTES": "1000000"}
    assert load_settings(environ=env).max_body_bytes == 1_000_000
    with pytest.raises(ConfigError, match="max_body_bytes"):
        load_settings(flags={"max_body_bytes": 10}, environ={"MTPLXD_HOME": str(tmp_path)})
