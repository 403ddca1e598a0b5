"""The daemon's security defaults, from outside, on a real daemon: what a web page in the
user's browser, another user on the machine, or a client without the key can do.

- every HTTP route refuses a foreign Host (DNS rebinding: 421) and a foreign Origin (403),
  and a cross-site "simple" POST (text/plain, a form) is refused before it runs (415);
- loopback origins and configured ones pass, with CORS headers, and configured host names;
- with an API key, every route but /health answers 401 without it;
- the daemon binds 127.0.0.1; another address without a key is refused at start;
- the state dir is 0700, its files 0600, the LSP socket 0600.
"""

from __future__ import annotations

import os
import stat
import subprocess

import httpx
import pytest

from tests.checkpoints import write
from tests.daemon_fixture import daemon_env, mtplxd_command, running_daemon

KEY = "sk-security"
UI = "http://ui.example:3000"  # a browser client the user allowed (allowed_origins)
NAME = "devbox.lan"  # a host name the user allowed (allowed_hosts)
EVIL_HOST, EVIL_ORIGIN = "evil.example", "http://evil.example"
JSON = {"Content-Type": "application/json"}
CHAT = {"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}

# (method, path, JSON body or None): every route of the app
ROUTES = [
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 1}),
    ("POST", "/v1/embeddings", {"model": "default", "input": "x"}),
    ("POST", "/v1/messages", {"model": "default", "max_tokens": 1, "messages": CHAT["messages"]}),
    ("POST", "/v1/messages/count_tokens", {"model": "default", "messages": CHAT["messages"]}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/default", None),
    ("GET", "/v1/sessions", None),
    ("DELETE", "/v1/sessions?workspace=default", None),
    ("GET", "/metrics", None),
    ("GET", "/health", None),
    ("GET", "/v1/status", None),  # and /v1/status/stream: tests/test_status_stream.py
    ("GET", "/", None),  # the daemon's page and its files: open without the key
    ("GET", "/page/page.js", None),
    ("POST", "/mcp", {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "probe", "version": "1"}}}),
]
IDS = [f"{m} {p}" for m, p, _ in ROUTES]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    checkpoint = write("mimo", tmp_path_factory.mktemp("ck") / "mimo", mtp_heads=1)
    env = {"MTPLXD_ALLOWED_ORIGINS": UI, "MTPLXD_ALLOWED_HOSTS": NAME}
    with running_daemon(tmp_path_factory.mktemp("state"), checkpoint, "--api-key", KEY, env=env) as info:
        yield info


def send(daemon, method: str, path: str, body, headers: dict | None = None, key: bool = True) -> httpx.Response:
    headers = {**JSON, **({"Authorization": f"Bearer {KEY}"} if key else {}), **(headers or {})}
    if path == "/mcp":
        headers["Accept"] = "application/json, text/event-stream"
    return httpx.request(method, daemon.base_url + path, json=body, headers=headers, timeout=30)


def completed(daemon) -> int:
    return httpx.get(daemon.base_url + "/health", timeout=10).json()["queue"]["completed"]


@pytest.mark.parametrize("method,path,body", ROUTES, ids=IDS)
def test_every_route_refuses_a_foreign_host_and_origin(daemon, method, path, body):
    r = send(daemon, method, path, body, {"Host": EVIL_HOST})
    assert r.status_code == 421, r.text
    assert EVIL_HOST in r.text and "allowed_hosts" in r.text
    r = send(daemon, method, path, body, {"Origin": EVIL_ORIGIN})
    assert r.status_code == 403, r.text
    assert "allowed_origins" in r.text and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("method,path,body", ROUTES, ids=IDS)
def test_loopback_and_configured_names_and_origins_pass(daemon, method, path, body):
    for headers in ({}, {"Origin": "http://localhost:5173"}, {"Origin": UI}, {"Host": NAME}):
        r = send(daemon, method, path, body, headers)
        assert r.status_code == 200, (headers, r.text)
        if "Origin" in headers:  # a browser may read the answer
            assert r.headers["access-control-allow-origin"] == headers["Origin"]


def test_cross_site_simple_posts_never_run(daemon):
    """What a page can send without a CORS preflight: text/plain and form bodies."""
    before = completed(daemon)
    body = '{"model": "default", "prompt": "x", "max_tokens": 4}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = httpx.post(daemon.base_url + "/v1/completions", content=body, timeout=30,
                       headers={"Content-Type": content_type, "Origin": "http://localhost:8000",
                                "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert completed(daemon) == before


def test_preflight_answers_allowed_origins_only(daemon):
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(daemon.base_url + "/v1/chat/completions", headers={"Origin": UI, **ask})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == UI
    r = httpx.options(daemon.base_url + "/v1/chat/completions", headers={"Origin": EVIL_ORIGIN, **ask})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("method,path,body", ROUTES, ids=IDS)
def test_the_key_guards_every_route_but_health_and_the_page(daemon, method, path, body):
    r = send(daemon, method, path, body, key=False)
    assert r.status_code == (200 if path in ("/health", "/", "/page/page.js") else 401), r.text


def test_state_files_are_private_and_the_bind_is_loopback(daemon):
    info = daemon.state_dir / "daemon.json"
    assert '"host": "127.0.0.1"' in info.read_text().replace("'", '"')
    assert stat.S_IMODE(daemon.state_dir.stat().st_mode) == 0o700
    for path in daemon.state_dir.rglob("*"):
        mode = stat.S_IMODE(path.lstat().st_mode)
        if path.is_symlink():
            continue
        if path.is_dir():
            assert mode & 0o077 == 0, (path, oct(mode))
        else:  # files and the LSP socket
            assert mode & 0o077 == 0, (path, oct(mode))
    assert (daemon.state_dir / "lsp.sock").exists()


def test_another_address_without_a_key_is_refused(tmp_path):
    env = daemon_env()
    done = subprocess.run([*mtplxd_command(), "start", "--state-dir", str(tmp_path), "--host", "0.0.0.0",
                           "--port", "0"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "without an API key" in done.stderr and "Traceback" not in done.stderr
    assert not os.path.exists(tmp_path / "daemon.json")
